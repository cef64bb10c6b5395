"""The charge fold's snapshots on ``accounting.snapshots``: when each input partition is saved,
how a rebuild reads them, and how replaced ones are deleted (the format and the choice of a
snapshot are ``streams.core.fold_snapshot``'s; ``fold_consumer`` calls these at a commit and at an
assignment).

* **When.** A partition that folded ``fold_snapshot_every_records`` messages since its last
  snapshot (or its rebuild), or any ``fold_snapshot_every_s`` ago, is saved at the next commit,
  after what those messages produced is durable and before their offsets are committed; an idle
  worker saves on the time rule too.
* **Written to partition 0** of the single-partition topic (a topic auto-created with more
  partitions would otherwise scatter a snapshot's chunks).
* **Replaced ones deleted.** Once a partition's new snapshot is durable, every other chunk of that
  partition the topic held at the last read (older snapshots, ones a killed writer left incomplete,
  ones under another ``delta``) and the snapshot it replaced get tombstones, flushed at once (one
  that fails is logged and never fails the outputs' flush); chunks of another state version
  (another release's) are kept for it.
* **A failed write** (the topic refused, the broker away past the flush timeout) deletes the chunks
  it may have left, logs an error and waits ``RETRY_S`` before trying again; the gauge
  ``nodeshare_fold_snapshot_age_seconds`` (the age of the oldest folded message in no snapshot,
  over the owned partitions; a quiet partition does not age) shows it: alert long before the input
  topics' retention.
* **A read that fails** (the topic unreadable, or not caught up within its timeout) is tried
  ``READ_ATTEMPTS`` times, a back-off apart; then the assignment fails and the worker exits with
  the reason, so its supervisor starts it again (a rebuild without its snapshots would refuse every
  partition whose log retention has cut, and nothing would try again).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaException
from prometheus_client import Gauge

from nodeshare.producers.kafka_producer import DeliveryError
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import FOLD_SNAPSHOTS

from ..core import fold_snapshot
from ..core.accounting import JobAccount
from .cursor import read_compacted

log = logging.getLogger(__name__)

#: seconds before a failed snapshot write is tried again
RETRY_S = 60.0
#: reads of the snapshot topic an assignment tries, ``READ_BACKOFF_S`` doubling between them
READ_ATTEMPTS = 3
READ_BACKOFF_S = 2.0

SNAPSHOT_AGE = Gauge("nodeshare_fold_snapshot_age_seconds",
                     "Age of the oldest input message the charge fold holds in no snapshot, over its owned "
                     "partitions (0: every folded message is in one): alert well below the input topics' retention")


class SnapshotsUnreadable(RuntimeError):
    """The snapshot topic could not be read: the worker exits to be started again."""

Messages = list[tuple[bytes | None, bytes | None]]


class Snapshots:
    """What a ``FoldConsumer`` knows of its partitions' snapshots."""

    def __init__(self, settings: Settings, read: Any = None) -> None:
        self.settings = settings
        self.topic = settings.topic(FOLD_SNAPSHOTS)
        self.on = True  # False: the topic does not exist (``topics create`` not run since the upgrade)
        self.taken = 0
        self.read_fn = read  # None: ``read_compacted`` (tests pass their broker's)
        #: per partition: messages folded since its state was last saved or rebuilt, and the time of the first
        self.unsaved: dict[int, tuple[int, float]] = {}
        self.replaces: dict[int, set[bytes]] = {}  # per partition: chunk keys its next snapshot deletes
        self.retry_at = 0.0

    def note(self, partition: int) -> None:
        """One more message folded (every message: the clock is read only for a partition's first)."""
        entry = self.unsaved.get(partition)
        self.unsaved[partition] = (1, time.monotonic()) if entry is None else (entry[0] + 1, entry[1])

    def read(self) -> Messages:
        """Every message of the topic (nothing when it does not exist); raises SnapshotsUnreadable
        when ``READ_ATTEMPTS`` reads failed."""
        if not self.on:
            return []
        wait = READ_BACKOFF_S
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return (self.read_fn or read_compacted)(self.settings, self.topic)
            except (KafkaException, RuntimeError) as exc:
                if attempt == READ_ATTEMPTS:
                    raise SnapshotsUnreadable(f"could not read {self.topic} in {READ_ATTEMPTS} attempts ({exc}); "
                                              "the worker stops to be started again") from exc
                log.warning("accounting: could not read %s (%s); trying again in %.0f s", self.topic, exc, wait)
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def loaded(self, partition: int, messages: Messages, folded: int, oldest: float | None) -> None:
        """The partition was rebuilt (from a snapshot among ``messages`` or none) with ``folded``
        messages after it, the first of them broker-stamped ``oldest`` (epoch seconds): its next
        snapshot replaces what the topic holds of it."""
        now = time.monotonic()
        age = 0.0 if oldest is None or oldest <= 0 else max(0.0, time.time() - oldest)
        self.unsaved[partition] = (folded, now - age)
        self.replaces[partition] = set(fold_snapshot.replaceable(messages, partition))

    def forget(self, partitions: set[int], park: bool) -> None:
        if park:
            return  # a parked state comes back as it was, with what it replaces
        for p in partitions:
            self.unsaved.pop(p, None)
            self.replaces.pop(p, None)

    def age(self, owned: set[int]) -> float:
        """Seconds since the oldest folded message no snapshot holds was folded (or, folded by a
        rebuild, written), over ``owned`` partitions; 0 when every one is in a snapshot."""
        now = time.monotonic()
        return max((now - since for p, (n, since) in self.unsaved.items() if p in owned and n), default=0.0)

    def save(self, producer: Any, states: dict[int, dict[bytes | None, JobAccount]],
             positions: dict[tuple[str, int], int], owned: set[int], partitions: int | None, config: str,
             flush_timeout_s: float, settled: dict[int, fold_snapshot.SettledIndex] | None = None) -> None:
        """Snapshot each owned partition that is due; durable before this returns, what it replaces
        deleted after (the tombstones go with the next flush)."""
        every, every_s = self.settings.fold_snapshot_every_records, self.settings.fold_snapshot_every_s
        now = time.monotonic()
        due = [p for p, (n, since) in sorted(self.unsaved.items())
               if p in owned and p in states and n and (n >= every or now - since >= every_s)]
        SNAPSHOT_AGE.set(self.age(owned))
        if not due or partitions is None or not self.on or now < self.retry_at:
            return
        written: dict[int, list[bytes]] = {}
        for p in due:
            offsets = {t: o for (t, q), o in sorted(positions.items()) if q == p}
            chunks = fold_snapshot.encode_snapshot(p, partitions, offsets, config, states[p],
                                                   settled=(settled or {}).get(p))
            for key, value in chunks:
                producer.send_raw(self.topic, key, value, partition=0)
            written[p] = [k for k, _ in chunks]
        try:
            producer.flush(flush_timeout_s)  # the new snapshots are durable: what they replace may go
        except DeliveryError as exc:  # the outputs were durable before: only snapshots failed
            self.retry_at = time.monotonic() + RETRY_S
            log.error("accounting: snapshots of partitions %s not written (%s); trying again in %.0f s", due, exc,
                      RETRY_S)
            # whatever part of them landed is never used: delete it
            self._delete([key for keys in written.values() for key in keys], producer, flush_timeout_s)
            return
        replaced = []
        for p, keys in written.items():
            replaced += sorted(self.replaces.get(p, set()) - set(keys))
            self.replaces[p] = set(keys)
            del self.unsaved[p]
        self.taken += len(written)
        SNAPSHOT_AGE.set(self.age(owned))
        self._delete(replaced, producer, flush_timeout_s)

    def _delete(self, keys: list[bytes], producer: Any, flush_timeout_s: float) -> None:
        """Tombstones for ``keys``, flushed here: one that fails is logged (compaction keeps a chunk
        longer, which costs space, never a charge) and never fails a later flush of the outputs."""
        if not keys:
            return
        for key in keys:
            producer.send_raw(self.topic, key, None, partition=0)
        try:
            producer.flush(flush_timeout_s)
        except DeliveryError as exc:
            log.warning("accounting: %d snapshot chunks not deleted (%s); a later snapshot deletes them", len(keys),
                        exc)
