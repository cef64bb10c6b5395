"""Issue 42, "day two: nothing silent": ended jobs without a charge are found and said why, an
upgrade keeps the audit, and the day-two commands (charges -j, audit --from/--to, ledger backup
and verify --head)."""

from __future__ import annotations

import json
from pathlib import Path

from factories import POLICY, archive_records, block, job_event, left
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.schemas import JobLeftNode, JobState
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

runner = CliRunner()


def _sim_events() -> list:
    return simulate(SimConfig(nodes=4, jobs=8, seed=5)).events


def _demo_like(tmp: Path, drop_markers_of: str | None = None) -> tuple[Path, Path, str]:
    """A simulated run archived and charged; with ``drop_markers_of``, that job's JobLeftNode records
    are left out of the archive, so it yields no charge and the ledger has no row of it (the issue's
    scenario: the demo's archive and ledger, one job's markers and ledger row removed)."""
    events = _sim_events()
    ended = {e.job_id for e in events if getattr(e, "kind", "") == "job_event" and e.ran}
    shuttered = {e.job_id for e in events if getattr(e, "kind", "") in ("shutter_batch", "shutter_block")}
    victim = drop_markers_of or sorted(ended & shuttered)[0]
    if drop_markers_of is not None:
        events = [e for e in events if not (isinstance(e, JobLeftNode) and e.job_id == victim)]
    archive, ledger, _ = archive_records(tmp, events)
    return archive, ledger, victim


def test_an_ended_job_whose_markers_are_gone_is_a_missing_charge_with_its_reason(tmp_path):
    clean_archive, clean_ledger, victim = _demo_like(tmp_path / "clean")
    clean = audit(clean_archive, clean_ledger, POLICY)
    assert clean.ok and clean.missing_charges == []
    archive, ledger, _ = _demo_like(tmp_path / "cut", drop_markers_of=victim)
    with Ledger(ledger, read_only=True) as led:
        assert victim not in {c.job_id for c in led.charges()}
    report = audit(archive, ledger, POLICY)
    assert not report.ok and report.mismatches == [] and report.missing_in_ledger == []
    [pending] = report.missing_charges
    assert pending.job_id == victim and pending.waiting and all(b is not None for _, b in pending.waiting)
    assert "block stream open" in pending.reason and "no JobLeftNode marker" in pending.reason
    assert report.as_dict()["missing_charges"] == 1
    result = runner.invoke(app, ["audit", "--archive", str(archive), "--ledger", str(ledger)])
    assert result.exit_code == 1
    assert "1 ended jobs without a charge" in result.output and victim in result.output


def test_a_node_never_heard_from_is_named(tmp_path):
    """The terminal event names n2, from which nothing ever came: the charge waits on it."""
    records = [block(1.0, 1.4, 1.02, job="j", cycle=0), left("j", "n1", 1, 0),
               job_event("j", JobState.ENDED, nodes=("n1", "n2"))]
    archive, ledger, charges = archive_records(tmp_path, records)
    assert charges == 0
    [pending] = audit(archive, ledger, POLICY).missing_charges
    assert pending.waiting == (("n2", None),) and "node n2: never seen" in pending.reason


def test_charges_pending_lists_them_from_the_archive_and_the_ledger(tmp_path):
    archive, ledger, victim = _demo_like(tmp_path, drop_markers_of=None)
    result = runner.invoke(app, ["charges", "--pending", "--archive", str(archive), "--ledger", str(ledger), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []
    archive, ledger, _ = _demo_like(tmp_path / "cut", drop_markers_of=victim)
    result = runner.invoke(app, ["charges", "--pending", "--archive", str(archive), "--ledger", str(ledger), "--json"])
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.output)
    assert row["job_id"] == victim and "block stream open" in row["reason"]
    result = runner.invoke(app, ["charges", "--pending", "--ledger", str(ledger)])
    assert result.exit_code == 2 and "--archive" in result.output


class _Sent:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    def send_raw(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append((topic, key, value))

    def flush(self, timeout: float = 30.0) -> None:
        pass


def test_the_worker_gauges_jobs_awaiting_a_node_and_the_oldest_ones_age():
    from prometheus_client import REGISTRY

    from nodeshare.config import Settings
    from nodeshare.schemas import encode
    from nodeshare.streams.core.accounting import Origin
    from nodeshare.streams.worker.fold_consumer import FoldConsumer

    fold = FoldConsumer(Settings.model_validate({"bootstrap": "127.0.0.1:1"}))
    fold.producer = _Sent()  # type: ignore[assignment]

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(name)

    ended = job_event("w", JobState.ENDED, nodes=("n1", "n2"))
    fold.apply((Origin("node.ipc", 0, 0), b"w", encode(block(1.0, 1.4, 1.02, job="w", cycle=0)), 0.0))
    fold.apply((Origin("node.ipc", 0, 1), b"w", encode(left("w", "n1", 1, 0)), 0.0))
    assert gauge("nodeshare_jobs_awaiting_nodes") == 0  # not ended yet: nothing awaited
    fold.apply((Origin("jobs.lifecycle", 0, 0), b"w", encode(ended), 0.0))
    assert gauge("nodeshare_jobs_awaiting_nodes") == 1
    assert gauge("nodeshare_jobs_awaiting_nodes_oldest_seconds") >= 0  # type: ignore[operator]
    assert fold.oldest_awaiting_s() > 0  # the factories' jobs ended in January 2026
    fold.apply((Origin("node.ipc", 0, 2), b"w", encode(block(1.0, 1.4, 1.02, job="w", cycle=0, node="n2")), 0.0))
    fold.apply((Origin("node.ipc", 0, 3), b"w", encode(left("w", "n2", 1, 0)), 0.0))
    assert gauge("nodeshare_jobs_awaiting_nodes") == 0 and gauge("nodeshare_jobs_awaiting_nodes_oldest_seconds") == 0
    assert any(t == "ledger.charges" for t, _, _ in fold.producer.sent)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- item 2: upgrades keep the audit


def test_a_version_bump_leaves_the_audit_clean(tmp_path, monkeypatch):
    """The ledger was written by this build; the audit runs on the next one (code_version bumped): the
    recomputed charges carry the new version, which is provenance, not a charge field. (Before: every
    row a mismatch on code_version, 12 of 12 in the issue's demo.)"""
    from nodeshare.streams.core import accounting

    archive, ledger, _ = _demo_like(tmp_path)
    monkeypatch.setattr(accounting, "__version__", "99.0.0")
    for fast in (True, False):
        report = audit(archive, ledger, POLICY, fast=fast)
        assert report.ok and report.mismatches == [] and report.matches > 0, report.as_dict()
    with Ledger(ledger, read_only=True) as led:
        assert {c.code_version for c in led.charges()} != {"99.0.0"}


def _as_version(record: object, version: int) -> bytes:
    """A record as a build of schema ``version`` wrote it: its version, without the fields added later."""
    from nodeshare.schemas import encode
    from nodeshare.schemas.events import ADDED_IN

    d = json.loads(encode(record))  # type: ignore[arg-type]
    d["schema_version"] = version
    for f, added in ADDED_IN.get(type(record), {}).items():
        if added > version:
            d.pop(f, None)
    return json.dumps(d).encode()


def test_every_input_record_of_every_older_version_is_read():
    """The worker reads versions 1..SCHEMA_VERSION of each input topic's records (a version-1/2 block
    as the ShutterBlock it was; from 3 on, batches)."""
    from nodeshare.schemas import INPUT_TOPICS, SCHEMA_VERSION, decode
    from nodeshare.schemas.catalog import TOPIC_OF_RECORD

    events = _sim_events()
    seen: dict[str, object] = {}
    for e in events:
        seen.setdefault(type(e).__name__, e)
    inputs = {t.name for t in INPUT_TOPICS}
    checked = 0
    for name, record in seen.items():
        spec = TOPIC_OF_RECORD[type(record)]
        if spec.name not in inputs:
            continue
        for version in range(1, SCHEMA_VERSION + 1):
            if name == "ShutterBatch" and version < 3:
                continue  # version 1/2 agents sent single blocks (read as batches of one: test_schema_evolution)
            assert decode(spec, _as_version(record, version)).schema_version == version
            checked += 1
    assert {"ShutterBatch", "JobLeftNode", "JobEvent"} <= set(seen) and checked >= 3 * SCHEMA_VERSION - 2


def test_an_archive_and_ledger_written_by_schema_3_audit_clean_today(tmp_path):
    """Pricing changed in version 4 (the time a job ran alone is undisturbed): the rule is selected
    by what the records carry, so a version-3 archive (markers without alone_us) recomputes to the
    version-3 ledger's charges, bit for bit, on today's build."""
    from nodeshare.schemas import Charge, decode_model
    from nodeshare.schemas.catalog import TOPIC_OF_RECORD, key_of
    from nodeshare.sinks.archive import ParquetArchive
    from nodeshare.sinks.audit import archived_messages
    from nodeshare.streams.core.accounting import fold_messages

    raw = [(TOPIC_OF_RECORD[type(e)].name, key_of(e), _as_version(e, 3)) for e in _sim_events()]
    archive, _, _ = archive_records(tmp_path, raw)
    msgs = [m for ms in archived_messages(ParquetArchive(archive)).values() for m in ms]
    made_then = fold_messages(msgs, POLICY)
    assert made_then and all(c.alone_s == 0.0 for c in made_then)
    rows = [(c, _as_version(c, 3)) for c in made_then]
    old = tmp_path / "v3.duckdb"
    with Ledger(old) as ledger:
        ledger.append([(decode_model(Charge, v), v, 0, i) for i, (_, v) in enumerate(rows)])
    report = audit(archive, old, POLICY)
    assert report.ok and report.matches == len(made_then), report.as_dict()
