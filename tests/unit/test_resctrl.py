"""Cache shares that act: the ways and bandwidth placement booked per job (pure fold and layout,
checked by hand), written as resctrl groups on a tree with the kernel's layout, and always
removed (every exit path, the watchdog, the next start)."""

from __future__ import annotations

import os

import pytest
from factories import node_shares, placement, resctrl_tree

from nodeshare.producers.agent.jobs import LocalJob
from nodeshare.producers.agent.llc_decisions import LlcFollower
from nodeshare.producers.agent.processes import Proc
from nodeshare.producers.agent.resctrl import Resctrl, ResctrlUnavailable
from nodeshare.producers.agent.watchdog import Watchdog
from nodeshare.schemas import encode
from nodeshare.streams.core.placement.resctrl import NodeShares, Setting, Share, layout, mb_percent


def test_mba_percent_by_hand():
    assert mb_percent(None, 100.0) is None and mb_percent(10.0, 0.0) is None
    assert mb_percent(20.0, 100.0) == 20  # exactly a step
    assert mb_percent(21.0, 100.0) == 30  # rounded up: never less than booked
    assert mb_percent(0.5, 100.0) == 10  # MBA's lowest level
    assert mb_percent(300.0, 100.0) == 100
    assert mb_percent(7.6, 76.0) == 10  # 10.000000000000002% is 10%, not 20%


def test_the_shares_a_node_gives_by_hand():
    shares = NodeShares("n1")
    shares.apply(placement("a", ("n1", "n2"), ways=4, gbps=20.0))
    shares.apply(placement("b", ("n2",), ways=3))  # another node's business
    shares.apply(placement("c", ("n1",)))  # placed without a cache share (CE): nothing to isolate
    shares.apply(placement("d", (), action="delay"))
    assert shares.shares == {"a": Share(4, 20.0)}
    shares.apply(placement("a", ("n3",), ways=4, action="pair"))  # placed again elsewhere
    assert shares.shares == {}


def test_layout_gives_each_job_its_own_contiguous_ways_by_hand():
    shares = {"a": Share(4, 20.0), "b": Share(3, None), "c": Share(5, 10.0), "gone": Share(2, None)}
    got = layout(shares, ["b", "a", "x"], total_ways=11, node_gbps=100.0)
    assert got == {"a": Setting(0b1111, 20), "b": Setting(0b1110000, None)}  # in job order from way 0
    # c arrives while a and b run: they keep their ways, c takes the lowest free run (ways 7-10: 4 < 5)
    got = layout(shares, ["a", "b", "c"], 11, 100.0, previous=got)
    assert got["a"].mask == 0b1111 and got["b"].mask == 0b1110000
    assert "c" not in got  # 4 + 3 + 5 > 11: no room of its own, so no group (it runs in the default group)
    # a leaves: 3 + 5 ways fit, but the free ways (0-3, 7-10) hold no run of 5: all are packed again
    got = layout(shares, ["b", "c"], 11, 100.0, previous=got)
    assert got == {"b": Setting(0b111, None), "c": Setting(0b11111000, 10)}
    # b leaves: c keeps its ways
    assert layout(shares, ["c"], 11, 100.0, previous=got) == {"c": Setting(0b11111000, 10)}
    with pytest.raises(ValueError, match="at least one LLC way"):
        layout(shares, ["a"], 0, 100.0)


def test_a_setting_as_schemata():
    assert Setting(0b1111, 20).schemata([0, 1], [0, 1]) == "L3:0=f;1=f\nMB:0=20;1=20\n"
    assert Setting(0x7f0, None).schemata([0], [0]) == "L3:0=7f0\n"
    assert Setting(0x3, 50).schemata([0], []) == "L3:0=3\n"  # no MBA on this processor


def test_groups_are_written_and_removed_on_a_kernel_layout(tmp_path):
    root = resctrl_tree(tmp_path / "resctrl")
    said: list[list[str]] = []
    rc = Resctrl(root, on_groups=said.append)
    assert (rc.cache_ids, rc.mb_ids, rc.total_ways) == ([0, 1], [0, 1], 11)
    rc.apply("job/7", Setting(0b11, 30), [101, 102])
    group = root / "nodeshare-job_7"
    assert said == [[str(group)]]  # said before the group existed
    assert (group / "schemata").read_text() == "L3:0=3;1=3\nMB:0=30;1=30\n"
    assert (group / "tasks").read_text().split() == ["101", "102"]
    rc.apply("job/7", Setting(0b11, 30), [101, 102, 103])  # a new process of the job joins; no duplicates
    assert (group / "tasks").read_text().split() == ["101", "102", "103"]
    rc.remove("job/7")
    assert not group.exists() and said[-1] == []
    (root / "nodeshare-left-by-a-dead-run").mkdir()
    assert Resctrl(root).remove_all() == 1 and not list(root.glob("nodeshare-*"))


def test_no_resctrl_is_said_plainly(tmp_path):
    with pytest.raises(ResctrlUnavailable, match="no resctrl with L3 CAT"):
        Resctrl(tmp_path)


def test_the_watchdog_removes_the_groups_of_an_agent_that_never_did(tmp_path):
    """(Mutation: the watchdog ignoring "resctrl" fails here.)"""
    root = resctrl_tree(tmp_path / "resctrl")
    watchdog = Watchdog(tmp_path / "freezer")
    rc = Resctrl(root, on_groups=watchdog.hold_groups)
    rc.apply("a", Setting(0b1, None), [os.getpid()])
    rc.apply("b", Setting(0b10, None), [])
    assert len(list(root.glob("nodeshare-*"))) == 2
    watchdog.close()  # the agent's end of the pipe is gone, nothing removed
    assert not list(root.glob("nodeshare-*"))


def test_the_follower_gives_running_jobs_their_shares_once_caught_up(tmp_path):
    root = resctrl_tree(tmp_path / "resctrl")
    follower = LlcFollower(settings=None, node="n1", resctrl=Resctrl(root), node_gbps=50.0)
    follower.handle(encode(node_shares("n1", ("z", 1, None))), write=False)  # an older state: replaced whole
    follower.handle(encode(node_shares("n1", ("a", 4, 10.0), ("b", 2, None))), write=False)
    follower.handle(encode(node_shares("n2", ("z", 3, None))), write=False)  # another node's: not ours
    follower.handle(b"not json", write=False)  # skipped, logged
    follower.handle(None, write=False)  # a tombstone
    jobs = {"a": LocalJob("a", frozenset({Proc(4242, 0)})), "z": LocalJob("z", frozenset())}
    follower.sync(jobs)
    assert not list(root.glob("nodeshare-*"))  # not caught up: nothing written yet
    follower.caught_up.set()
    follower.sync(jobs)
    assert (root / "nodeshare-a" / "schemata").read_text() == "L3:0=f;1=f\nMB:0=20;1=20\n"
    assert (root / "nodeshare-a" / "tasks").read_text().split() == ["4242"]
    assert not (root / "nodeshare-b").exists() and not (root / "nodeshare-z").exists()  # b is not running here
    follower.sync({})  # a left the node
    assert not list(root.glob("nodeshare-*"))


def test_a_job_the_kernel_refuses_keeps_the_whole_cache_and_is_not_retried_every_rescan(tmp_path, monkeypatch):
    from pathlib import Path

    root = resctrl_tree(tmp_path / "resctrl")
    follower = LlcFollower(settings=None, node="n1", resctrl=Resctrl(root), node_gbps=50.0)
    follower.handle(encode(node_shares("n1", ("a", 4, None), ("b", 2, None))), write=False)
    follower.caught_up.set()
    real, attempts = Path.write_text, []

    def refuse_a(self: Path, data: str, *args, **kwargs) -> int:
        if self.name == "schemata" and self.parent.name == "nodeshare-a":
            attempts.append(data)
            raise PermissionError(13, "Permission denied")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse_a)
    jobs = {j: LocalJob(j, frozenset({Proc(100 + i, 0)})) for i, j in enumerate("ab")}
    for _ in range(3):  # three rescans
        follower.sync(jobs)
    assert len(attempts) == 1 and follower.refused == {"a"}
    assert not (root / "nodeshare-a").exists()
    assert (root / "nodeshare-b" / "schemata").read_text() == "L3:0=30;1=30\n"  # b keeps its ways 4-5
    follower.sync({"b": jobs["b"]})  # a left: a new job "a" would be tried again
    assert follower.refused == set()
