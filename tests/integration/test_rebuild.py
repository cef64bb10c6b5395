"""The charge fold's rebuild against a commit that lands while it runs, on the real broker (issue 44,
item 3). A member that lost partitions (its commit on revoke failed, and it committed its leftovers
later; or a worker of an older build) can move the group's offsets while the new owner rebuilds up
to the offsets it read. The new owner must consume from where its rebuild stopped, or the messages
in between are never folded and its charges are wrong."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Consumer, TopicPartition

from nodeshare.deploy.topics import create_topics
from nodeshare.producers.batching import FlushPolicy
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPIC_OF_RECORD, Charge, JobEvent, JobLeftNode, ShutterBatch, ShutterBlock, encode
from nodeshare.schemas.serde import decode_model
from nodeshare.streams.core.accounting import Message, Origin, fold_messages
from nodeshare.streams.worker import fold_consumer
from nodeshare.streams.worker.copartition import kafka_partition
from nodeshare.streams.worker.cursor import accounting_group, committed_offsets
from nodeshare.streams.worker.fold_consumer import FoldConsumer, FoldThread

pytestmark = pytest.mark.integration

SIM = SimConfig(nodes=6, jobs=24, seed=44, flush=FlushPolicy(max_blocks=4))
#: Charge fields that depend on where and when a charge was made, not on what it charges.
WHERE = {"event_range", "revision_reason", "code_version"}


class _Fold(FoldConsumer):
    """The worker's charge fold, keeping its group consumer and the first offset it applied per partition."""

    def consumer(self) -> Consumer:
        self.group_consumer = super().consumer()
        return self.group_consumer

    def apply(self, message: Message) -> None:
        origin = message[0]
        self.first.setdefault((origin.topic, origin.partition), origin.offset)
        super().apply(message)

    first: dict[tuple[str, int], int]


@contextmanager
def _running(fold: _Fold) -> Iterator[_Fold]:
    """The fold in the worker's own thread class; stopped (and committed) on exit, its failure raised."""
    stop, failed = threading.Event(), []
    fold.first = {}
    thread = FoldThread(fold, stop, failed.append)
    with fold.producer:  # closed once the thread is done with it
        thread.start()
        try:
            yield fold
        finally:
            stop.set()
            thread.join(timeout=30)
    assert not failed, failed


def _inputs(records: list) -> list:
    return [r for r in records if isinstance(r, ShutterBatch | ShutterBlock | JobLeftNode | JobEvent)]


def _ends(settings: Settings, records: list) -> dict[tuple[str, int], int]:
    """The end offset of each input partition once ``records`` are published (murmur2 of the job id,
    as our producer partitions)."""
    ends = {(settings.topic(t.name), p): 0 for t in (TOPIC_OF_RECORD[ShutterBatch], TOPIC_OF_RECORD[JobEvent])
            for p in range(settings.partitions)}
    for r in _inputs(records):
        where = (settings.topic(TOPIC_OF_RECORD[type(r)].name), kafka_partition(r.job_id.encode(), settings.partitions))
        ends[where] += 1
    return ends


def _reference(records: list, settings: Settings) -> dict[tuple[str, int], dict]:
    """The charges of one uninterrupted fold, by (job, revision)."""
    offsets: dict[str, int] = {}
    messages = []
    for r in _inputs(records):
        topic = TOPIC_OF_RECORD[type(r)].name
        offsets[topic] = offsets.get(topic, -1) + 1
        messages.append((Origin(topic, 0, offsets[topic]), r.job_id.encode(), encode(r), 0.0))
    return {(c.job_id, c.revision): c.model_dump(exclude=WHERE) for c in fold_messages(messages, settings.policy())}


def _charges(settings: Settings, want: set, deadline_s: float = 60.0, idle_s: float = 2.0) -> dict[tuple, list]:
    """Every charge of ledger.charges by (job, revision), read until ``want`` are all there (or the
    deadline) and the topic has been quiet for ``idle_s``."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"test-charges-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "session.timeout.ms": settings.session_timeout_ms}))
    consumer.subscribe([settings.topic("ledger.charges")])
    got: dict[tuple, list] = {}
    end, last = time.monotonic() + deadline_s, time.monotonic()
    try:
        while time.monotonic() < end and not (want <= set(got) and time.monotonic() - last > idle_s):
            for m in consumer.consume(500, timeout=0.5):
                if m.error() is None:
                    c = decode_model(Charge, m.value())
                    got.setdefault((c.job_id, c.revision), []).append(c.model_dump(exclude=WHERE))
                    last = time.monotonic()
    finally:
        consumer.close()
    return got


def _wait_committed(settings: Settings, want: dict[tuple[str, int], int], deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while (now := committed_offsets(settings, list(want), accounting_group(settings))) != want:
        assert time.monotonic() < end, f"the fold committed {now}, not {want}"
        time.sleep(0.3)


def test_a_commit_landing_during_the_rebuild_does_not_move_where_the_new_owner_resumes(settings, monkeypatch):
    """A fold folds and commits part 1, then stops; part 2 is published with no fold running. A new
    fold is assigned the partitions and, while it rebuilds up to part 1's offsets, a commit of part
    2's end offsets lands in the group (sent through the new member's own consumer: the broker takes
    a member's commit for any partition, as it took the old owner's). Part 3 follows. Every charge
    must equal an uninterrupted fold's, and the fold must resume at part 1's end. (Today's code
    assigned without offsets, so librdkafka fetched the committed offsets again, now part 2's end:
    part 2 was never folded and its jobs were charged wrong or not at all.)"""
    create_topics(settings)
    events = simulate(SIM).events
    n = len(events)
    part1, part2, part3 = events[: n * 4 // 10], events[n * 4 // 10: n * 7 // 10], events[n * 7 // 10:]
    want = _reference(events, settings)
    rebuilt_to, pushed_to = _ends(settings, part1), _ends(settings, part1 + part2)
    assert sum(pushed_to.values()) > sum(rebuilt_to.values())

    with EventProducer(settings, client_id="sim") as producer:
        producer.send_all(part1)
    with _running(_Fold(settings)):
        _wait_committed(settings, rebuilt_to)
    with EventProducer(settings, client_id="sim") as producer:
        producer.send_all(part2)

    fold, landed = _Fold(settings), threading.Event()
    read_range = fold_consumer.read_range

    def rebuild_read(s: Settings, topic: str, partition: int, start: int, stop: int,
                     verifier: object = None) -> list[Message]:
        out = read_range(s, topic, partition, start, stop, verifier=verifier)
        if not landed.is_set():  # the first read of the new owner's rebuild: the stale commit lands now
            fold.group_consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in pushed_to.items()],
                                       asynchronous=False)
            landed.set()
        return out

    monkeypatch.setattr(fold_consumer, "read_range", rebuild_read)
    with _running(fold):
        deadline = time.monotonic() + 60
        while fold.rebuilds < settings.partitions and time.monotonic() < deadline:
            time.sleep(0.2)
        assert landed.is_set() and fold.rebuilds == settings.partitions
        with EventProducer(settings, client_id="sim") as producer:
            producer.send_all(part3)
        got = _charges(settings, set(want))
        _wait_committed(settings, _ends(settings, events))  # its own commits replaced the stale ones

    lost = sorted(set(want) - set(got))
    wrong = sorted(k for k in want if k in got and any(c != want[k] for c in got[k]))
    assert not lost and not wrong, f"{len(want)} charges expected: lost {lost[:5]}, wrong {wrong[:5]}"
    resumed = {k: o for k, o in fold.first.items() if pushed_to[k] > rebuilt_to[k]}
    assert resumed and resumed == {k: rebuilt_to[k] for k in resumed}  # where the rebuild stopped
