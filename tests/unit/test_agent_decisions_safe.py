"""Decisions that act, made safe (issue 43, the agent's side): a refused restore keeps the original,
a follower that cannot go on is noticed and undoes what it applied, the agent's fold of
``decisions.power`` is the same in every interleaving of its partitions, and resctrl masks never
share a way, follow the kernel's rules and keep unmanaged processes out of booked ways."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from factories import limit, powercap_tree, resctrl_tree
from factories import power_decision as decision
from factories import power_plan as plan
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

import nodeshare.producers.agent.follower as follower_mod
from nodeshare.producers.agent.follower import Follower, FollowerStopped
from nodeshare.producers.agent.jobs import LocalJob
from nodeshare.producers.agent.llc_decisions import LlcFollower
from nodeshare.producers.agent.power_decisions import CapFollower
from nodeshare.producers.agent.powercap import CapRefused, Powercap
from nodeshare.producers.agent.processes import Proc
from nodeshare.producers.agent.resctrl import Resctrl
from nodeshare.producers.agent.watchdog import Watchdog, WatchdogLost
from nodeshare.schemas import encode
from nodeshare.schemas.catalog import CLUSTER_INVENTORY, JOBS_LIFECYCLE
from nodeshare.schemas.events import JobEvent, JobState, NodeInventory, PowerAction, PowerDecision, ProcessorSpec
from nodeshare.streams.core.placement.resctrl import Setting, Share, default_mask, layout
from nodeshare.streams.core.power.caps import CapFold
from nodeshare.streams.core.power.stream import PowerManager

T0 = datetime(2026, 3, 1, tzinfo=UTC)

# --------------------------------------------------------------------------- a refused restore


def _busy_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Powercap._write

    def busy(self: Powercap, path: Path, uw: int) -> None:
        monkeypatch.setattr(Powercap, "_write", real)  # refused once, as a transient EBUSY on sysfs is
        raise CapRefused(f"cannot write {path}: Device or resource busy")

    monkeypatch.setattr(Powercap, "_write", busy)


def test_a_refused_restore_keeps_the_original_for_the_next_cap_and_the_exit(tmp_path, monkeypatch):
    """(Mutation: popping the original before the write-back fails here: the next cap records 80 W.)"""
    root = powercap_tree(tmp_path / "powercap")
    state = tmp_path / "caps.json"
    heard: list[dict[str, int]] = []
    pc = Powercap(state, root, on_originals=heard.append)
    pc.set(0, 80.0)
    _busy_once(monkeypatch)
    with pytest.raises(CapRefused, match="busy"):
        pc.set(0, None)
    assert limit(root, 0) == 80_000_000
    assert list(json.loads(state.read_text()).values()) == [125_000_000] and list(heard[-1].values()) == [125_000_000]
    pc.set(0, 90.0)  # the next job on the package: the original is still 125 W, everywhere
    assert list(json.loads(state.read_text()).values()) == [125_000_000] and list(heard[-1].values()) == [125_000_000]
    assert pc.restore_all() == 1 and limit(root, 0) == 125_000_000 and not state.exists()


def test_a_refused_restore_is_tried_again_and_kept_for_the_next_start(tmp_path, monkeypatch):
    root = powercap_tree(tmp_path / "powercap")
    state = tmp_path / "caps.json"
    follower = CapFollower(settings=None, node="n1", powercap=Powercap(state, root))
    follower.handle(encode(decision("a", PowerAction.START, plan("a", ("n1", 0, 80.0)))), write=True)
    _busy_once(monkeypatch)
    follower.handle(encode(decision("a", PowerAction.RELEASE)), write=True)  # refused, counted, kept
    assert limit(root, 0) == 80_000_000 and len(follower.refused) == 1 and state.exists()
    follower.idle()  # the follower's next poll writes it back
    assert limit(root, 0) == 125_000_000 and not state.exists() and follower.powercap.unrestored == set()
    # a restore refused at exit stays in the state file, and the next start puts it back
    pc = Powercap(state, root)
    pc.set(1, 60.0)
    real = Path.write_text

    def busy(self: Path, data: str, *a, **k) -> int:
        if self.name == "constraint_0_power_limit_uw":
            monkeypatch.setattr(Path, "write_text", real)
            raise OSError(16, "Device or resource busy")
        return real(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", busy)
    assert pc.restore_all() == 0 and limit(root, 1) == 60_000_000 and state.exists()
    assert Powercap(state, root).recover() == 1 and limit(root, 1) == 125_000_000 and not state.exists()


def test_an_original_that_cannot_be_recorded_refuses_the_cap(tmp_path):
    root = powercap_tree(tmp_path / "powercap")
    pc = Powercap(tmp_path / "no-such-dir" / "caps.json", root)
    with pytest.raises(CapRefused, match="cannot record the original"):
        pc.set(0, 80.0)
    assert limit(root, 0) == 125_000_000 and pc.originals == {}


# --------------------------------------------------------------------------- a follower that cannot go on


class _Msg:
    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset = value, offset

    def error(self) -> None:
        return None

    def value(self) -> bytes:
        return self._value

    def partition(self) -> int:
        return 0

    def topic(self) -> str:
        return "decisions.power"

    def offset(self) -> int:
        return self._offset


def _fake_consumer(records: list[PowerDecision], wait_for: list[bool]) -> type:
    class FakeConsumer:
        def __init__(self, conf: dict) -> None:
            self.batches = [[_Msg(encode(d), i)] for i, d in enumerate(records)]

        def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(topics={topic: SimpleNamespace(partitions={0: None})})

        def get_watermark_offsets(self, tp: object, timeout: float) -> tuple[int, int]:
            return (0, 0)  # no history: caught up at once

        def assign(self, tps: object) -> None:
            pass

        def consume(self, n: int, timeout: float) -> list[_Msg]:
            time.sleep(0.02)
            if not wait_for[0] or not self.batches:
                return []
            if len(self.batches) == len(records) - 1:  # the first is applied: wait for the test's go
                wait_for[0] = wait_for[1]
            return self.batches.pop(0)

        def close(self) -> None:
            pass

    return FakeConsumer


def test_a_follower_whose_watchdog_is_gone_restores_its_caps_and_stops_the_agent(tmp_path, monkeypatch, caplog):
    """(Mutation: ``Follower.run`` swallowing the failure, as it did, fails here.)"""
    live = [decision("a", PowerAction.START, plan("a", ("n1", 0, 80.0))),
            decision("b", PowerAction.START, plan("b", ("n1", 1, 90.0))),  # needs the watchdog: it is gone
            decision("a", PowerAction.RELEASE)]
    gate = [True, False]
    monkeypatch.setattr(follower_mod, "Consumer", _fake_consumer(live, gate))
    root = powercap_tree(tmp_path / "pc")
    watchdog = Watchdog(tmp_path)
    pc = Powercap(tmp_path / "caps.json", root, on_originals=watchdog.hold_caps)
    config = SimpleNamespace(topic=lambda n: n, client_config=lambda **k: k, app_id="t")
    follower = CapFollower(config, "n1", pc)
    follower.start()
    deadline = time.monotonic() + 5
    while limit(root, 0) != 80_000_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert limit(root, 0) == 80_000_000
    os.kill(watchdog.pid, signal.SIGKILL)
    watchdog.process.wait()
    with caplog.at_level(logging.CRITICAL, logger="nodeshare.producers.agent.follower"):
        gate[0] = True
        follower._thread.join(5)  # type: ignore[union-attr]
    assert not follower._thread.is_alive()  # type: ignore[union-attr]
    assert isinstance(follower.failure, WatchdogLost)
    assert (limit(root, 0), limit(root, 1)) == (125_000_000, 125_000_000)  # every limit back, at once
    assert REGISTRY.get_sample_value("nodeshare_agent_follower_up", {"follower": "power"}) == 0
    assert any("the follower stopped" in r.getMessage() for r in caplog.records)
    with pytest.raises(WatchdogLost, match=r"decisions\.power follower stopped"):  # the agent's loop exits (3)
        Follower.check(None, follower)


def test_check_names_a_follower_stopped_by_anything_else():
    follower = CapFollower(settings=None, node="n1", powercap=Powercap(Path("/nonexistent/caps.json")))
    Follower.check(follower)  # running: nothing
    follower.failure = KeyError("bug")
    with pytest.raises(FollowerStopped, match=r"decisions\.power follower stopped"):
        Follower.check(follower)


# --------------------------------------------------------------------------- decisions.power in any interleaving


def _inventory(node: str, processors: int) -> NodeInventory:
    return NodeInventory(event_id=f"inv-{node}", source="t", event_time=T0, node=node, cores=12 * processors,
                         sockets=processors, llc_ways=20, mem_bandwidth_gbps=100.0,
                         processors=tuple(ProcessorSpec(processor=i, min_watts=51.0, max_watts=120.0)
                                          for i in range(processors)))


def _job(job_id: str, state: JobState, at: int, node: str = "A", cores: int = 12) -> JobEvent:
    t = T0 + timedelta(seconds=at)
    return JobEvent(event_id=f"{job_id}-{state.value}", source="t", event_time=t, job_id=job_id, state=state,
                    user="u", account="a", program="EP", cores=cores, nodes=(node,), submit_time=T0, start_time=T0,
                    end_time=t if state is JobState.ENDED else None)


def _decisions(budget: float, events: list[JobEvent]) -> list[PowerDecision]:
    pm = PowerManager(budget)
    pm.apply(CLUSTER_INVENTORY.name, encode(_inventory("A", 4)))
    out: list[PowerDecision] = []
    for e in events:
        out += pm.apply(JOBS_LIFECYCLE.name, encode(e))
    return out


def _fold(records: list[PowerDecision]) -> dict[int, float]:
    caps = CapFold("A")
    for d in records:
        caps.apply(d)
    return caps.caps()


def _interleavings(left: list[PowerDecision], right: list[PowerDecision]):
    n = len(left) + len(right)
    for slots in itertools.combinations(range(n), len(left)):
        li, ri = iter(left), iter(right)
        yield [next(li) if i in slots else next(ri) for i in range(n)]


def _truth(records: list[PowerDecision]) -> dict[int, float]:
    caps = CapFold("A")  # the fold in the manager's own order
    for d in records:
        caps.apply(d)
    return caps.caps()


def test_every_interleaving_of_the_partitions_gives_the_managers_caps():
    """The manager gives b, c, d, e 75 W each, raises c, d, e to 100 W when b ends, and lowers them
    to 75 W again when f starts. b's release and f's start are on other partitions: delivered the
    other way round, a fold in arrival order kept 100 W (375 W of a 300 W budget)."""
    log = _decisions(300.0, [_job("b", JobState.STARTED, 1), _job("c", JobState.STARTED, 2),
                             _job("d", JobState.STARTED, 3), _job("e", JobState.STARTED, 4),
                             _job("b", JobState.ENDED, 5), _job("f", JobState.STARTED, 6)])
    truth = _truth(log)
    assert sum(truth.values()) <= 300.0 and len(truth) == 4
    swapped = [*log[:4], log[5], log[4]]
    assert _fold(swapped) == truth  # (Mutation: folding in arrival order, as version-5 records are, gives 375 W here)
    for one, other in (([0, 4], [1, 2, 3, 5]), ([0, 2, 4], [1, 3, 5])):  # by job's partition, and a harder split
        for order in _interleavings([log[i] for i in one], [log[i] for i in other]):
            assert _fold(order) == truth
            assert _fold(order + order[::2]) == truth  # redelivered records change nothing


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("bcdefgh"), st.booleans()), min_size=2, max_size=9),
       st.randoms(use_true_random=False))
def test_property_every_interleaving_of_two_partitions_gives_the_same_caps(steps, rnd):
    """Jobs start and end on node A (each event one second after the last); the decisions go to two
    partitions by job; any merge of the two keeps each partition's order and must fold to the caps
    of the manager's own order."""
    events, running, seen = [], set(), set()
    for i, (job, end) in enumerate(steps):
        if job in running and end:
            events.append(_job(job, JobState.ENDED, i + 1))
            running.discard(job)
        elif job not in seen:
            events.append(_job(job, JobState.STARTED, i + 1))
            running.add(job)
            seen.add(job)
    log = _decisions(300.0, events)
    truth = _truth(log)
    left = [d for d in log if ord(d.job_id) % 2]
    right = [d for d in log if not ord(d.job_id) % 2]
    merged, li, ri = [], list(left), list(right)
    while li or ri:
        merged.append((li if li and (not ri or rnd.random() < 0.5) else ri).pop(0))
    assert _fold(merged) == _fold(log) == truth


# --------------------------------------------------------------------------- resctrl masks


def _contiguous(mask: int) -> bool:
    low = mask & -mask
    return mask != 0 and (mask + low) & mask == 0


def test_fragmented_free_ways_never_give_two_jobs_a_shared_way():
    """a, b, c fill 11 ways; a and c end; d books 5: 4 + 5 fit, but no free run of 5 is left beside
    b (ways 0-2 and 7-10). (Mutation: giving d the highest ways, as before, shares way 6 with b.)"""
    s = {"a": Share(3, None), "b": Share(4, None), "c": Share(4, None), "d": Share(5, None)}
    first = layout(s, ["a", "b", "c"], 11, 50.0)
    assert [first[j].mask for j in "abc"] == [0x007, 0x078, 0x780]
    then = layout(s, ["b", "d"], 11, 50.0, previous=first)
    assert then["b"].mask & then["d"].mask == 0 and all(_contiguous(x.mask) for x in then.values())
    assert {j: x.mask.bit_count() for j, x in then.items()} == {"b": 4, "d": 5}


def test_masks_hold_at_least_min_cbm_bits():
    got = layout({"e": Share(1, None), "f": Share(2, None)}, ["e", "f"], 11, 50.0, min_bits=2)
    assert got == {"e": Setting(0b11, None), "f": Setting(0b1100, None)}
    with pytest.raises(ValueError, match="min_cbm_bits"):
        layout({}, [], 11, 50.0, min_bits=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdefg"), st.integers(1, 6)), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(4, 16))
def test_property_masks_are_disjoint_contiguous_and_within_the_ways(steps, min_bits, total):
    """Jobs arrive (with a share) or leave, in any order: every layout is one the kernel accepts and
    no way is in two masks; every job whose share fits the ways left by the others gets one."""
    shares: dict[str, Share] = {}
    running: list[str] = []
    previous: dict[str, Setting] = {}
    for job, ways in steps:
        if job in running:
            running.remove(job)
        else:
            running.append(job)
            shares[job] = Share(ways, None)
        if min_bits > total:
            return
        got = layout(shares, running, total, 50.0, previous, min_bits)
        used = 0
        for setting in got.values():
            assert _contiguous(setting.mask) and setting.mask.bit_count() >= min_bits
            assert setting.mask >> total == 0 and setting.mask & used == 0
            used |= setting.mask
        need = sum(min(max(min_bits, shares[j].ways), total) for j in running)
        if need <= total:
            assert got.keys() == set(running)
        default = default_mask(got, total, min_bits)
        assert _contiguous(default) and default.bit_count() >= min_bits and default >> total == 0
        run = (1 << min_bits) - 1
        if any((used >> first) & run == 0 for first in range(total - min_bits + 1)):  # a free run is left
            assert default & used == 0
        previous = got


def _schemata(root: Path) -> list[str]:
    return (root / "schemata").read_text().split()


def test_unmanaged_processes_keep_out_of_booked_ways_and_get_them_back_at_exit(tmp_path):
    root = resctrl_tree(tmp_path / "resctrl", ways=11, caches=2)
    (root / "info" / "L3" / "min_cbm_bits").write_text("2\n")
    resctrl = Resctrl(root)
    assert resctrl.min_bits == 2
    follower = LlcFollower(settings=None, node="n1", resctrl=resctrl, node_gbps=100.0)
    follower.shares.shares.update({"a": Share(1, None), "b": Share(4, None)})
    follower.caught_up.set()
    jobs = {j: LocalJob(j, frozenset({Proc(os.getpid(), 0)})) for j in ("a", "b", "c")}  # c has no share
    follower.sync(jobs)
    assert resctrl.settings == {"a": Setting(0b11, None), "b": Setting(0b111100, None)}  # a: min_cbm_bits ways
    assert _schemata(root)[0] == "L3:0=7c0;1=7c0"  # the default group (c, the system): the ways no job booked
    follower.sync({"c": jobs["c"]})  # a and b leave: the default group has every way again
    assert _schemata(root)[0] == "L3:0=7ff;1=7ff" and resctrl.jobs() == []
    follower.sync(jobs)
    assert _schemata(root)[0] == "L3:0=7c0;1=7c0"
    resctrl.remove_all()  # the agent's exit
    assert _schemata(root)[0] == "L3:0=7ff;1=7ff" and not list(root.glob("nodeshare-*"))


def test_the_next_start_gives_the_default_group_back_what_a_killed_agent_narrowed(tmp_path):
    root = resctrl_tree(tmp_path / "resctrl", ways=11, caches=2)
    dead = Resctrl(root)
    dead.apply("a", Setting(0b1111, None), [])
    dead.set_default(0b11111110000)  # ... and the agent was killed here
    assert _schemata(root)[0] == "L3:0=7f0;1=7f0"
    again = Resctrl(root)
    assert again.remove_all() == 1 and _schemata(root)[0] == "L3:0=7ff;1=7ff"


def test_a_follower_says_so_when_a_topic_it_also_folds_is_missing_and_still_applies_the_rest(
        tmp_path, monkeypatch, caplog):
    """decisions.power.nodes not created since the upgrade (docs/upgrades.md): the agent's caps
    still come from decisions.power, and an error says what to run. (A review found it silent.)"""
    live = [decision("a", PowerAction.START, plan("a", ("n1", 0, 80.0)))]
    consumer = _fake_consumer(live, [True, True])

    class Missing(consumer):  # type: ignore[misc, valid-type]
        def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
            missing = topic.endswith("decisions.power.nodes")
            return SimpleNamespace(topics={topic: SimpleNamespace(
                partitions={} if missing else {0: None}, error="UNKNOWN_TOPIC_OR_PART" if missing else None)})

    monkeypatch.setattr(follower_mod, "Consumer", Missing)
    root = powercap_tree(tmp_path / "pc")
    pc = Powercap(tmp_path / "caps.json", root)
    config = SimpleNamespace(topic=lambda n: n, client_config=lambda **k: k, app_id="t")
    follower = CapFollower(config, "n1", pc)
    with caplog.at_level(logging.ERROR, logger="nodeshare.producers.agent.follower"):
        follower.start()
        deadline = time.monotonic() + 5
        while limit(root, 0) != 80_000_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        follower.stop()
    assert limit(root, 0) == 80_000_000
    assert any("no topic decisions.power.nodes" in r.getMessage() and "topics create" in r.getMessage()
               for r in caplog.records)
    pc.restore_all()


def test_a_follower_whose_own_topic_is_missing_waits_for_it_and_never_says_it_caught_up(tmp_path, monkeypatch):
    """decisions.placement.nodes not created since the upgrade: the --resctrl follower must not hold
    "no shares" as caught up (a review found it silent); it waits for the topic as for a broker away."""
    from confluent_kafka import KafkaException

    consumer = _fake_consumer([], [True, True])

    class Missing(consumer):  # type: ignore[misc, valid-type]
        def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(topics={topic: SimpleNamespace(partitions={}, error="UNKNOWN_TOPIC_OR_PART")})

    monkeypatch.setattr(follower_mod, "Consumer", Missing)
    config = SimpleNamespace(topic=lambda n: n, client_config=lambda **k: k, app_id="t")
    follower = LlcFollower(config, "n1", Resctrl(resctrl_tree(tmp_path / "resctrl")), 50.0)
    with pytest.raises(KafkaException, match=r"no topic decisions\.placement\.nodes: run `nodeshare topics create`"):
        follower._follow()
    assert not follower.caught_up.is_set()
