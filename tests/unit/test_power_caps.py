"""Power decisions that act: the caps a node must hold (pure fold), written through a powercap tree
with the kernel's layout, refused with a reason, and always restored (close, watchdog, next start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import limit, powercap_tree
from factories import power_decision as decision
from factories import power_plan as plan

from nodeshare.producers.agent.power_decisions import CapFollower
from nodeshare.producers.agent.powercap import CapRefused, Powercap
from nodeshare.producers.agent.watchdog import Watchdog
from nodeshare.schemas import encode
from nodeshare.schemas.events import PowerAction
from nodeshare.streams.core.power.caps import CapFold


def test_the_caps_a_node_holds_by_hand():
    caps = CapFold("n1")
    # a starts on n1's processors 0 and 1 (and n2's 0, another agent's business)
    assert caps.apply(decision("a", PowerAction.START, plan("a", ("n1", 0, 80.0), ("n1", 1, 85.0),
                                                              ("n2", 0, 90.0)))) == {0: 80.0, 1: 85.0}
    assert caps.apply(decision("b", PowerAction.DEFER)) == {}
    # b starts on processor 2; PPartition takes power from a: its caps are re-tuned, one moves
    got = caps.apply(decision("b", PowerAction.START, plan("b", ("n1", 2, 70.0)),
                              updates=(plan("a", ("n1", 0, 60.0), ("n1", 3, 60.0)),)))
    assert got == {0: 60.0, 1: None, 2: 70.0, 3: 60.0}  # 1 is free again: its original limit returns
    assert caps.caps() == {0: 60.0, 2: 70.0, 3: 60.0}
    assert caps.apply(decision("a", PowerAction.RELEASE, plan("a", ("n1", 0, 60.0)))) == {0: None, 3: None}
    assert caps.apply(decision("a", PowerAction.RELEASE)) == {}  # released twice: nothing more
    assert caps.caps() == {2: 70.0}


def test_a_cap_is_written_its_original_kept_and_restored(tmp_path):
    root = powercap_tree(tmp_path / "powercap")
    state = tmp_path / "spool.db.caps.json"
    heard: list[dict[str, int]] = []
    pc = Powercap(state, root, on_originals=heard.append)
    pc.set(0, 80.5)
    assert limit(root, 0) == 80_500_000 and limit(root, 1) == 125_000_000
    original = {str(root / "intel-rapl:0" / "constraint_0_power_limit_uw"): 125_000_000}
    assert json.loads(state.read_text()) == original and heard == [original]  # told before the write
    pc.set(0, 70.0)  # a second cap keeps the first original
    assert json.loads(state.read_text()) == original and limit(root, 0) == 70_000_000
    pc.set(0, None)
    assert limit(root, 0) == 125_000_000 and pc.originals == {}
    pc.set(1, 90.0)
    assert pc.restore_all() == 1 and limit(root, 1) == 125_000_000 and not state.exists()


@pytest.mark.parametrize(("processor", "watts", "reason"), [
    (0, 151.0, r"cap 151 W for processor 0 is outside \(0, 150 W\]"),
    (0, 0.0, "is outside"),
    (7, 80.0, "processor 7 has no powercap domain"),
])
def test_a_cap_out_of_range_or_without_a_domain_is_refused_and_nothing_changes(tmp_path, processor, watts, reason):
    root = powercap_tree(tmp_path / "powercap")
    pc = Powercap(tmp_path / "caps.json", root)
    with pytest.raises(CapRefused, match=reason):
        pc.set(processor, watts)
    assert limit(root, 0) == 125_000_000 and pc.originals == {} and not (tmp_path / "caps.json").exists()


def test_a_limit_the_agent_may_not_write_is_refused_with_what_it_needs(tmp_path, monkeypatch):
    root = powercap_tree(tmp_path / "powercap")
    pc = Powercap(tmp_path / "caps.json", root)
    real = Path.write_text

    def denied(self: Path, data: str, *a, **k) -> int:
        if self.name == "constraint_0_power_limit_uw":
            raise PermissionError(13, "Permission denied")
        return real(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", denied)
    with pytest.raises(CapRefused, match=r"cannot write .*Permission denied.*root or CAP_SYS_ADMIN"):
        pc.set(0, 80.0)
    assert limit(root, 0) == 125_000_000


def test_the_next_start_restores_what_a_dead_agent_left_changed(tmp_path):
    root = powercap_tree(tmp_path / "powercap")
    state = tmp_path / "caps.json"
    Powercap(state, root).set(1, 60.0)  # ... and the agent and its watchdog died here
    assert limit(root, 1) == 60_000_000
    assert Powercap(state, root).recover() == 1
    assert limit(root, 1) == 125_000_000 and not state.exists()


def test_the_watchdog_restores_the_caps_of_an_agent_that_never_restored_them(tmp_path):
    """Closing the pipe without restoring is what a SIGKILLed agent does: the watchdog writes back
    the originals of the last line it read. (Mutation: the watchdog ignoring "caps" fails here.)"""
    root = powercap_tree(tmp_path / "powercap")
    watchdog = Watchdog(tmp_path / "freezer")
    pc = Powercap(tmp_path / "caps.json", root, on_originals=watchdog.hold_caps)
    pc.set(0, 75.0)
    pc.set(1, 65.0)
    assert (limit(root, 0), limit(root, 1)) == (75_000_000, 65_000_000)
    watchdog.close()  # the agent's end of the pipe is gone, no restore said
    assert (limit(root, 0), limit(root, 1)) == (125_000_000, 125_000_000)


def test_the_follower_folds_the_history_first_then_writes_what_it_ends_with(tmp_path):
    """History is folded without writing (a cap superseded long ago must not flash on); a refused
    cap is counted and the others still apply."""
    root = powercap_tree(tmp_path / "powercap", packages=2)
    pc = Powercap(tmp_path / "caps.json", root)
    follower = CapFollower(settings=None, node="n1", powercap=pc)
    follower.handle(encode(decision("a", PowerAction.START, plan("a", ("n1", 0, 50.0)))), write=False)
    follower.handle(encode(decision("a", PowerAction.RELEASE)), write=False)
    follower.handle(b"{not json", write=False)  # skipped, logged
    follower.handle(encode(decision("b", PowerAction.START, plan("b", ("n1", 1, 95.0), ("n1", 5, 90.0)))),
                    write=False)
    assert limit(root, 0) == limit(root, 1) == 125_000_000  # nothing written while catching up
    follower.write(dict(follower.caps.caps()))
    assert (limit(root, 0), limit(root, 1)) == (125_000_000, 95_000_000)
    assert follower.applied == 1 and len(follower.refused) == 1 and "processor 5" in follower.refused[0]
    follower.handle(encode(decision("b", PowerAction.RELEASE)), write=True)
    assert limit(root, 1) == 125_000_000
