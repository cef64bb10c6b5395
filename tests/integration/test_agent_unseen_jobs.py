"""A job the node agent never saw run is charged all the same: the resource manager's terminal
event names the agent's node, the agent's lifecycle follower reads it from the real broker, and
the marker it spools closes the job's stream there, so the real worker charges the job (issue 40,
item 4). A restarted agent resumes after its committed offset and sends no marker again."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from nodeshare.demo import running_pipeline
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.agent.agent import Agent, AgentOptions, build
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobEvent, JobState
from nodeshare.schemas.catalog import JOBS_LIFECYCLE
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def agent_for(settings: Settings, tmp_path: Path) -> Agent:
    (tmp_path / "jobs.toml").write_text("")  # no process of any job runs on this node
    options = AgentOptions(node="n1", spool=tmp_path / "spool.db", hardware_counters=False)
    return build(settings, options, job_file=tmp_path / "jobs.toml", slurm=False, progress_dir=tmp_path / "progress")


def run_until(agent: Agent, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    agent.run(stop=lambda: done() or time.monotonic() > deadline, drain_s=10.0)


def committed(settings: Settings, purpose: str) -> int:
    """How many records of jobs.lifecycle the agent's group has committed, over all partitions."""
    consumer = Consumer(settings.client_config(**{"group.id": f"{settings.app_id}-agent-n1-{purpose}"}))
    try:
        topic = settings.topic(JOBS_LIFECYCLE.name)
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(max(0, tp.offset) for tp in consumer.committed([TopicPartition(topic, p) for p in partitions],
                                                                   timeout=10))
    finally:
        consumer.close()


def test_a_job_the_agent_never_saw_is_charged(settings: Settings, tmp_path: Path) -> None:
    create_topics(settings)
    end = datetime.now(UTC).replace(microsecond=0)
    ended = JobEvent(event_id="slurm/unseen-1/ended", source="slurm", event_time=end, job_id="unseen-1",
                     state=JobState.ENDED, user="ana", account="physics", program="short", cores=2, nodes=("n1",),
                     start_time=end - timedelta(seconds=0.4), end_time=end)
    producer = EventProducer(settings)
    producer.send(ended)
    producer.flush()

    agent = agent_for(settings, tmp_path)
    run_until(agent, lambda: "unseen-1" in agent.closed.jobs and agent.spool.rows == 0)
    assert agent.closed.jobs["unseen-1"].at == end and agent.forwarder.sent >= 1
    assert committed(settings, "lifecycle") == 1  # the event read, committed by the agent's own group

    # restarted: the follower resumes after its commit, and spools no marker again
    again = agent_for(settings, tmp_path)
    spooled, put = [], again.spool.put
    again.spool.put = lambda events, *a, **k: (spooled.extend(events), put(events, *a, **k))[1]  # type: ignore[method-assign]
    run_until(again, lambda: again.lifecycle is not None and again.lifecycle.caught_up.is_set(), timeout_s=30)
    assert again.lifecycle is not None and again.lifecycle.caught_up.is_set()
    assert not [v for _, _, v in spooled if b"job_left_node" in v]

    with running_pipeline(settings, tmp_path / "run") as pipeline:
        pipeline.wait(charges=1, archived=0, timeout_s=90, report=lambda *_: None)
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        (charge,) = ledger.charges()
    assert charge.job_id == "unseen-1" and [n.node for n in charge.nodes] == ["n1"]
    assert charge.blocks_used == 0 and charge.pause_credit_s == 0.0
