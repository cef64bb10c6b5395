"""The sinks' consumer loop: read a batch, write it durably, and only then commit offsets."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from nodeshare import metrics
from nodeshare.config import Settings
from nodeshare.logs import fields

log = logging.getLogger(__name__)


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

    def write(self, messages: list[Message]) -> None:
        raise NotImplementedError

    def resume_offsets(self, partitions: list[TopicPartition]) -> None:
        """Hook: set ``p.offset`` on partitions to override the committed position."""

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.resume_offsets(partitions)
        consumer.assign(partitions)

    def consumer(self) -> Consumer:
        # librdkafka's 500 ms fetch wait delayed a message by 94 ms at p50 on Tansu, 100 ms by 11 ms
        return Consumer(self.settings.group_consumer_config(self.group_id))

    def run(self, stop: threading.Event) -> None:
        consumer = self.consumer()
        consumer.subscribe(self.topics, on_assign=self._on_assign)
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
                        if err.fatal():
                            raise KafkaException(err)
                        log.warning("consumer error on %s: %s", self.topics, err,
                                    extra=fields(topic=",".join(self.topics)))
                if batch and (len(batch) >= self.max_batch or time.monotonic() - first_at >= self.max_delay_s):
                    self._flush(consumer, batch)
                    batch = []
                if time.monotonic() - lag_at >= metrics.LAG_INTERVAL_S:
                    metrics.report_lag(consumer, self.name, {
                        (tp.topic, tp.partition): tp.offset for tp in consumer.position(consumer.assignment())
                        if tp.offset >= 0})
                    lag_at = time.monotonic()
            if batch:
                self._flush(consumer, batch)
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
        consumer.commit(offsets=_next_offsets(batch), asynchronous=False)
        self.messages_written += len(batch)
        self.batches_written += 1
        metrics.SINK_ROWS.labels(self.name).inc(len(batch))


def position(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed message (never None once consume() returned it)."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def _next_offsets(batch: list[Message]) -> list[TopicPartition]:
    last: dict[tuple[str, int], int] = {}
    for m in batch:
        topic, partition, offset = position(m)
        last[(topic, partition)] = max(last.get((topic, partition), -1), offset)
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


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

