"""PTune and PPartition (Seed 004): hand-worked cases, water-filling optimality, invariants."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.streams.core.power.curves import Characterization, Curve, curve_from_points
from nodeshare.streams.core.power.ppartition import JobRequest, Machine, PowerPolicy, check, dispatch, release
from nodeshare.streams.core.power.ptune import distribute_power, ptune, uniform


def line(name: str, lo_w: int, hi_w: int, ips_lo: float, ips_hi: float) -> Curve:
    return Curve((name, 0), (lo_w * 1000, hi_w * 1000), (ips_lo, ips_hi))


def water_filling(curves: list[Curve], budget_mw: int) -> float:
    """The optimum for concave curves: everyone at min power, the rest to the steepest pieces first."""
    ips = sum(c.ips[0] for c in curves)
    left = budget_mw - sum(c.min_mw for c in curves)
    assert left >= 0
    pieces = sorted(((c.ips[i + 1] - c.ips[i]) / (c.power_mw[i + 1] - c.power_mw[i]), c.power_mw[i + 1] - c.power_mw[i])
                    for c in curves for i in range(len(c.power_mw) - 1))
    for slope, length in reversed(pieces):
        take = min(left, length)
        ips += slope * take
        left -= take
    return ips


# ------------------------------------------------------------------ curves


def test_table2_curve_interpolates_measured_power():
    # Seed 004, Table 2: (cap, IPS, measured): (60, 46.43, 59.99) (80, 64.83, 79.88) (100, 76.33, 99.43)
    # (120, 79.13, 104.66). The x axis is the measured power, so the curve ends at 104.66 W.
    c = curve_from_points(("n", 0), 51_000, [(59_990, 46.43), (79_880, 64.83), (99_430, 76.33), (104_660, 79.13)])
    assert c.max_mw == 104_660
    slope = (64.83 - 46.43) / (79_880 - 59_990)
    assert c.at(51_000) == pytest.approx(46.43 - slope * (59_990 - 51_000))  # the first piece, extended down
    assert c.at(69_935) == pytest.approx((46.43 + 64.83) / 2)  # half-way between 59.99 and 79.88 W
    assert c.at(120_000) == 79.13  # a cap above the uncapped draw buys nothing
    # 59.99 W lies on the first piece extended down to 51 W, so the pieces are 51-79.88-99.43-104.66 W.
    assert c.power_mw == (51_000, 79_880, 99_430, 104_660)
    assert c.slopes == pytest.approx(((64.83 - 46.43) / (79_880 - 59_990), (76.33 - 64.83) / (99_430 - 79_880),
                                      (79.13 - 76.33) / (104_660 - 99_430)))


def test_noisy_points_are_smoothed_to_the_concave_majorant():
    # 70 W loses IPS (dropped); 80 W lies below the chord 60 -> 100 W (slope 0.15/W vs 0.1, then 0.2): dropped.
    c = curve_from_points(("n", 0), 50_000, [(50_000, 10.0), (60_000, 12.0), (70_000, 11.5), (80_000, 14.0),
                                             (100_000, 18.0), (110_000, 18.5)])
    assert c.power_mw == (50_000, 60_000, 100_000, 110_000) and c.ips == (10.0, 12.0, 18.0, 18.5)
    slopes = [(b - a) / (y - x) for a, b, x, y in zip(c.ips, c.ips[1:], c.power_mw, c.power_mw[1:], strict=False)]
    assert slopes == sorted(slopes, reverse=True)


def test_unavailable_power_readings_are_skipped_never_zero():
    from datetime import UTC, datetime

    from nodeshare.schemas.events import PowerReading

    char = Characterization()
    at = datetime(2026, 1, 1, tzinfo=UTC)
    absent = PowerReading(event_id="a", source="t", event_time=at, node="n1", processor=0, available=False)
    assert char.add_reading(absent, program="EP") is False and char.readings() == 0
    ok = PowerReading(event_id="b", source="t", event_time=at, node="n1", processor=0, available=True, watts=80.0,
                      cap_watts=80.0, instructions=64_000_000_000, interval_s=1.0, program="EP")
    assert char.add_reading(ok) is True
    assert char.curve("EP", ("n1", 0), 51_000) is not None and char.curve("BT", ("n1", 0), 51_000) is None


def test_rolling_characterization_moves_towards_new_readings():
    char = Characterization(smoothing=0.5)
    char.add("EP", ("n", 0), 80.0, 60.0, 80.0)
    char.add("EP", ("n", 0), 80.0, 70.0, 80.0)
    assert char.points["EP"][("n", 0)][80_000] == (80.0, 65.0, 2)


# ------------------------------------------------------------------ PTune


def test_ptune_hand_worked_three_processors():
    # A: 50..100 W, 10..20 GIPS (0.2/W); B: 50..110 W, 10..20 (1/6 per W); C: 50..120 W, 8..20 (12/70 per W).
    a, b, c = line("A", 50, 100, 10, 20), line("B", 50, 110, 10, 20), line("C", 50, 120, 8, 20)
    t = ptune(200_000, 3, [c, b, a])
    # Efficiency order A, B, C. n_lo = 1 (A+B at max = 210 W > 200), n_hi = 3 (200 / 50 = 4, capped at 3).
    assert (t.n_lo, t.n_hi) == (1, 3)
    # n=1: A at 100 W -> 20. n=2: B gets the 100 W spare -> 10 + 50/6 = 18.33; total 38.33.
    # n=3: C's 50 W stolen from B (loses 1/6 per W, less than A's 0.2) -> 20 + 10 + 8 = 38 < 38.33.
    assert [n for n, _ in t.ips_by_n] == [1, 2, 3]
    assert [round(v, 4) for _, v in t.ips_by_n] == [20.0, round(20 + 10 + 50 / 6, 4), 38.0]
    assert t.n_opt == 2 and t.processors == (("A", 0), ("B", 0)) and t.caps_mw == (100_000, 100_000)
    # Uniform power: 66.666 W each on all three -> 13.33 + 12.78 + 10.86 = 36.97, 3.7% less than PTune.
    caps, ips = uniform(200_000, [a, b, c])
    assert caps == (66_666,) * 3 and ips == pytest.approx(10 + 16.666 * 0.2 + 10 + 16.666 / 6 + 8 + 16.666 * 12 / 70)


def test_ptune_cannot_run_a_processor_below_min_power():
    t = ptune(40_000, 4, [line("A", 50, 100, 10, 20)])
    assert t.n_opt == 0 and t.processors == () and t.ips == 0.0


def test_ptune_keeps_uniform_power_unless_it_predicts_a_margin_better():
    a, b, c = line("A", 50, 100, 10, 20), line("B", 50, 110, 10, 20), line("C", 50, 120, 8, 20)
    # PTune's own plan is 38.33 GIPS, uniform 36.97: 3.7% better. A 5% margin keeps uniform, 3% does not.
    kept = ptune(200_000, 3, [a, b, c], margin=0.05)
    assert kept.uniform_fallback and kept.n_opt == 3 and kept.caps_mw == (66_666,) * 3
    tuned = ptune(200_000, 3, [a, b, c], margin=0.03)
    assert not tuned.uniform_fallback and tuned.n_opt == 2


def test_ptune_respects_the_fewest_processors_a_job_may_run_on():
    a, b, c = line("A", 50, 100, 10, 20), line("B", 50, 110, 10, 20), line("C", 50, 120, 8, 20)
    t = ptune(200_000, 3, [a, b, c], n_min=3)  # JobIPS_3 = 38 (hand-worked above), the best n >= 3
    assert t.n_opt == 3 and t.ips == pytest.approx(38.0) and sum(t.caps_mw) <= 200_000
    assert ptune(140_000, 3, [a, b, c], n_min=3).n_opt == 0  # 3 x 50 W do not fit in 140 W


def test_ptune_prefers_fewer_processors_on_a_tie():
    # Linear through the origin: two processors at 50 W give what one gives at 100 W.
    t = ptune(100_000, 2, [line("A", 50, 100, 10, 20), line("B", 50, 100, 10, 20)])
    assert t.n_opt == 1 and t.caps_mw == (100_000,)


@st.composite
def concave_curve(draw, name: str) -> Curve:
    lo = draw(st.integers(40_000, 60_000))
    pieces = draw(st.integers(1, 5))
    slopes = sorted(draw(st.lists(st.floats(0.01, 2.0), min_size=pieces, max_size=pieces)), reverse=True)
    xs, ys = [lo], [draw(st.floats(1.0, 40.0))]
    for s in slopes:
        length = draw(st.integers(1_000, 25_000))
        xs.append(xs[-1] + length)
        ys.append(ys[-1] + s * length / 1000)
    return Curve((name, 0), tuple(xs), tuple(ys))


@st.composite
def processor_set(draw):
    n = draw(st.integers(1, 9))
    return [draw(concave_curve(f"p{i}")) for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(curves=processor_set(), budget_w=st.integers(30, 900), n_req=st.integers(1, 10))
def test_ptune_is_optimal_for_every_n_and_keeps_its_bounds(curves, budget_w, n_req):
    budget = budget_w * 1000
    t = ptune(budget, n_req, curves)
    ordered = sorted(curves, key=lambda c: (c.max_mw, -c.ips[-1], c.processor))
    for n, ips in t.ips_by_n:  # JobIPS_n is the water-filling optimum over the n most efficient
        best = water_filling(ordered[:n], budget) if n > t.n_lo else sum(c.ips[-1] for c in ordered[:n])
        assert ips == pytest.approx(best, rel=1e-9, abs=1e-9)
    if t.n_opt:
        assert max(t.n_lo, 1) <= t.n_opt <= t.n_hi <= min(n_req, len(curves))
        assert sum(t.caps_mw) <= budget
        by_id = {c.processor: c for c in curves}
        assert all(by_id[p].min_mw <= cap <= by_id[p].max_mw for p, cap in zip(t.processors, t.caps_mw, strict=True))
        assert t.ips == pytest.approx(max(v for _, v in t.ips_by_n))
    else:  # the processors are taken in efficiency order: the first one does not fit
        assert budget < ordered[0].min_mw


@settings(max_examples=100, deadline=None)
@given(curves=processor_set(), extra_w=st.integers(0, 400))
def test_distribute_power_on_fixed_processors_is_water_filling(curves, extra_w):
    budget = sum(c.min_mw for c in curves) + extra_w * 1000
    caps, ips = distribute_power(curves, budget)
    assert sum(caps) <= budget and all(c.min_mw <= x <= c.max_mw for c, x in zip(curves, caps, strict=True))
    assert ips == pytest.approx(water_filling(curves, budget), rel=1e-9)


# ------------------------------------------------------------------ PPartition


def machine(n_proc: int, budget_w: int, **policy) -> Machine:
    m = Machine(budget_mw=budget_w * 1000, policy=PowerPolicy(**{"margin": 0.0, **policy}))
    for i in range(n_proc):
        m.limits[(f"n{i}", 0)] = (50_000, 100_000)
        m.char.add("X", (f"n{i}", 0), 50.0, 10.0, 50.0)
        m.char.add("X", (f"n{i}", 0), 100.0, 20.0, 100.0)
    return m


def test_ppartition_starts_defers_and_gives_back_hand_worked():
    m = machine(4, 300)  # 4 processors of 50..100 W, 10..20 GIPS; Pm/c = 300 W
    j1 = dispatch(m, JobRequest("j1", "X", 2))  # share 300*2/4 = 150 W -> one at 100 W, one at 50 W
    assert j1.action == "start" and j1.plan is not None and j1.plan.caps_mw == (100_000, 50_000)
    j2 = dispatch(m, JobRequest("j2", "X", 1))  # share 75 W
    j3 = dispatch(m, JobRequest("j3", "X", 1))
    assert [o.plan.caps_mw for o in (j2, j3) if o.plan] == [(75_000,), (75_000,)] and m.unused_mw == 0
    j4 = dispatch(m, JobRequest("j4", "X", 1))
    assert j4.action == "defer" and "0 free processors" in j4.reason
    m.deferred.append(j4.request)
    freed, started = release(m, "j1")
    # j4 starts on a freed processor at its 75 W share; the 75 W left go to j2, j3, j4 (25 W each).
    assert started.action == "start" and started.request.job_id == "j4"
    assert {p.job_id: p.caps_mw for p in freed.updates} == {"j2": (100_000,), "j3": (100_000,)}
    assert started.plan is not None and started.plan.caps_mw == (100_000,)  # announced with its final caps
    assert m.allocated_mw == 300_000 and m.deferred == []
    check(m)


def test_ppartition_repartitions_by_eq5_and_steals_in_proportion():
    m = machine(4, 200)
    for j in ("j1", "j2"):  # share 100 W for 2 processors: one at 100 W is as good as two at 50 W -> one
        out = dispatch(m, JobRequest(j, "X", 2))
        assert out.plan is not None and out.plan.caps_mw == (100_000,)
    j3 = dispatch(m, JobRequest("j3", "X", 2))
    # No unused power: P = 200 * 2 / (2 + 2) = 100 W -> n_opt 1 -> P = 200 * 1 / (1 + 2) = 66.666 W, stolen
    # half from each running job (equal budgets), 33.333 W each.
    assert j3.action == "start" and j3.fair_share_mw == 66_666
    assert dict(j3.stolen_mw) == {"j1": 33_333, "j2": 33_333}
    assert j3.plan is not None and j3.plan.caps_mw == (66_666,)
    assert {p.job_id: p.caps_mw for p in j3.updates} == {"j1": (66_667,), "j2": (66_667,)}
    assert m.allocated_mw == 200_000
    check(m)


def test_ppartition_defers_without_changing_anything_when_power_runs_out():
    m = machine(6, 160, min_share=1.0)  # room for three processors at 50 W, at most
    dispatch(m, JobRequest("j1", "X", 1))
    dispatch(m, JobRequest("j2", "X", 1))
    before = {j: r.caps_mw for j, r in m.running.items()}
    out = dispatch(m, JobRequest("j3", "X", 2))
    assert out.action == "defer" and "at least 2 needed" in out.reason
    assert {j: r.caps_mw for j, r in m.running.items()} == before


def admission_case(admit: str) -> tuple[Machine, str]:
    m = machine(4, 200, admit=admit)
    for p in (("n2", 0), ("n3", 0)):  # program Z gets almost nothing from power on n2 and n3
        m.char.add("Z", p, 50.0, 1.0, 50.0)
        m.char.add("Z", p, 100.0, 2.0, 100.0)
    for j in ("j1", "j2", "j3"):  # 50 W each (share 200 * 1/4)
        assert dispatch(m, JobRequest(j, "X", 1)).action == "start"
    release(m, "j3")  # its 50 W go back to j1 and j2: 100 W each, nothing unused
    assert m.unused_mw == 0
    # Z needs 200 * 1 / (1 + 2) = 66.7 W, stolen from j1 and j2 (33.3 W each, losing 0.2 GIPS/W):
    # it would add 1.33 GIPS and cost 13.3.
    return m, dispatch(m, JobRequest("z", "Z", 1)).action


def test_throughput_admission_defers_a_job_that_costs_more_than_it_adds():
    m, action = admission_case("throughput")
    assert action == "defer" and set(m.running) == {"j1", "j2"}
    assert [r.caps_mw for r in m.running.values()] == [(100_000,), (100_000,)]
    m, action = admission_case("fair")
    assert action == "start" and set(m.running) == {"j1", "j2", "z"}


ops = st.lists(st.tuples(st.sampled_from(["start", "end"]), st.integers(0, 11), st.integers(1, 5)), max_size=40)


def run_ops(sequence, release_policy):
    m = machine(10, 700, release=release_policy)
    m.char.add("Y", ("n3", 0), 70.0, 30.0, 70.0)  # a second program with its own curve on one processor
    out = []
    for op, j, n in sequence:
        job = f"j{j}"
        if op == "start" and job not in m.running and all(r.job_id != job for r in m.deferred):
            o = dispatch(m, JobRequest(job, "X" if j % 2 else "Y", n))
            if o.action == "defer":
                m.deferred.append(o.request)
            out.append(o)
        elif op == "end":
            out.extend(release(m, job))
        check(m)  # every decision keeps the invariants
        assert 0 <= m.allocated_mw <= m.budget_mw
    return out, m


@settings(max_examples=80, deadline=None)
@given(sequence=ops, release_policy=st.sampled_from(["proportional", "pool"]))
def test_ppartition_invariants_and_determinism(sequence, release_policy):
    first, m1 = run_ops(sequence, release_policy)
    again, m2 = run_ops(sequence, release_policy)
    assert [asdict(o) for o in first] == [asdict(o) for o in again]
    assert m1.running == m2.running


# ------------------------------------------------------------------ the stream fold


def test_power_manager_fold_is_deterministic_and_keeps_the_bound():
    from power_events import scenario

    from nodeshare.schemas.catalog import TOPIC_OF_RECORD
    from nodeshare.schemas.serde import encode
    from nodeshare.streams.core.power.stream import PowerManager

    log = [(TOPIC_OF_RECORD[type(r)].name, encode(r)) for r in scenario()]
    first = PowerManager(600.0)
    decisions = [d for topic, value in log for d in first.apply(topic, value)]
    again = PowerManager(600.0)
    assert [d for topic, value in log for d in again.apply(topic, value)] == decisions
    assert first.machine.char.readings() == 8 * 2 * 15  # every reading folded into the characterization
    # Decided at `started`, on the jobs' nodes: p1 (2 nodes, 4 processors), p2 and p3 (one node
    # each) fill the 8 processors; p4 starts on pnode0000 after p1 has ended. `submitted` decides nothing.
    assert [(d.job_id, d.action.value) for d in decisions] == [
        ("p1", "start"), ("p2", "start"), ("p3", "start"), ("p1", "release"), ("p4", "start")]
    for d in decisions:
        assert d.machine_allocated_watts <= d.machine_budget_watts == 600.0
        for plan in (d.plan, *d.running_updates):
            if plan is not None:
                assert all(51.0 <= c.cap_watts <= 120.0 for c in plan.caps)
                assert sum(c.cap_watts for c in plan.caps) <= plan.budget_watts + 1e-9
        assert d.inputs is not None and d.inputs.trigger_event_id
    p1, p3, freed, p4 = decisions[0], decisions[2], decisions[3], decisions[4]
    assert p1.inputs is not None and p1.inputs.requested_processors == 4  # 48 cores / 12 per processor
    assert p1.inputs.candidate_processors == 4 and p1.inputs.characterized_processors == 4
    assert p1.plan is not None and {(c.node, c.processor) for c in p1.plan.caps} == {
        (n, i) for n in ("pnode0000", "pnode0001") for i in (0, 1)}  # the processors it runs on, all of them
    assert p3.plan is not None and {(c.node, c.processor) for c in p3.plan.caps} == {("pnode0003", 0), ("pnode0003", 1)}
    # The release frees p1's processors and gives its leftover power to p2 and p3; p4's start comes
    # after it, so a scheduler applying decisions in order never double-books.
    assert freed.plan is not None and {u.job_id for u in freed.running_updates} == {"p2", "p3"}
    assert p4.plan is not None and {(c.node, c.processor) for c in p4.plan.caps} == {("pnode0000", 0), ("pnode0000", 1)}
    assert len({d.event_id for d in decisions}) == len(decisions)
    assert first.apply("jobs.lifecycle", b"{not json") == [] and first.skipped == 1


def test_jobs_seen_before_the_inventory_start_when_processors_appear() -> None:
    from power_events import scenario

    from nodeshare.schemas.catalog import TOPIC_OF_RECORD
    from nodeshare.schemas.events import JobEvent
    from nodeshare.schemas.serde import encode
    from nodeshare.streams.core.power.stream import PowerManager

    records = scenario()
    jobs_first = [r for r in records if isinstance(r, JobEvent)] + [r for r in records if not isinstance(r, JobEvent)]
    pm = PowerManager(600.0)
    out = [d for r in jobs_first for d in pm.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))]
    assert [(d.job_id, d.action.value) for d in out[:5]] == [
        ("p1", "defer"), ("p2", "defer"), ("p3", "defer"), ("p1", "release"), ("p4", "defer")]
    assert "no processor known on pnode0000, pnode0001" in out[0].reason and "min and max watts" in out[0].reason
    started = {d.job_id for d in out if d.action.value == "start"}
    assert started == {"p2", "p3", "p4"}  # p1 ended before its processors were known
