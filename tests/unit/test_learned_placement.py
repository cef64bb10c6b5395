"""The learned placement policy (issue 37): it learns the slowdown per program pair from the
pipeline's records alone, and admission follows what it measured."""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
from factories import T0

from nodeshare.experiments.sns import TraceJob, simulate
from nodeshare.experiments.sns import testbed_machine as make_testbed
from nodeshare.producers.simulator import JobTruth
from nodeshare.schemas import JobEvent, JobState
from nodeshare.schemas.events import DegradationEstimate, EstimateStatus
from nodeshare.streams.core.placement import learned as learned_mod
from nodeshare.streams.core.placement.learned import InterferenceModel
from nodeshare.streams.core.placement.sns import LEARNED, NodeCapacity, PendingJob, Scheduler


def ev(job: str, state: JobState, program: str, nodes: tuple[str, ...], start_s: float, end_s: float | None = None
       ) -> JobEvent:
    ended = end_s is not None
    return JobEvent(event_id=f"{job}-{state.value}", source="t", event_time=T0 + timedelta(seconds=end_s or start_s),
                    job_id=job, state=state, user="u", account="a", program=program, cores=8, nodes=nodes,
                    start_time=T0 + timedelta(seconds=start_s),
                    end_time=T0 + timedelta(seconds=end_s) if ended else None)


def est(job: str, d: float, at_s: float) -> DegradationEstimate:
    return DegradationEstimate(event_id=f"est-{job}", source="t", event_time=T0 + timedelta(seconds=at_s), job_id=job,
                               status=EstimateStatus.OK, degradation=d, filtered=d, unfiltered=d, blocks_used=3,
                               blocks_rejected=0, delta=0.05, final=True)


def shared_run(model: InterferenceModel, a: str, pa: str, b: str, pb: str, node: str, d_a: float, d_b: float,
               t0: float = 0.0) -> None:
    """Jobs a and b ran side by side on ``node`` and the fold measured D for each."""
    for job, prog in ((a, pa), (b, pb)):
        model.apply(ev(job, JobState.STARTED, prog, (node,), t0))
    for job, prog, d in ((a, pa, d_a), (b, pb, d_b)):
        model.apply(ev(job, JobState.ENDED, prog, (node,), t0, t0 + 100))
        model.apply(est(job, d, t0 + 100))


class Profile:
    def runtime_by_scale(self):
        return {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}

    def demand(self, cores_per_node, alpha):
        return None


def test_the_model_refuses_anything_but_lifecycle_and_estimates():
    model = InterferenceModel()
    truth = JobTruth("j", "CG", ("n1",), 10.0, 12.0, 0.0, 0.2)
    with pytest.raises(TypeError):
        model.apply(truth)  # type: ignore[arg-type]
    assert model.measured_jobs == 0


def test_a_measured_pair_is_learned_and_an_unmeasured_one_shrinks_toward_the_program():
    model = InterferenceModel()
    for i in range(4):
        shared_run(model, f"a{i}", "CG", f"b{i}", "MG", f"n{i}", 0.30, 0.02, t0=1000.0 * i)
    assert model.measured_jobs == 8
    cg_mg, _ = model.predict("CG", ["MG"])
    cg_new, cg_new_upper = model.predict("CG", ["EP"])
    mg_cg, _ = model.predict("MG", ["CG"])
    assert cg_mg > cg_new > mg_cg > 0.0  # the pair's own mean, then its program's, pulled toward the global one
    assert cg_mg < -math.log(1 - 0.30)  # shrunk toward the prior
    assert cg_new_upper > cg_new  # the uncertainty of a pair never measured
    assert model.predict("CG", []) == (0.0, 0.0)  # alone: nothing to correct


def test_a_job_is_not_placed_next_to_a_co_runner_measured_too_slow_but_would_be_before_measuring():
    nodes = {"n1": NodeCapacity(16, 22, 76.0), "n2": NodeCapacity(16, 22, 76.0)}
    for measured in (False, True):
        model = InterferenceModel()
        if measured:
            for i in range(4):
                shared_run(model, f"a{i}", "CG", f"b{i}", "MG", f"m{i}", 0.30, 0.30, t0=1000.0 * i)
        s = Scheduler(nodes, LEARNED, model=model)
        s.submit(PendingJob("mg", 8, 0.9, 0.0, Profile(), "MG"))
        s.submit(PendingJob("other", 12, 0.9, 0.0, Profile(), "EP"))
        s.schedule(0.0)
        assert s.nodes_of("mg") != s.nodes_of("other")
        s.submit(PendingJob("cg", 6, 0.9, 1.0, Profile(), "CG"))
        (d,) = s.schedule(1.0)
        if measured:  # the only node with room holds MG, measured to slow CG beyond 1/alpha: CG waits
            assert d.placement is None and d.refused
        else:  # nothing measured: compact sharing, next to MG
            assert d.placement is not None and "mg" in d.placement.co_jobs


def test_a_program_measured_slowed_next_to_everything_waits_for_an_empty_node():
    model = InterferenceModel()
    for i in range(6):
        shared_run(model, f"a{i}", "CG", f"b{i}", f"P{i}", f"m{i}", 0.5, 0.5, t0=1000.0 * i)
    s = Scheduler({"n1": NodeCapacity(16, 22, 76.0)}, LEARNED, model=model)
    s.submit(PendingJob("x", 8, 0.9, 0.0, Profile(), "EP"))
    s.schedule(0.0)
    s.submit(PendingJob("cg", 8, 0.9, 1.0, Profile(), "CG"))
    (d,) = s.schedule(1.0)
    assert d.placement is None and d.refused  # 8 cores free, but not with what CG was measured next to
    s.release("x")
    s.withdraw("x")
    (d,) = s.schedule(2.0)
    assert d.placement is not None and d.placement.nodes == ("n1",)


def test_no_ground_truth_reaches_the_learned_policy_in_the_experiment(monkeypatch):
    """The policy's inputs are the pipeline's records: every record the model folded is a lifecycle
    event or a final estimate, and a fresh model fed the same records predicts exactly the same."""
    seen = []
    original = InterferenceModel.apply

    def spy(self, record):
        seen.append(record)
        return original(self, record)

    monkeypatch.setattr(learned_mod.InterferenceModel, "apply", spy)
    machine = make_testbed()
    rng = np.random.default_rng(3)
    progs = rng.integers(len(machine.programs), size=24).tolist()
    jobs = [TraceJob(f"j{i}", float(i * 5), 100.0 + 10 * i, int(rng.choice([8, 16]))) for i in range(24)]
    model = InterferenceModel()
    out = simulate(jobs, progs, machine, "learned", 3, model=model)
    assert np.isfinite(out["end"]).all()
    assert seen and {type(r) for r in seen} == {JobEvent, DegradationEstimate}
    assert model.measured_jobs == 24 and out["learned"][0] == 0 and out["learned"].max() > 0
    replay = InterferenceModel()
    monkeypatch.setattr(learned_mod.InterferenceModel, "apply", original)
    for r in seen:
        replay.apply(r)
    names = [w.name for w in machine.programs]
    for p in names:
        for q in names:
            assert replay.predict(p, [q]) == model.predict(p, [q])


def test_the_placement_manager_learns_from_its_log_and_keeps_a_job_off_a_measured_bad_co_runner():
    """The manager's only input is its log: the learned policy's model is folded from the lifecycle and
    final estimates on it (the fold's output), and a snapshot of the manager carries it."""
    from nodeshare.schemas import encode
    from nodeshare.schemas.catalog import TOPIC_OF_RECORD
    from nodeshare.schemas.events import NodeInventory, PlacementAction, PlacementDecision

    def feed(m, records):
        return [out for r in records for out in m.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))]

    def inventory(node, cores):
        return NodeInventory(event_id=f"inv-{node}", source="t", event_time=T0, node=node, cores=cores, llc_ways=22,
                             mem_bandwidth_gbps=76.0)

    def submitted(job, program, cores, at_s):
        return JobEvent(event_id=f"{job}-submitted", source="t", event_time=T0 + timedelta(seconds=at_s), job_id=job,
                        state=JobState.SUBMITTED, user="u", account="a", program=program, cores=cores,
                        submit_time=T0 + timedelta(seconds=at_s))
    from nodeshare.streams.core.placement.stream import PlacementManager
    from nodeshare.streams.core.snapshot import dump, load

    m = PlacementManager(policy="learned", pairing="off")
    recs = [inventory("n1", cores=16), inventory("n2", cores=16), inventory("n3", cores=16)]
    for i in range(4):  # CG measured 30% slower next to MG, four times
        t = 1000.0 * i
        recs += [ev(f"c{i}", JobState.STARTED, "CG", ("n1",), t), ev(f"g{i}", JobState.STARTED, "MG", ("n1",), t),
                 ev(f"c{i}", JobState.ENDED, "CG", ("n1",), t, t + 100),
                 ev(f"g{i}", JobState.ENDED, "MG", ("n1",), t, t + 100), est(f"c{i}", 0.3, t + 100),
                 est(f"g{i}", 0.01, t + 100)]
    feed(m, recs)
    assert m.interference.measured_jobs == 8 and m.scheduler is not None and m.scheduler.model is m.interference
    feed(m, [ev("mg", JobState.STARTED, "MG", ("n1",), 9000.0), ev("ep", JobState.STARTED, "EP", ("n2",), 9000.0)])
    out = feed(m, [submitted("cg", "CG", 8, 9001)])
    [d] = [r for r in out if isinstance(r, PlacementDecision)]
    # CG suffered (next to MG, and its program's mean is what an unmeasured EP is taken at): a node of its own
    assert d.action is PlacementAction.PLACE and d.nodes == ("n3",)
    _, _, again = load(dump(m, 0))
    assert again.interference.predict("CG", ["MG"]) == m.interference.predict("CG", ["MG"])


def test_a_refused_job_waits_at_most_the_age_limit():
    model = InterferenceModel()
    for i in range(6):
        shared_run(model, f"a{i}", "CG", f"b{i}", "MG", f"m{i}", 0.5, 0.5, t0=1000.0 * i)
    s = Scheduler({"n1": NodeCapacity(16, 22, 76.0)}, LEARNED, age_limit_s=100.0, model=model)
    s.submit(PendingJob("mg", 8, 0.9, 0.0, Profile(), "MG"))
    s.schedule(0.0)
    s.submit(PendingJob("cg", 8, 0.9, 1.0, Profile(), "CG"))
    (d,) = s.schedule(50.0)
    assert d.placement is None and d.refused
    (d,) = s.schedule(101.0)  # aged: it would block every younger job, so it takes the room there is
    assert d.placement is not None and d.placement.nodes == ("n1",)
