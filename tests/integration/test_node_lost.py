"""Issue 39 on a real broker: a job whose second node is lost for good (its agent never closes the
stream) is charged once an operator says so with `nodeshare nodes down`, through the real worker,
ledger and archive; the node's late data is a second revision; the audit recomputes both."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import block, job_event, left
from integration.test_metrics import scrape, value

from nodeshare.demo import running_pipeline
from nodeshare.deploy.broker import free_port
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
    """How many of the job's accounts the worker wrote to ``accounting.settled``."""
    out = read_compacted(settings, settings.topic(FOLD_SETTLED), idle_s=0.5)
    return sum(1 for k, _ in out if k is not None and k.split(b"/", 1)[1].split(b"@")[0] == job.encode())


def wait_metric(port: int, name: str, at_least: float, timeout_s: float = 30.0, **labels: str) -> None:
    """Until the worker's metric reaches ``at_least`` (its endpoint comes up with the worker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if value(scrape(port), name, **labels) >= at_least:
                return
        assert time.monotonic() < deadline, f"{name}{labels} never reached {at_least}"
        time.sleep(0.3)


@pytest.mark.parametrize("evict_after_s", [300.0, 0.0], ids=["in-memory", "settled"])
def test_a_job_that_lost_a_node_is_charged_after_nodes_down_and_again_with_the_late_data(
        settings: Settings, tmp_path: Path, evict_after_s: float) -> None:
    """With ``fold_evict_after_s`` 0 the charged account leaves the worker's memory before the node's
    late data comes, which reads it back from accounting.settled (issue 42, item 6): the same charges."""
    port = free_port()
    settings = settings.model_copy(update={"fold_evict_after_s": evict_after_s, "metrics_port": port})
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
        if not evict_after_s:  # out of the worker's memory before the late data comes
            wait_metric(port, "nodeshare_fold_accounts", 1, where="settled")

        publish(settings, late)  # n2 comes back with its spool
        pipeline.wait(charges=2, archived=len(before) + 1 + len(late), timeout_s=90, report=lambda *_: None)
        if not evict_after_s:  # read back for the late data, charged again, and out of memory again
            wait_metric(port, "nodeshare_fold_settled_total", 1, direction="in")
            wait_metric(port, "nodeshare_fold_settled_total", 2, direction="out")
            assert settled_copies(settings, job) == 2  # one per state it left memory in
        else:
            assert settled_copies(settings, job) == 0
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.revision: c for c in ledger.charges()}
    assert charges[1].estimate_status is not EstimateStatus.NODE_LOST and not charges[1].evidence_problems
    assert {n.node: n.blocks for n in charges[1].nodes} == {"n1": 2, "n2": 3}
    assert charges[1].revision_reason.startswith("late data: node n2, declared lost")
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == 2, report.as_dict()


def test_a_keyed_read_finds_the_message_at_its_offset_in_a_batch_and_never_takes_slow_for_absent(
        settings: Settings) -> None:
    """``read_keyed`` on the broker: a message in the middle of one produced batch (the bundled
    broker reports the batch's first offset as the end), a later copy when ``accept`` refuses the
    first, None once the topic was read to its end or when it ends before the offset."""
    from nodeshare.deploy.topics import create_topics
    from nodeshare.streams.worker.cursor import read_keyed

    create_topics(settings)
    topic = settings.topic(FOLD_SETTLED)
    with EventProducer(settings, client_id="test-read-keyed") as producer:
        for i in range(50):
            producer.send_raw(topic, f"k{i % 10}".encode(), f"v{i}".encode(), partition=0)
        producer.flush(30)
    assert read_keyed(settings, topic, 37, b"k7", lambda v: True) == b"v37"
    assert read_keyed(settings, topic, 7, b"k7", lambda v: v != b"v7") == b"v17"
    assert read_keyed(settings, topic, 45, b"k3", lambda v: True, idle_s=0.5) is None  # no k3 from 45 on
    assert read_keyed(settings, topic, 3, b"k3", lambda v: False, idle_s=0.5) is None  # none usable to the end
    assert read_keyed(settings, topic, 500, b"k3", lambda v: True, idle_s=0.5) is None  # the topic ends before
    with EventProducer(settings, client_id="test-read-keyed") as producer:  # others keep writing: no wait on them
        for i in range(50, 60):
            producer.send_raw(topic, b"other", f"v{i}".encode(), partition=0)
        producer.flush(30)
    assert read_keyed(settings, topic, 3, b"k3", lambda v: v == b"v43") == b"v43"
    assert read_keyed(settings, topic, 3, b"k3", lambda v: False, idle_s=0.5) is None  # past the end seen: done
