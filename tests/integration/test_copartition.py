"""The charge fold's inputs co-partitioned, on the real broker (issue 44): the worker refuses topics
with different partition counts, `topics create` reconciles them, and records a producer put on
another partition than murmur2 gives their key are dead letters (never folded, never lost)."""

from __future__ import annotations

import base64
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from zlib import crc32

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, NewTopic

from nodeshare.deploy.processes import start_worker, stop_process
from nodeshare.deploy.topics import TopicsError, create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPIC_OF_RECORD, Charge, JobEvent, JobLeftNode, ShutterBatch, ShutterBlock, encode
from nodeshare.schemas.serde import decode_model
from nodeshare.sinks.analysis.inspect import read_dead_letters
from nodeshare.streams.core.accounting import Origin, fold_messages
from nodeshare.streams.worker.copartition import NotCoPartitioned, input_partitions, kafka_partition
from nodeshare.streams.worker.fold_consumer import FoldConsumer

pytestmark = pytest.mark.integration

SIM = SimConfig(nodes=6, jobs=16, seed=31)


def _make(settings: Settings, counts: dict[str, int]) -> None:
    admin = AdminClient(settings.client_config())
    for fut in admin.create_topics([NewTopic(settings.topic(name), num_partitions=n, replication_factor=-1)
                                    for name, n in counts.items()]).values():
        fut.result()


def _partitions(settings: Settings, name: str) -> int | None:
    topics = AdminClient(settings.client_config()).list_topics(timeout=30).topics
    return len(topics[settings.topic(name)].partitions) if settings.topic(name) in topics else None


@contextmanager
def _fold(settings: Settings) -> Iterator[FoldConsumer]:
    """A charge fold consuming in a thread, as in the worker; stopped (and committed) on exit."""
    fold, stop, failed = FoldConsumer(settings), threading.Event(), []

    def run() -> None:
        try:
            fold.run(stop)
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield fold
    finally:
        stop.set()
        thread.join(30)
        fold.producer.close()
    assert not failed, failed


def _charges(settings: Settings, want: set[str], deadline_s: float = 60.0, idle_s: float = 2.0) -> set[str]:
    """The job ids of ledger.charges, read until ``want`` are all there (or the deadline) and the topic
    has then been quiet for ``idle_s``: what else arrived is in the answer too."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"test-charges-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "session.timeout.ms": settings.session_timeout_ms}))
    consumer.subscribe([settings.topic("ledger.charges")])
    got: set[str] = set()
    end, last = time.monotonic() + deadline_s, time.monotonic()
    try:
        while time.monotonic() < end and not (want <= got and time.monotonic() - last > idle_s):
            for m in consumer.consume(500, timeout=0.5):
                if m.error() is None:
                    got.add(decode_model(Charge, m.value()).job_id)
                    last = time.monotonic()
    finally:
        consumer.close()
    return got


def _charged_jobs(events: list, settings: Settings) -> set[str]:
    """The jobs an uninterrupted fold of the events charges (partition-agnostic)."""
    offsets: dict[str, int] = {}
    messages = []
    for record in events:
        if isinstance(record, ShutterBatch | ShutterBlock | JobLeftNode | JobEvent):
            topic = TOPIC_OF_RECORD[type(record)].name
            offsets[topic] = offsets.get(topic, -1) + 1
            messages.append((Origin(topic, 0, offsets[topic]), record.job_id.encode(), encode(record), 0.0))
    return {c.job_id for c in fold_messages(messages, settings.policy())}


def _crc32_moves(job: str, partitions: int = 4) -> bool:
    """Whether librdkafka's default partitioner (consistent_random: CRC32) puts the job elsewhere than murmur2."""
    return crc32(job.encode()) % partitions != kafka_partition(job.encode(), partitions)


def test_the_worker_and_topics_create_refuse_input_topics_that_are_not_co_partitioned(settings: Settings,
                                                                                      tmp_path: Path):
    _make(settings, {"node.ipc": 8, "jobs.lifecycle": 4})
    ipc, life = settings.topic("node.ipc"), settings.topic("jobs.lifecycle")
    said = f"{ipc} has 8 partitions and {life} has 4 partitions"

    with pytest.raises(NotCoPartitioned, match=re.escape(said)):  # the fold, before it joins its group
        FoldConsumer(settings).run(threading.Event())

    started = time.monotonic()
    worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
    try:
        status = worker.wait(120)
    finally:
        stop_process(worker)
    said_by_worker = (tmp_path / "worker.log").read_text()
    assert status != 0
    assert f"refusing to start: {said}" in said_by_worker and f"Grow {life} from 4 to 8" in said_by_worker
    print(f"worker exit {status} after {time.monotonic() - started:.1f} s: {said_by_worker.strip()}")

    with pytest.raises(TopicsError, match=f"{re.escape(said)}.*Nothing was created or changed"):
        create_topics(settings)
    assert _partitions(settings, "ledger.charges") is None  # refused before creating anything
    assert (_partitions(settings, "node.ipc"), _partitions(settings, "jobs.lifecycle")) == (8, 4)

    try:  # the explicit growth the docs' procedure ends with
        result = create_topics(settings, grow_inputs_to=8)
    except TopicsError as exc:  # the bundled Tansu 0.6 implements no CreatePartitions (measured)
        assert f"could not grow {life} from 4 to 8 partitions" in str(exc) and "cannot add partitions" in str(exc)
        assert _partitions(settings, "ledger.charges") is None
    else:
        assert (result[ipc], result[life], result[settings.topic("ledger.charges")]) == ("exists", "grown", "created")
        assert input_partitions(settings) == {ipc: 8, life: 8}


def test_topics_create_gives_a_missing_input_topic_the_count_of_the_other(settings: Settings):
    _make(settings, {"node.ipc": 6})
    result = create_topics(settings)
    assert result[settings.topic("jobs.lifecycle")] == "created"
    assert _partitions(settings, "jobs.lifecycle") == 6 and _partitions(settings, "ledger.charges") == 4
    assert input_partitions(settings) == {settings.topic("node.ipc"): 6, settings.topic("jobs.lifecycle"): 6}
    assert set(create_topics(settings).values()) == {"exists"}


def test_records_routed_by_another_partitioner_are_dead_letters_and_re_published_they_are_charged(
        settings: Settings):
    """A site's Slurm hook writing lifecycle events with librdkafka's default partitioner (CRC32):
    every such event off its murmur2 partition is a dead letter with its reason and bytes, the jobs
    routed right are charged, no record of our own producer is misrouted, and re-publishing the dead
    letters as docs/topics.md says (any murmur2 producer) charges the rest."""
    create_topics(settings)
    events = simulate(SIM).events
    want = _charged_jobs(events, settings)
    moved = {e.job_id for e in events if isinstance(e, JobEvent) and _crc32_moves(e.job_id)}
    moved_events = [e for e in events if isinstance(e, JobEvent) and e.job_id in moved]
    assert want & moved and want - moved  # the seed gives both kinds
    with EventProducer(settings, client_id="agents") as agents, \
            EventProducer(settings, client_id="slurm-hook", partitioner="consistent_random") as hook:
        for e in events:
            (hook if isinstance(e, JobEvent) else agents).send(e)

    with _fold(settings):
        assert _charges(settings, want - moved) == want - moved  # and nothing of the moved jobs
        summary = read_dead_letters(settings, first=10_000, idle_s=2.0)
    assert summary.total == len(moved_events) and summary.by_origin == {settings.topic("jobs.lifecycle"): len(
        moved_events)}  # every node.ipc record (EventProducer: murmur2) was where the fold looks for it
    assert all(d.reason.startswith("misrouted:") and d.field == "key" for d in summary.first)
    assert sorted(base64.b64decode(d.value_b64) for d in summary.first) == sorted(encode(e) for e in moved_events)

    # The recovery docs/topics.md gives: the dead letters' bytes again, through a murmur2 producer.
    misrouted = sorted((d for d in summary.first if d.reason.startswith("misrouted")),
                       key=lambda d: (d.origin_topic, d.origin_partition or 0, d.origin_offset or 0))
    with EventProducer(settings, client_id="republish") as producer:
        for d in misrouted:
            producer.send_raw(d.origin_topic, base64.b64decode(d.key_b64 or ""), base64.b64decode(d.value_b64))
    with _fold(settings):
        assert _charges(settings, want) == want


def test_a_rebuild_skips_what_the_live_fold_dead_lettered(settings: Settings):
    """Both topics written with CRC32: a moved job's records agree with each other but not with
    murmur2. The live fold dead-letters them; a restarted fold rebuilding the partitions must not
    fold them into a charge the live fold never made. (Mutation: the rebuild without the routing
    filter charges the moved jobs.)"""
    create_topics(settings)
    events = simulate(SIM).events
    want = _charged_jobs(events, settings)
    moved = {j for j in want if _crc32_moves(j)}
    with EventProducer(settings, client_id="crc32-everything", partitioner="consistent_random") as producer:
        producer.send_all(events)
    with _fold(settings):
        assert _charges(settings, want - moved) == want - moved
    with _fold(settings) as fold:
        deadline = time.monotonic() + 60
        while fold.rebuilds < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fold.rebuilds >= 4  # every partition rebuilt from its committed input
        assert _charges(settings, want - moved) == want - moved
