"""Store-and-forward: every event the agent produces is first written to a local SQLite spool
(WAL, synchronous=FULL), then sent in spool order, and deleted only once the broker acknowledged it.

While the broker is unreachable the spool grows up to ``max_bytes``; beyond that ``put`` raises
``SpoolFull`` (the agent then stops shuttering rather than drop what it measured). Events a
restarted agent finds in its spool are sent again; at worst an event the broker had already
acknowledged is sent twice, which event-id de-duplication downstream removes. The agent's own
counters (next cycle, blocks sent per job) live in the same database and change in the same
transaction as the events they describe.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, Message

from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.schemas.catalog import NODE_IPC

log = logging.getLogger("nodeshare.agent.spool")

DEFAULT_MAX_BYTES = 256 * 2**20
RESERVE_FRACTION = 0.05  # head-room kept for end-of-stream markers and lifecycle events when full


class SpoolFull(RuntimeError):
    """The spool reached its bound; nothing more is accepted until the broker drains it."""


class Spool:
    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "topic TEXT NOT NULL, key BLOB, value BLOB NOT NULL, size INTEGER NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        # events the broker refused for good (Forwarder.MAX_ATTEMPTS), kept with the reason, never sent again
        self._db.execute("CREATE TABLE IF NOT EXISTS refused (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, "
                         "key BLOB, value BLOB NOT NULL, reason TEXT NOT NULL)")
        self._lock = threading.Lock()
        self.rows, self.bytes = self._db.execute("SELECT count(*), coalesce(sum(size), 0) FROM events").fetchone()

    def put(self, events: Iterable[tuple[str, bytes | None, bytes]], meta: dict[str, Any] | None = None, *,
            reserve: bool = False, forget: Iterable[str] = ()) -> None:
        """Append events (topic, key, value), update meta and delete the meta names in ``forget``,
        atomically. ``reserve`` lets the few events that close a job's stream use the head-room kept
        for them."""
        rows = [(t, k, v, len(v) + len(k or b"")) for t, k, v in events]
        size = sum(r[3] for r in rows)
        bound = self.max_bytes * (1 + RESERVE_FRACTION) if reserve else self.max_bytes
        with self._lock:
            if self.bytes + size > bound:
                raise SpoolFull(
                    f"the agent's spool {self.path} holds {self.bytes / 2**20:.1f} MiB of events the broker has "
                    f"not acknowledged (limit {self.max_bytes / 2**20:.1f} MiB): is the broker reachable?")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT INTO events (topic, key, value, size) VALUES (?, ?, ?, ?)", rows)
                for name, value in (meta or {}).items():
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, json.dumps(value)))
                self._db.executemany("DELETE FROM meta WHERE name = ?", [(name,) for name in forget])
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                else:  # a signal (SIGTERM's SystemExit) arrived just after the COMMIT: the rows are in
                    self.rows += len(rows)
                    self.bytes += size
                raise
            self.rows += len(rows)
            self.bytes += size

    def after(self, seq: int, limit: int) -> list[tuple[int, str, bytes | None, bytes]]:
        """The oldest events with a sequence number above ``seq``."""
        with self._lock:
            return self._db.execute("SELECT seq, topic, key, value FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (seq, limit)).fetchall()

    def ack(self, seqs: list[int]) -> None:
        """Forget events the broker acknowledged."""
        if not seqs:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            freed = deleted = 0
            try:
                for seq in seqs:
                    row = self._db.execute("DELETE FROM events WHERE seq = ? RETURNING size", (seq,)).fetchone()
                    if row is not None:
                        freed += row[0]
                        deleted += 1
                self._db.execute("COMMIT")
            except BaseException:  # counted only if the deletions committed (as in put)
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                else:
                    self.rows -= deleted
                    self.bytes -= freed
                raise
            self.rows -= deleted
            self.bytes -= freed

    def set_aside(self, seq: int, reason: str) -> None:
        """Move an event the broker refused for good out of the queue, with the reason: kept on disk
        for an operator (``refused`` table), no longer holding back what follows it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO refused SELECT seq, topic, key, value, ? FROM events "
                                 "WHERE seq = ?", (reason, seq))
                row = self._db.execute("DELETE FROM events WHERE seq = ? RETURNING size", (seq,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            if row is not None:
                self.rows -= 1
                self.bytes -= row[0]

    def refused(self) -> list[tuple[int, str, str]]:
        """The events set aside: (seq, topic, reason)."""
        with self._lock:
            return self._db.execute("SELECT seq, topic, reason FROM refused ORDER BY seq").fetchall()

    def meta(self, name: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return default if row is None else json.loads(row[0])

    def metas(self, prefix: str) -> dict[str, Any]:
        """Every meta value whose name starts with ``prefix``, by the rest of its name."""
        with self._lock:
            rows = self._db.execute("SELECT name, value FROM meta WHERE substr(name, 1, ?) = ?",
                                    (len(prefix), prefix)).fetchall()
        return {name[len(prefix):]: json.loads(value) for name, value in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Forwarder:
    """Sends spooled events in spool order, at most ``in_flight`` unacknowledged at a time, and a
    job's ``node.ipc`` records one at a time (per key): they reach the broker in the order they were
    spooled, whatever the client does with a failed one. (An idempotent librdkafka producer keeps
    order across retries, but a message that fails for good, e.g. larger than a topic's
    ``max.message.bytes``, is reported while later ones of its partition may be delivered:
    librdkafka's ``enable.gapless.guarantee`` is off by default. Re-sent after them, a job's last
    batch would land behind its JobLeftNode and the fold would count the job short.) One job's
    batches go one after another (a few a second at most); the agent runs a few dozen jobs, so other
    jobs fill the pipe. Other topics keep no per-key order the pipeline relies on and are not held:
    the node's shutter windows, one a cycle under one key, would otherwise drain no faster than they
    are made, and a backlog left by an outage would never clear. An event the broker refuses
    ``MAX_ATTEMPTS`` times in a row (larger than a topic's max.message.bytes, say) is set aside in the
    spool's ``refused`` table with the reason, so the job's later records, its marker among them, go
    out; the fold then says which blocks never arrived.

    The producer should retry without a deadline (``message.timeout.ms=0``): an idempotent
    producer whose messages time out bumps its epoch, which a broker may answer with
    ProducerFenced for good (Tansu does, after a 30 s stop). Should a fatal error still come, a
    new producer from ``connect`` takes over and everything unacknowledged is sent again."""

    MAX_ATTEMPTS = 10  # failed sends of one event, in a row, before it is set aside

    def __init__(self, spool: Spool, connect: Callable[[], EventProducer], in_flight: int = 5000) -> None:
        self.spool = spool
        self.connect = connect
        self.producer = connect()
        self.in_flight = in_flight
        self._fatal = False
        self._sent_up_to = 0  # every seq up to this one was handed to the producer
        self._pending: dict[int, tuple[str, bytes | int | None]] = {}  # seq in flight -> its ordered stream
        self._acked: list[int] = []
        self._failed: list[int] = []
        self.last_error: str | None = None
        self.sent = 0
        self._attempts: dict[int, int] = {}  # seq -> failed sends so far

    def _on_delivery(self, seq: int) -> Any:
        def done(err: KafkaError | None, msg: Message) -> None:
            self._pending.pop(seq, None)
            if err is None:
                self._acked.append(seq)
                self._attempts.pop(seq, None)
            else:
                self._failed.append(seq)
                self._attempts[seq] = self._attempts.get(seq, 0) + 1
                self.last_error = err.str()
                self._fatal = self._fatal or err.fatal()
        return done

    def pump(self, timeout: float = 0.0) -> None:
        """Serve delivery reports, forget what was acknowledged, send more (resending from the first
        failure, in order, when something failed)."""
        self.producer.poll(timeout)
        acked, self._acked = self._acked, []
        self.spool.ack(acked)
        if self._fatal:  # this producer is done for: start over with a new one from the oldest unacknowledged
            log.error("producer failed for good (%s); reconnecting and re-sending from the spool", self.last_error)
            self.producer.release(0)
            self.producer = self.connect()
            self._fatal, self._pending, self._failed, self._sent_up_to = False, {}, [], 0
        if self._failed:
            for seq in self._failed:
                if self._attempts.get(seq, 0) >= self.MAX_ATTEMPTS and not self._fatal:
                    log.error("spooled event %d refused %d times (%s): set aside in the spool's refused table",
                              seq, self._attempts.pop(seq), self.last_error)
                    self.spool.set_aside(seq, self.last_error or "refused")
            self._sent_up_to = min(min(self._failed) - 1, self._sent_up_to)
            self._failed = []
        room = self.in_flight - len(self._pending)
        if room <= 0:
            return
        busy = set(self._pending.values())  # streams with a record in flight: their next one waits
        contiguous = True  # every row read so far was handed over: the watermark may follow
        for seq, topic, key, value in self.spool.after(self._sent_up_to, room + len(self._pending)):
            # a job's node.ipc records in order (a topic prefix goes before the name); anything else alone
            stream: tuple[str, bytes | int | None] = (topic, key) if topic.endswith(NODE_IPC.name) else (topic, seq)
            if seq not in self._pending:
                if stream in busy or room <= 0:
                    busy.add(stream)  # and every later record of it waits too
                    contiguous = False
                    continue
                self._pending[seq] = stream
                busy.add(stream)
                self.producer.send_raw(topic, key, value, on_delivery=self._on_delivery(seq))
                self.sent += 1
                room -= 1
            if contiguous:
                self._sent_up_to = seq

    def drain(self, timeout: float) -> bool:
        """Pump until the spool is empty or ``timeout`` seconds pass; True when empty."""
        deadline = time.monotonic() + timeout
        while self.spool.rows and time.monotonic() < deadline:
            self.pump(0.05)
        return self.spool.rows == 0

    def close(self, timeout: float) -> None:
        """Drain for up to ``timeout`` seconds, then release the producer; what is left stays spooled."""
        self.drain(timeout)
        self.producer.release()
