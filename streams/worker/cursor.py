"""Reading input back from the broker: what a stream worker needs to never miss a message.

faust (at least once) acknowledges, and so commits, messages that it drops from a stream's buffer
without delivering them: messages fetched under an older consumer generation, or while flow
control is paused around a rebalance (faust ``Stream._py_aiter``). Nothing delivers them again.
On the bundled broker this was measured after restarts: the first event after a worker's rebuild
was followed by one 22 to 40 offsets later, and those blocks were missing from the charges that a
five-SIGKILL run produced (README, Reliability).

A ``Cursor`` remembers, per (topic, partition), the next offset its agent expects. A message past
that offset means messages were skipped: the cursor reads them back from the broker, in order,
before the message itself. A message before it was handled already by this process (faust
redelivers after a rebalance) and is skipped. Skipped messages at the end of a partition are
found by ``tail``: the group's committed offset is past what the agent has handled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from nodeshare.runtime import logs, metrics
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    ESTIMATES_DEGRADATION,
    JOBS_LIFECYCLE,
    NODE_IPC,
    NODE_LLC,
    NODE_POWER,
    PLACEMENT_LOG,
    POWER_LOG,
)
from nodeshare.schemas.signing import Verifier, header_value

from ..core.accounting import Message, Origin
from ..core.placement.stream import ROUTED

log = logging.getLogger(__name__)


class LogHeadGone(RuntimeError):
    """Offsets a read needs were deleted from the head of the log (retention, or records deleted):
    what is left starts after them, and reading on would fold a truncated history."""

    def __init__(self, topic: str, partition: int, start: int, low: int) -> None:
        super().__init__(f"{topic}[{partition}] begins at offset {low} (its low watermark): offsets {start}..{low - 1} "
                         f"were deleted before they could be read again (retention?); rebuild from the archive with "
                         f"`nodeshare replay`, or keep the input topics' retention longer than the charge fold needs")
        self.topic, self.partition, self.start, self.low = topic, partition, start, low


def head_deleted(start: int, first_read: int, low_watermark: int | None) -> bool:
    """Whether a read from ``start`` whose first offset (or position, when nothing came) is ``first_read``
    lost its head: the log now begins past ``start``. A first offset past ``start`` alone is not
    enough (on Apache Kafka a transaction marker takes an offset without a message); the low
    watermark (None: not asked, because nothing was missing) decides."""
    return first_read > start and low_watermark is not None and low_watermark > start


def reader(settings: Settings, purpose: str, **extra: Any) -> Consumer:
    """A consumer that reads partitions it is assigned from their start (a group of its own per
    ``purpose``, never committing): the rebuild's, the snapshot readers', the progress check's."""
    return Consumer(settings.client_config(**{
        "group.id": f"{settings.app_id}-{purpose}", "enable.auto.commit": False, "auto.offset.reset": "earliest",
        **extra}))


def _readable(m: Any) -> bool:
    """Whether a consumed message holds a record; raises KafkaException on an error that ends the
    read (a missing or unauthorized topic, a fatal one); False on one librdkafka retries itself (or
    the end of a partition)."""
    err = m.error()
    if err is None:
        return True
    if err.fatal() or err.code() in _UNREADABLE:
        raise KafkaException(err)
    return False


def read_range(settings: Settings, topic: str, partition: int, start: int, stop: int,
               timeout_s: float = 60.0, verifier: Verifier | None = None) -> list[Message]:
    """Messages [start, stop) of one topic partition, in offset order. Waits on content and on the
    consumer's position, never on end offsets (wrong on the bundled broker); offsets without a
    message (transaction markers on Apache Kafka) are passed by the position. Raises LogHeadGone
    when the log no longer begins at or before ``start`` (the consumer would silently jump to what
    is left), RuntimeError if the range cannot be read in time. With ``verifier``, each message's
    origin names the identity that signed it, as the live consumer's does."""
    if stop <= start:
        return []
    consumer = reader(settings, "repair")
    tp = TopicPartition(topic, partition, start)
    consumer.assign([tp])
    out: list[Message] = []
    # only input topics carry signatures (a manager's own log is not in the catalog): others get no signer
    catalog = settings.input_topics().get(topic, "")
    verifier = verifier if catalog else None
    position = start
    deadline = time.monotonic() + timeout_s
    try:
        while position < stop and time.monotonic() < deadline:
            for m in consumer.consume(5000, timeout=0.5):
                offset = m.offset() or 0
                if m.error() is None and start <= offset < stop:
                    signer = None if verifier is None else verifier.signer(catalog, m.key(), m.value(),
                                                                           header_value(m.headers()))
                    out.append((Origin(topic, partition, offset, signer), m.key(), m.value(), m.timestamp()[1] / 1000))
                    position = max(position, offset + 1)
            [now] = consumer.position([TopicPartition(topic, partition)])
            position = max(position, now.offset)
        first = out[0][0].offset if out else position
        low = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[0] if first > start else None
    finally:
        consumer.close()
    if head_deleted(start, first, low):
        assert low is not None
        raise LogHeadGone(topic, partition, start, low)
    if position < stop:
        raise RuntimeError(f"could not re-read {topic}[{partition}] offsets {start}..{stop - 1} within "
                           f"{timeout_s:.0f} s; rebuild from the archive with `nodeshare replay`")
    return out


def committed_offsets(settings: Settings, positions: list[tuple[str, int]],
                      group: str | None = None) -> dict[tuple[str, int], int]:
    """A group's committed offset of each (topic, partition); 0 when none. The group is the stream
    worker's faust agents' (``app_id``) unless named."""
    if not positions:
        return {}
    consumer = Consumer(settings.client_config(**{"group.id": group or settings.app_id, "enable.auto.commit": False}))
    try:
        found = consumer.committed([TopicPartition(t, p) for t, p in positions], timeout=10)
        return {(tp.topic, tp.partition): max(0, tp.offset) for tp in found}
    finally:
        consumer.close()


Handler = Callable[[Message], Awaitable[None]]
T = TypeVar("T")


async def blocking(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking broker call in a thread. While the broker cannot answer (an outage), retry
    every second, logged: the agent cannot go on without the answer, and an exception would crash
    the whole worker (a faust agent or timer that raises stops the app)."""
    loop = asyncio.get_running_loop()
    attempt = 0
    while True:
        try:
            return await loop.run_in_executor(None, fn, *args)
        except (KafkaException, RuntimeError) as exc:
            attempt += 1
            log.warning("%s failed (attempt %d); retrying in 1 s: %s", what, attempt, exc)
            await asyncio.sleep(1.0)


class Cursor:
    """The next offset an agent expects per (topic, partition), and the repair of skipped messages.

    ``handle`` processes one message; the cursor calls it for messages read back from the broker
    and the agent calls it (through ``deliver``) for the message in hand, always under ``lock``,
    so a tail repair from a timer never interleaves with the agent.
    """

    def __init__(self, settings: Settings, name: str, handle: Handler) -> None:
        self.settings = settings
        self.name = name
        self.handle = handle
        self.lock = asyncio.Lock()
        self.next: dict[tuple[str, int], int] = {}
        self.before_rebalance: dict[tuple[str, int], int] = {}  # ``next`` as the last rebalance found it
        self.generation = -1  # the app's rebalance count when the agent last started or checked its partitions
        self.refetched = 0  # messages read back because faust skipped them
        self.verifier = settings.verifier()  # who signed each message (None: identities not checked)
        self._inputs = settings.input_topics()

    def signer(self, topic: str, key: bytes | None, value: bytes | None, headers: Any) -> str | None:
        """The identity whose valid signature a message of Kafka ``topic`` carries ("" none); None
        when the site checks no identities, or for a topic that is not an input (derived records
        and the managers' logs are the worker's own, never signed)."""
        catalog = self._inputs.get(topic)
        if self.verifier is None or catalog is None:
            return None
        return self.verifier.signer(catalog, key, value, header_value(headers))

    def start(self, topic: str, partition: int, offset: int) -> None:
        """Live consumption of (topic, partition) continues at ``offset``: what precedes it is handled."""
        self.next[(topic, partition)] = offset

    def forget(self) -> None:
        """After a rebalance: partitions may have moved; each is started again before its next event
        (``before_rebalance`` keeps where this process had got to)."""
        self.before_rebalance.update(self.next)
        self.next.clear()

    def knows(self, topic: str, partition: int) -> bool:
        return (topic, partition) in self.next

    async def deliver(self, message: Message) -> None:
        """Handle a message from the stream, after any messages skipped before it; drop it when this
        process handled it already. Call under ``lock``."""
        origin = message[0]
        where = (origin.topic, origin.partition)
        expected = self.next.get(where, origin.offset)
        if origin.offset < expected:
            return
        if origin.offset > expected:
            await self._refetch(origin.topic, origin.partition, expected, origin.offset)
        await self.handle(message)
        self.next[where] = origin.offset + 1

    async def tail(self) -> int:
        """Handle messages skipped at the end of a partition: those below the group's committed offset
        that the agent never saw. Returns how many were read back."""
        async with self.lock:
            loop = asyncio.get_running_loop()
            try:
                committed = await loop.run_in_executor(None, committed_offsets, self.settings, list(self.next))
            except KafkaException as exc:  # the broker is away: look again at the next interval
                log.warning("%s: could not read committed offsets: %s", self.name, exc)
                return 0
            before = self.refetched
            for (topic, partition), offset in committed.items():
                expected = self.next.get((topic, partition))
                if expected is not None and offset > expected:
                    await self._refetch(topic, partition, expected, offset)
                    self.next[(topic, partition)] = offset
            return self.refetched - before

    async def _refetch(self, topic: str, partition: int, start: int, stop: int) -> None:
        missed = await blocking(f"{self.name}: reading back {topic}[{partition}]", read_range, self.settings, topic,
                                partition, start, stop, 60.0, self.verifier if topic in self._inputs else None)
        log.warning("%s: read back %d messages of %s[%d] at offsets %d..%d that the stream skipped", self.name,
                    len(missed), topic, partition, start, stop - 1,
                    extra=logs.fields(topic=topic, partition=partition))
        for m in missed:
            await self.handle(m)
            self.next[(topic, partition)] = m[0].offset + 1
        self.refetched += len(missed)
        metrics.REFETCHED.labels(self.name).inc(len(missed))


def latest_snapshot(settings: Settings, topic: str, idle_s: float = 1.0, timeout_s: float = 60.0) -> bytes | None:
    """The snapshot with the highest log offset on a (compacted, single-partition) snapshot topic,
    or None when it has none. Reads until ``idle_s`` passes without a message (never end offsets,
    wrong on the bundled broker)."""
    from nodeshare.streams.core.snapshot import SnapshotError, header

    consumer = reader(settings, "snapshots")
    best: tuple[int, bytes] | None = None
    deadline = time.monotonic() + timeout_s
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        while time.monotonic() < deadline:
            got = [m for m in consumer.consume(100, timeout=idle_s) if m.error() is None and m.value()]
            if not got:
                break
            for m in got:
                value = m.value()
                assert value is not None
                try:
                    at = header(value)[0]
                except SnapshotError as exc:
                    log.warning("%s: a snapshot set aside: %s", topic, exc)
                    continue
                if best is None or at >= best[0]:
                    best = (at, value)
    finally:
        consumer.close()
    return None if best is None else best[1]


#: Consumer errors that end a read of a topic (the others, librdkafka retries)
_UNREADABLE = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION,
                         KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED})


def read_compacted(settings: Settings, topic: str, idle_s: float = 1.0,
                   timeout_s: float = 120.0) -> list[tuple[bytes | None, bytes | None]]:
    """Every (key, value) of a single-partition (compacted) topic in offset order, tombstones (None)
    included. Reads at least up to the high watermark seen at the start, then until ``idle_s`` passes
    without a message (the bundled broker's end offset can be one batch short: docs/broker.md), so a
    slow first fetch is waited for rather than taken for an empty topic. Raises KafkaException on a
    consumer error (a missing or unauthorized topic), RuntimeError when not done after ``timeout_s``."""
    consumer = reader(settings, "snapshots")
    out: list[tuple[bytes | None, bytes | None]] = []
    tp = TopicPartition(topic, 0)
    deadline = time.monotonic() + timeout_s
    try:
        low, high = consumer.get_watermark_offsets(tp, timeout=10)
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        quiet_since = time.monotonic()
        while True:
            for m in consumer.consume(1000, timeout=min(idle_s, 0.5)):
                if _readable(m):
                    out.append((m.key(), m.value()))
                    quiet_since = time.monotonic()
            [now] = consumer.position([tp])
            caught_up = high <= low or now.offset >= high
            if caught_up and time.monotonic() - quiet_since >= idle_s:
                return out
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic}: read {len(out)} messages in {timeout_s:.0f} s, not yet to offset {high}")
    finally:
        consumer.close()


def read_keyed(settings: Settings, topic: str, offset: int, key: bytes, accept: Callable[[bytes | None], bool],
               idle_s: float = 1.0, timeout_s: float = 60.0) -> bytes | None:
    """The value of the first message with ``key`` at or after ``offset`` on a (compacted,
    single-partition) topic that ``accept`` takes: the one there, or, where compaction removed it,
    one of the key's later ones. None once the read passed ``offset`` and reached the end the topic
    had when it began (asked twice: the bundled broker's can be one batch short) without one, or
    when the topic ends before ``offset`` (made again since) and nothing came for 5 x ``idle_s``:
    later messages (other workers keep writing) never hold it up. Raises KafkaException on a consumer
    error (a missing or unauthorized topic), RuntimeError when not done within ``timeout_s``."""
    consumer = reader(settings, "settled", **{"fetch.wait.max.ms": 100})
    tp = TopicPartition(topic, 0)
    deadline = time.monotonic() + timeout_s
    try:
        high = consumer.get_watermark_offsets(tp, timeout=10)[1]
        asked_again = False
        consumer.assign([TopicPartition(topic, 0, offset)])
        started = time.monotonic()
        while time.monotonic() < deadline:
            # one message at a time: consume(n) waits its whole timeout for n messages, so an account
            # settled near the topic's end (the usual: the latest) took 0.5 s to read (measured: 0.504 s
            # at 50 messages from the end, 2-3 ms elsewhere); poll returns with the first one there
            m = consumer.poll(min(idle_s, 0.5))
            if m is not None:
                if _readable(m) and (m.offset() or 0) >= offset and m.key() == key and accept(m.value()):
                    return m.value()
                continue  # the end is judged when nothing more comes (the bundled broker's can lag a batch)
            [now] = consumer.position([tp])
            past = now.offset > offset and now.offset >= high  # read the offset, and on to the end seen
            before = high <= offset and time.monotonic() - started >= 5 * idle_s  # nothing there, it seems
            if past or before:
                if asked_again:
                    return None
                high = max(high, consumer.get_watermark_offsets(tp, timeout=10)[1])
                asked_again = True
    finally:
        consumer.close()
    raise RuntimeError(f"{topic}: no message keyed {key!r:.80} read at or after offset {offset} within "
                       f"{timeout_s:.0f} s")


def accounting_group(settings: Settings) -> str:
    """The consumer group of the charge fold (apart from faust's, whose assignor differs)."""
    return f"{settings.app_id}-accounting"


def accounting_topics(settings: Settings) -> list[str]:
    return [settings.topic(NODE_IPC.name), settings.topic(JOBS_LIFECYCLE.name)]


def worker_groups(settings: Settings) -> dict[str, list[str]]:
    """Every topic the stream worker reads, by consumer group: the charge fold's inputs, and the
    faust agents' inputs and decision logs."""
    names = {t.name for t in (*ROUTED, NODE_POWER, CLUSTER_INVENTORY, NODE_LLC, ESTIMATES_DEGRADATION)}
    return {accounting_group(settings): accounting_topics(settings),
            settings.app_id: sorted(settings.topic(n) for n in (*names, POWER_LOG, PLACEMENT_LOG))}


def unconsumed(settings: Settings, groups: dict[str, list[str]], idle_s: float = 1.0) -> int:
    """How many messages of each group's topics lie after that group's committed offsets (read
    within ``idle_s``; 0 means the worker has handled, and committed, everything). Counts content,
    never end offsets, which are wrong on the bundled broker."""
    consumer = reader(settings, "progress")
    try:
        metadata = consumer.list_topics(timeout=10).topics
        left = 0
        for group, topics in groups.items():
            positions = [(t, p) for t in topics if t in metadata for p in metadata[t].partitions]
            committed = committed_offsets(settings, positions, group)
            consumer.assign([TopicPartition(t, p, committed[(t, p)]) for t, p in positions])
            left += sum(1 for m in consumer.consume(100_000, timeout=idle_s) if m.error() is None)
        return left
    finally:
        consumer.close()
