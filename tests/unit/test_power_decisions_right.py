"""The power manager's decisions are the right ones for what really runs (issue 43, power part).

Decided at `started`, on the nodes the job runs on, capping every processor it occupies; lifecycle
duplicates ignored by the rule placement follows; inventory changes (a record without processors,
a processor removed, limits changed) reconciled without a crash; caps inside the processors' limits;
and, for generated event sequences, the budget holds at every step.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeshare.producers.slurm_nodes import inventory as slurm_inventory
from nodeshare.producers.slurm_nodes import parse_nodes
from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.events import (
    HeldCap,
    JobEvent,
    JobState,
    NodeCapState,
    NodeInventory,
    NodePowerState,
    PowerAction,
    PowerDecision,
    PowerReading,
    ProcessorSpec,
    Record,
)
from nodeshare.schemas.serde import encode
from nodeshare.streams.core.lifecycle import JobPhases
from nodeshare.streams.core.placement.stream import PlacementManager
from nodeshare.streams.core.power.caps import CapFold, node_states
from nodeshare.streams.core.power.curves import MIN_CAP_MW
from nodeshare.streams.core.power.ppartition import _occupied, check
from nodeshare.streams.core.power.stream import PowerManager

T0 = datetime(2026, 3, 1, tzinfo=UTC)
NODES = ("A", "B", "C")


def inv(node: str, nproc: int, lo: float = 51.0, hi: float = 120.0, at: int = 0, cores_per: int = 12,
        procs: tuple[int, ...] | None = None) -> NodeInventory:
    idx = procs if procs is not None else tuple(range(nproc))
    return NodeInventory(event_id=f"inv-{node}-{idx}-{lo}-{hi}-{at}", source="t", event_time=T0 + timedelta(seconds=at),
                         node=node, cores=cores_per * max(nproc, 1), sockets=max(nproc, 1), llc_ways=20,
                         mem_bandwidth_gbps=100.0,
                         processors=tuple(ProcessorSpec(processor=i, min_watts=lo, max_watts=hi) for i in idx))


def job(jid: str, state: JobState, cores: int, nodes: tuple[str, ...] = (), at: int = 0, program: str = "EP",
        eid: str | None = None) -> JobEvent:
    ran = state in (JobState.STARTED, JobState.ENDED)
    return JobEvent(event_id=eid or f"{jid}-{state.value}", source="t", event_time=T0 + timedelta(seconds=at),
                    job_id=jid, state=state, user="u", account="a", program=program, cores=cores,
                    nodes=nodes if ran else (), submit_time=T0, start_time=T0 if ran else None,
                    end_time=T0 + timedelta(seconds=at) if state is JobState.ENDED else None)


def reading(node: str, proc: int, watts: float, gips: float | None, cap: float | None = None,
            program: str | None = "EP", at: int = 0) -> PowerReading:
    return PowerReading(event_id=f"pw-{node}-{proc}-{watts}-{gips}-{cap}-{at}", source="t",
                        event_time=T0 + timedelta(seconds=at), node=node, processor=proc, available=True,
                        watts=watts, cap_watts=cap, instructions=None if gips is None else round(gips * 1e9),
                        interval_s=1.0, program=program)


class Site:
    """The power manager and one agent's cap fold per node, fed the same records."""

    def __init__(self, budget: float | None) -> None:
        self.pm = PowerManager(budget)
        self.agents = {n: CapFold(n) for n in NODES}
        self.decisions: list[PowerDecision] = []

    def feed(self, *records: Record) -> list[PowerDecision]:
        out = []
        for r in records:
            got = self.pm.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))
            for d in got:
                for a in self.agents.values():
                    a.apply(d)
            out += got
        self.decisions += out
        return out

    def held(self) -> dict[tuple[str, int], float]:
        return {(n, p): w for n, a in self.agents.items() for p, w in a.caps().items()}

    def limits_of(self, busy: set[tuple[str, int]], uncapped: float = 120.0) -> float:
        """What the busy processors may draw: their cap, else their own (uncapped) limit."""
        held = self.held()
        return sum(held.get(p, uncapped) for p in busy)


def caps_of(d: PowerDecision) -> set[tuple[str, int]]:
    return {(c.node, c.processor) for c in (d.plan.caps if d.plan else ())}


# ------------------------------------------------------------------ decided where the job runs


def test_caps_land_on_the_processors_a_started_job_runs_on():
    site = Site(400.0)
    site.feed(*(inv(n, 2) for n in NODES))
    assert site.feed(job("j1", JobState.SUBMITTED, 24)) == []  # not placed yet: nothing to cap
    [d1] = site.feed(job("j1", JobState.STARTED, 24, ("C",), at=5))
    assert d1.action is PowerAction.START and caps_of(d1) == {("C", 0), ("C", 1)}
    assert site.feed(job("j2", JobState.SUBMITTED, 24, at=6)) == []
    [d2] = site.feed(job("j2", JobState.STARTED, 24, ("B",), at=7))
    assert d2.action is PowerAction.START and caps_of(d2) == {("B", 0), ("B", 1)}
    busy = {(n, p) for n in "BC" for p in (0, 1)}
    assert set(site.held()) == busy  # node A, where nothing runs, keeps its limits
    assert site.limits_of(busy) <= 400.0
    check(site.pm.machine)


def test_every_processor_a_job_occupies_is_capped_within_the_budget():
    site = Site(400.0)
    site.feed(*(inv(n, 2) for n in NODES))
    for j, n in (("j1", "A"), ("j2", "B"), ("j3", "C")):
        [d] = site.feed(job(j, JobState.STARTED, 24, (n,)))  # 24 cores: both processors of the node
        assert d.action is PowerAction.START and caps_of(d) == {(n, 0), (n, 1)}
    busy = {(n, p) for n in NODES for p in (0, 1)}
    assert set(site.held()) == busy and site.limits_of(busy) <= 400.0
    # A job spread over two nodes occupies processors on both; a 12-core job one processor.
    site = Site(400.0)
    site.feed(*(inv(n, 2) for n in NODES))
    [d] = site.feed(job("wide", JobState.STARTED, 24, ("A", "B")))
    assert caps_of(d) == {("A", 0), ("B", 0)}
    [d] = site.feed(job("small", JobState.STARTED, 12, ("A",)))
    assert caps_of(d) == {("A", 1)}


def test_a_job_the_budget_cannot_hold_is_power_gated_with_the_reason_and_started_when_power_frees():
    """(p2, p2b: before, j2 was deferred and ran uncapped: its processors' limits took the busy
    processors to 342 W of a 200 W budget.) A suspended job's processors are not busy."""
    site = Site(200.0)  # 4 busy processors need 204 W at min power
    site.feed(*(inv(n, 2) for n in NODES))
    [d1] = site.feed(job("j1", JobState.STARTED, 24, ("C",)))
    [d2] = site.feed(job("j2", JobState.STARTED, 24, ("B",), at=1))
    assert d1.action is PowerAction.START and d2.action is PowerAction.SUSPEND
    assert "over budget" in d2.reason and "102 W at min power and only 98 W" in d2.reason
    assert "suspended until power is freed" in d2.reason and d2.plan is None and d2.node_caps == ()
    assert d2.machine_allocated_watts <= 200.0
    running = {("C", 0), ("C", 1)}  # j2 is suspended by the Slurm adapter
    assert site.limits_of(running) <= 200.0 and set(site.held()) == running
    out = site.feed(job("j1", JobState.ENDED, 24, ("C",), at=2))
    assert [(d.job_id, d.action) for d in out] == [("j1", PowerAction.RELEASE), ("j2", PowerAction.START)]
    assert caps_of(out[1]) == {("B", 0), ("B", 1)} and set(site.held()) == {("B", 0), ("B", 1)}
    assert out[1].resumes and not d1.resumes  # the Slurm adapter resumes j2
    assert site.pm.machine.gated == set()


def test_a_deferred_job_whose_processors_become_known_over_budget_is_suspended_once():
    site = Site(110.0)
    site.feed(inv("A", 2))
    [d] = site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    assert d.action is PowerAction.START
    [d] = site.feed(job("j2", JobState.STARTED, 24, ("B",), at=1))
    assert d.action is PowerAction.DEFER and "no processor known on B" in d.reason
    [d] = site.feed(inv("B", 2, at=2))  # now known: 102 W at min power, 8 W left
    assert d.action is PowerAction.SUSPEND and d.job_id == "j2"
    assert site.feed(inv("C", 2, at=3)) == []  # still gated: said once
    out = site.feed(job("j2", JobState.ENDED, 24, ("B",), at=4))
    assert [(o.job_id, o.action) for o in out] == [("j2", PowerAction.RELEASE)] and site.pm.machine.gated == set()


def test_a_placed_job_takes_power_from_any_running_job_above_its_min_when_the_proportional_steal_falls_short():
    site = Site(446.0)
    site.feed(inv("A", 4, lo=60.0, hi=60.0), inv("B", 2), inv("C", 2))  # A's processors have no slack
    site.feed(job("j2", JobState.STARTED, 24, ("B",)), job("j1", JobState.STARTED, 48, ("A",), at=1))
    # j3's processors need 102 W: 94.5 W unused, 5.4 W from j2 by proportion (none from j1): short of it
    [d] = site.feed(job("j3", JobState.STARTED, 24, ("C",), at=2))
    assert d.action is PowerAction.START and caps_of(d) == {("C", 0), ("C", 1)}
    assert [u.job_id for u in d.running_updates] == ["j2"]
    assert sum(c.cap_watts for c in d.running_updates[0].caps) == 102.0
    assert d.machine_allocated_watts <= 446.0
    check(site.pm.machine)


def test_a_job_whose_processors_are_all_held_runs_under_their_caps():
    site = Site(400.0)
    site.feed(inv("A", 2))
    site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    [d] = site.feed(job("j2", JobState.STARTED, 12, ("A",), at=1))  # more cores than the node has
    assert d.action is PowerAction.DEFER and "held by running jobs" in d.reason
    out = site.feed(job("j1", JobState.ENDED, 24, ("A",), at=2))
    assert [(o.job_id, o.action) for o in out] == [("j1", PowerAction.RELEASE), ("j2", PowerAction.START)]
    assert caps_of(out[1]) == {("A", 0)}


# ------------------------------------------------------------------ lifecycle duplicates


def test_duplicate_and_late_lifecycle_events_change_nothing_by_the_rule_placement_follows():
    site = Site(400.0)
    assert isinstance(site.pm.phases, JobPhases) and isinstance(PlacementManager().phases, JobPhases)
    site.feed(inv("A", 2), inv("B", 2))
    [start] = site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    assert site.feed(job("j1", JobState.STARTED, 24, ("A",))) == []  # the same record again
    assert site.feed(job("j1", JobState.SUBMITTED, 24)) == []  # a restarted source re-publishes it
    assert site.feed(job("j1", JobState.STARTED, 24, ("B",), eid="other-source")) == []  # another id, same job
    [freed] = site.feed(job("j1", JobState.ENDED, 24, ("A",), at=3))
    assert freed.action is PowerAction.RELEASE
    assert site.feed(job("j1", JobState.ENDED, 24, ("A",), at=3)) == []
    assert site.feed(job("j1", JobState.STARTED, 24, ("A",))) == []  # late: after its end
    assert site.feed(job("j1", JobState.SUBMITTED, 24)) == []
    assert site.pm.machine.running == {} and site.held() == {}
    assert start.event_id != freed.event_id
    # A job cancelled while pending had nothing decided for it: nothing to release.
    site.feed(job("p", JobState.SUBMITTED, 12))
    assert site.feed(job("p", JobState.CANCELLED, 12)) == []


# ------------------------------------------------------------------ inventory changes


def test_an_inventory_without_processors_changes_none_and_the_fold_goes_on():
    slurm = slurm_inventory(parse_nodes("NodeName=A CPUTot=24 Sockets=2 State=IDLE\n"), "c", 20, 100.0, T0)[0]
    assert slurm.processors == ()
    log: list[Record] = [inv("A", 2), inv("B", 2), job("j1", JobState.STARTED, 24, ("A",), at=1),
                         job("j2", JobState.STARTED, 24, ("B",), at=2), slurm,
                         job("j2", JobState.ENDED, 24, ("B",), at=10),
                         job("j3", JobState.STARTED, 24, ("B",), at=11)]
    for budget in (400.0, None):
        first, again = Site(budget), Site(budget)
        out = first.feed(*log)
        assert again.feed(*log) == out  # a restarted worker re-folds the same log to the same decisions
        assert [(d.job_id, d.action) for d in out] == [
            ("j1", PowerAction.START), ("j2", PowerAction.START), ("j2", PowerAction.RELEASE),
            ("j3", PowerAction.START)]
        m = first.pm.machine
        assert sorted(m.limits) == [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
        assert m.allocated_mw <= m.budget_mw == (400_000 if budget else 480_000)
        assert not m.retired and first.pm.cores_per_processor["A"] == 12
        check(m)


def test_a_processor_removed_while_a_job_holds_it_is_kept_until_the_job_ends():
    for budget in (400.0, None):
        site = Site(budget)
        site.feed(inv("A", 2), inv("B", 2))
        site.feed(job("j1", JobState.STARTED, 24, ("A",)))
        assert site.feed(inv("A", 1, at=1)) == []  # processor 1 of A gone from the inventory
        m = site.pm.machine
        assert ("A", 1) in m.limits and ("A", 1) in m.retired
        check(m)
        site.feed(job("j1", JobState.ENDED, 24, ("A",), at=2))
        assert ("A", 1) not in m.limits and not m.retired
        assert m.budget_mw == (400_000 if budget else 360_000)
        [d] = site.feed(job("j2", JobState.STARTED, 24, ("A",), at=3))
        assert caps_of(d) == {("A", 0)}  # only what the inventory lists now is capped
        check(m)


def test_changed_limits_refit_running_caps_and_keep_the_budget():
    site = Site(200.0)
    site.feed(inv("A", 2), inv("B", 2))
    for j, n, at in (("j1", "A", 1), ("j2", "B", 2), ("j3", "B", 3)):
        site.feed(job(j, JobState.STARTED, 12, (n,), at=at))
    [d] = site.feed(inv("A", 2, lo=70.0, hi=120.0, at=5))  # node A's min power raised
    assert d.action is PowerAction.RETUNE and d.plan is None
    assert {u.job_id for u in d.running_updates} >= {"j1"}
    assert all(c.cap_watts >= 70.0 for u in d.running_updates for c in u.caps if c.node == "A")
    assert d.machine_allocated_watts <= 200.0 and site.held()[("A", 0)] >= 70.0
    check(site.pm.machine)
    [late] = site.feed(inv("A", 2, lo=72.0, hi=120.0, at=-60))  # an inventory stamped before the last decision
    assert late.action is PowerAction.RETUNE and late.event_time == d.event_time  # decision times never go back
    out = site.feed(job("j2", JobState.ENDED, 12, ("B",), at=6))  # before: ValueError
    assert out[0].action is PowerAction.RELEASE
    check(site.pm.machine)
    # Raised min power that puts the machine over its budget: the other jobs give it back.
    site = Site(250.0)
    site.feed(inv("A", 2), inv("B", 2), job("j1", JobState.STARTED, 24, ("A",)),
              job("j2", JobState.STARTED, 24, ("B",)))
    assert site.pm.machine.allocated_mw == 250_000
    [d] = site.feed(inv("A", 2, lo=70.0, hi=120.0, at=5))
    assert {u.job_id for u in d.running_updates} == {"j1", "j2"} and d.machine_allocated_watts <= 250.0
    assert sum(w for (n, _), w in site.held().items() if n == "B") == 110.0
    check(site.pm.machine)
    # No fixed budget: lowering max power lowers the budget and the caps with it.
    site = Site(None)
    site.feed(inv("A", 2), inv("B", 2))
    site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    site.feed(job("j1b", JobState.STARTED, 24, ("B",)))
    [d] = site.feed(inv("A", 2, lo=51.0, hi=80.0, at=5))
    assert d.action is PowerAction.RETUNE
    m = site.pm.machine
    assert m.budget_mw == 400_000 and m.allocated_mw <= m.budget_mw
    assert all(w <= 80.0 for (n, _), w in site.held().items() if n == "A")
    check(m)


def test_caps_stay_inside_the_inventory_limits():
    # A measured draw above the inventory's max never becomes a cap.
    site = Site(400.0)
    site.feed(inv("A", 2, 51.0, 100.0), reading("A", 0, 130.0, 30.0), reading("A", 0, 80.0, 25.0, cap=80.0),
              reading("A", 1, 130.0, 30.0), reading("A", 1, 80.0, 25.0, cap=80.0))
    [d] = site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    assert d.plan is not None and all(51.0 <= c.cap_watts <= 100.0 for c in d.plan.caps)
    check(site.pm.machine)
    # min_watts = 0 (valid in the inventory) never gives a 0 W cap, which an agent refuses.
    site = Site(100.0)
    site.feed(inv("A", 2, 0.0, 100.0), reading("A", 0, 50.0, 14.0, cap=50.0), reading("A", 0, 100.0, 20.0, cap=100.0),
              reading("A", 1, 50.0, 8.25, cap=50.0), reading("A", 1, 100.0, 8.5, cap=100.0))
    [d] = site.feed(job("j1", JobState.STARTED, 24, ("A",)))
    assert d.plan is not None and len(d.plan.caps) == 2
    assert all(c.cap_watts >= MIN_CAP_MW / 1000 > 0 for c in d.plan.caps)
    assert sum(c.cap_watts for c in d.plan.caps) <= 100.0


def test_two_cap_levels_measuring_the_same_draw_make_one_curve_point():
    from nodeshare.streams.core.power.curves import curve_from_points

    c = curve_from_points(("A", 0), 51_000, [(140_000, 5.0), (140_000, 6.0)])  # before: ZeroDivisionError
    assert c.power_mw == (51_000, 140_000) and c.ips == (51 / 140 * 6.0, 6.0)


def test_a_real_deployment_gets_caps_once_the_site_publishes_processors_or_is_told_why_not():
    site = Site(1000.0)
    nodes = parse_nodes("NodeName=A CPUTot=32 Sockets=2 State=IDLE\nNodeName=B CPUTot=32 Sockets=2 State=IDLE\n")
    site.feed(*slurm_inventory(nodes, "c", 11, 50.0, T0))
    site.feed(reading("A", 0, 95.0, None, cap=120.0, program=None))  # the agent's reading: no instructions
    assert site.feed(job("j1", JobState.SUBMITTED, 32)) == []
    [d] = site.feed(job("j1", JobState.STARTED, 32, ("A",), at=5))
    assert d.action is PowerAction.DEFER and "no processor known on A" in d.reason and "min and max watts" in d.reason
    # The site publishes each package's limits (16 cores per package, as Slurm's sockets say): the
    # running job is capped on both, power split evenly (no instruction counts: no curve).
    [d] = site.feed(inv("A", 2, 40.0, 150.0, at=6, cores_per=16))
    assert d.action is PowerAction.START and caps_of(d) == {("A", 0), ("A", 1)}
    assert d.plan is not None and len({c.cap_watts for c in d.plan.caps}) == 1


def test_a_real_deployment_gets_caps_from_the_agents_own_powercap_discovery(tmp_path):
    """(p4: before, the only inventory was Slurm's, without processors: every job was deferred and no
    cap was ever written.) The node agent with --power-caps --power-min-watts publishes its packages
    (max from constraint_0_max_power_uw) as a processors-only record keyed <node>/processors; the
    power manager caps the job on them; the placement manager ignores the record (Slurm's says the
    node is DOWN, and stays so)."""
    from factories import powercap_tree
    from unit.test_agent import FakeSource, NoBroker

    from nodeshare.producers.agent.spool import Spool

    def spooled(at, name):
        spool = Spool(at / name)
        try:
            return [json.loads(r[3]) for r in spool.after(0, 1000)]
        finally:
            spool.close()

    from nodeshare.producers.agent.agent import Agent, AgentOptions
    from nodeshare.schemas.catalog import key_of

    root = powercap_tree(tmp_path / "powercap", packages=2, max_uw=150_000_000)
    (root / "intel-rapl:2").mkdir()  # a package without a readable max: left out
    agents = {}
    for min_w in (None, 40.0):
        options = AgentOptions(node="A", spool=tmp_path / f"spool{min_w}.db", hardware_counters=False,
                               power_caps=True, powercap_root=root, power_min_watts=min_w)
        agent = Agent(options, FakeSource({}, {}), NoBroker, lambda name: name)  # type: ignore[arg-type]
        agents[min_w] = agent.processors()
        agent.run(duration_s=0.0, drain_s=0.0)  # what it spools at its start
    published = [e for e in spooled(tmp_path, "spool40.0.db") if e["kind"] == "node_inventory"]
    assert [(e["node"], e["processors_only"], len(e["processors"])) for e in published] == [("A", True, 2)]
    assert agents[None] is None  # no floor given: nothing published (and logged why)
    packages = agents[40.0]
    assert packages is not None and packages.processors_only and key_of(packages) == b"A/processors"
    assert [(p.processor, p.min_watts, p.max_watts) for p in packages.processors] == [(0, 40.0, 150.0),
                                                                                   (1, 40.0, 150.0)]
    site = Site(1000.0)
    nodes = parse_nodes("NodeName=A CPUTot=32 Sockets=2 State=IDLE\nNodeName=B CPUTot=32 Sockets=2 State=DOWN\n")
    slurm = slurm_inventory(nodes, "c", 11, 50.0, T0)
    site.feed(*slurm, packages)
    [d] = site.feed(job("j1", JobState.STARTED, 32, ("A",), at=5))
    assert d.action is PowerAction.START and caps_of(d) == {("A", 0), ("A", 1)}
    assert all(40.0 <= c.cap_watts <= 150.0 for c in d.plan.caps)  # type: ignore[union-attr]
    placement = PlacementManager()
    for r in (*slurm, packages.model_copy(update={"node": "B"})):
        placement.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))
    assert placement.scheduler is not None
    assert placement.scheduler.loads["B"].capacity.usable is False  # the agent's record did not make B usable


# ------------------------------------------------------------------ the budget holds at every step

LO = (0.0, 40.0, 51.0, 70.0)  # a fixed budget of 450 W covers 6 processors at the highest min power
inventories = st.tuples(st.just("inv"), st.sampled_from(NODES), st.sampled_from([0, 1, 2, (1,)]),
                        st.sampled_from(LO), st.sampled_from([0.0, 30.0, 69.0]))
lifecycle = st.tuples(st.just("job"), st.integers(0, 5),
                      st.sampled_from([JobState.SUBMITTED, JobState.STARTED, JobState.ENDED, JobState.CANCELLED]),
                      st.sampled_from([6, 12, 24, 36, 48]), st.lists(st.sampled_from(NODES), min_size=1, max_size=3,
                                                                      unique=True))
readings = st.tuples(st.just("read"), st.sampled_from(NODES), st.integers(0, 1),
                     st.sampled_from([20.0, 60.0, 95.0, 140.0]),
                     st.sampled_from([None, 5.0, 20.0, 31.0]), st.sampled_from([None, 60.0, 100.0]),
                     st.sampled_from(["EP", "SP", None]))
events = st.lists(st.one_of(inventories, lifecycle, lifecycle, readings), min_size=1, max_size=40)


def build(i: int, ev: tuple) -> Record:
    if ev[0] == "inv":
        _, node, shape, lo, spread = ev
        if shape == (1,):  # only processor 1 listed: processor 0 removed
            return inv(node, 1, lo, lo + spread, at=i, procs=(1,))
        return inv(node, shape, lo, lo + spread, at=i)
    if ev[0] == "job":
        _, j, state, cores, nodes = ev
        return job(f"j{j}", state, cores, tuple(nodes), at=i, program="EP" if j % 2 else "SP")
    _, node, proc, watts, gips, cap, program = ev
    return reading(node, proc, watts, gips, cap, program, at=i)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=events, budget=st.sampled_from([450.0, 800.0, None]), known=st.lists(inventories, max_size=3))
def test_for_any_events_the_budget_holds_at_every_step_and_every_cap_is_inside_its_limits(seq, budget, known):
    site = Site(budget)
    for i, ev in enumerate([*known, *seq]):  # mostly, some processors are known before jobs start
        out = site.feed(build(i, ev))  # never raises
        m = site.pm.machine
        check(m)  # allocated <= budget; every cap inside its curve and its inventory limits; no processor twice
        assert not any("over budget" in d.reason for d in out)  # the budget covers every processor's min power
        held = site.held()
        # The agents hold exactly the caps the manager allocated: decisions carry every change.
        assert held == {p: w / 1000 for j in m.running.values() for p, w in zip(j.processors, j.caps_mw, strict=True)}
        assert sum(held.values()) <= m.budget_mw / 1000 + 1e-9
        for p, w in held.items():
            lo, hi = m.limits[p]
            assert max(lo, MIN_CAP_MW) / 1000 <= w <= hi / 1000
        # A job left deferred has no free processor it could be capped on.
        owner = m.owner()
        assert all(_occupied(m, r, owner)[0] == [] for r in m.deferred)
        for d in out:
            assert d.machine_allocated_watts <= d.machine_budget_watts


# ------------------------------------------------------------------ the agents' fold, in any interleaving


def _partition(job_id: str) -> int:
    from aiokafka.partitioner import murmur2

    return (murmur2(job_id.encode()) & 0x7FFFFFFF) % 4  # decisions.power: 4 partitions keyed by job


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=events, budget=st.sampled_from([450.0, 800.0]), known=st.lists(inventories, min_size=1, max_size=3),
       rnd=st.randoms(use_true_random=False))
def test_every_interleaving_of_the_partitions_gives_the_managers_caps_and_the_budget_holds_at_every_prefix(
        seq, budget, known, rnd):
    """The production fold (streams.core.power.caps.CapFold, which the agent runs) fed the manager's
    decisions merged from their 4 partitions in a random order that keeps each partition's own:
    every node ends at the manager's caps, and after every record each node holds caps the manager
    decided for it at some point, within the budget (across nodes, one agent may be a few records
    behind another for as long as delivery lags: docs/decisions.md). (Before: the fold applied running_updates in
    arrival order; a3's interleaving held 375 W of a 300 W budget.)"""
    site = Site(budget)
    for i, ev in enumerate([*known, *seq]):
        site.feed(build(i, ev))
    log = site.decisions
    states: dict[str, list[dict[int, float]]] = {n: [{}] for n in NODES}  # each node's caps after each decision
    in_order = {n: CapFold(n) for n in NODES}
    for d in log:
        for n, a in in_order.items():
            a.apply(d)
            states[n].append(a.caps())
    parts = [[d for d in log if _partition(d.job_id) == p] for p in range(4)]
    merged = []
    while any(parts):
        merged.append(rnd.choice([p for p in parts if p]).pop(0))
    merged += rnd.sample(merged, min(3, len(merged)))  # and some redelivered
    agents = {n: CapFold(n) for n in NODES}
    for d in merged:
        for n, a in agents.items():
            a.apply(d)
            assert a.caps() in states[n]
            assert sum(a.caps().values()) <= budget + 1e-9
    truth = site.held()
    assert {(n, p): w for n, a in agents.items() for p, w in a.caps().items()} == truth
    m = site.pm.machine
    assert truth == {p: w / 1000 for j in m.running.values() for p, w in zip(j.processors, j.caps_mw, strict=True)}
    assert all(a.jobs() <= set(m.running) for a in agents.values())  # ended jobs are forgotten


def test_a_manager_rebuilt_without_its_snapshot_is_not_ignored_by_the_agents():
    """A changed budget makes the snapshot unusable, and retention had deleted the log's head: the
    new manager folds only the tail. Its states must still win at the agents (a review found them
    dropped as stale: per-node sequences restarted at 1 below the agents' 5)."""
    site = Site(400.0)
    site.feed(inv("A", 4), *(x for i in range(3) for x in (job(f"j{i}", JobState.STARTED, 12, ("A",), at=10 * i),
                                                           job(f"j{i}", JobState.ENDED, 12, ("A",), at=10 * i + 5))))
    site.feed(job("a", JobState.STARTED, 12, ("A",), at=40))
    assert site.agents["A"].jobs() == {"a"}
    fresh = PowerManager(300.0)  # another budget; the head (the jobs above and a's start) gone
    fresh.apply(TOPIC_OF_RECORD[NodeInventory].name, encode(inv("A", 4, at=50)))
    decided = fresh.apply(TOPIC_OF_RECORD[JobEvent].name, encode(job("b", JobState.STARTED, 12, ("A",), at=60)))
    for d in decided:
        site.agents["A"].apply(d)
    stated = {c.processor: c.cap_watts for d in decided for s in d.node_caps if s.node == "A" for c in s.caps}
    assert decided and site.agents["A"].caps() == stated and site.agents["A"].jobs() == {"b"}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=events, budget=st.sampled_from([450.0, 800.0]), known=st.lists(inventories, min_size=1, max_size=3),
       rnd=st.randoms(use_true_random=False))
def test_an_agent_starting_after_retention_deleted_any_head_of_decisions_power_holds_the_managers_caps(
        seq, budget, known, rnd):
    """Retention deleted a head of each of ``decisions.power``'s 4 partitions (any length, up to all);
    the compacted ``decisions.power.nodes`` kept each node's newest state and, not yet compacted,
    some older ones. An agent folding what is left of both, in any order, holds the manager's caps.
    (Before: an agent read only ``decisions.power``; a node whose caps last changed in the deleted
    head restarted with none while the manager counted them: issue 43, "state lost to retention".)"""
    site = Site(budget)
    for i, ev in enumerate([*known, *seq]):
        site.feed(build(i, ev))
    log = site.decisions
    parts = [[d for d in log if _partition(d.job_id) == p] for p in range(4)]
    kept: list[PowerDecision | NodePowerState] = [d for p in parts for d in p[rnd.randint(0, len(p)):]]
    published = [s for d in log for s in node_states(d)]
    newest = {s.node: s for s in published}
    kept += list(newest.values()) + [s for s in published if s is not newest[s.node] and rnd.random() < 0.3]
    rnd.shuffle(kept)
    agents = {n: CapFold(n) for n in NODES}
    for record in kept:
        for a in agents.values():
            a.apply(record)
    assert {(n, p): w for n, a in agents.items() for p, w in a.caps().items()} == site.held()


def test_a_node_state_names_one_node_and_its_id_stays_short():
    from nodeshare.schemas import decode

    site = Site(400.0)
    site.feed(inv("A", 4), job("a", JobState.STARTED, 12, ("A",)))
    [d] = [d for d in site.decisions if d.node_caps]
    [s] = node_states(d)
    assert (s.node, s.state, s.decided_by) == ("A", d.node_caps[0], d.event_id) and len(s.event_id) == 36
    assert decode(TOPIC_OF_RECORD[NodePowerState], encode(s)) == s
    assert node_states(d.model_copy(update={"event_id": "x" * 128})) != []  # a long id: a fixed-length one
    with pytest.raises(ValueError, match="published as node"):
        NodePowerState(event_id="e", source="t", event_time=s.event_time, node="B", state=s.state, decided_by="d")


def test_caps_decided_before_decisions_power_nodes_existed_are_restated_after_a_rebuild():
    """An upgrade: the manager decided caps before it published node states; after its rebuild it
    restates every node it stated (empty ones too), so an agent folding decisions.power.nodes alone,
    once decisions.power's records expired, holds the manager's caps. (A review found them missing.)"""
    from nodeshare.streams.core.power.stream import RESTATED

    site = Site(400.0)
    site.feed(inv("A", 4), inv("B", 4), job("a", JobState.STARTED, 12, ("A",)), job("b", JobState.STARTED, 12, ("B",)),
              job("b", JobState.ENDED, 12, ("B",), at=5))
    restated = site.pm.restatement()
    assert {s.node for s in restated} == {"A", "B"} and all(s.decided_by == RESTATED for s in restated)
    assert [s.state.caps for s in restated if s.node == "B"] == [()]  # B held caps once: stated empty
    agents = {n: CapFold(n) for n in NODES}
    stale = NodePowerState(event_id="old", source="t", event_time=restated[0].event_time, node="B",
                           state=NodeCapState(node="B", sequence=1, caps=(HeldCap(processor=0, job_id="x",
                                                                                  cap_watts=70.0),)),
                           decided_by="older")
    for record in (stale, *restated):
        for a in agents.values():
            a.apply(record)
    assert {(n, p): w for n, a in agents.items() for p, w in a.caps().items()} == site.held()
    assert restated == site.pm.restatement()  # the same records (and ids) each time: nothing changed
