"""Issue 39 on a real broker: a job whose second node is lost for good (its agent never closes the
stream) is charged once an operator says so with `nodeshare nodes down`, through the real worker,
ledger and archive; the node's late data is a second revision; the audit recomputes both."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import block, job_event, left

from nodeshare.demo import running_pipeline
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas import EstimateStatus, JobState, Record
from nodeshare.schemas.catalog import FOLD_SETTLED
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.worker.cursor import read_compacted

pytestmark = pytest.mark.integration


def publish(settings: Settings, records: list[Record]) -> None:
    with EventProducer(settings, client_id="test-node-lost") as producer:
        producer.send_all(records)
        producer.flush(30)


def settled_copies(settings: Settings, job: str) -> int:
    """How many of the job's accounts the worker moved to ``accounting.settled`` (out of its memory)."""
    out = read_compacted(settings, settings.topic(FOLD_SETTLED), idle_s=0.5)
    return sum(1 for k, _ in out if k is not None and k.split(b"/", 1)[1] == job.encode())


def wait_settled(settings: Settings, job: str, copies: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while settled_copies(settings, job) < copies:
        assert time.monotonic() < deadline, f"job {job}'s account never left the worker's memory"
        time.sleep(0.5)


@pytest.mark.parametrize("evict_after_s", [300.0, 0.0], ids=["in-memory", "settled"])
def test_a_job_that_lost_a_node_is_charged_after_nodes_down_and_again_with_the_late_data(
        settings: Settings, tmp_path: Path, evict_after_s: float) -> None:
    """With ``fold_evict_after_s`` 0 the charged account leaves the worker's memory before the node's
    late data comes, which reads it back from accounting.settled (issue 42, item 6): the same charges."""
    settings = settings.model_copy(update={"fold_evict_after_s": evict_after_s})
    job = f"lost-{int(evict_after_s)}"
    before = [block(1.0, 2.0, 1.0, job=job, node="n1", cycle=0), block(1.0, 0.9, 1.0, job=job, node="n2", cycle=1),
              block(0.8, 1.0, 0.82, job=job, node="n1", cycle=3), block(0.9, 1.2, 0.9, job=job, node="n2", cycle=2),
              left(job, "n1", 2, 3),
              job_event(job, JobState.STARTED, nodes=("n1", "n2")),
              job_event(job, JobState.FAILED, nodes=("n1", "n2"), cores=32, run_s=7200)]
    late = [block(0.7, 1.4, 0.7, job=job, node="n2", cycle=4), left(job, "n2", 3, 4)]
    with running_pipeline(settings, tmp_path / "run") as pipeline:
        publish(settings, before)
        env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env()}
        done = subprocess.run([sys.executable, "-m", "nodeshare", "nodes", "down", "n2", "--job", job,
                               "--reason", "n2 powered off, IPMI does not answer"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        pipeline.wait(charges=1, archived=len(before) + 1, timeout_s=90, report=lambda *_: None)
        with Ledger(pipeline.ledger_path, read_only=True) as ledger:
            [lost] = ledger.charges()
        assert lost.estimate_status is EstimateStatus.NODE_LOST and lost.revision == 0
        assert {n.node: n.blocks for n in lost.nodes} == {"n1": 2, "n2": 2}
        assert "n2 powered off, IPMI does not answer (operator/" in lost.evidence_problems[0]
        report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
        assert report.ok and report.matches == 1, report.as_dict()
        if not evict_after_s:
            wait_settled(settings, job, 1)

        publish(settings, late)  # n2 comes back with its spool
        pipeline.wait(charges=2, archived=len(before) + 1 + len(late), timeout_s=90, report=lambda *_: None)
        if not evict_after_s:  # read back, charged again, and out of memory again
            wait_settled(settings, job, 2)
        else:
            assert settled_copies(settings, job) == 0
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.revision: c for c in ledger.charges()}
    assert charges[1].estimate_status is not EstimateStatus.NODE_LOST and not charges[1].evidence_problems
    assert {n.node: n.blocks for n in charges[1].nodes} == {"n1": 2, "n2": 3}
    assert charges[1].revision_reason.startswith("late data: node n2, declared lost")
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == 2, report.as_dict()
