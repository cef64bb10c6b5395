"""The calibrated simulator's cluster through the real pipeline, with no ground truth anywhere.

The experiments (``nodeshare experiment pairwise|pricing``) charge through the stream worker's
fold in-process (the audit path). This shows, on calibrated events, that the broker, the faust
worker and the ledger give the same charges as that fold, and that they do so with the truth
file never written: pricing cannot depend on it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from nodeshare.config import Settings
from nodeshare.demo import run_demo
from nodeshare.experiments.poppa import charges_of
from nodeshare.producers.simulator import JobTruth
from nodeshare.scenarios import ClusterChoice, build, source

pytestmark = pytest.mark.integration

PRICED = ("job_id", "revision", "cores", "run_time_s", "pause_credit_s", "billed_time_s", "solo_time_s",
          "degradation", "estimate_status", "degradation_filtered", "degradation_unfiltered",
          "degradation_corrected", "estimator", "blocks_used", "blocks_rejected", "blocks_ignored",
          "standard_price", "solo_price", "price", "dividend", "user", "account", "program")


def test_calibrated_cluster_charges_equal_the_experiments_fold_without_any_truth(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    choice = ClusterChoice(nodes=4, jobs=8, seed=11, mean_work_s=25.0, span_s=20.0)
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"c{tag}.", app_id=f"nodeshare-c{tag}")
    # published as the demo does: simulated and sent cycle by cycle while the worker runs
    run = run_demo(settings, source(choice), tmp_path / "run", timeout_s=120, truth=False)
    cluster = build(choice)  # the same run again, whole, for the experiments' in-process fold
    assert run.events_published == len(cluster.events)

    assert run.truth is None and not list((tmp_path / "run").rglob("truth*"))
    assert run.audit.ok, run.audit.as_dict()
    expected = charges_of(cluster.events, run.settings.policy())
    got = {c.job_id: c for c in run.charges}
    assert got.keys() == expected.keys() == {t.job_id for t in cluster.truth}
    for job, c in got.items():
        assert {f: getattr(c, f) for f in PRICED} == {f: getattr(expected[job], f) for f in PRICED}
    shared = [c for c in got.values() if c.blocks_used]
    assert len(shared) >= 4 and sum(c.dividend for c in shared) > 0  # jobs shared nodes and were discounted
    # the truth (which only the experiment reads) is what the charges approximate
    truth: dict[str, JobTruth] = {t.job_id: t for t in cluster.truth}
    for c in shared:
        assert abs(c.degradation - truth[c.job_id].true_degradation) < 0.06, (c.program, truth[c.job_id])
