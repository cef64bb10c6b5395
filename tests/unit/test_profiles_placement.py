"""Rolling program profiles (streams.core.profiles) and the placement manager (streams.core.placement.stream)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from factories import T0, batch, block

from nodeshare.schemas import JobEvent, JobState, encode
from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.events import (
    DegradationEstimate,
    EstimateStatus,
    LlcSample,
    NodeInventory,
    PlacementAction,
    PlacementDecision,
    ProgramClass,
    ProgramProfile,
    Record,
)
from nodeshare.streams.core.accounting import JobAccount, Origin, PricingPolicy
from nodeshare.streams.core.placement.stream import PlacementManager
from nodeshare.streams.core.profiles import ProfileBook, degradation_pct, interpolate


def ev(job: str, state: JobState, program: str, nodes: tuple[str, ...], start_s: float = 0, end_s: float = 0,
       cores: int = 16, submit_s: float = 0) -> JobEvent:
    ran = state is not JobState.SUBMITTED
    ended = state in (JobState.ENDED, JobState.FAILED)
    at = end_s if ended else (start_s if ran else submit_s)
    return JobEvent(event_id=f"{job}-{state.value}", source="t", event_time=T0 + timedelta(seconds=at), job_id=job,
                    state=state, user="u", account="a", program=program, cores=cores, nodes=nodes if ran else (),
                    submit_time=T0 + timedelta(seconds=submit_s),
                    start_time=T0 + timedelta(seconds=start_s) if ran else None,
                    end_time=T0 + timedelta(seconds=end_s) if ended else None)


def estimate(job: str, d: float, at_s: float, event_id: str | None = None) -> DegradationEstimate:
    return DegradationEstimate(event_id=event_id or f"est-{job}", source="t", event_time=T0 + timedelta(seconds=at_s),
                               job_id=job, status=EstimateStatus.OK, degradation=d, filtered=d, unfiltered=d,
                               blocks_used=3, blocks_rejected=0, delta=0.05, final=True)


def inventory(node: str, cores: int = 16) -> NodeInventory:
    return NodeInventory(event_id=f"inv-{node}", source="t", event_time=T0, node=node, cores=cores, llc_ways=22,
                         mem_bandwidth_gbps=76.0)


def cat(job: str, node: str, ways: int, ipc: float, bw: float) -> LlcSample:
    return LlcSample(event_id=f"cat-{job}-{node}-{ways}", source="t", event_time=T0, job_id=job, node=node,
                     llc_ways=ways, node_llc_ways=8, cores=8, ipc=ipc, bandwidth_gbps=bw, interval_s=5.0)


def running_estimate(*blocks: Record) -> DegradationEstimate:
    """The running estimate (with the job's IPC moments) the charge fold sends for a batch of these blocks."""
    step = JobAccount(job_id=blocks[0].job_id).apply(batch(*blocks), Origin("node.ipc", 0, 0), PricingPolicy())
    assert step.estimate is not None and not step.estimate.final
    return step.estimate


def history() -> list[Record]:
    """Two CG jobs, one at scale 1 (alone) and one at scale 2 (next to a LAMMPS job), with CAT
    episodes and blocks; every number chosen so the profile can be worked out by hand."""
    nodes = [inventory(n) for n in ("n1", "n2", "n3")]
    a = [ev("a", JobState.STARTED, "CG", ("n1",), 0), ev("a", JobState.ENDED, "CG", ("n1",), 0, 1000),
         estimate("a", 0.0, 1000)]
    b = [ev("b", JobState.STARTED, "CG", ("n2", "n3"), 2000), ev("b", JobState.ENDED, "CG", ("n2", "n3"), 2000, 3000),
         estimate("b", 0.2, 3000)]  # T_solo = 0.8 * 1000 = 800 s; Deg = 100 (1/0.8 - 1) = 25%
    c = [ev("c", JobState.STARTED, "LAMMPS", ("n3",), 1500), ev("c", JobState.ENDED, "LAMMPS", ("n3",), 1500, 2500)]
    curves = [cat("a", "n1", 2, 0.5, 9.0), cat("a", "n1", 8, 1.0, 4.0), cat("b", "n2", 2, 0.7, 7.0)]
    blocks = [running_estimate(block(0.8, 1.0, 0.9, job="a", cycle=1), block(0.6, 1.2, 0.7, job="a", cycle=2))]
    return nodes + a[:1] + curves + blocks + a[1:] + c[:1] + b[:1] + c[1:] + b[1:]


def test_interpolate_and_deg_by_hand() -> None:
    assert interpolate({2: 0.6, 8: 1.2}, 8) == pytest.approx((0.6, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2))
    assert interpolate({}, 4) == ()
    assert degradation_pct(0.2) == pytest.approx(25.0)
    assert degradation_pct(0.0) == 0.0


def test_profile_worked_by_hand() -> None:
    book = ProfileBook()
    for r in history():
        book.apply(r)
    p = book.profile("CG")
    assert p.runtime_s_by_scale == {"1": 1000.0, "2": 800.0}
    assert p.program_class is ProgramClass.SCALING
    # ways 2: mean(0.5, 0.7) = 0.6, ways 8: 1.0; linear in between, flat below
    assert p.ipc_by_llc_ways == pytest.approx((0.6, 0.6, 0.6 + 0.4 / 6, 0.6 + 0.8 / 6, 0.8, 0.6 + 1.6 / 6,
                                               0.6 + 2.0 / 6, 1.0))
    assert p.bandwidth_gbps_by_llc_ways[0] == pytest.approx(8.0) and p.bandwidth_gbps_by_llc_ways[-1] == 4.0
    alone = p.features["ipc_alone"]
    assert (alone.mean, alone.min, alone.max, alone.sd) == pytest.approx((1.1, 1.0, 1.2, 0.1))
    shared = p.features["ipc_shared"]
    assert (shared.mean, shared.min, shared.max) == pytest.approx((0.75, 0.6, 0.9))
    assert p.degradation_next_to == pytest.approx({"LAMMPS": 25.0})  # b shared n3 with c, a ran alone
    assert list(book.pair_samples()) == [("CG", "LAMMPS", pytest.approx(25.0), 1)]
    # the curves are kept between episodes: a new episode at 8 ways moves them
    book.apply(cat("a", "n1", 8, 0.8, 4.0).model_copy(update={"event_id": "cat-a-late"}))
    assert book.curves("CG")[0][-1] == pytest.approx(0.9)


def test_the_profile_is_the_same_in_any_order_and_with_redeliveries() -> None:
    """Replays interleave partitions differently: the final profile must not care."""
    events = history()
    reference = ProfileBook()
    for r in events:
        reference.apply(r)
    for seed in range(5):
        shuffled = events[:] + events[3:8]  # some records delivered twice
        random.Random(seed).shuffle(shuffled)
        book = ProfileBook()
        for r in shuffled:
            book.apply(r)
        assert book.profile("CG") == reference.profile("CG")


def test_a_revised_estimate_replaces_the_jobs_contribution() -> None:
    book = ProfileBook()
    for r in history():
        book.apply(r)
    book.apply(estimate("b", 0.5, 4000, event_id="est-b-rev1"))
    p = book.profile("CG")
    assert p.runtime_s_by_scale == {"1": 1000.0, "2": 500.0}
    assert p.degradation_next_to == pytest.approx({"LAMMPS": 100.0})


def test_failed_runs_and_unknown_scales_do_not_profile_run_time() -> None:
    book = ProfileBook()
    for r in (inventory("n1"), inventory("n2"), inventory("n3"),
              ev("f", JobState.STARTED, "X", ("n1",), 0), ev("f", JobState.FAILED, "X", ("n1",), 0, 10),
              estimate("f", 0.0, 10),
              ev("g", JobState.STARTED, "X", ("n1", "n2", "n3"), 0),
              ev("g", JobState.ENDED, "X", ("n1", "n2", "n3"), 0, 9),
              estimate("g", 0.0, 9)):  # 3 nodes for 16 cores: scale 3 is not profiled
        book.apply(r)
    assert book.runtime_by_scale("X") == {}


def feed(m: PlacementManager, records: list[Record]) -> list[Record]:
    out: list[Record] = []
    for r in records:
        out += m.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))
    return out


def test_the_manager_places_submitted_jobs_and_publishes_profiles() -> None:
    m = PlacementManager()
    out = feed(m, history())
    profiles = [r for r in out if isinstance(r, ProgramProfile)]
    assert profiles[-1] == m.book.profile("CG")  # the last published is the current one
    assert {p.program for p in profiles} == {"CG"}  # the LAMMPS job has no estimate: nothing learned yet
    # CG is a scaling program now (1000 s at scale 1, 800 s at scale 2): a 16-process job spreads to 2 nodes
    out = feed(m, [ev("d", JobState.SUBMITTED, "CG", (), submit_s=5000)])
    [d] = [r for r in out if isinstance(r, PlacementDecision)]
    assert (d.action, d.scale_factor, len(d.nodes), d.cores_per_node) == (PlacementAction.PLACE, 2, 2, 8)
    assert d.inputs is not None and d.inputs.runtime_s_by_scale == {"1": 1000.0, "2": 800.0}
    assert d.inputs.program_class is ProgramClass.SCALING and d.inputs.processes == 16
    # alpha against CE leaves 0.9 * 800 / 1000 = 0.72 of F-IPC to sharing: the curve first reaches it at
    # 4 ways (0.6 + 0.8 / 6 = 0.733); predicted 0.8 / 0.733 = 1.09x the CE run, within 1 / 0.9
    assert d.llc_ways == 4 and d.bandwidth_gbps == pytest.approx(8.0 - 4.0 * 2 / 6)
    assert d.predicted_slowdown == pytest.approx(0.8 / (0.6 + 0.8 / 6))
    assert d.event_id.endswith("d-submitted")
    # the next job finds the first one's nodes taken; a third waits for a node, and is delayed once
    out = feed(m, [ev("e", JobState.SUBMITTED, "LAMMPS", (), cores=16, submit_s=5001)])
    [e] = [r for r in out if isinstance(r, PlacementDecision)]
    assert e.action is PlacementAction.PLACE and not set(e.nodes) & set(d.nodes)
    out = feed(m, [ev("f", JobState.SUBMITTED, "LAMMPS", (), cores=16, submit_s=5002)])
    [f] = [r for r in out if isinstance(r, PlacementDecision)]
    assert f.action is PlacementAction.DELAY and f.nodes == ()
    # e starts and ends: f is placed on the node e freed, and the decision says what triggered it
    feed(m, [ev("e", JobState.STARTED, "LAMMPS", e.nodes, start_s=5010)])
    out = feed(m, [ev("e", JobState.ENDED, "LAMMPS", e.nodes, start_s=5010, end_s=5100)])
    [f2] = [r for r in out if isinstance(r, PlacementDecision)]
    assert f2.action is PlacementAction.PLACE and f2.nodes == e.nodes
    assert f2.inputs is not None and f2.inputs.trigger_event_id == "e-ended"


def test_a_job_started_elsewhere_is_booked_where_it_runs() -> None:
    m = PlacementManager()
    feed(m, [inventory("n1"), inventory("n2")])
    feed(m, [ev("x", JobState.STARTED, "Y", ("n2",), 0)])  # never submitted through us
    out = feed(m, [ev("z", JobState.SUBMITTED, "Y", (), submit_s=1)])
    [z] = [r for r in out if isinstance(r, PlacementDecision)]
    assert z.nodes == ("n1",)


def test_the_pair_model_serializes_a_pair_predicted_too_slow() -> None:
    """Pairs of A next to B measured at Deg 100% (2x slower): once the model is trained, a new A
    is not put next to a running B; it waits (serialized) until B leaves."""
    m = PlacementManager()
    recs: list[Record] = [inventory("n1", cores=32)]
    t = 0
    for i in range(6):  # six measured A/B pairs on n1 (16 + 16 cores)
        a, b = f"a{i}", f"b{i}"
        recs += [ev(a, JobState.STARTED, "A", ("n1",), t), ev(b, JobState.STARTED, "B", ("n1",), t),
                 block(0.5, 1.0, 0.5, job=a, cycle=i), block(1.5, 1.6, 1.5, job=b, cycle=i),
                 ev(a, JobState.ENDED, "A", ("n1",), t, t + 100), ev(b, JobState.ENDED, "B", ("n1",), t, t + 100),
                 estimate(a, 0.5, t + 100), estimate(b, 0.5, t + 100)]
        t += 200
    feed(m, recs)
    # refitted at 4, 5, 7, 9 and 12 jobs measured (each 25% more than the last fit)
    assert m.pairs.model is not None and m.pairs.measured == 12
    feed(m, [ev("b9", JobState.STARTED, "B", ("n1",), t)])
    out = feed(m, [ev("a9", JobState.SUBMITTED, "A", (), submit_s=t + 1)])
    [d] = [r for r in out if isinstance(r, PlacementDecision)]
    assert d.action is PlacementAction.SERIALIZE and "serialized" in d.reason
    out = feed(m, [ev("b9", JobState.ENDED, "B", ("n1",), t, t + 50)])
    [d2] = [r for r in out if isinstance(r, PlacementDecision)]
    assert d2.action is PlacementAction.PLACE and d2.inputs is not None and d2.inputs.model_pairs == 12


def measured_pairs(node: str, pairs: list[tuple[str, str, float]], t: float = 0) -> tuple[list[Record], float]:
    """Jobs of two programs run side by side on ``node`` (16 cores each), each pair measured at
    degradation ``d`` (both jobs), with shutter blocks that give each program its features."""
    ipc = {"P": (0.5, 1.0, 0.5), "Q": (1.5, 1.6, 1.5)}  # P loses half its IPC to a co-runner, Q hardly any
    recs: list[Record] = []
    for i, (x, y, d) in enumerate(pairs):
        a, b = f"{x.lower()}{y.lower()}{i}a", f"{x.lower()}{y.lower()}{i}b"
        recs += [ev(a, JobState.STARTED, x, (node,), t), ev(b, JobState.STARTED, y, (node,), t),
                 running_estimate(block(*ipc[x], job=a, node=node, cycle=i)),
                 running_estimate(block(*ipc[y], job=b, node=node, cycle=i)),
                 ev(a, JobState.ENDED, x, (node,), t, t + 100), ev(b, JobState.ENDED, y, (node,), t, t + 100),
                 estimate(a, d, t + 100), estimate(b, d, t + 100)]
        t += 200
    return recs, t


@pytest.mark.parametrize("pairing", ["blossom", "greedy"])
def test_waiting_jobs_are_paired_where_the_model_predicts_they_mix_well(pairing: str) -> None:
    """P next to P measured at Deg 100%, P next to Q and Q next to Q at about 3%: when a node
    frees, the queue P, P, Q, Q is paired P with Q, and each pair starts on one node. (The P/Q
    mix is measured most often: a forest trained on a handful of rows blurs what it saw least.)"""
    m = PlacementManager(pairing=pairing)
    recs, t = measured_pairs("n1", [("P", "P", 0.5)] * 2 + [("P", "Q", 0.03)] * 6 + [("Q", "Q", 0.03)] * 2)
    feed(m, [inventory("n1", cores=32), *recs])
    assert m.pairs.model is not None
    feed(m, [ev("x", JobState.STARTED, "X", ("n1",), t, cores=32)])  # the node is full
    waiting = [("p1", "P"), ("p2", "P"), ("q1", "Q"), ("q2", "Q")]
    out = feed(m, [ev(j, JobState.SUBMITTED, prog, (), cores=16, submit_s=t + k)
                   for k, (j, prog) in enumerate(waiting)])
    assert {d.action for d in out if isinstance(d, PlacementDecision)} == {PlacementAction.DELAY}
    out = feed(m, [ev("x", JobState.ENDED, "X", ("n1",), t, t + 50, cores=32)])
    pair = [d for d in out if isinstance(d, PlacementDecision)]
    assert [d.action for d in pair] == [PlacementAction.PAIR] * 2 and pair[0].job_id == "p1"  # the oldest first
    a, b = pair
    assert (a.paired_with, b.paired_with) == (b.job_id, a.job_id) and b.job_id in ("q1", "q2")
    assert a.nodes == b.nodes == ("n1",) and a.cores_per_node == b.cores_per_node == 16
    assert a.inputs is not None and set(a.inputs.co_runners) == {b.job_id}
    assert a.inputs.predicted_degradation_pct[b.job_id] < 100.0 * (1 / 0.9 - 1)  # within alpha
    assert f"paired with {b.job_id} ({pairing})" in a.reason
    assert m.scheduler is not None and set(m.scheduler.queue) == {"p2", "q1", "q2"} - {b.job_id}


def test_pairing_off_leaves_the_queue_to_spread_n_share() -> None:
    m = PlacementManager(pairing="off")
    recs, t = measured_pairs("n1", [("P", "Q", 0.03)] * 4)
    feed(m, [inventory("n1", cores=32), *recs, ev("x", JobState.STARTED, "X", ("n1",), t, cores=32)])
    feed(m, [ev("p1", JobState.SUBMITTED, "P", (), cores=16, submit_s=t + 1),
             ev("q1", JobState.SUBMITTED, "Q", (), cores=16, submit_s=t + 2)])
    out = feed(m, [ev("x", JobState.ENDED, "X", ("n1",), t, t + 50, cores=32)])
    assert [(d.action, d.paired_with) for d in out if isinstance(d, PlacementDecision)] == [
        (PlacementAction.PLACE, None)] * 2
    with pytest.raises(ValueError, match="pairing must be"):
        PlacementManager(pairing="fifo")


def test_bad_bytes_are_skipped_not_fatal() -> None:
    m = PlacementManager()
    assert m.apply("node.llc", b"{not json") == []
    assert m.apply("no.such.topic", b"{}") == []
    assert m.skipped == 2


def test_each_node_whose_cache_shares_change_gets_its_whole_set_and_a_rebuild_restates_them() -> None:
    """decisions.placement.nodes (issue 42, item 6): what an agent with --resctrl reads instead of
    every decision. d books 4 ways on each of its two nodes; it starts elsewhere, and its shares
    leave the nodes it was placed on; a job that ends gives its ways back."""
    from nodeshare.schemas.events import LlcShare, NodePlacementState
    from nodeshare.streams.core import snapshot

    m = PlacementManager()
    feed(m, history())
    out = feed(m, [ev("d", JobState.SUBMITTED, "CG", (), submit_s=5000)])
    [d] = [r for r in out if isinstance(r, PlacementDecision)]
    states = [r for r in out if isinstance(r, NodePlacementState)]
    assert d.bandwidth_gbps == pytest.approx(8.0 - 4.0 * 2 / 6)
    share = LlcShare(job_id="d", ways=4, bandwidth_gbps=d.bandwidth_gbps)
    assert [(s.node, s.shares) for s in states] == [(n, (share,)) for n in sorted(d.nodes)]
    assert all(s.decided_by == "d-submitted" for s in states)
    assert [r for r in feed(m, [inventory("n9")]) if isinstance(r, NodePlacementState)] == []  # nothing changed
    # restated after a rebuild (the snapshot round trip the worker makes): every node, none included
    _, rebuilt = snapshot.usable(snapshot.dump(m, 7), PlacementManager())
    held = {s.node: s.shares for s in states}
    assert [(s.node, s.shares) for s in rebuilt.restatement()] == [
        (n, held.get(n, ())) for n in ("n1", "n2", "n3", "n9")]
    # d starts on another node than the one it was placed on: its shares leave both
    out = feed(m, [ev("d", JobState.STARTED, "CG", ("n9",), start_s=5010)])
    gone = [r for r in out if isinstance(r, NodePlacementState)]
    assert [(s.node, s.shares) for s in gone] == [(n, ()) for n in sorted(d.nodes)]
    assert [r for r in feed(m, [ev("d", JobState.ENDED, "CG", ("n9",), start_s=5010, end_s=5100)])
            if isinstance(r, NodePlacementState)] == []  # no shares on n9 to give back
    assert [(s.node, s.shares) for s in m.restatement()] == [(n, ()) for n in ("n1", "n2", "n3", "n9")]
