"""The charge fold's settled accounts on ``accounting.settled``: what bounds a worker's memory (issue
42, item 6).

After its charge, a job's account is needed only by a record of the job that comes later: a
corrected terminal event, a lost node's late blocks and marker, a copy of a marker, a later run
under the same id. Those are rare but may come at any time, so an account cannot just be dropped;
kept in memory, each costs about 12 kB for as long as the worker runs (docs/sizing.md). So:

* **When.** At a commit, once what was applied is durable, every account that is settled
  (``fold_snapshot.settled``: charged, no terminal event waiting for a node) and whose latest
  charge is ``fold_evict_after_s`` old (wall clock; 300 s) moves out: compressed, with a header of
  what it was folded under and a digest, to the compacted single-partition ``accounting.settled``,
  keyed ``<input partition>/<job id>``. Once the broker acknowledged it, it leaves memory and the
  partition's index keeps its offset (about 100 bytes a job, ``bench settled``).
* **Read back** when a record of the job arrives, live or while a rebuild folds: the first message
  with its key at or after the indexed offset. That is the one indexed, or, where compaction
  removed it, the job's newer one. Either is a state the fold passed through, and the offsets an
  account holds make the records it applied redeliveries, so folding on from either gives the
  same account and the same charges. The account is in memory again, and leaves at a later commit.
* **Durable with the snapshots.** The index is part of each partition's snapshot (state version 2).
  A rebuild from a snapshot taken before an eviction holds the account itself; from one after, the
  index, and the records after the snapshot read the account back as the live fold did.
* **Failures.** A write the broker does not acknowledge keeps the accounts in memory (tried again
  at the next commit, logged). A read that fails (the topic missing or unauthorized, the broker away
  for ``READ_TIMEOUT_S``) stops the worker, whose supervisor restarts it: the record is folded again
  by the rebuild. A settled account that cannot be used (damaged, another release's, none under the
  key) is never replaced by an empty account: the record is dead-lettered with the reason (kind
  ``unsettled``) and the account stays where it is.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException
from prometheus_client import Counter, Gauge

from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import FOLD_SETTLED

from ..core import fold_snapshot
from ..core.accounting import AccountUnavailable, JobAccount

__all__ = ["AccountUnavailable", "Settled"]
from .cursor import read_keyed

log = logging.getLogger(__name__)

#: how long reading one settled account back may take before the worker stops
READ_TIMEOUT_S = 60.0

ACCOUNTS = Gauge("nodeshare_fold_accounts", "Job accounts of the charge fold's partitions, in memory or settled "
                 "(on accounting.settled, read back when a late record of the job comes)", ["where"])
MOVED = Counter("nodeshare_fold_settled_total", "Job accounts the charge fold moved out of memory (out) or read "
                "back for a late record (in)", ["direction"])

Index = dict[bytes | None, int]
#: reads a settled message: (settings, topic, offset, key) -> its value, None when the topic has none
Reader = Callable[[Settings, str, int, bytes], "bytes | None"]


class Settled:
    """The settled accounts of a ``FoldConsumer``'s partitions: their index, which charged accounts
    are due to leave memory, and the reads and writes of ``accounting.settled``."""

    def __init__(self, settings: Settings, read: Reader | None = None) -> None:
        self.settings = settings
        self.topic = settings.topic(FOLD_SETTLED)
        self.after_s = settings.fold_evict_after_s
        self.on = math.isfinite(self.after_s)  # False also when the topic does not exist (``topics create``)
        self.read_fn = read  # None: ``read_keyed`` (tests pass their broker's)
        self.index: dict[int, Index] = {}  # input partition -> key -> offset on the topic
        #: accounts charged since they came into memory, oldest charge first: (partition, key) -> when
        self.due: dict[tuple[int, bytes | None], float] = {}
        self._parked: dict[int, Index] = {}

    # ------------------------------------------------------------------ what is in memory

    def charged(self, partition: int, key: bytes | None) -> None:
        """The job's account produced a charge: it may leave memory ``after_s`` from now."""
        self.due.pop((partition, key), None)
        self.due[(partition, key)] = time.monotonic()

    def rebuilt(self, partition: int, index: Index, accounts: dict[bytes | None, JobAccount]) -> None:
        """A partition was rebuilt with ``index`` (its snapshot's, less what the rebuild read back):
        its settled accounts in memory may leave at once."""
        self.index[partition] = index
        self._parked.pop(partition, None)
        for key, account in accounts.items():
            if fold_snapshot.settled(account):
                self.due.setdefault((partition, key), 0.0)

    def forget(self, partitions: set[int], park: bool) -> None:
        """Partitions revoked or lost: their index goes (kept with their parked state if ``park``)."""
        for p in partitions:
            index = self.index.pop(p, None)
            if park and index is not None:
                self._parked[p] = index
        self.due = {k: t for k, t in self.due.items() if k[0] not in partitions}

    def unpark(self, partition: int, accounts: dict[bytes | None, JobAccount]) -> None:
        """A parked partition came back as it was: its index too."""
        self.rebuilt(partition, self._parked.pop(partition, {}), accounts)

    def count(self, states: dict[int, dict[bytes | None, JobAccount]]) -> None:
        ACCOUNTS.labels("memory").set(sum(len(jobs) for jobs in states.values()))
        ACCOUNTS.labels("settled").set(sum(len(index) for index in self.index.values()))

    # ------------------------------------------------------------------ out and back

    def evict(self, producer: Any, states: dict[int, dict[bytes | None, JobAccount]], owned: set[int],
              partitions: int | None, config: str, flush_timeout_s: float) -> int:
        """Move the settled accounts due out of memory (owned partitions only); returns how many moved.
        Call once what was applied is durable: an account leaves only after the broker acknowledged
        it, with its offset in the index."""
        if not self.on or partitions is None or not self.due:
            return 0
        cutoff = time.monotonic() - self.after_s
        going: list[tuple[int, bytes | None, JobAccount]] = []
        for (p, key), at in list(self.due.items()):
            if at > cutoff:
                break  # oldest first: the rest are younger
            del self.due[(p, key)]
            account = states.get(p, {}).get(key)
            if p in owned and account is not None and fold_snapshot.settled(account):
                going.append((p, key, account))
        if not going:
            return 0
        sent = {fold_snapshot.settled_key(p, key): (p, key) for p, key, _ in going}
        acked: dict[tuple[int, bytes | None], int] = {}
        failed: list[str] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is None:
                acked[sent[msg.key()]] = msg.offset()
            else:
                failed.append(str(err))

        for p, key, account in going:
            producer.send_raw(self.topic, fold_snapshot.settled_key(p, key),
                              fold_snapshot.encode_settled(p, partitions, config, account), partition=0,
                              on_delivery=delivered)
        try:
            producer.flush(flush_timeout_s)
        except Exception as exc:  # the outputs were durable before: only these failed; they stay in memory
            failed.append(str(exc))
        moved = 0
        for p, key, account in going:
            offset = acked.get((p, key))
            jobs = states.get(p)
            if offset is None or jobs is None or jobs.get(key) is not account:
                continue  # not acknowledged (kept in memory), or the partition went meanwhile
            del jobs[key]
            self.index.setdefault(p, {})[key] = offset
            moved += 1
        if failed:
            log.error("accounting: %d of %d settled accounts not written to %s (%s); they stay in memory and are "
                      "tried again", len(going) - moved, len(going), self.topic, failed[0])
            for p, key, account in going:
                if (p, key) not in acked and states.get(p, {}).get(key) is account:
                    self.due[(p, key)] = time.monotonic()
        MOVED.labels("out").inc(moved)
        self.count(states)
        return moved

    def check_topic(self, consumer: Any) -> None:
        """Moves nothing out of memory when the topic does not exist, and says so."""
        if not self.on:
            return
        with contextlib.suppress(KafkaException):  # else assumed there: a failed write keeps the accounts
            self.on = self.topic in consumer.list_topics(timeout=30).topics
        if not self.on:
            log.error("accounting: no topic %s: the charge fold keeps every charged job's account in memory (it grows "
                      "with every job); run `nodeshare topics create` and restart the worker", self.topic)

    def load(self, jobs: dict[bytes | None, JobAccount], partition: int, key: bytes | None, partitions: int | None,
             config: str) -> JobAccount | None:
        """The settled account of ``key``, back in ``jobs`` (its partition's accounts) and out of the
        index, due to leave again as after a charge; None when ``key`` has none. Raises
        AccountUnavailable when it has one that cannot be used, and what reading raises
        (KafkaException, RuntimeError) when the topic cannot be read."""
        index = self.index.get(partition)
        if not index or key not in index:
            return None
        offset = index[key]
        read = self.read_fn or read_keyed
        value = read(self.settings, self.topic, offset, fold_snapshot.settled_key(partition, key))
        if value is None:
            raise AccountUnavailable(f"job {_job(key)} was settled at {self.topic}@{offset}, which holds nothing "
                                     "under its key now (the topic was deleted or emptied)")
        try:
            account = fold_snapshot.decode_settled(value, partition, partitions or 0, config, key)
        except fold_snapshot.SnapshotProblem as exc:
            raise AccountUnavailable(f"job {_job(key)}'s settled account at {self.topic}@{offset}: {exc}") from None
        del index[key]
        jobs[key] = account
        self.charged(partition, key)
        MOVED.labels("in").inc()
        log.info("accounting: read back job %s's settled account (%s@%d) for a late record", _job(key), self.topic,
                 offset)
        return account



def _job(key: bytes | None) -> str:
    """A job's key as text for a message (input keys are job ids; a bad one may be anything)."""
    return repr(None) if key is None else key[:80].decode("utf-8", "replace")
