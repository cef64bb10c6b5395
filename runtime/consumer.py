"""The sinks' consumer loop: read a batch, write it durably, and only then commit offsets."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.runtime.logs import fields

log = logging.getLogger(__name__)

#: Commit errors that pass for a while: the group is rebalancing, its coordinator moved or restarted
#: (a restarted broker forgets the members), or the broker is away. The batch is durable; its
#: offsets are kept and committed with the next batch's or retried (``COMMIT_RETRY_S``). Any other
#: error (fatal, authorization, a topic gone, offsets refused) would recur: it ends the sink, as
#: do these once commits have failed for ``COMMIT_GIVE_UP_S``.
TRANSIENT_COMMIT_ERRORS = frozenset({
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError._ASSIGNMENT_LOST, KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION,
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._WAIT_COORD, KafkaError._ALL_BROKERS_DOWN,
})
COMMIT_RETRY_S = 5.0
COMMIT_GIVE_UP_S = 300.0


class BatchSink:
    """Subclasses implement ``write(messages)``, which must be durable when it returns.

    Offsets are committed after ``write`` returns, so a crash redelivers at most the batch
    being written; ``write`` must therefore be idempotent (the ledger keys on job and revision,
    the archive resumes after the offsets it already holds).
    """

    def __init__(self, settings: Settings, topics: Sequence[str], name: str, *,
                 max_batch: int = 10_000, max_delay_s: float = 0.5) -> None:
        self.settings = settings
        self.topics = [settings.topic(t) for t in topics]
        self.name = name
        self.group_id = f"{settings.app_id}-{name}-sink"
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.messages_written = 0
        self.batches_written = 0
        #: offsets of durable batches whose commit the broker refused, committed with the next
        #: commit or retried; forgotten when the partitions are assigned anew
        self.pending_offsets: dict[tuple[str, int], int] = {}
        self._failing_since: float | None = None
        self._retry_at = 0.0
        metrics.SINK_COMMITS_FAILED.labels(name, "none")  # the series exists before a first failure

    def write(self, messages: list[Message]) -> None:
        raise NotImplementedError

    def resume_offsets(self, partitions: list[TopicPartition]) -> None:
        """Hook: set ``p.offset`` on partitions to override the committed position."""

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget_pending()  # the new assignment starts from the group's committed offsets
        self.resume_offsets(partitions)
        consumer.assign(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The last moment this member's refused offsets may still be committed: one try, then
        they are the next owner's to read again."""
        if self.pending_offsets:
            with contextlib.suppress(KafkaException):
                self._commit(consumer, {})
        self._forget_pending()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget_pending()  # the group moved on: committing now would move another member's offsets

    def _forget_pending(self) -> None:
        self.pending_offsets, self._failing_since = {}, None

    def consumer(self) -> Consumer:
        # librdkafka's 500 ms fetch wait delayed a message by 94 ms at p50 on Tansu, 100 ms by 11 ms
        return Consumer(self.settings.group_consumer_config(self.group_id))

    def run(self, stop: threading.Event) -> None:
        consumer = self.consumer()
        consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        batch: list[Message] = []
        first_at = 0.0
        lag_at = time.monotonic()
        try:
            while not stop.is_set():
                for msg in self._next_messages(consumer, batch, first_at):
                    err = msg.error()
                    if err is None:
                        if not batch:
                            first_at = time.monotonic()
                        batch.append(msg)
                    elif err.code() != KafkaError._PARTITION_EOF:
                        if err.fatal() or err.code() == KafkaError._FATAL:
                            raise KafkaException(err)
                        log.warning("consumer error on %s: %s", self.topics, err,
                                    extra=fields(topic=",".join(self.topics)))
                if batch and (len(batch) >= self.max_batch or time.monotonic() - first_at >= self.max_delay_s):
                    self._flush(consumer, batch)
                    batch = []
                elif not batch and self.pending_offsets and time.monotonic() >= self._retry_at:
                    self._commit(consumer, {})  # a quiet partition's refused commit, retried
                if time.monotonic() - lag_at >= metrics.LAG_INTERVAL_S:
                    metrics.report_lag(consumer, self.name, {
                        (tp.topic, tp.partition): tp.offset for tp in consumer.position(consumer.assignment())
                        if tp.offset >= 0})
                    lag_at = time.monotonic()
            if batch:
                self._flush(consumer, batch)
            if self.pending_offsets:  # one last try: what stays pending is read again at the next start
                with contextlib.suppress(KafkaException):
                    self._commit(consumer, {})
        finally:
            consumer.close()

    def _next_messages(self, consumer: Consumer, batch: list[Message], first_at: float) -> list[Message]:
        """What has arrived; if nothing has, wait for the next message until the open batch is due
        (0.2 s when none is open: how often ``stop`` is looked at). ``consume(n, timeout)`` alone
        would wait its whole timeout for n messages, and hold a lone charge for it."""
        ready = consumer.consume(num_messages=self.max_batch - len(batch), timeout=0)
        if ready:
            return ready
        due = first_at + self.max_delay_s - time.monotonic() if batch else 0.2
        msg = consumer.poll(max(0.0, due))
        return [] if msg is None else [msg]

    def _flush(self, consumer: Consumer, batch: list[Message]) -> None:
        self.write(batch)
        self._commit(consumer, _next_offsets(batch))
        self.messages_written += len(batch)
        self.batches_written += 1
        metrics.SINK_ROWS.labels(self.name).inc(len(batch))

    def _commit(self, consumer: Consumer, offsets: dict[tuple[str, int], int]) -> None:
        """Commit these offsets and any a refused commit left (``TRANSIENT_COMMIT_ERRORS``)."""
        merged = dict(self.pending_offsets)
        for tp, offset in offsets.items():
            merged[tp] = max(offset, merged.get(tp, -1))
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in merged.items()], asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if err is None or err.code() not in TRANSIENT_COMMIT_ERRORS:
                raise
            now = time.monotonic()
            self._failing_since = self._failing_since or now
            if now - self._failing_since > COMMIT_GIVE_UP_S:
                raise KafkaException(KafkaError(err.code(), f"{self.name}: no commit accepted for "
                                                f"{now - self._failing_since:.0f} s; last: {err.str()}")) from exc
            self.pending_offsets, self._retry_at = merged, now + COMMIT_RETRY_S
            metrics.SINK_COMMITS_FAILED.labels(self.name, err.name()).inc()
            log.warning("%s: commit of a durable batch refused (%s): kept, committed with the next or retried in "
                        "%.0f s", self.name, err, COMMIT_RETRY_S, extra=fields(topic=",".join(self.topics)))
            return
        self.pending_offsets, self._failing_since = {}, None

def position(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed message (never None once consume() returned it)."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def _next_offsets(batch: list[Message]) -> dict[tuple[str, int], int]:
    """Per partition, the offset after the batch's last message of it (what a commit stores)."""
    last: dict[tuple[str, int], int] = {}
    for m in batch:
        topic, partition, offset = position(m)
        last[(topic, partition)] = max(last.get((topic, partition), -1), offset + 1)
    return last


def next_offsets(batch: list[Message]) -> list[TopicPartition]:
    """The commit of a whole batch, as confluent-kafka takes it."""
    return [TopicPartition(t, p, o) for (t, p), o in _next_offsets(batch).items()]


class SinkThread(threading.Thread):
    """Runs a sink until ``stop`` is set; an exception is kept in ``errors`` for the caller."""

    def __init__(self, sink: BatchSink, stop: threading.Event, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.sink = sink
        self.stop_event = stop
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            self.sink.run(self.stop_event)
        except BaseException as exc:
            self.errors.append(exc)
            log.exception("sink %s failed", self.name)


def run_in_thread(sink: BatchSink, stop: threading.Event, name: str) -> SinkThread:
    thread = SinkThread(sink, stop, name)
    thread.start()
    return thread

