"""Manager state that survives the log's retention (issue 43, s4): a restarted worker rebuilds the
placement and power managers from their latest snapshot and folds only the log after it. Before,
a manager rebuilt from a log whose head retention deleted had no inventory and no running jobs:
placement left the next job queued (then placed it on the node a running job holds), power
deferred it with ``no processor known``."""

from __future__ import annotations

import pytest
from unit.test_power_decisions_right import inv
from unit.test_power_decisions_right import job as pjob
from unit.test_profiles_placement import ev, inventory

from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.events import JobState, PlacementDecision, PowerAction, Record
from nodeshare.schemas.serde import encode
from nodeshare.streams.core import snapshot
from nodeshare.streams.core.placement.stream import PlacementManager
from nodeshare.streams.core.power.stream import PowerManager


def log_of(*records: Record) -> list[tuple[str, bytes]]:
    return [(TOPIC_OF_RECORD[type(r)].name, encode(r)) for r in records]


def fold(manager, log) -> list:
    return [d for topic, value in log for d in manager.apply(topic, value)]


def rebuilt(fresh, log, cut: int, at: int | None = None):
    """A worker restarted after ``cut`` records: the snapshot taken after ``at`` records (default:
    ``cut``) restored, then the log from the snapshot's offset folded."""
    first = fresh()
    fold(first, log[: at if at is not None else cut])
    raw = snapshot.dump(first, at if at is not None else cut)
    start, m = snapshot.usable(raw, fresh())
    fold(m, log[start:cut])  # a rebuild re-folds without publishing
    return m


def test_the_power_manager_rebuilt_from_a_snapshot_and_the_tail_decides_as_the_whole_log():
    log = log_of(inv("A", 2), inv("B", 2), pjob("j1", JobState.STARTED, 24, ("A",), at=1),
                 pjob("j2", JobState.STARTED, 24, ("A",), at=2), pjob("j1", JobState.ENDED, 24, ("A",), at=3),
                 pjob("j3", JobState.STARTED, 24, ("B",), at=4))
    whole = PowerManager(250.0)
    decided = fold(whole, log)
    tail_only = fold(PowerManager(250.0), log[4:])  # the head deleted, no snapshot: what it did before
    assert [d.action for d in tail_only] == [PowerAction.DEFER]  # j3: no processor known on B
    for cut in range(len(log) + 1):
        m = rebuilt(lambda: PowerManager(250.0), log, cut)
        assert fold(m, log[cut:]) == decided[len(fold(PowerManager(250.0), log[:cut])):]
        assert m.sequences == whole.sequences or cut < len(log)
    m = rebuilt(lambda: PowerManager(250.0), log, 5, at=3)  # a snapshot older than the restart
    assert fold(m, log[5:]) == decided[-1:] and decided[-1].action is PowerAction.START


def test_a_snapshot_past_the_committed_offset_is_resumed_after_not_folded_twice():
    """The worker snapshots between records, after their decisions were sent; its offsets may be
    committed later. A restart at committed offset 3 with a snapshot at 5 resumes at 5: records 3
    and 4 are in the snapshot (folded again, a reading would count twice in the curves)."""
    log = log_of(inv("A", 2), inv("B", 2), pjob("j1", JobState.STARTED, 24, ("A",), at=1),
                 pjob("j2", JobState.STARTED, 24, ("B",), at=2), pjob("j1", JobState.ENDED, 24, ("A",), at=3),
                 pjob("j3", JobState.STARTED, 24, ("A",), at=4))
    decided = fold(PowerManager(250.0), log)
    first = PowerManager(250.0)
    fold(first, log[:5])
    start, m = snapshot.usable(snapshot.dump(first, 5), PowerManager(250.0))
    committed = 3
    resume = max(committed, start)
    assert resume == 5 and fold(m, log[resume:]) == decided[-1:]


def test_the_placement_manager_rebuilt_from_a_snapshot_keeps_the_inventory_and_running_jobs():
    log = log_of(inventory("n1"), inventory("n2"), ev("x", JobState.SUBMITTED, "LAMMPS", ()),
                 ev("x", JobState.STARTED, "LAMMPS", ("n1",), start_s=10),
                 ev("y", JobState.SUBMITTED, "LAMMPS", (), submit_s=700000))
    whole = [r for r in fold(PlacementManager(), log) if isinstance(r, PlacementDecision)]
    assert [(d.job_id, d.nodes) for d in whole][-1] == ("y", ("n2",))
    tail_only = [r for r in fold(PlacementManager(), log[4:]) if isinstance(r, PlacementDecision)]
    assert tail_only == []  # before: no inventory, y queued behind nothing
    m = rebuilt(PlacementManager, log, 4)
    assert [r for r in fold(m, log[4:]) if isinstance(r, PlacementDecision)] == whole[-1:]


def test_a_snapshot_under_another_configuration_or_format_is_not_used():
    m = PowerManager(250.0)
    fold(m, log_of(inv("A", 2)))
    raw = snapshot.dump(m, 1)
    assert snapshot.usable(raw, PowerManager(300.0))[0] == 0  # the budget changed: fold from the start
    assert snapshot.usable(None, PowerManager(250.0))[0] == 0
    start, again = snapshot.usable(raw, PowerManager(250.0))
    assert start == 1 and again.machine.limits == m.machine.limits
    with pytest.raises(snapshot.SnapshotError, match="digest"):
        snapshot.load(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(snapshot.SnapshotError, match="format 9"):
        snapshot.load(raw.replace(b"nodeshare-snapshot 1 ", b"nodeshare-snapshot 9 ", 1))
    with pytest.raises(snapshot.SnapshotError, match="not a nodeshare snapshot"):
        snapshot.load(b"garbage")


class _Runs:
    """A pickle that runs a command on load (what anyone able to write the snapshot topic could send)."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/nodeshare-snapshot-pwned",))


class _Reaches:
    """A pickle that climbs from an allowed function to its module's globals."""

    def __reduce__(self):
        from nodeshare.streams.core.snapshot import config_of

        return (getattr, (config_of, "__globals__"))


@pytest.mark.parametrize("payload", [_Runs(), _Reaches()], ids=["os.system", "__globals__"])
def test_a_snapshot_that_names_anything_outside_the_core_is_refused_never_run(tmp_path, payload):
    import hashlib
    import pickle

    body = pickle.dumps(payload)
    raw = snapshot.MAGIC + f" {snapshot.FORMAT} 7 {hashlib.sha256(body).hexdigest()} cfg".encode() + b"\n" + body
    with pytest.raises(snapshot.SnapshotError, match="may not"):
        snapshot.load(raw)
    import os

    assert not os.path.exists("/tmp/nodeshare-snapshot-pwned")


def test_a_manager_with_a_trained_pair_model_snapshots_and_loads():
    """The placement manager's forest (scikit-learn) is on the allowlist: a snapshot taken after it
    trained loads, and predicts as the original (else every restart folded the log from its start)."""
    import numpy as np
    from sklearn.ensemble import RandomForestRegressor

    x = np.random.default_rng(0).random((40, 3))
    forest = RandomForestRegressor(n_estimators=5, random_state=0).fit(x, x.sum(axis=1))
    m = PlacementManager()
    m.pairs.model = forest
    _, _, again = snapshot.load(snapshot.dump(m, 3))
    assert (again.pairs.model.predict(x) == forest.predict(x)).all()


@pytest.mark.parametrize(("module", "name"), [
    ("nodeshare.streams.core.snapshot", "pickle"),  # a module the core imports: pickle.loads runs anything
    ("nodeshare.streams.core.degradation", "np"),  # numpy through the core: np.fromfile reads any file
    ("nodeshare.streams.core.snapshot", "hashlib"),
])
def test_a_snapshot_may_not_name_what_the_core_imports(module, name):
    """Only classes and functions *defined* in the core load (a review reached pickle.loads and
    numpy.fromfile through the core's own imports)."""
    import hashlib
    import io
    import pickle

    body = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."  # GLOBAL module.name, STOP
    raw = snapshot.MAGIC + f" {snapshot.FORMAT} 7 {hashlib.sha256(body).hexdigest()} cfg".encode() + b"\n" + body
    assert pickle.Unpickler(io.BytesIO(body)).load() is not None  # plain pickle would hand it over
    with pytest.raises(snapshot.SnapshotError, match="may not name"):
        snapshot.load(raw)
