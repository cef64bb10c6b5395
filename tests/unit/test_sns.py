"""Spread-n-Share (Seed 001 Section 4) core and the trace-driven CE / CS / SNS experiment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from nodeshare.experiments.sns import Machine, simulate
from nodeshare.experiments.sns_trace import experiment_sns, read_swf
from nodeshare.producers.workloads import BUILTIN
from nodeshare.schemas.events import ProgramClass
from nodeshare.streams.core.placement.sns import (
    CE,
    CS,
    LEARNED,
    SNS,
    LlcDemand,
    NodeCapacity,
    NodeLoad,
    PendingJob,
    Placement,
    Policy,
    Scheduler,
    choose_nodes,
    classify,
    layouts,
    llc_demand,
    sns_scales,
    spread,
)


@dataclass(frozen=True)
class Fixed:
    """A profile given by hand."""

    runtimes: Mapping[int, float]
    ways: int = 4
    bw: float = 10.0

    def runtime_by_scale(self) -> Mapping[int, float]:
        return self.runtimes

    def demand(self, cores_per_node: int, alpha: float) -> LlcDemand | None:
        return LlcDemand(self.ways, self.bw, 0.95)


NODE = NodeCapacity(cores=16, llc_ways=22, bandwidth_gbps=76.0)


def job(job_id: str, procs: int, profile: Fixed | None = None, submitted: float = 0.0) -> PendingJob:
    return PendingJob(job_id, procs, 0.9, submitted, profile or Fixed({1: 100.0}))


def test_classes_follow_the_five_percent_rule() -> None:
    assert classify({1: 100.0, 2: 98.0, 4: 97.0}) is ProgramClass.NEUTRAL  # 100 <= 1.05 * 97
    assert classify({1: 100.0, 2: 80.0, 4: 90.0}) is ProgramClass.SCALING
    assert classify({1: 100.0, 2: 110.0}) is ProgramClass.COMPACT
    assert classify({2: 80.0, 4: 70.0}) is ProgramClass.UNKNOWN  # no CE run yet
    assert classify({1: 100.0}) is ProgramClass.UNKNOWN


def test_scale_order_fastest_first_but_neutral_smallest_first() -> None:
    assert sns_scales({1: 100.0, 2: 80.0, 4: 70.0, 8: 90.0}) == [4, 2, 8, 1]
    assert sns_scales({1: 100.0, 2: 99.0, 4: 98.0}) == [1, 2, 4]  # neutral: spread only passively
    assert sns_scales({}) == [1]  # unprofiled: the CE run that profiles it


def test_spread_by_hand() -> None:
    assert spread(20, 16, 1) == (2, 10)  # n = 1 * ceil(20/16) = 2, c = ceil(20/2) = 10
    assert spread(20, 16, 4) == (8, 3)  # n = 8, c = ceil(20/8) = 3
    assert spread(16, 16, 8) == (8, 2)
    with pytest.raises(ValueError, match="positive"):
        spread(0, 16, 1)


def test_layouts_keep_to_the_node_count_a_job_asked_for_by_hand() -> None:
    def tried(*args: object) -> list[tuple[int, int, int, bool]]:
        return [(x.scale, x.nodes, x.cores, x.asked) for x in layouts(*args)]  # type: ignore[arg-type]

    every = (1, 2, 4, 8)
    # no count asked: Seed 001's spread at every scale factor, in the policy's order
    assert tried(20, 16, every) == [(1, 2, 10, False), (2, 4, 5, False), (4, 8, 3, False), (8, 16, 2, False)]
    assert tried(20, 16, (4, 2, 1, 8), 1, None, 3) == [(1, 2, 10, False)]  # none wider than the 3 nodes there are
    # -N 2 -n 2: scale 2 is n = 2 * ceil(2/16) = 2, c = 1; then the count asked nearest compact (2)
    assert tried(2, 16, every, 2, 2) == [(2, 2, 1, False), (2, 2, 1, True)]
    # -N 2-8 -n 20 on 10 nodes: scale 8's 16 nodes is past it; the nearest count to compact (2) last
    assert tried(20, 16, (4, 2, 1, 8), 2, 8, 10) == [(4, 8, 3, False), (2, 4, 5, False), (1, 2, 10, False),
                                                     (1, 2, 10, True)]
    # -N 3 -n 3: no scale factor gives 3 nodes: 3 itself, scale 3 // 1
    assert tried(3, 16, every, 3, 3) == [(3, 3, 1, True)]
    # -N 1 -n 32, smallest node 16 cores: compact is 2 nodes, past the 1 asked: 1 node of 32 cores
    assert tried(32, 16, every, 1, 1) == [(1, 1, 32, True)]
    # -N 5-8 -n 8 on 6 nodes: scale 8's 8 nodes do not exist; 5 nodes of 2 cores do
    assert tried(8, 16, every, 5, 8, 6) == [(5, 5, 2, True)]
    # a minimum alone (-w of 5 nodes, -n 5): never more nodes than processes
    assert tried(5, 16, every, 5, None, 8) == [(5, 5, 1, True)]
    assert tried(2, 16, every, 3, None) == []  # 3 nodes for 2 processes: none (Slurm would not run it)


@pytest.mark.parametrize("policy", [CE, CS, SNS, LEARNED], ids=lambda p: p.name)
def test_a_job_is_placed_on_the_node_count_it_asked_for(policy: Policy) -> None:
    """A two-task job submitted with ``-N 2`` (two nodes at least and at most) fits one 16-core node,
    but asked for two: every policy places it on two (before, each packed it onto one, and the Slurm
    adapter's NumNodes=1 overrode the request); a scaling program is not spread past the two either."""
    s = Scheduler({f"n{i}": NODE for i in range(5)}, policy)
    scaling = Fixed({1: 100.0, 2: 80.0, 4: 70.0})  # SNS would take scale 4 (the fastest)
    s.submit(PendingJob("wide", 2, 0.9, 0.0, scaling, "P", min_nodes=2, max_nodes=2))
    s.submit(job("narrow", 2))
    placed = {d.job.job_id: d.placement for d in s.schedule(0.0)}
    assert placed["wide"] is not None and placed["narrow"] is not None
    assert len(set(placed["wide"].nodes)) == 2 and placed["wide"].cores_per_node == 1
    assert placed["wide"].scale == 2  # as its profile will record the run (two nodes for two processes)
    assert len(placed["narrow"].nodes) == 1


@pytest.mark.parametrize("policy", [CS, SNS, LEARNED], ids=lambda p: p.name)
def test_a_job_whose_scale_factors_miss_its_count_still_gets_the_count(policy: Policy) -> None:
    """``-N 5-8 -n 8`` on 6 empty nodes: the one scale factor in range (8 nodes) does not exist here,
    5 nodes do; and ``-N 2 -n 2`` of a program its profile finds 1.5 times slower on 2 nodes, which
    the alpha check refuses as a spread (SNS), but which is the count the job asked for."""
    s = Scheduler({f"n{i}": NODE for i in range(6)}, policy)
    s.submit(PendingJob("wide", 8, 0.9, 0.0, Fixed({1: 100.0}, ways=1, bw=1.0), "P", min_nodes=5, max_nodes=8))
    [d] = s.schedule(0.0)
    assert d.placement is not None and len(d.placement.nodes) == 5 and d.placement.cores_per_node == 2
    compact = Fixed({1: 100.0, 2: 150.0}, ways=1, bw=1.0)
    s.submit(PendingJob("pinned", 2, 0.9, 1.0, compact, "Q", min_nodes=2, max_nodes=2))
    [d] = s.schedule(1.0)
    assert d.placement is not None and len(d.placement.nodes) == 2


@pytest.mark.parametrize("policy", [CS, SNS, LEARNED], ids=lambda p: p.name)
def test_a_job_that_fits_its_node_count_nowhere_now_waits_rather_than_spreading_past_it(policy: Policy) -> None:
    """``-N 2 -n 32`` on 16-core nodes each half busy: two nodes cannot hold it now, four could (and
    SNS would pick four for this scaling program), but it asked for two at most: it waits."""
    s = Scheduler({f"n{i}": NODE for i in range(4)}, policy)
    for i in range(4):
        s.allocate(f"busy{i}", Placement(1, (f"n{i}",), 8, None, None, 1.0))
    scaling = Fixed({1: 100.0, 2: 70.0, 4: 80.0}, ways=1, bw=1.0)
    s.submit(PendingJob("wide", 32, 0.9, 0.0, scaling, "P", min_nodes=2, max_nodes=2))
    [d] = s.schedule(0.0)
    assert d.placement is None
    s.release("busy0")
    s.release("busy1")
    [d] = s.schedule(1.0)
    assert d.placement is not None and sorted(d.placement.nodes) == ["n0", "n1"]


@pytest.mark.parametrize("policy", [CE, CS, SNS, LEARNED], ids=lambda p: p.name)
def test_a_one_node_job_bigger_than_the_smallest_node_goes_to_a_big_one(policy: Policy) -> None:
    """``-N 1 -n 32`` on a cluster of a 16-core and a 64-core node: Slurm runs it on the big node.
    Sized by the smallest node, it needs two; bounded to one, it gets the one count it asked for and
    the node that holds it (it must not wait for ever: a held job the manager delays stays held)."""
    big = NodeCapacity(cores=64, llc_ways=22, bandwidth_gbps=76.0)
    s = Scheduler({"small": NODE, "big": big}, policy)
    s.submit(PendingJob("one", 32, 0.9, 0.0, Fixed({1: 100.0}, ways=1, bw=1.0), "P", min_nodes=1, max_nodes=1))
    [d] = s.schedule(0.0)
    assert d.placement is not None and d.placement.nodes == ("big",) and d.placement.cores_per_node == 32


def test_llc_demand_reads_the_curves_like_fig_10() -> None:
    ipc, bw = (0.5, 0.8, 0.9, 1.0), (9.0, 7.0, 5.0, 4.0)
    d = llc_demand(ipc, bw, 0.9)  # T-IPC = 0.9 * 1.0: first reached at 3 ways
    assert (d.ways, d.bandwidth_gbps, d.ipc_share) == (3, 5.0, 0.9)
    assert llc_demand(ipc, bw, 0.5).ways == 1
    assert llc_demand(ipc, bw, 1.0).ways == 4
    with pytest.raises(ValueError, match="same"):
        llc_demand(ipc, bw[:2], 0.9)


def test_node_score_is_co_plus_bo_plus_two_wo() -> None:
    load = NodeLoad(NODE, {"a": (8, 11, 19.0)})
    assert load.score() == pytest.approx(0.5 + 0.25 + 2 * 0.5)


def test_nodes_chosen_within_one_idle_core_group_else_the_whole_cluster() -> None:
    loads = {"a": NodeLoad(NODE), "b": NodeLoad(NODE, {"x": (8, 2, 5.0)}), "c": NodeLoad(NODE, {"y": (8, 1, 1.0)})}
    assert choose_nodes(loads, 2, 4, 0, 0.0, CS) == ("c", "b")  # the 8-idle group, idlest first
    assert choose_nodes(loads, 3, 4, 0, 0.0, CS) == ("a", "c", "b")  # no group of 3: whole cluster
    assert choose_nodes(loads, 1, 12, 0, 0.0, CS) == ("a",)
    assert choose_nodes(loads, 4, 4, 0, 0.0, CS) is None
    assert choose_nodes(loads, 1, 4, 22, 0.0, SNS) == ("a",)  # only the empty node has all 22 ways free
    assert choose_nodes(loads, 1, 4, 21, 0.0, SNS) == ("c",)  # c (1 way used) is fuller than a: best fit


def test_ce_gives_each_job_whole_nodes() -> None:
    s = Scheduler({"n1": NODE, "n2": NODE}, CE)
    for j in ("a", "b", "c"):
        s.submit(job(j, 1))
    placed = [d for d in s.schedule(0.0) if d.placement]
    assert [(d.job.job_id, d.placement.nodes) for d in placed if d.placement] == [("a", ("n1",)), ("b", ("n2",))]
    assert list(s.queue) == ["c"]
    s.release("a")
    assert [d.job.job_id for d in s.schedule(10.0) if d.placement] == ["c"]


def test_cs_shares_nodes_by_cores_and_sns_also_by_ways_and_bandwidth() -> None:
    cs = Scheduler({"n1": NODE}, CS)
    sns = Scheduler({"n1": NODE}, SNS)
    for s in (cs, sns):
        for j in ("a", "b", "c"):
            s.submit(job(j, 4, Fixed({1: 100.0}, ways=8, bw=30.0)))
    assert len([d for d in cs.schedule(0.0) if d.placement]) == 3  # 12 cores of 16
    assert len([d for d in sns.schedule(0.0) if d.placement]) == 2  # 3 x 8 ways > 22
    reasons = [d.reason for d in sns.schedule(1.0)]
    assert reasons == []  # the delay was reported once, at the first pass


def test_sns_spreads_a_scaling_job_to_its_fastest_scale() -> None:
    s = Scheduler({f"n{i}": NODE for i in range(4)}, SNS)
    s.submit(job("a", 16, Fixed({1: 100.0, 2: 80.0, 4: 75.0, 8: 90.0})))
    [d] = s.schedule(0.0)
    assert d.placement is not None
    assert (d.placement.scale, len(d.placement.nodes), d.placement.cores_per_node) == (4, 4, 4)
    # predicted slowdown against CE: 75 / 100 for the scale, / 0.95 for the IPC kept at 4 ways
    assert d.placement.predicted_slowdown == pytest.approx(0.75 / 0.95)


def test_alpha_counts_the_scale_factor_against_the_ce_run() -> None:
    """A compact program 20% slower at scale 2 cannot also share: 1.2 > 1 / 0.9."""
    for policy, placed in ((SNS, False), (CS, True)):  # CS knows no alpha: it spreads anyway
        s = Scheduler({"n1": NODE, "n2": NODE}, policy)
        s.allocate("big", Placement(1, ("n1",), 8, 2, 5.0, None))
        s.allocate("other", Placement(1, ("n2",), 1, 1, 1.0, None))
        s.submit(job("a", 16, Fixed({1: 100.0, 2: 120.0})))  # scale 1 fits nowhere, scale 2 on n1 + n2
        [d] = s.schedule(0.0)
        assert (d.placement is not None) is placed


def test_an_aged_job_stops_younger_ones_from_jumping_ahead() -> None:
    s = Scheduler({"n1": NODE}, CS, age_limit_s=100.0)
    s.allocate("running", Placement(1, ("n1",), 8, None, None, None))
    s.submit(job("big", 16, submitted=0.0))
    s.submit(job("small", 4, submitted=1.0))
    assert [d.job.job_id for d in s.schedule(50.0) if d.placement] == ["small"]  # backfilled
    s.release("small")
    s.submit(job("small2", 4, submitted=60.0))
    assert [d.job.job_id for d in s.schedule(150.0) if d.placement] == []  # big has aged: small2 waits
    s.release("running")
    assert [d.job.job_id for d in s.schedule(160.0) if d.placement] == ["big"]


def test_a_veto_delays_the_job_with_its_reason() -> None:
    s = Scheduler({"n1": NODE}, SNS, veto=lambda j, p: "predicted too slow: serialized")
    s.submit(job("a", 4))
    [d] = s.schedule(0.0)
    assert d.placement is None and d.refused and "serialized" in d.reason


# --------------------------------------------------------------------------- the experiment

SWF_HEADER = "; MaxNodes: 4\n; MaxProcs: 64\n"


def swf(tmp_path: Path, rows: list[tuple[int, int, int, int]], header: str = SWF_HEADER) -> Path:
    """A small Standard Workload Format trace: (job, submit, run time, processors)."""
    path = tmp_path / "t.swf"
    lines = [f"{j} {s} 0 {r} {p} -1 -1 {p} 3600 -1 1 1 1 -1 -1 1 -1 -1" for j, s, r, p in rows]
    path.write_text(header + "\n".join(lines) + "\n")
    return path


def test_read_swf_resizes_and_filters(tmp_path: Path) -> None:
    path = swf(tmp_path, [(1, 100, 50, 32), (2, 110, 0, 32), (3, 120, 60, 4), (4, 90, 70, 16)])
    jobs, meta = read_swf(path, min_procs=8, node_cores=8)
    # 16 trace cores per node -> 8 simulated: processes halve; run time 0 and 4-proc jobs dropped
    assert [(j.job_id, j.submit_s, j.procs) for j in jobs] == [("4", 0.0, 8), ("1", 10.0, 16)]
    assert meta == {"trace_nodes": 4, "trace_cores_per_node": 16.0, "trace_processors_per_node": 16.0}
    (tmp_path / "bad.swf").write_text("1 2 3\n")
    with pytest.raises(ValueError, match=r"bad\.swf:1: 3 fields"):
        read_swf(tmp_path / "bad.swf")


def test_a_trace_that_counts_nodes_as_processors_needs_its_cores_per_node(tmp_path: Path) -> None:
    rows = [(1, 100, 50, 2), (2, 110, 60, 1), (3, 120, 70, 4)]  # nodes, logged as processors
    path = swf(tmp_path, rows, header="; MaxNodes: 4\n; MaxProcs: 4\n")
    with pytest.raises(ValueError, match=r"MaxProcs = MaxNodes = 4: .* --cores-per-node"):
        read_swf(path, min_procs=8, node_cores=28)
    # 36-core nodes: 1 node is 36 cores (kept at min_procs 36), 2 nodes 72; each keeps its node count
    jobs, meta = read_swf(path, min_procs=36, node_cores=28, cores_per_node=36)
    assert [(j.job_id, j.procs) for j in jobs] == [("1", 56), ("2", 28), ("3", 112)]
    assert meta["trace_cores_per_node"] == 36 and meta["trace_processors_per_node"] == 1.0
    assert [j.job_id for j in read_swf(path, min_procs=72, node_cores=28, cores_per_node=36)[0]] == ["1", "3"]
    with pytest.raises(ValueError, match=r"MaxProcs \(2\) is below its MaxNodes \(4\)"):
        read_swf(swf(tmp_path, rows, header="; MaxNodes: 4\n; MaxProcs: 2\n"))
    with pytest.raises(ValueError, match="more than the 2 simulated nodes"):
        experiment_sns(swf(tmp_path, [(1, 0, 50, 3)], header="; MaxNodes: 4\n; MaxProcs: 4\n"), nodes=2,
                       min_procs=1, cores_per_node=36, policies=("CE",))


def test_a_job_alone_runs_exactly_its_ce_time() -> None:
    m = Machine([BUILTIN["MG"], BUILTIN["LAMMPS"]])
    for prog in (0, 1):
        assert m.stretch(prog, 16, 1, m.exclusive_ipc(prog, 16)) == pytest.approx(1.0)
    # MG (memory bound) speeds up when spread: fewer processes share a node's bandwidth
    assert m.runtime_by_scale(0, 16)[4] < 0.9
    assert classify(m.runtime_by_scale(1, 16)) is not ProgramClass.SCALING


def test_shared_nodes_slow_jobs_down_and_ce_never() -> None:
    m = Machine([BUILTIN["MG"], BUILTIN["ADVECT3D"]])
    from nodeshare.experiments.sns import TraceJob
    jobs = [TraceJob(str(i), float(i), 1000.0, 8) for i in range(4)]
    ce = simulate(jobs, [0, 1, 0, 1], m, "CE", nodes=2)
    cs = simulate(jobs, [0, 1, 0, 1], m, "CS", nodes=2)
    ce_run = ce["end"] - ce["start"]
    assert np.allclose(ce_run, 1000.0)
    assert ce["start"][2] >= ce["end"][0] - 1e-6  # the third job waited for a whole node
    cs_run = cs["end"] - cs["start"]
    assert (cs_run > 1000.0).all()  # two memory-bound jobs per node: every one slower than alone


def test_experiment_reports_what_the_issue_asks(tmp_path: Path) -> None:
    rows = [(i, 60 * i, 600 + 37 * (i % 7), 16 * (1 + i % 3)) for i in range(40)]
    r = experiment_sns(swf(tmp_path, rows), min_procs=8, nodes=4)
    assert r["jobs"] == 40
    ce_turn = r["policies"]["CE"]["mean_turnaround_s"]
    assert set(r["throughput_gain_vs_ce_pct"]) == {"CS", "SNS", "learned"}
    assert set(r["alpha_violations"]) == {"CE", "CS", "SNS", "learned"} and r["alpha_violations"]["CE"] == 0
    learned = r["policies"]["learned"]["learned"]  # issue 37: what it learned from, the warm-up apart
    assert learned["measured_jobs"] == 40 and 1 <= learned["warmup_jobs"] < 40
    assert r["policies"]["learned"]["vs_ce"]["turnaround"] == pytest.approx(
        r["policies"]["learned"]["mean_turnaround_s"] / ce_turn)
    assert r["policies"]["CE"]["run_vs_ce_geomean"] == pytest.approx(1.0)
    assert r["policies"]["CE"]["scale_share"]["1"] == 1.0
    ce, sns = r["policies"]["CE"], r["policies"]["SNS"]
    gain = 100.0 * (ce["mean_turnaround_s"] / sns["mean_turnaround_s"] - 1.0)
    assert r["throughput_gain_vs_ce_pct"]["SNS"] == pytest.approx(gain)
    with pytest.raises(ValueError, match="scaling-ratio"):
        experiment_sns(swf(tmp_path, rows), scaling_ratio=1.0)


def test_the_testbed_sequences_are_the_papers() -> None:
    """Seed 001 Section 6.2: 20 jobs of 16 or 28 processes, all submitted at once, a program's CE run
    time fixed by its input (the same program, the same time)."""
    from nodeshare.experiments.sns_testbed import testbed_sequence

    programs = [w for n, w in BUILTIN.items() if n != "NULL"]
    seq, assignment = testbed_sequence(programs, 20, np.random.default_rng(1))
    assert len(seq) == 20 and {j.procs for j in seq} <= {16, 28} and {j.submit_s for j in seq} == {0.0}
    by_program: dict[int, set[float]] = {}
    for j, p in zip(seq, assignment, strict=True):
        by_program.setdefault(p, set()).add(j.run_s)
    assert all(len(times) == 1 for times in by_program.values())
    assert seq[0].run_s == programs[assignment[0]].solo_s * 10.0


def test_the_testbed_experiment_reports_fig_14_from_its_own_runs() -> None:
    from nodeshare.experiments.sns_testbed import experiment_sns_testbed

    r = experiment_sns_testbed(sequences=3, jobs=8, seed=3)
    assert r["node"] == {"cores": 28, "llc_mb": 70.0, "bandwidth_gbps": 118.26} and r["nodes"] == 8
    rows = r["per_sequence"]
    assert len(rows) == len(r["scaling_ratio"]) == 3 and all(0.0 <= x <= 1.0 for x in r["scaling_ratio"])
    for row in rows:  # a gain is CE's mean turnaround over the policy's, as the paper's throughput
        t = row["mean_turnaround_s"]
        for p in ("CS", "SNS"):
            assert row["throughput_gain_vs_ce_pct"][p] == pytest.approx(100.0 * (t["CE"] / t[p] - 1.0))
        assert all(row["mean_wait_s"][p] < t[p] for p in t)  # waits are part of the turnaround
    for p in ("CS", "SNS"):
        gains = [row["throughput_gain_vs_ce_pct"][p] for row in rows]
        assert r["throughput_gain_vs_ce_pct"][p] == pytest.approx(float(np.mean(gains)))
    assert r["sns_beats_cs"] == sum(row["sns_vs_cs_pct"] > 0 for row in rows)
    # the model's assumptions are inputs, not constants: without communication growth nothing is
    # slower spread out, so the profiles change
    flat = experiment_sns_testbed(sequences=1, jobs=8, seed=3, comm_growth=0.0)
    assert flat["comm_growth"] == 0.0 and flat["programs"] != r["programs"]


def test_testbed_sequences_draw_programs_by_the_papers_class_mix() -> None:
    from nodeshare.experiments.sns_testbed import PAPER_CLASS_MIX, testbed_sequence

    programs = [w for n, w in BUILTIN.items() if n != "NULL"][:4]
    classes = [ProgramClass.SCALING, ProgramClass.NEUTRAL, ProgramClass.NEUTRAL, ProgramClass.UNKNOWN]
    _, assignment = testbed_sequence(programs, 6000, np.random.default_rng(3), classes=classes)
    share = np.bincount(assignment, minlength=4) / 6000
    # no compact program in this library: scaling 5 of 9, neutral 4 of 9 split over two programs
    assert PAPER_CLASS_MIX[ProgramClass.SCALING] == 5
    assert share == pytest.approx([5 / 9, 2 / 9, 2 / 9, 0.0], abs=0.02)
    with pytest.raises(ValueError, match="no program"):
        testbed_sequence(programs, 5, np.random.default_rng(3), classes=[ProgramClass.UNKNOWN] * 4)


def test_mba_keeps_a_light_job_from_a_bandwidth_hogs_queue() -> None:
    from nodeshare.experiments.sns import testbed_machine

    names = [w.name for w in testbed_machine().programs]
    hog, light = names.index("ADVECT3D"), names.index("LAMMPS")
    by_mba = {}
    for mba in (True, False):
        m = testbed_machine(mba=mba)
        alone = m.node_ipc(((light, 8, 6, 20.0),), True)[0]
        beside = m.node_ipc(((light, 8, 6, 20.0), (hog, 20, 10, 60.0)), True)[0]
        by_mba[mba] = beside / alone
    assert by_mba[False] < by_mba[True] <= 1.0 + 1e-9


def test_sns_testbed_cli_reports_the_papers_figures_and_refuses_an_unknown_curve(tmp_path: Path) -> None:
    from cli_runs import run_json
    from typer.testing import CliRunner

    from nodeshare.cli import app

    png = tmp_path / "t.png"
    r = run_json("experiment", "sns-testbed", "--sequences", "2", "--json", "--png", str(png))
    assert set(r["throughput_gain_vs_ce_pct"]) == {"CS", "SNS", "learned"} and r["sequences"] == 2
    assert set(r["beats_cs"]) == {"SNS", "learned"} and all(0 <= n <= 2 for n in r["beats_cs"].values())
    assert set(r["beyond_1_over_alpha_pct"]) == {"CS", "SNS", "learned"}
    assert r["learned"]["measured_jobs"] == 40 and r["learned"]["warmup_jobs"] >= 1
    assert len(r["scaling_ratio"]) == 2 and r["latency"] == "measured" and r["mba"] is True
    assert r["programs_mix"] == "paper" and set(r["programs"]["CG"]["speedup_by_scale"]) == {"1", "2", "4", "8"}
    assert r["sns_run_vs_exclusive_at_scale"]["mean"] > 0 and png.exists()
    bad = CliRunner().invoke(app, ["experiment", "sns-testbed", "--latency", "flat"])
    assert bad.exit_code == 2 and "measured, mm1" in bad.output


def test_sns_sweep_and_clusters_cli(tmp_path: Path) -> None:
    from cli_runs import run_json

    r = run_json("experiment", "sns-sweep", "--ratios", "0,1", "--sequences", "1", "--json",
                 "--png", str(tmp_path / "s.png"))
    assert [x["scaling_ratio"] for x in r["ratios"]] == [0.0, 1.0]
    assert set(r["ratios"][0]["SNS"]) == {"run", "wait", "turnaround"}
    rows = [(i, 60 * i, 600 + 37 * (i % 7), 16 * (1 + i % 5)) for i in range(30)]  # 1 to 5 trace nodes of 16
    r = run_json("experiment", "sns-clusters", "--trace", str(swf(tmp_path, rows)), "--nodes", "4,8",
                 "--scaling-ratios", "0.5", "--min-procs", "8", "--json", "--png", str(tmp_path / "c.png"))
    assert [x["nodes"] for x in r["runs"]] == [4, 8]
    # jobs over the smallest cluster are left out of every run, so both sizes replay the same jobs
    assert r["runs"][0]["jobs"] == r["runs"][1]["jobs"] == 24 and r["runs"][0]["skipped_too_big"] == 6
    assert r["runs"][0]["breakdown"]["CE"]["wait"] + r["runs"][0]["breakdown"]["CE"]["run"] == pytest.approx(1.0)
