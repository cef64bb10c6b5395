"""The charge fold's guarantees, whatever the topics look like (issue 44): for generated jobs,
partition counts, partitioners, rebalances, zombies and crashes, the worker's charge fold charges
exactly what one uninterrupted single-partition fold (``fold_messages``) charges, and dead-letters
what it does plus every misrouted record.

The worker's own code decides everything that matters here: ``FoldConsumer.take`` (the consume
loop's body), ``commit``, ``_on_assign`` (read committed offsets, rebuild each partition from its log,
reuse a parked state, assign at the rebuild's offsets), ``_on_revoke`` (commit, park or drop),
``_on_lost`` and the misrouted check. What stands in for the broker is the smallest model of what
those calls rely on, in memory:

* the input log: each record on the partition its producer's partitioner gives it (murmur2 of the
  job id, the project's; or a site's own hook partitioning lifecycle or node.ipc with crc32, or at
  random), the same count for both topics, 1 to 8;
* a consumer group: committed offsets; members assigned partition p of both topics (the range
  assignor), eager rebalances (every member revokes, then is assigned); a commit on revoke that
  fails, or fails after it landed; a member the group dropped (session timeout) that goes on folding
  and committing (a zombie: a broker need not fence it) until it notices, including a commit that
  lands while the group rebalances or while another member rebuilds a partition the zombie holds;
  records published a few at a time while the group folds;
* each member's producer: sent messages durable at ``flush``; a SIGKILL (crash) delivers any prefix of
  what was not flushed and loses the rest, and the member's state with it;
* ``read_range``, which the rebuild reads the log with, and retention: a step deletes the head of
  each partition's log up to what its complete snapshots, the group's offsets and every member's
  position no longer need (a rebuild that still read from offset 0 would be refused: charges lost);
* the compacted ``accounting.snapshots`` (``read_compacted``): every durable message, the last
  value of a key winning (compaction at its harshest), chunks of a few hundred bytes so that a
  snapshot spans several; snapshots taken after every message, every few, or only when forced.

Besides the outputs, each member's accounts are checked after every step where another member's
commit may have moved the group's offsets, and at the end: they must be exactly the fold of their
partition's log up to where the member's consumer reads next (a wrong resume offset may be masked in
the outputs by a zombie that charged the same jobs).

The jobs (one to three nodes, one or two runs, blocks or none, corrections, a node listed that never
reports, copies of markers, batches and end events) are chosen so that their charges do not depend on
how the two topics interleave (the one rule that does, a revision superseded before a node it waits
for closes, is the differential test's: tests/unit/test_differential.py); the test checks that
promise on the reference itself. A charge names where its evidence was read (event range, a
correction's offset): those are compared as the records they point at, so a charge read from
partition 3 at offset 5 equals the reference's from partition 0 at offset 17 only if both are the
same record.

``NODESHARE_PARTITION_EXAMPLES`` sets how many examples (default 300).
"""

from __future__ import annotations

import base64
import os
import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from zlib import crc32

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from factories import T0, block
from factories import batch as make_batch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nodeshare.producers.kafka_producer import DeliveryError
from nodeshare.runtime.config import Settings
from nodeshare.schemas import Charge, DeadLetter, JobEvent, JobLeftNode, JobState, encode
from nodeshare.schemas.serde import decode_model
from nodeshare.streams.core import fold_snapshot
from nodeshare.streams.core.accounting import Message, Origin, apply_message, fold_messages, fold_states
from nodeshare.streams.worker import fold_consumer, fold_snapshots
from nodeshare.streams.worker.copartition import kafka_partition
from nodeshare.streams.worker.cursor import LogHeadGone
from nodeshare.streams.worker.fold_consumer import MISROUTED, FoldConsumer

EXAMPLES = int(os.environ.get("NODESHARE_PARTITION_EXAMPLES", "300"))
PREFIX = "t."
IPC, LIFE = f"{PREFIX}node.ipc", f"{PREFIX}jobs.lifecycle"
CHARGES, DLQ = f"{PREFIX}ledger.charges", f"{PREFIX}dlq"
SNAPSHOTS = f"{PREFIX}accounting.snapshots"
SETTLED = f"{PREFIX}accounting.settled"
MEMBERS = ("a", "b", "c")  # worker processes; a and b run at first
SETTINGS = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": PREFIX})
POLICY = SETTINGS.policy()  # the worker's


# --------------------------------------------------------------------------- generated jobs


@dataclass(frozen=True)
class Rec:
    """One input record: its identity (``rid``, in publication order) and its bytes."""

    rid: int
    topic: str
    key: bytes
    value: bytes


def _end(job: str, eid: str, state: JobState, nodes: tuple[str, ...], run: int, minutes: int, cores: int) -> JobEvent:
    start = T0 + timedelta(hours=3 * run)
    return JobEvent(event_id=eid, source="t", event_time=start + timedelta(minutes=minutes), job_id=job, state=state,
                    user="u", account="a", program="p", cores=cores, nodes=nodes, start_time=start,
                    end_time=start + timedelta(minutes=minutes))


def job_records(rnd: random.Random, job: str) -> tuple[list[bytes], list[bytes]]:
    """One job's node.ipc values (each node's in order, nodes interleaved) and lifecycle values."""
    nodes = sorted(rnd.sample(["n1", "n2", "n3", "n4"], rnd.randint(1, 3)))
    idle = rnd.random() < 0.2  # no block at all: priced on its markers alone
    per_node: dict[str, list[bytes]] = {n: [] for n in nodes}
    life: list[bytes] = []
    cycle = 0
    runs = rnd.choice([1, 1, 1, 2])  # a requeued job runs again under its id
    for run in range(runs):
        if rnd.random() < 0.3:
            life.append(encode(JobEvent(event_id=f"{job}-sub{run}", source="t", event_time=T0, job_id=job,
                                        state=JobState.SUBMITTED, user="u", account="a", program="p", cores=4)))
        for node in nodes:
            values = per_node[node]
            blocks = []
            for _ in range(0 if idle else rnd.randint(0, 4)):
                cycle += rnd.choice([1, 1, 2])
                base = rnd.choice([0.8, 1.0, 1.2])
                blocks.append(block(base, base * rnd.choice([1.0, 1.1, 1.4]), base + rnd.choice([0.0, 0.01]),
                                    job=job, node=node, cycle=cycle))
            cut = rnd.randint(0, len(blocks))
            for part in (blocks[:cut], blocks[cut:]):
                if part:
                    values.append(encode(make_batch(*part)))
                    if rnd.random() < 0.1:  # re-sent: its blocks are out of order, a dead letter
                        values.append(values[-1])
            values.append(encode(JobLeftNode(
                event_id=f"{job}-{node}-left{run}", source="t", event_time=T0 + timedelta(hours=3 * run + 1),
                job_id=job, node=node, blocks_sent=len(blocks), last_cycle=blocks[-1].cycle if blocks else -1,
                paused_us=rnd.choice([0, 1000]), alone_us=rnd.choice([0, 60_000_000]))))
            if rnd.random() < 0.1:  # a copy of the marker: a dead letter
                values.append(values[-1])
        state = JobState.CANCELLED if run < runs - 1 else rnd.choice([JobState.ENDED, JobState.FAILED])
        ghost = rnd.random() < 0.15  # the resource manager lists a node that never reports
        listed = (*nodes, "n9") if ghost else tuple(nodes)
        life.append(encode(_end(job, f"{job}-end{run}", state, listed, run, 60, 8)))
        if rnd.random() < 0.1:  # the same end event again: a dead letter
            life.append(life[-1])
        for fix in range(rnd.choice([0, 0, 1, 2]) + ghost):  # corrections, each a revision (the ghost dropped)
            life.append(encode(_end(job, f"{job}-fix{run}.{fix}", state, tuple(nodes), run, 50 - 10 * fix,
                                    rnd.choice([8, 16]))))
    ipc: list[bytes] = []
    queues = [list(v) for v in per_node.values()]
    while queues:  # each node's values in order, the nodes' streams interleaved
        q = rnd.choice(queues)
        ipc.append(q.pop(0))
        queues = [q for q in queues if q]
    return ipc, life


def records(seed: int, jobs: int) -> list[Rec]:
    """The jobs' records in publication order: each job's two topics in order, jobs interleaved."""
    rnd = random.Random(seed)
    streams: list[list[tuple[str, bytes, bytes]]] = []
    for _ in range(jobs):
        job = str(7000 + rnd.randint(0, 10**6))  # ids that hash all over the partitions
        ipc, life = job_records(rnd, job)
        labels = [IPC] * len(ipc) + [LIFE] * len(life)
        rnd.shuffle(labels)  # the two topics of a job interleave as they were published
        queues = {IPC: iter(ipc), LIFE: iter(life)}
        streams.append([(t, job.encode(), next(queues[t])) for t in labels])
    out: list[Rec] = []
    while streams:
        s = rnd.choice(streams)
        topic, key, value = s.pop(0)
        out.append(Rec(len(out), topic, key, value))
        streams = [s for s in streams if s]
    return out


def hold_back(recs: list[Rec], rnd: random.Random) -> list[Rec]:
    """The records with the last lifecycle record of most jobs moved to the end (each
    topic of a job stays in its order, so the charges are the same: the property checks it)."""
    last = {r.key: r.rid for r in recs if r.topic == LIFE}
    late = {rid for rid in last.values() if rnd.random() < 0.8}
    order = [r for r in recs if r.rid not in late] + [r for r in recs if r.rid in late]
    return [Rec(i, r.topic, r.key, r.value) for i, r in enumerate(order)]


# --------------------------------------------------------------------------- the broker, in memory


def partition_of(rec: Rec, partitions: int, partitioner: str, rnd: random.Random) -> int:
    """Where a producer with this partitioner puts a record: murmur2 (Kafka's and the project's),
    crc32 (librdkafka's default, a site's own hook) or any partition."""
    if partitioner == "murmur2":
        return kafka_partition(rec.key, partitions)
    if partitioner == "crc32":
        return crc32(rec.key) % partitions
    return rnd.randrange(partitions)


class _Msg:
    """A consumed message as confluent-kafka hands it over."""

    def __init__(self, topic: str, partition: int, offset: int, rec: Rec) -> None:
        self._where, self._rec = (topic, partition, offset), rec

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]

    def key(self) -> bytes:
        return self._rec.key

    def value(self) -> bytes:
        return self._rec.value

    def timestamp(self) -> tuple[int, int]:
        return (1, 0)  # no broker time: nothing to check clocks against


@dataclass
class Broker:
    log: dict[tuple[str, int], list[Rec]]
    #: Records published so far (record ids below it): producers publish while the group folds.
    published: int = 0
    committed: dict[tuple[str, int], int] = field(default_factory=dict)
    durable: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    #: Called at the start of the next rebuild's read of one of its partitions (a zombie's commit
    #: landing while another member rebuilds a partition the zombie still folds), once.
    during_rebuild: list[tuple[set[tuple[str, int]], Callable[[], object]]] = field(default_factory=list)
    #: Each partition's first offset still held (retention deleted the ones before)
    low: dict[tuple[str, int], int] = field(default_factory=dict)

    def read_range(self, settings: Settings, topic: str, partition: int, start: int, stop: int,
                   timeout_s: float = 60.0, verifier: object = None) -> list[Message]:
        for hook in [h for h in self.during_rebuild if (topic, partition) in h[0]]:
            self.during_rebuild.remove(hook)
            hook[1]()
        low = self.low.get((topic, partition), 0)
        if start < low and stop > start:
            raise LogHeadGone(topic, partition, start, low)
        return self.messages(topic, partition, start, stop)

    #: The next read of the snapshot topic fails (the worker reads it again)
    read_fails: bool = False

    def snapshots(self, settings: Settings, topic: str) -> list[tuple[bytes | None, bytes | None]]:
        assert topic == SNAPSHOTS
        if self.read_fails:
            self.read_fails = False
            raise RuntimeError(f"{topic}: still reading after 60 s")
        return self.view()

    #: settled accounts read back by the members' folds
    reads: int = 0

    def settled(self, settings: Settings, topic: str, offset: int, key: bytes,
                accept: Callable[[bytes | None], bool]) -> bytes | None:
        """``read_keyed`` on the settled topic, compacted at its harshest (only each key's last value
        is left)."""
        assert topic == SETTLED
        self.reads += 1
        held = [(o, k, v) for o, (t, k, v) in enumerate(m for m in self.durable if m[0] == SETTLED)]
        last = {k: o for o, k, _ in held}
        return next((v for o, k, v in held if last[k] == o and o >= offset and k == key and accept(v)), None)

    def view(self) -> list[tuple[bytes | None, bytes | None]]:
        """What the snapshot topic holds."""
        return [(k, v) for t, k, v in self.durable if t == SNAPSHOTS]

    def messages(self, topic: str, partition: int, start: int, stop: int) -> list[Message]:
        recs = self.end(topic, partition)
        assert stop <= len(recs), "a read past the log's end would wait for ever"
        return [(Origin(topic, partition, o), recs[o].key, recs[o].value, 0.0) for o in range(start, stop)]

    def end(self, topic: str, partition: int) -> list[Rec]:
        """What a partition holds so far."""
        recs = self.log[(topic, partition)]
        return recs[:sum(1 for r in recs if r.rid < self.published)]


class GroupConsumer:
    """What the fold calls on its group consumer, plus ``consume``."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.position: dict[tuple[str, int], int] = {}
        self.paused: set[tuple[str, int]] = set()
        self.commit_fails: str = ""  # "", "lost" (never reached the group) or "landed" (took effect, then failed)

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.broker.committed.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def assign(self, partitions: list[TopicPartition]) -> None:
        # without an offset, librdkafka starts at the group's committed offset as it is then
        self.position = {(tp.topic, tp.partition): tp.offset if tp.offset >= 0
                         else max(0, self.broker.committed.get((tp.topic, tp.partition), 0)) for tp in partitions}
        self.paused = set()

    def unassign(self) -> None:
        self.position, self.paused = {}, set()

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        foreign = [(tp.topic, tp.partition) for tp in offsets if (tp.topic, tp.partition) not in self.position]
        assert not foreign, f"a commit of partitions not assigned to this member: {foreign}"
        fails, self.commit_fails = self.commit_fails, ""
        if fails != "lost":
            self.broker.committed.update({(tp.topic, tp.partition): tp.offset for tp in offsets})
        if fails:
            raise KafkaException(KafkaError(KafkaError.REQUEST_TIMED_OUT))

    def consume(self, n: int, rnd: random.Random) -> list[_Msg]:
        """Up to ``n`` messages of the assigned partitions, each in order, partitions interleaved."""
        out = []
        while len(out) < n:
            ready = [tp for tp, o in self.position.items()
                     if tp not in self.paused and o < len(self.broker.end(*tp))]
            if not ready:
                break
            tp = rnd.choice(sorted(ready))
            out.append(_Msg(*tp, self.position[tp], self.broker.log[tp][self.position[tp]]))
            self.position[tp] += 1
        return out


class Producer:
    """A member's producer: what it sends is durable once flushed. ``fail_snapshots``: the next flush
    that holds snapshot chunks delivers only some of its messages and raises (the topic refused the
    rest, or the broker was away past the timeout)."""

    def __init__(self, broker: Broker) -> None:
        self.broker, self.buffer = broker, []
        self.reports: list[tuple[int, Callable]] = []  # (index in the buffer, its delivery callback)
        self.fail_snapshots = 0  # 0: never; else how many of the buffer's messages get through

    def send_raw(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None,
                 on_delivery: Callable | None = None) -> None:
        self.buffer.append((topic, key, value))
        if on_delivery is not None:
            self.reports.append((len(self.buffer) - 1, on_delivery))

    def poll(self, timeout: float = 0.0) -> None:
        """Delivery reports come with ``flush`` here: a poll serves none."""

    def flush(self, timeout: float = 30.0) -> int:
        if self.fail_snapshots and any(t == SNAPSHOTS for t, _, _ in self.buffer):
            kept, self.fail_snapshots = self.fail_snapshots, 0
            kept %= len(self.buffer) + 1
            self._report(kept)
            self.broker.durable += self.buffer[:kept]
            self.buffer = []
            raise DeliveryError("1 records failed, first: accounting.snapshots: Broker: Message size too large")
        self._report(len(self.buffer))
        self.broker.durable += self.buffer
        self.buffer = []
        return 0

    def _report(self, delivered: int) -> None:
        """Delivery reports: the offset each of the first ``delivered`` messages takes on its topic,
        an error for the others."""
        for i, report in self.reports:
            topic, key, _ = self.buffer[i]
            if i >= delivered:
                report("Local: Message timed out", None)
                continue
            offset = sum(1 for t, _, _ in self.broker.durable if t == topic) + sum(
                1 for t, _, _ in self.buffer[:i] if t == topic)
            report(None, _Delivered(key, offset))
        self.reports = []


class _Delivered:
    def __init__(self, key: bytes, offset: int) -> None:
        self._key, self._offset = key, offset

    def key(self) -> bytes:
        return self._key

    def offset(self) -> int:
        return self._offset


class Member:
    """One worker process's charge fold (the real ``FoldConsumer``) with its consumer and producer."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.fold = FoldConsumer(settings)
        self.fold.producer = self.producer = Producer(broker)  # type: ignore[assignment]
        self.fold.settled.read_fn = broker.settled
        self.consumer = GroupConsumer(broker)
        self.zombie = False  # dropped by the group, not yet aware of it

    def tps(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in sorted(self.consumer.position)]


class Cluster:
    def __init__(self, broker: Broker, settings: Settings, partitions: int) -> None:
        self.broker, self.settings, self.partitions = broker, settings, partitions
        self.members: dict[str, Member] = {name: Member(broker, settings) for name in MEMBERS[:2]}
        self.crashes = self.zombies = self.rebuilt = self.retained = 0  # how often each happened (statistics)
        self.rebalance(0)

    def live(self) -> list[str]:
        return [n for n, m in sorted(self.members.items()) if not m.zombie]

    def rebalance(self, seed: int, revoke_fails: str = "", landing: list | None = None) -> None:
        """An eager rebalance among the group's members: each revokes all it has, then each is
        assigned partition p of both topics for the partition numbers the assignor gives it."""
        rnd, live = random.Random(seed), self.live()
        owner = {p: rnd.choice(live) for p in range(self.partitions)} if live else {}
        for i, name in enumerate(live):
            m = self.members[name]
            m.consumer.commit_fails = revoke_fails if i == 0 else ""
            m.fold._on_revoke(m.consumer, m.tps())  # type: ignore[arg-type]
            m.consumer.commit_fails = ""
            m.consumer.unassign()
        for commit in landing or ():  # while the group rebalances: before any member reads its offsets
            commit()
        for name in live:
            m = self.members[name]
            mine = [TopicPartition(t, p) for p in range(self.partitions) if owner[p] == name for t in (IPC, LIFE)]
            m.fold._on_assign(m.consumer, mine)  # type: ignore[arg-type]
            self.rebuilt += sum(1 for p, jobs in m.fold.states.items() if jobs and p in {tp.partition for tp in mine})

    def step(self, kind: str, name: str, a: int, b: int) -> None:
        zombies = [n for n, z in sorted(self.members.items()) if z.zombie]
        if kind in ("stale", "notice") and zombies:
            name = zombies[a % len(zombies)]
        elif kind in ("consume", "commit") and name not in self.members and self.members:
            name = sorted(self.members)[a % len(self.members)]
        m = self.members.get(name)
        if kind == "publish":
            self.broker.published += a % 20 + 1
        elif kind == "consume" and m is not None:
            m.fold.take(m.consumer.consume(a % 40 + 1, random.Random(b)))  # type: ignore[arg-type]
        elif kind == "commit" and m is not None:
            m.consumer.commit_fails = ("", "", "lost", "landed")[a % 4]
            try:
                m.fold.commit(m.consumer)  # type: ignore[arg-type]
            except KafkaException:
                pass  # the fold loop's commit raises: the worker exits; modelled as a crash next
            else:
                return
            finally:
                m.consumer.commit_fails = ""  # also when nothing was pending: the next commit goes through
            self.crash(name, b, restart=bool(a & 4))
        elif kind == "idle" and m is not None and not m.fold._pending:  # the loop's turn with nothing to commit
            m.fold.idle()
        elif kind == "quiet" and m is not None:  # a commit, then a turn with nothing consumed (settled accounts go)
            m.fold.commit(m.consumer)  # type: ignore[arg-type]
            m.fold.idle()
        elif kind == "rebalance":
            self.rebalance(b, ("", "", "lost", "landed")[a % 4])
        elif kind == "crash" and m is not None:
            self.crash(name, b, restart=bool(a % 2))
        elif kind == "join" and m is None:
            self.members[name] = Member(self.broker, self.settings)
            self.rebalance(b)
        elif kind == "lose" and m is not None and not m.zombie:
            m.zombie = True  # the group dropped it (session timed out); it folds on
            self.zombies += 1
            self.rebalance(b)
        elif kind == "stale" and m is not None and m.zombie:  # its commit lands during the next rebalance,
            commit = lambda: m.zombie and m.fold.commit(m.consumer)  # type: ignore[arg-type]  # noqa: E731
            if a % 2:  # before anyone reads the group's offsets
                self.rebalance(b, landing=[commit])
            else:  # or while another member rebuilds from the offsets it read
                self.broker.during_rebuild.append((set(m.consumer.position), commit))
                self.rebalance(b)
        elif kind == "notice" and m is not None and m.zombie:
            m.fold._on_lost(m.consumer, m.tps())  # type: ignore[arg-type]
            m.consumer.unassign()
            m.zombie = False
            self.rebalance(b)
        elif kind == "retain" and not any(z.zombie for z in self.members.values()):
            self.retain()
        elif kind == "snapfail" and m is not None:
            m.producer.fail_snapshots = a % 7 + 1
        elif kind == "readfail":
            self.broker.read_fails = True

    def retain(self) -> None:
        """Retention deletes the head of each partition's log up to what no reader needs any more:
        below every complete snapshot of it, the group's offsets and every member's position (or
        parked state). Days, against a fold that reads seconds behind: this is the most it may take."""
        view = self.broker.view()
        for p in range(self.partitions):
            snaps = fold_snapshot.complete_snapshots(view, p, self.partitions, fold_snapshot.config_of(POLICY))
            for t in (IPC, LIFE):
                needed = [s.offsets[t] for s in snaps] + [self.broker.committed.get((t, p), 0)]
                for m in self.members.values():
                    needed += [o for k, o in m.consumer.position.items() if k == (t, p)]
                    needed += [parked[1][t] for q, parked in m.fold._parked.items() if q == p]
                if snaps:
                    self.broker.low[(t, p)] = max(self.broker.low.get((t, p), 0), min(needed))
                    self.retained += 1

    def check_accounts(self) -> None:
        """Each member's accounts of each partition it folds are exactly the fold of that partition's
        records before where its consumer reads next (those on their key's partition): nothing
        skipped, nothing twice. Which event completed a charge (``triggers``) depends on how the
        topics interleaved, so it is left out."""
        for name, m in self.members.items():
            for p, jobs in m.fold.states.items():
                at = {t: m.consumer.position[(t, p)] for t in (LIFE, IPC)}
                msgs = [msg for t in (LIFE, IPC) for msg in self.broker.messages(t, p, 0, at[t])
                        if m.fold.misrouted(msg[0], msg[1]) is None]
                # as models: exact sums compare by their exact totals (a snapshot's are split otherwise)
                want = {k: a.model_copy(update={"triggers": []})
                        for k, a in fold_states(msgs, POLICY, PREFIX)[0].items()}
                got = {k: a.model_copy(update={"triggers": []}) for k, a in jobs.items()}
                reads = self.broker.reads  # the fold's own, counted apart from these
                for k, packed in m.fold.settled.index.get(p, {}).items():  # and what left memory, as the fold reads it
                    assert k not in got, f"job {k!r} both in memory and settled"
                    got[k] = m.fold.settled.read(p, k, packed, self.partitions, fold_snapshot.config_of(POLICY)
                                                 ).model_copy(update={"triggers": []})
                self.broker.reads = reads
                assert got == want, f"member {name}'s accounts of partition {p} are not the fold of its log up to {at}"

    def crash(self, name: str, delivered: int, restart: bool) -> None:
        """SIGKILL: what the producer had not flushed is partly delivered, the rest and the state are lost."""
        m = self.members.pop(name)
        self.crashes += 1
        self.broker.durable += m.producer.buffer[:delivered % (len(m.producer.buffer) + 1)]
        if restart:
            self.members[name] = Member(self.broker, self.settings)
        if not m.zombie or restart:
            self.rebalance(delivered)

    def drain(self, seed: int) -> None:
        """The group settles: zombies notice, a member runs, and everything is folded and committed."""
        for name, m in list(self.members.items()):
            if m.zombie:
                self.step("notice", name, 0, seed)
        if not self.members:
            self.step("join", "a", 0, seed)
        self.broker.published = max(r.rid for recs in self.broker.log.values() for r in recs) + 1
        self.rebalance(seed)
        rnd = random.Random(seed)
        while True:
            got = 0
            for m in self.members.values():
                batch = m.consumer.consume(rnd.randint(1, 60), rnd)
                m.fold.take(batch)  # type: ignore[arg-type]
                got += len(batch)
                if rnd.random() < 0.5:  # the loop's commit, and a quiet turn (settled accounts leave memory)
                    m.fold.commit(m.consumer)  # type: ignore[arg-type]
                    m.fold.idle()
            if not got:
                break
        for m in self.members.values():
            m.fold.commit(m.consumer)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- comparing outputs


def _locator(where: dict[tuple[str, int, int], int]):
    """Rewrites a charge's or dead letter's (topic, partition, offset) into the record there."""
    def charge(c: Charge) -> dict:
        d = c.model_dump(exclude={"event_range", "revision_reason"})
        d["event_range"] = sorted((r.topic, where[(r.topic, r.partition, r.first_offset)],
                                   where[(r.topic, r.partition, r.last_offset)]) for r in c.event_range)
        d["revision_reason"] = re.sub(r" at (jobs\.lifecycle):(\d+):(\d+)$",
                                      lambda g: f" at record {where[(g[1], int(g[2]), int(g[3]))]}",
                                      c.revision_reason)
        return d

    def letter(dl: DeadLetter) -> tuple:
        rid = where[(dl.origin_topic.removeprefix(PREFIX), dl.origin_partition, dl.origin_offset)]
        rows = tuple((r.index, r.field, r.reason) for r in dl.rows)
        reason = MISROUTED if dl.reason.startswith(f"{MISROUTED}:") else dl.reason
        return rid, reason, dl.field, rows, dl.key_b64, dl.value_b64

    return charge, letter


def reference(recs: list[Rec], order: list[int]) -> tuple[dict, set]:
    """One uninterrupted fold of ``recs`` on one partition per topic, the two topics merged as
    ``order`` (record ids) says: its charges by (job, revision) and its dead letters, as records."""
    offsets: dict[str, int] = defaultdict(int)
    where: dict[tuple[str, int, int], int] = {}
    placed: dict[int, Message] = {}
    for r in recs:
        o = offsets[r.topic]
        offsets[r.topic] += 1
        where[(r.topic.removeprefix(PREFIX), 0, o)] = r.rid
        placed[r.rid] = (Origin(r.topic, 0, o), r.key, r.value, 0.0)
    messages = [placed[i] for i in order if i in placed]
    charge, letter = _locator(where)
    charges = {(c.job_id, c.revision): charge(c) for c in fold_messages(messages, POLICY, PREFIX)}
    letters, accounts = set(), {}
    for origin, key, value, ts in messages:
        new, out, _ = apply_message(accounts.get(key), origin, key, value, ts, POLICY, PREFIX,
                                    running_estimates=False)
        if new is not None:
            accounts[key] = new
        letters |= {letter(decode_model(DeadLetter, o.value)) for o in out if o.topic == "dlq"}
    return charges, letters


# --------------------------------------------------------------------------- the property

PARTITIONER = st.sampled_from(["murmur2", "murmur2", "murmur2", "crc32", "random"])
#: What may happen, with its odds: records published, and mostly folding and committing, now and then a
#: rebalance, a SIGKILL (restarted or not), a member joining, one dropped by the group (a zombie),
#: a zombie's commit landing while another member rebuilds, a zombie noticing.
STEPS = {"publish": 4, "consume": 12, "commit": 4, "idle": 2, "quiet": 3, "rebalance": 2, "crash": 1, "join": 1,
         "lose": 3, "stale": 4, "notice": 1, "retain": 4, "snapfail": 1, "readfail": 1}


def plan(rnd: random.Random, n: int) -> list[tuple[str, str, int, int]]:
    """``n`` steps drawn from a seed: hypothesis's own draws are too slow for thousands of steps a run,
    and a failure still names its seed (and shrinks ``n``)."""
    kinds = [k for k, w in STEPS.items() for _ in range(w)]
    return [(rnd.choice(kinds), rnd.choice(MEMBERS), rnd.randrange(2**16), rnd.randrange(2**16)) for _ in range(n)]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(partitions=st.integers(1, 8), ipc_partitioner=PARTITIONER, life_partitioner=PARTITIONER,
       seed=st.integers(0, 2**32), jobs=st.integers(1, 10), steps=st.integers(0, 80),
       snapshot_every=st.sampled_from([1, 3, 10**9]), evict=st.sampled_from([float("inf"), 0.0, 0.0]))
def test_the_partitioned_fold_charges_what_one_uninterrupted_fold_charges(
        partitions, ipc_partitioner, life_partitioner, seed, jobs, steps, snapshot_every, evict):
    recs = records(seed, jobs)
    rnd = random.Random(seed + 1)
    if evict == 0:  # some jobs' last lifecycle record comes last of all: late, after their accounts left memory
        recs = hold_back(recs, rnd)
    log: dict[tuple[str, int], list[Rec]] = {(t, p): [] for t in (IPC, LIFE) for p in range(partitions)}
    where: dict[tuple[str, int, int], int] = {}
    misrouted: set[int] = set()
    for r in recs:
        p = partition_of(r, partitions, ipc_partitioner if r.topic == IPC else life_partitioner, rnd)
        where[(r.topic.removeprefix(PREFIX), p, len(log[(r.topic, p)]))] = r.rid
        log[(r.topic, p)].append(r)
        if p != kafka_partition(r.key, partitions):
            misrouted.add(r.rid)

    # What must come out: the uninterrupted fold of what is routed right, and a misrouted dead letter
    # for each of the others. The jobs' charges are the same whichever way the topics interleave.
    routed = [r for r in recs if r.rid not in misrouted]
    want_charges, want_letters = reference(routed, [r.rid for r in recs])
    by_topic = sorted(routed, key=lambda r: (r.topic != LIFE, r.rid))
    assert reference(routed, [r.rid for r in by_topic])[0] == want_charges, "the generator broke its promise"
    want_letters |= {(rid, MISROUTED, "key", (), base64.b64encode(recs[rid].key).decode(),
                      base64.b64encode(recs[rid].value).decode()) for rid in misrouted}

    broker = Broker(log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fold_consumer, "EventProducer", lambda *a, **k: None)  # replaced by the member's
        mp.setattr(fold_consumer, "input_partitions", lambda *a, **k: {IPC: partitions, LIFE: partitions})
        mp.setattr(fold_consumer, "read_range", broker.read_range)
        mp.setattr(fold_snapshots, "read_compacted", broker.snapshots)
        mp.setattr(fold_snapshots, "RETRY_S", 0.0)  # a failed snapshot is tried again at the next commit
        mp.setattr(fold_snapshots, "READ_BACKOFF_S", 0.0)  # a failed read is tried again at once
        mp.setattr(fold_snapshot, "CHUNK_BYTES", 300)
        # evict 0.0: every settled account leaves memory at every commit, and each later record of its
        # job reads it back (live, or in a rebuild from a snapshot's index)
        cluster = Cluster(broker, SETTINGS.model_copy(update={"fold_snapshot_every_records": snapshot_every,
                                                              "fold_evict_after_s": evict}), partitions)
        for kind, name, a, b in plan(random.Random(seed + 2), steps):
            cluster.step(kind, name, a, b)
            if kind in ("stale", "lose", "notice"):  # where another member's commit may have moved offsets
                cluster.check_accounts()
        cluster.check_accounts()
        cluster.drain(seed)
        cluster.check_accounts()

    event(f"settled accounts read back: {'some' if broker.reads else 'none'} (evicting: {evict == 0})")
    event(f"settled accounts written: {'some' if any(t == SETTLED for t, _, _ in broker.durable) else 'none'} "
          f"(evicting: {evict == 0})")
    event(f"misrouted records: {'some' if misrouted else 'none'}")
    event(f"charges expected: {'some' if want_charges else 'none'}")
    event(f"rebuilds with state: {'some' if cluster.rebuilt else 'none'}")
    event(f"log heads deleted: {'some' if any(broker.low.values()) else 'none'}")
    event(f"crashes: {'some' if cluster.crashes else 'none'}; zombies: {'some' if cluster.zombies else 'none'}")
    charge, letter = _locator(where)
    copies: dict[tuple[str, int], list[dict]] = defaultdict(list)
    letters = set()
    for topic, _, value in broker.durable:
        if topic == CHARGES:
            c = decode_model(Charge, value)
            copies[(c.job_id, c.revision)].append(charge(c))
        elif topic == DLQ:
            letters.add(letter(decode_model(DeadLetter, value)))
    divergent = {k: v for k, v in copies.items() if any(c != v[0] for c in v)}
    assert not divergent, f"different copies of a charge: {sorted(divergent)[:3]}"
    got = {k: v[0] for k, v in copies.items()}
    lost, extra = sorted(want_charges.keys() - got.keys()), sorted(got.keys() - want_charges.keys())
    wrong = sorted(k for k in want_charges.keys() & got.keys() if got[k] != want_charges[k])
    differs = {f: (want_charges[k][f], got[k][f]) for k in wrong[:1] for f in got[k] if got[k][f] != want_charges[k][f]}
    assert not lost and not extra and not wrong, (f"lost {lost[:3]}, unexpected {extra[:3]}, wrong {wrong[:3]} "
                                                  f"(first: expected, got {differs})")
    assert letters == want_letters, (f"dead letters missing {sorted(want_letters - letters)[:3]}, "
                                     f"unexpected {sorted(letters - want_letters)[:3]}")
