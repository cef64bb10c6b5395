"""The charge fold on confluent-kafka batches, inside the stream worker's process.

Longer than 500 lines because the consume loop, its commits and the rebalance callbacks share one
state (positions, owned and parked partitions, what is pending a commit) that a split would scatter.

faust hands every message to an agent through a task of its own; at the agents' 64-block batches
that hand-over, faust's event loop and its consumer thread took a third of a busy worker (py-spy,
`nodeshare bench stream`). The charge fold has no need of faust's machinery: it is one reducer per
input partition. So it reads ``node.ipc`` and ``jobs.lifecycle`` with ``consume(n)`` in a thread of
the worker (issue 24, item 6), with the same guarantees faust's agent had:

* **Co-partitioned.** One consumer group of its own (``<app_id>-accounting``: faust's group uses
  faust's assignor) with the range assignor, which gives a member partition p of both topics.
* **Rebuilt on assignment, resumed where the rebuild stopped** (issue 44). Before consuming a
  partition, its job states are folded from its newest complete snapshot (or offset 0) up to the
  group's committed offsets, read once, and the charges the folded records complete are sent again
  (the ledger's key absorbs copies). The partition is then assigned at those very offsets (or at
  the snapshot's, where it is ahead of the commit): a commit landing during the rebuild (a member
  that lost the partition) cannot move where consumption starts, and the next commit puts the
  group's offsets back where the state is. A log whose head was deleted (retention) before what
  the rebuild needs is never rebuilt from what is left: the partition is refused and kept paused,
  with an error logged and ``nodeshare_fold_partitions_refused`` above 0 (docs/reliability.md).
* **Snapshots bound the rebuild** (``streams.core.fold_snapshot``): at a commit, once the outputs
  are durable, a partition that folded enough writes its accounts and positions to the compacted
  ``accounting.snapshots``, so the input topics' retention only has to outlive a snapshot.
* **Settled accounts leave memory** (``streams.worker.fold_settled``): at a commit, once the outputs
  are durable, a charged account with nothing waiting goes to the compacted ``accounting.settled``
  ``fold_evict_after_s`` after its charge; a later record of the job reads it back.
* **Commits only what it owns.** A commit carries explicit offsets of assigned partitions only;
  what could not be committed on a revoke is dropped with the partitions (the next owner re-reads
  it), never committed later over the next owner's progress.
* **At least once, idempotent.** What a batch produced (charges, estimates, dead letters) is
  flushed to the broker before the batch's offsets are committed; a crash replays at most the
  uncommitted messages, which the reducer recognizes by offset. A consumed batch is applied whole
  before the next ``consume``, where rebalance callbacks run, so a revoked partition's state is
  never dropped with messages of it still in hand.
* **Running estimates coalesced.** ``estimates.degradation`` is compacted by job: only a job's
  latest estimate matters. A batch does not build one; every ``commit_interval_s`` the fold
  publishes the estimate of each job whose blocks changed since, as its account stands (final
  estimates, which come with charges, go at once). Placement sees every job at most that late, and
  a busy worker builds and routes one estimate per job per interval instead of one per batch.
* **Nothing skipped.** librdkafka delivers every offset of an assigned partition in order (faust
  could drop messages around a rebalance, which ``streams.worker.cursor`` repairs for its agents).
* **Co-partitioned, checked** (issue 44). A job's account is found by partition number, so the fold
  refuses to run when the two topics' partition counts differ (at start and at every assignment:
  librdkafka rebalances when a count changes), and a record whose key does not hash to the
  partition it was read from (murmur2, Kafka's default partitioner) goes to the dead-letter topic
  as ``misrouted``, with its bytes, instead of into an account that can never complete. A rebuild
  skips such records as the live fold did, so a restart charges exactly what the fold charged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage
from prometheus_client import Gauge

from nodeshare.producers.kafka_producer import DeliveryError, EventProducer
from nodeshare.runtime import logs, metrics
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import DLQ, ESTIMATES_DEGRADATION, LEDGER_CHARGES, NODE_IPC
from nodeshare.schemas.dead_letters import dead_letter
from nodeshare.schemas.serde import encode
from nodeshare.schemas.signing import header_value

from ..core import fold_snapshot
from ..core.accounting import (
    SOURCE,
    JobAccount,
    Message,
    Origin,
    Outgoing,
    apply_message,
    as_read_live,
    fold_states,
)
from .copartition import NotCoPartitioned, input_partitions, routing_problem
from .cursor import LogHeadGone, accounting_group, accounting_topics, read_range
from .fold_settled import AccountUnavailable, Settled, SettledUnreadable
from .fold_snapshots import Snapshots

log = logging.getLogger(__name__)

#: Messages one ``consume`` call may return: at 64 blocks a message, about 0.1 s of the fold.
MAX_MESSAGES = 500
#: How often what was applied is made durable (producer flushed) and its offsets committed. Also
#: how stale the group's committed offsets may be (the demo's progress check reads them).
COMMIT_INTERVAL_S = 0.5
#: How long making outputs durable may wait for the broker before the fold gives up (and the worker
#: exits to be restarted): librdkafka's own delivery timeout (message.timeout.ms, 300 s), so a
#: broker that is away for less than that stalls the fold instead of ending it. At 30 s, a commit
#: that fell at the start of a 30 s outage could end the worker (the likely cause of one failure of the
#: broker-stop fault test on a loaded machine; its log was not kept).
FLUSH_TIMEOUT_S = 300.0


#: Input partitions (numbers) a worker's charge fold refuses: their log's head was deleted before a
#: rebuild could read it. Above 0 means charges of those partitions wait for an operator.
REFUSED = Gauge("nodeshare_fold_partitions_refused",
                "Input partitions the charge fold holds paused: their log's head was deleted before the rebuild")


def resume_offsets(committed: list[TopicPartition]) -> dict[tuple[str, int], int]:
    """Where each partition's rebuild stops and its consumption starts: the committed offset, 0 when
    none. Read once per assignment: the same offsets bound the rebuild and start the consumer."""
    return {(tp.topic, tp.partition): max(0, tp.offset) for tp in committed}


def owned_offsets(pending: Mapping[tuple[str, int], int], owned: set[tuple[str, int]]) -> list[TopicPartition]:
    """The offsets to commit: those of partitions assigned to this member now. Another member owns
    the rest (or will), and a commit of ours would move its offsets."""
    return [TopicPartition(t, p, o) for (t, p), o in sorted(pending.items()) if (t, p) in owned]


#: Dead-letter kind (the ``nodeshare_dead_letters_total`` label) of a record on a partition its key
#: does not hash to.
MISROUTED = "misrouted"
#: Dead-letter kind of a record whose job's settled account cannot be read back usable
UNSETTLED = "unsettled"


def _job_id(key: bytes | None) -> str | None:
    """A message key as a log field: input keys are job ids, but a bad message's key may be anything."""
    return None if key is None else key[:64].decode("utf-8", "replace")


#: Commit errors that mean the group moved on without this member (it rejoins and is rebuilt).
_GROUP_MOVED_ON = frozenset({KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION,
                             KafkaError.REBALANCE_IN_PROGRESS})


class FoldConsumer:
    """Folds the worker's input partitions into job accounts and publishes what the fold produces.

    ``run(stop)`` consumes until ``stop`` is set; it raises on a fatal consumer error or an
    undelivered output (the process must then exit: its supervisor restarts it, and the
    uncommitted messages are read again).
    """

    def __init__(self, settings: Settings, *, max_messages: int = MAX_MESSAGES,
                 commit_interval_s: float = COMMIT_INTERVAL_S) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.prefix = settings.topic_prefix
        self.max_messages = max_messages
        self.commit_interval_s = commit_interval_s
        self.states: dict[int, dict[bytes | None, JobAccount]] = {}
        self.producer = EventProducer(settings, client_id="nodeshare-accounting")
        #: checks who signed each input record (None: the site checks no identities)
        self.verifier = settings.verifier()
        self._inputs = settings.input_topics()  # Kafka topic -> catalog name, for the signature
        self._pending: dict[tuple[str, int], int] = {}  # next offset to commit per (topic, partition)
        self._position: dict[tuple[str, int], int] = {}  # next offset to apply per (topic, partition)
        #: States of revoked partitions, with where they stopped: an eager rebalance revokes every
        #: partition, and one that comes back with the group's offsets still there needs no rebuild.
        self._parked: dict[int, tuple[dict[bytes | None, JobAccount], dict[str, int]]] = {}
        #: Partitions assigned to this member and folded: the only ones it commits.
        self._owned: set[tuple[str, int]] = set()
        #: Partition numbers assigned but refused (their log's head is gone, a settled account unreadable):
        #: paused, never committed.
        self.refused: set[int] = set()
        self._to_pause: set[int] = set()  # refused by ``take``: the loop pauses them
        #: where settled accounts go (one of its own, never flushed by a commit: see ``evict``); None
        #: until ``run`` (tests drive ``take`` and ``commit`` with their own producer, used for both)
        self.settled_producer: EventProducer | None = None
        self.rebuilds = 0
        self.snapshots = Snapshots(settings)  # of the partitions' accounts (streams.worker.fold_snapshots)
        self.snapshot_config = fold_snapshot.config_of(self.policy)
        self.settled = Settled(settings)  # charged accounts out of memory (streams.worker.fold_settled)
        #: Jobs whose blocks changed since their last published estimate, by partition and key.
        self._changed: dict[tuple[int, bytes | None], JobAccount] = {}
        #: Partition count of each input topic, from the broker's metadata at start and at each assignment.
        self._partitions: dict[str, int] = {}
        #: Jobs whose charge waits for a node's stream, with their end time (``JobAccount.awaiting``),
        #: kept as accounts change; read by the metrics thread, hence the lock.
        self._awaiting: dict[tuple[int, bytes | None], datetime] = {}
        self._awaiting_lock = threading.Lock()
        metrics.JOBS_AWAITING_NODES.set_function(lambda: self.awaiting()[0])
        metrics.JOBS_AWAITING_OLDEST.set_function(self.oldest_awaiting_s)

    # ------------------------------------------------------------------ the loop

    def consumer(self) -> Consumer:
        return Consumer(self.settings.group_consumer_config(
            accounting_group(self.settings),
            **{"partition.assignment.strategy": "range"}))  # partition p of both topics to one member

    def run(self, stop: threading.Event) -> None:
        consumer = self.consumer()
        try:
            self._partitions = input_partitions(self.settings, consumer)  # refuse before joining the group
        except NotCoPartitioned:
            consumer.close()
            raise
        except KafkaException as exc:  # no metadata yet: checked at the first assignment instead
            log.warning("accounting: could not read the input topics' partition counts: %s", exc)
        with contextlib.suppress(KafkaException):  # else assumed there; a failed snapshot is tried again later
            self.snapshots.on = self.snapshots.topic in consumer.list_topics(timeout=30).topics
        if not self.snapshots.on:
            log.error("accounting: no topic %s: the charge fold takes no snapshots and rebuilds every partition "
                      "from offset 0 (node.ipc and jobs.lifecycle must then keep everything); run `nodeshare topics "
                      "create` and restart the worker", self.snapshots.topic)
        self.settled.check_topic(consumer)
        if self.settled.on:
            self.settled_producer = EventProducer(self.settings, client_id="nodeshare-accounting-settled")
        consumer.subscribe(accounting_topics(self.settings), on_assign=self._on_assign,
                           on_revoke=self._on_revoke, on_lost=self._on_lost)
        committed_at = lag_at = time.monotonic()
        try:
            while not stop.is_set():
                self.take(consumer.consume(self.max_messages, timeout=0.2))
                if self._to_pause:
                    consumer.pause([TopicPartition(t, p) for t in accounting_topics(self.settings)
                                    for p in sorted(self._to_pause)])
                    self._to_pause.clear()
                if time.monotonic() - committed_at >= self.commit_interval_s:
                    if self._pending:
                        self.commit_or_rejoin(consumer)
                    else:
                        self.idle()
                    committed_at = time.monotonic()
                if time.monotonic() - lag_at >= metrics.LAG_INTERVAL_S:
                    metrics.report_lag(consumer, "accounting", {k: p for k, p in self._position.items()
                                                                if k in self._owned})
                    lag_at = time.monotonic()
            self.commit(consumer)
            self.producer.flush(FLUSH_TIMEOUT_S)  # the tombstones of replaced snapshots too
        finally:
            consumer.close()  # leaves the group: the other members take the partitions at once
            if self.settled_producer is not None:  # accounts in flight stay in memory's place: nothing to lose
                with contextlib.suppress(KafkaException, DeliveryError):
                    self.settled_producer.flush(5.0)

    def take(self, batch: list[KafkaMessage]) -> None:
        """Apply a consumed batch whole, in order, each message's offset then pending a commit (the
        loop's body, apart so that tests drive it without a broker). Raises on a fatal consumer error."""
        for msg in batch:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise KafkaException(err)
                log.warning("accounting: consumer error: %s", err)
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            assert topic is not None and partition is not None and offset is not None
            if partition in self.refused:
                continue  # refused while this batch was in hand: its messages wait, uncommitted
            try:
                self.apply((Origin(topic, partition, offset, self.signer(topic, msg)), msg.key(), msg.value(),
                            msg.timestamp()[1] / 1000))
            except SettledUnreadable as exc:
                self.refuse(partition, exc)
                continue
            self._pending[(topic, partition)] = self._position[(topic, partition)] = offset + 1
            self.snapshots.note(partition)

    def refuse(self, partition: int, exc: SettledUnreadable) -> None:
        """A record of ``partition`` needs a settled account that cannot be read: that partition stops
        (its state dropped, nothing of it committed, paused by the loop), the others fold on. Each
        later owner meets the record the same way, until the account can be read and a restart or a
        rebalance assigns the partition again."""
        self._forget([TopicPartition(t, partition) for t in accounting_topics(self.settings)])
        self.refused.add(partition)
        self._to_pause.add(partition)
        REFUSED.set(len(self.refused))
        log.error("accounting: refusing partition %d: %s. It stays paused (nothing more folded or committed) until "
                  "the account can be read and the worker restarts", partition, exc,
                  extra=logs.fields(partition=partition, topic=exc.topic))

    def signer(self, topic: str, msg: KafkaMessage) -> str | None:
        """The identity whose valid signature ``msg`` carries ("" none), None when none is checked."""
        if self.verifier is None:
            return None
        return self.verifier.signer(self._inputs[topic], msg.key(), msg.value(), header_value(msg.headers()))

    def apply(self, message: Message) -> None:
        """One input message through the reducer; what it produced goes to the producer's queue."""
        origin, key, value, ts = message
        started = time.perf_counter()
        misrouted = self.misrouted(origin, key)
        if misrouted is not None:  # its job's account is on another partition: folding it here would lose it
            account, out, blocks = None, _letter(message, misrouted, MISROUTED), None
        else:
            jobs = self.states.setdefault(origin.partition, {})
            try:  # a job not in memory: its settled account, if it has one, back in memory
                account, out, blocks = apply_message(
                    jobs.get(key), origin, key, value, ts, self.policy, self.prefix, running_estimates=False,
                    load=lambda k: self.settled.load(jobs, origin.partition, k, self._input_count(),
                                                     self.snapshot_config))
            except AccountUnavailable as exc:  # never folded into a new account: charged from nothing
                account, out, blocks = None, _letter(message, str(exc), UNSETTLED), None
        if account is not None:
            jobs[key] = account
            if any(o.topic == LEDGER_CHARGES.name for o in out):
                self.settled.charged(origin.partition, key)
            self._note_awaiting(origin.partition, key, account)
            if any(o.topic == ESTIMATES_DEGRADATION.name for o in out):  # a fresher one goes now
                self._changed.pop((origin.partition, key), None)
            elif blocks is not None and blocks.accepted + blocks.rejected:
                self._changed[(origin.partition, key)] = account
        metrics.EVENTS_IN.labels(origin.topic).inc()
        if blocks is not None:
            metrics.SHUTTER_BLOCKS.labels("accepted").inc(blocks.accepted)
            metrics.SHUTTER_BLOCKS.labels("rejected").inc(blocks.rejected)
            metrics.SHUTTER_BLOCKS.labels("refused").inc(blocks.refused)
        self._publish(out, origin, key)
        metrics.PROCESSING_SECONDS.observe(time.perf_counter() - started)

    def _input_count(self) -> int | None:
        """The input topics' partition count (None before the broker's metadata was read)."""
        return self._partitions.get(self.settings.topic(NODE_IPC.name))

    def _note_awaiting(self, partition: int, key: bytes | None, account: JobAccount) -> None:
        end = account.awaiting()
        with self._awaiting_lock:
            if end is None or end.end_time is None:
                self._awaiting.pop((partition, key), None)
            else:
                self._awaiting[(partition, key)] = end.end_time

    def awaiting(self, now: datetime | None = None) -> tuple[int, float]:
        """Jobs whose charge waits for a node's stream, and seconds since the oldest of them ended (0:
        none). Wall clock against event time: a metric for operators, never an input of a charge."""
        with self._awaiting_lock:
            if not self._awaiting:
                return 0, 0.0
            oldest = min(self._awaiting.values())
            count = len(self._awaiting)
        return count, max(0.0, ((now or datetime.now(UTC)) - oldest).total_seconds())

    def oldest_awaiting_s(self) -> float:
        """Seconds since the end of the job that has waited longest for a node's stream (0: none waits)."""
        return self.awaiting()[1]

    def misrouted(self, origin: Origin, key: bytes | None) -> str | None:
        """Why this input record is not on the partition its key hashes to, or None (also when the
        topic's partition count is not known: no metadata read yet)."""
        partitions = self._partitions.get(origin.topic)
        return None if partitions is None else routing_problem(key, origin.partition, partitions)

    def _publish(self, out: list[Outgoing], origin: Origin, key: bytes | None) -> None:
        for o in out:
            topic = self.settings.topic(o.topic)
            self.producer.send_raw(topic, o.key, o.value)
            metrics.EVENTS_OUT.labels(topic).inc()
            if o.kind:
                metrics.DEAD_LETTERS.labels(o.kind).inc()
                log.warning("dead letter (%s) for %s[%d]@%d; `nodeshare dlq show` has the reason", o.kind,
                            origin.topic, origin.partition, origin.offset, extra=logs.fields(
                                kind=o.kind, topic=origin.topic, partition=origin.partition, job_id=_job_id(key)))
            elif o.topic == LEDGER_CHARGES.name:
                metrics.CHARGES_EMITTED.inc()
                log.info("charge published", extra=logs.fields(job_id=_job_id(key), topic=origin.topic,
                                                               partition=origin.partition))

    def publish_estimates(self) -> None:
        """The latest estimate of each job whose blocks changed since its last one."""
        topic = self.settings.topic(ESTIMATES_DEGRADATION.name)
        for (_, key), account in self._changed.items():
            self.producer.send_raw(topic, key, encode(account.running_estimate(self.policy)))
            metrics.EVENTS_OUT.labels(topic).inc()
        self._changed.clear()

    def commit(self, consumer: Consumer) -> None:
        """Make what was applied durable, then commit its offsets (never the other way round)."""
        self.publish_estimates()
        if not self._pending:
            return
        self.producer.flush(FLUSH_TIMEOUT_S)  # raises DeliveryError if the broker did not take every output
        self.evict()
        self.save_snapshots()
        offsets = owned_offsets(self._pending, self._owned)
        if len(offsets) < len(self._pending):  # forgotten with their partitions: never reached here
            log.warning("accounting: not committing offsets of partitions not assigned here: %s",
                        {k: o for k, o in self._pending.items() if k not in self._owned})
        if offsets:
            consumer.commit(offsets=offsets, asynchronous=False)
        self._pending.clear()

    def idle(self) -> None:
        """Nothing to commit: settled accounts may still leave memory (those sent before, now
        acknowledged) or be due to, and a partition may be due a snapshot by the time rule."""
        self.evict()
        self.save_snapshots()

    def evict(self) -> None:
        """Move the settled accounts due out of memory (``streams.worker.fold_settled``), once what was
        applied is durable."""
        self.settled.evict(self.settled_producer or self.producer, self.states, {p for _, p in self._owned},
                           self._input_count(), self.snapshot_config)

    def save_snapshots(self) -> None:
        """Snapshot the owned partitions that are due (``streams.worker.fold_snapshots``), once what
        their messages produced is durable."""
        self.snapshots.save(self.producer, self.states, self._position, {p for _, p in self._owned},
                            self._input_count(), self.snapshot_config, FLUSH_TIMEOUT_S, self.settled.index)

    def commit_or_rejoin(self, consumer: Consumer) -> None:
        """``commit``; when the group no longer knows this member (a broker restarted with the group's
        state lost, a session timed out), drop the uncommitted offsets instead of stopping: the
        consumer rejoins, its partitions are assigned again and rebuilt from the group's committed
        offsets (``_on_assign``), so nothing applied but uncommitted is lost or counted twice. Any
        other failure still stops the fold."""
        try:
            self.commit(consumer)
        except KafkaException as exc:
            if exc.args[0].code() not in _GROUP_MOVED_ON:
                raise
            log.warning("accounting: commit refused (%s): the group moved on; dropping the uncommitted offsets %s "
                        "(the partitions are rebuilt from the committed ones when assigned again)", exc, self._pending)
            self._pending.clear()

    # ------------------------------------------------------------------ rebalances

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebuild each assigned partition's job states from the input topics up to the group's
        committed offsets, re-send the charges they complete, and assign the partitions at those
        same offsets (read once: a commit landing meanwhile changes nothing). A partition whose log
        lost its head is refused: paused, and reported."""
        log.info("accounting: assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))
        self._partitions = input_partitions(self.settings, consumer)  # a count may have changed (so a rebalance)
        stops = resume_offsets(consumer.committed(partitions, timeout=30))
        parked, self._parked = self._parked, {}
        snapshots: list[tuple[bytes | None, bytes | None]] | None = None  # read once, if a partition needs them
        for partition in sorted({p for _, p in stops}):
            mine = {t: s for (t, p), s in stops.items() if p == partition}
            if partition in parked and parked[partition][1] == mine:  # nobody consumed it meanwhile
                self.states[partition] = parked[partition][0]
                self.settled.unpark(partition, self.states[partition])
                for key, account in self.states[partition].items():
                    self._note_awaiting(partition, key, account)
            else:
                if snapshots is None:
                    snapshots = self.snapshots.read()
                try:
                    mine = self._rebuild(partition, mine, snapshots)
                    stops.update({(t, partition): o for t, o in mine.items()})
                except (LogHeadGone, SettledUnreadable) as exc:
                    self.refused.add(partition)
                    self.settled.index.pop(partition, None)
                    log.error("accounting: refusing partition %d: %s. It stays paused (nothing folded, nothing "
                              "committed) until the worker restarts with the history available",
                              partition, exc, extra=logs.fields(partition=partition, topic=exc.topic))
                    continue
            self._position.update({(t, partition): s for t, s in mine.items()})
            self._pending.update({(t, partition): s for t, s in mine.items()})  # undoes a stale commit of another
        self.settled.assigned()
        self.producer.flush(FLUSH_TIMEOUT_S)
        start = [TopicPartition(t, p, o) for (t, p), o in sorted(stops.items())]
        consumer.assign(start)  # at the offsets the rebuild stopped at, not at what is committed by now
        self._owned = {k for k in stops if k[1] not in self.refused}
        if self.refused & {p for _, p in stops}:
            consumer.pause([tp for tp in start if tp.partition in self.refused])
        REFUSED.set(len(self.refused))

    def _rebuild(self, partition: int, stops: dict[str, int],
                 snapshots: list[tuple[bytes | None, bytes | None]]) -> dict[str, int]:
        """The job states of ``partition``: its newest complete snapshot among ``snapshots`` (or
        nothing), with the records after it folded up to ``stops`` (per topic); the charges those
        records complete go to the producer. Returns where consumption resumes (``stops``, or the
        snapshot's offset where it is ahead). Raises LogHeadGone when a topic's log no longer starts
        where the rebuild must read from (a truncated history would charge less than the fold did)."""
        partitions = self._partitions.get(self.settings.topic(NODE_IPC.name), 0)
        snap, problems = fold_snapshot.best(snapshots, partition, partitions, self.snapshot_config)
        for problem in problems:
            log.warning("accounting: partition %d: %s", partition, problem, extra=logs.fields(partition=partition))
        start, resume = fold_snapshot.resume(snap, stops)
        messages: list[Message] = []
        for topic, stop in sorted(stops.items()):  # what the live fold dead-lettered as misrouted it skips here too
            messages += [m for m in read_range(self.settings, topic, partition, start[topic], stop,
                                               verifier=self.verifier)
                         if self.misrouted(m[0], m[1]) is None]
        messages = as_read_live(messages)  # the topics interleaved as the live fold most likely read them
        self.settled.index[partition] = dict(snap.settled) if snap else {}
        rebuilt = snap.accounts if snap else {}
        rebuilt, charges = fold_states(messages, self.policy, self.prefix, rebuilt, load=lambda key: self.settled.load(
            rebuilt, partition, key, partitions, self.snapshot_config))
        self.states[partition] = rebuilt
        self.settled.rebuilt(partition, self.settled.index[partition], rebuilt)
        oldest = min((m[3] for m in messages if m[3] > 0), default=None)  # broker time of the first record folded
        self.snapshots.loaded(partition, snapshots, len(messages), oldest)
        for key, account in rebuilt.items():
            self._note_awaiting(partition, key, account)
        self.rebuilds += 1
        log.warning("accounting: rebuilt %d job states of partition %d from %s and %d input messages (%s); "
                    "re-sending %d charges", len(rebuilt), partition,
                    f"snapshot {snap.snapshot_id}" if snap else "nothing", len(messages),
                    ", ".join(f"{t} {start[t]}..{resume[t]}" for t in sorted(stops)), len(charges),
                    extra=logs.fields(partition=partition))
        for o in charges:
            self.producer.send_raw(self.settings.topic(o.topic), o.key, o.value)
        return resume

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Everything consumed was applied (callbacks run inside ``consume``): make it durable and
        commit it, so the next owner resumes exactly after it; then forget the partitions."""
        try:
            self.commit(consumer)
        except KafkaException as exc:  # the group moved on: the next owner re-reads what was not committed
            log.warning("accounting: could not commit on revoke: %s; dropping the uncommitted offsets %s with "
                        "the partitions (never committed later: the next owner resumes from the group's)",
                        exc, self._pending)
            self._forget(partitions)
            return
        self._forget(partitions, park=True)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions lost without a revoke (session timed out): another member owns them already."""
        self.producer.flush(FLUSH_TIMEOUT_S)
        self._forget(partitions)

    def _forget(self, partitions: list[TopicPartition], park: bool = False) -> None:
        """Drop what this member held of the partitions: states (parked if ``park``), positions, and
        offsets not committed, which are no longer its to commit."""
        gone = {tp.partition for tp in partitions}
        self._pending = {k: o for k, o in self._pending.items() if k[1] not in gone}
        self._owned = {k for k in self._owned if k[1] not in gone}
        self.refused -= gone
        REFUSED.set(len(self.refused))
        self._changed = {k: a for k, a in self._changed.items() if k[0] not in gone}
        self.snapshots.forget(gone, park)
        self.settled.forget(gone, park)
        with self._awaiting_lock:
            self._awaiting = {k: t for k, t in self._awaiting.items() if k[0] not in gone}
        for p in gone:
            state = self.states.pop(p, None)
            here = {t: o for (t, q), o in self._position.items() if q == p}
            if park and state is not None:
                self._parked[p] = (state, here)
            for t in here:
                del self._position[(t, p)]


def _letter(message: Message, reason: str, kind: str) -> list[Outgoing]:
    """The dead letter of an input message whose key the fold cannot take it under."""
    origin, key, value, ts = message
    dl = dead_letter(origin.topic, origin.partition, origin.offset, key, value, ts, reason, field="key", source=SOURCE)
    return [Outgoing(DLQ.name, origin.topic.encode(), encode(dl), kind)]


class FoldThread(threading.Thread):
    """Runs a FoldConsumer until ``stop`` is set; on failure it calls ``on_failure`` (the worker exits)."""

    def __init__(self, fold: FoldConsumer, stop: threading.Event, on_failure: Callable[[BaseException], None]) -> None:
        super().__init__(name="accounting", daemon=True)
        self.fold = fold
        self.stop_event = stop
        self.on_failure = on_failure

    def run(self) -> None:
        try:
            self.fold.run(self.stop_event)
        except BaseException as exc:
            log.exception("accounting: the charge fold failed; the worker stops")
            self.on_failure(exc)
