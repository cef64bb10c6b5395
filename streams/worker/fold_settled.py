"""The charge fold's settled accounts on ``accounting.settled``: what bounds a worker's memory (issue
42, item 6).

After its charge, a job's account is needed only by a record of the job that comes later: a
corrected terminal event, a lost node's late blocks and marker, a copy of a marker, a later run
under the same id. Those are rare but may come at any time, so an account cannot just be dropped;
kept in memory, each costs about 12 kB for as long as the worker runs (docs/sizing.md). So:

* **When.** At a commit, once what was applied is durable, every account that is settled
  (``fold_snapshot.settled``: charged, no terminal event waiting for a node) and whose latest
  charge is ``fold_evict_after_s`` old (wall clock; 300 s) is sent, compressed, with a header of
  what it was folded under and a digest, to the compacted single-partition ``accounting.settled``,
  keyed ``<input partition>/<job id>@<node.ipc offset>.<jobs.lifecycle offset>`` (``settled_key``).
  The fold does not wait for the broker: the worker sends them with a producer of their own that
  no commit flushes (a flush in the fold doubled the p99 of job end to charge in ``bench
  stream``). At a later commit, once the broker acknowledged it and if no record of the job came
  meanwhile, the account leaves memory and the partition's index keeps where it is (109.6 bytes a
  job, ``bench sizing``). A job requeued under its id is settled between its runs, so while its
  next run goes it may leave and come back every ``fold_evict_after_s``: a read and a write each
  time, never a wrong charge.
* **Read back** when a record of the job arrives that passed every check needing no account
  (decode, signature, key, clock), live or while a rebuild folds: the message at the indexed
  offset, under a key that names the state (``settled_key``: the records of the job applied), so
  another member's copy of an earlier state (a zombie's) never replaces it under compaction. An
  equal key is an equal state; so is any later copy ``at_least`` as far, whose records applied
  since are then redeliveries: folding on from it gives the same account and charges. The
  account is in memory again, and leaves at a later commit.
* **Durable with the snapshots.** The index is part of each partition's snapshot (state version 2).
  A rebuild from a snapshot taken before an eviction holds the account itself; from one after, the
  index, and the records after the snapshot read the account back as the live fold did.
* **Failures.** A write the broker does not acknowledge, or refuses outright (an account larger
  than it takes), keeps the account in memory (logged; sent again ``fold_evict_after_s`` later);
  so does one whose job got a record while it was in flight. At most ``MAX_SENT`` are in flight:
  a backlog (after an upgrade or a rebuild) leaves over several commits. A read that fails
  ``READ_ATTEMPTS`` times, 2 and 4 s apart (the topic missing or unauthorized, the broker away)
  stops that partition only (``SettledUnreadable``): live, its state is dropped, nothing more of
  it is committed and it is paused; in a rebuild, it is refused. Either way
  ``nodeshare_fold_partitions_refused`` shows it, as for a log whose head is gone, and the other
  partitions fold on; a restart or a rebalance tries again. A settled account that cannot be
  used (damaged, another release's, no copy under its key at least as recent as the one indexed)
  is never replaced by an empty account: the record is dead-lettered with the reason (kind
  ``unsettled``), logged, and the account stays settled.
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
from ..core.fold_snapshot import SettledIndex
from .cursor import read_keyed

__all__ = ["AccountUnavailable", "Settled", "SettledUnreadable"]

log = logging.getLogger(__name__)

ACCOUNTS = Gauge("nodeshare_fold_accounts", "Job accounts of the charge fold's partitions, in memory or settled "
                 "(on accounting.settled, read back when a late record of the job comes)", ["where"])
MOVED = Counter("nodeshare_fold_settled_total", "Job accounts the charge fold moved out of memory (out) or read "
                "back for a late record (in)", ["direction"])

#: accounts sent and not yet acknowledged at most: a backlog leaves memory over several commits,
#: never as one burst the next output flush would wait on
MAX_SENT = 2000
#: reads of one settled account a record makes, ``READ_BACKOFF_S`` apart (doubling), before its
#: partition stops
READ_ATTEMPTS = 3
READ_BACKOFF_S = 2.0

#: reads a settled message: (settings, topic, offset, key, accept) -> the value of the first message
#: with the key at or after the offset that ``accept`` takes, None when the topic has none
Reader = Callable[[Settings, str, int, bytes, Callable[[bytes | None], bool]], "bytes | None"]


class SettledUnreadable(RuntimeError):
    """A settled account could not be read (the topic missing, unauthorized, or the broker away):
    the partition's fold cannot go on without it. The partition is refused (paused, as for a log
    whose head is gone), live or in a rebuild; the other partitions fold on."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


class _Sent:
    """An account sent to the topic, as it stood (its applied offsets), and the broker's answer."""

    __slots__ = ("account", "applied", "error", "offset")

    def __init__(self, account: JobAccount) -> None:
        self.account = account
        self.applied = dict(account.applied)
        self.offset: int | None = None
        self.error: str | None = None

    def report(self, err: Any, msg: Any) -> None:
        """librdkafka's delivery report (served by the producer's poll or flush, in the fold's thread)."""
        if err is None:
            self.offset = msg.offset()
        else:
            self.error = str(err)


class Settled:
    """The settled accounts of a ``FoldConsumer``'s partitions: their index, which charged accounts
    are due to leave memory, and the reads and writes of ``accounting.settled``."""

    def __init__(self, settings: Settings, read: Reader | None = None) -> None:
        self.settings = settings
        self.topic = settings.topic(FOLD_SETTLED)
        self.after_s = settings.fold_evict_after_s
        self.on = math.isfinite(self.after_s)  # False also when the topic does not exist (``topics create``)
        self.read_fn = read  # None: ``read_keyed`` (tests pass their broker's)
        self.index: dict[int, SettledIndex] = {}  # input partition -> key -> where its account is (``Mark``)
        #: accounts charged since they came into memory, oldest charge first: (partition, key) -> when
        self.due: dict[tuple[int, bytes | None], float] = {}
        #: accounts sent to the topic, not yet out of memory: (partition, key) -> what was sent
        self.sending: dict[tuple[int, bytes | None], _Sent] = {}
        self._parked: dict[int, SettledIndex] = {}

    # ------------------------------------------------------------------ what is in memory

    def charged(self, partition: int, key: bytes | None) -> None:
        """The job's account produced a charge: it may leave memory ``after_s`` from now."""
        if self.on:  # else nothing ever leaves: keep no list of what could
            self.due.pop((partition, key), None)
            self.due[(partition, key)] = time.monotonic()

    def rebuilt(self, partition: int, index: SettledIndex, accounts: dict[bytes | None, JobAccount]) -> None:
        """A partition was rebuilt with ``index`` (its snapshot's, less what the rebuild read back):
        its settled accounts in memory may leave at once."""
        self.index[partition] = index
        self._parked.pop(partition, None)
        if self.on:  # due at once: first in the list, which is oldest first
            ready = {(partition, key): 0.0 for key, account in accounts.items() if fold_snapshot.settled(account)}
            self.due = ready | {k: t for k, t in self.due.items() if k not in ready}

    def forget(self, partitions: set[int], park: bool) -> None:
        """Partitions revoked or lost: their index goes (kept with their parked state if ``park``)."""
        for p in partitions:
            index = self.index.pop(p, None)
            if park and index is not None:
                self._parked[p] = index
        self.due = {k: t for k, t in self.due.items() if k[0] not in partitions}
        self.sending = {k: t for k, t in self.sending.items() if k[0] not in partitions}

    def unpark(self, partition: int, accounts: dict[bytes | None, JobAccount]) -> None:
        """A parked partition came back as it was: its index too."""
        self.rebuilt(partition, self._parked.pop(partition, {}), accounts)

    def assigned(self) -> None:
        """An assignment is done: what was parked and not given back went to other members."""
        self._parked.clear()

    def count(self, states: dict[int, dict[bytes | None, JobAccount]]) -> None:
        ACCOUNTS.labels("memory").set(sum(len(jobs) for jobs in states.values()))
        ACCOUNTS.labels("settled").set(sum(len(index) for index in self.index.values()))

    # ------------------------------------------------------------------ out and back

    def evict(self, producer: Any, states: dict[int, dict[bytes | None, JobAccount]], owned: set[int],
              partitions: int | None, config: str) -> int:
        """Move settled accounts out of memory, in two steps that never wait for the broker: the
        accounts sent at an earlier call that the broker has acknowledged since (and that no record
        touched meanwhile) leave memory, their offsets into the index; then the accounts now due are
        sent, to leave at a later call. Call once what was applied is durable, with a producer of
        their own that the commits never flush (the worker's: a settled topic the broker cannot take
        must not hold up the charges); returns how many left memory."""
        if self.sending:
            producer.poll(0)  # delivery reports of what was sent before
        moved = self._finish(states, owned)
        if self.on and partitions is not None and self.due:
            self._send(producer, states, owned, partitions, config)
        if moved:
            MOVED.labels("out").inc(moved)
        self.count(states)
        return moved

    def _send(self, producer: Any, states: dict[int, dict[bytes | None, JobAccount]], owned: set[int],
              partitions: int, config: str) -> None:
        cutoff = time.monotonic() - self.after_s
        room = MAX_SENT - len(self.sending)  # a backlog (after an upgrade, a rebuild) goes over several commits
        while self.due and room > 0:  # oldest first: taken from the front, never the whole list copied
            (p, key), at = next(iter(self.due.items()))
            if at > cutoff:
                break  # the rest are younger
            room -= 1
            del self.due[(p, key)]
            account = states.get(p, {}).get(key)
            if p not in owned or account is None or not fold_snapshot.settled(account):
                continue  # gone, or waiting for a node again: a later charge makes it due again
            sent = _Sent(account)
            try:
                producer.send_raw(self.topic, fold_snapshot.settled_key(p, key, fold_snapshot.progress(account, p)),
                                  fold_snapshot.encode_settled(p, partitions, config, account), partition=0,
                                  on_delivery=sent.report)
            except KafkaException as exc:  # refused before sending (larger than the broker takes): it stays
                log.error("accounting: job %s's settled account not sent to %s (%s); it stays in memory", _job(key),
                          self.topic, exc)
                continue
            self.sending[(p, key)] = sent  # a copy still in flight is superseded: its report is ignored

    def _finish(self, states: dict[int, dict[bytes | None, JobAccount]], owned: set[int]) -> int:
        moved = 0
        failed: list[str] = []
        for (p, key), sent in list(self.sending.items()):
            if sent.offset is None and sent.error is None:
                continue  # not acknowledged yet
            del self.sending[(p, key)]
            jobs = states.get(p)
            if jobs is None or p not in owned or jobs.get(key) is not sent.account:
                continue  # the partition went, with its accounts
            if sent.error is None and sent.offset is not None and sent.account.applied == sent.applied:
                del jobs[key]
                self.index.setdefault(p, {})[key] = fold_snapshot.pack((sent.offset,
                                                                        *fold_snapshot.progress(sent.account, p)))
                moved += 1
                continue
            if sent.error is not None:
                failed.append(sent.error)
            # refused, or a record of the job came while it was in flight: it stays, due again if settled
            if fold_snapshot.settled(sent.account):
                self.charged(p, key)
        if failed:
            log.error("accounting: %d settled accounts not written to %s (%s); they stay in memory and are tried "
                      "again", len(failed), self.topic, failed[0])
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
        index, due to leave again as after a charge; None when ``key`` has none. Raises what
        ``read`` raises."""
        index = self.index.get(partition)
        if not index or key not in index:
            return None
        account = self.read(partition, key, index[key], partitions, config)
        del index[key]
        jobs[key] = account
        self.charged(partition, key)
        MOVED.labels("in").inc()
        log.info("accounting: read back job %s's settled account for a late record", _job(key))
        return account

    def read(self, partition: int, key: bytes | None, packed: int, partitions: int | None,
             config: str) -> JobAccount:
        """The account a settled job's mark (``packed``) names, changing nothing here. Raises
        AccountUnavailable when no copy under its key is usable, SettledUnreadable when the topic
        cannot be read in ``READ_ATTEMPTS``."""
        mark = fold_snapshot.unpack(packed)
        problems: list[str] = []
        found: list[JobAccount] = []

        def usable(value: bytes | None) -> bool:
            try:
                account = fold_snapshot.decode_settled(value, partition, partitions or 0, config, key)
            except fold_snapshot.SnapshotProblem as exc:
                problems.append(str(exc))
                return False
            if not fold_snapshot.at_least(account, partition, mark):
                problems.append(f"a copy of an earlier state (records applied up to "
                                f"{fold_snapshot.progress(account, partition)}, not {mark[1:]}), written by a "
                                "member that had lost the partition")
                return False
            found.append(account)
            return True

        read = self.read_fn or read_keyed
        skey = fold_snapshot.settled_key(partition, key, (mark[1], mark[2]))
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                value = read(self.settings, self.topic, mark[0], skey, usable)
                break
            except (KafkaException, RuntimeError) as exc:
                if attempt == READ_ATTEMPTS:
                    raise SettledUnreadable(self.topic, f"could not read job {_job(key)}'s settled account at "
                                                        f"{self.topic}@{mark[0]} ({exc})") from exc
                log.warning("accounting: could not read %s@%d (%s); trying again", self.topic, mark[0], exc)
                time.sleep(READ_BACKOFF_S * 2 ** (attempt - 1))
        if value is None:
            why = (f"job {_job(key)} was settled at {self.topic}@{mark[0]}, and no message under its key from there "
                   f"is usable: {problems[-1] if problems else 'there is none'}")
            log.error("accounting: %s; its record is a dead letter (unsettled), the account stays settled", why)
            raise AccountUnavailable(why)
        return found[-1]


def _job(key: bytes | None) -> str:
    """A job's key as text for a message (input keys are job ids; a bad one may be anything)."""
    return repr(None) if key is None else key[:80].decode("utf-8", "replace")
