"""The ledger: charges in a DuckDB file, one row per (job id, revision), never updated in place.

Longer than 500 lines because the chain, the re-send check that tells a redelivery or a stated
repricing from a divergent charge, and the sink that applies them are one contract with the audit.

Rows are chained: ``row_hash = sha256(prev_hash || record)`` in insertion order (``seq``), so
editing, deleting or reordering any row breaks the chain. The chain assumes one writer per
ledger file (one ledger sink), which is how the sink is deployed.

Next to the charges, for analysts: ``co_runners`` counts, per job and co-runner job, the shutter
windows (``node.shutter``) in which the first ran alone while the second was paused beside it.
It is not billing data and not in the chain; ``shutter_watermarks`` (the last cycle counted per
node) makes the count exactly-once under redelivery.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from confluent_kafka import Message

from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import BatchSink, position
from nodeshare.schemas import Charge, DecodeError, ShutterWindow, decode, decode_model
from nodeshare.schemas.catalog import LEDGER_CHARGES, NODE_SHUTTER
from nodeshare.schemas.dead_letters import dead_letter
from nodeshare.schemas.events import carried
from nodeshare.schemas.signing import AUTH_FIELD, header_value, identity_problem
from nodeshare.streams.core.confidence import levels_low
from nodeshare.streams.core.degradation import MIXED_S
from nodeshare.streams.core.pricing import fair_charge, job_degradation

log = logging.getLogger(__name__)

SINK_SOURCE = "nodeshare.sinks.ledger"

#: Scalar columns copied from each charge for SQL; the full charge is kept verbatim in ``record``.
_COLUMNS: dict[str, str] = {
    "job_id": "VARCHAR NOT NULL",
    "revision": "INTEGER NOT NULL",
    "event_id": "VARCHAR NOT NULL",
    "final_state": "VARCHAR NOT NULL",
    "user": "VARCHAR NOT NULL",
    "account": "VARCHAR NOT NULL",
    "program": "VARCHAR NOT NULL",
    "cores": "INTEGER NOT NULL",
    "start_time": "TIMESTAMPTZ NOT NULL",
    "end_time": "TIMESTAMPTZ NOT NULL",
    "run_time_s": "DOUBLE NOT NULL",
    "pause_credit_s": "DOUBLE NOT NULL",
    "billed_time_s": "DOUBLE NOT NULL",
    "solo_time_s": "DOUBLE NOT NULL",
    "degradation": "DOUBLE NOT NULL",
    "estimate_status": "VARCHAR NOT NULL",
    "degradation_filtered": "DOUBLE",
    "degradation_unfiltered": "DOUBLE",
    "degradation_corrected": "DOUBLE",
    "estimator": "VARCHAR NOT NULL",
    "degradation_shared": "DOUBLE NOT NULL DEFAULT 0",  # schema 4; a record before it reads 0
    "alone_s": "DOUBLE NOT NULL DEFAULT 0",  # schema 4
    "degradation_point": "DOUBLE",  # schema 6: the interval (NULL in a record before it)
    "degradation_low": "DOUBLE",
    "degradation_high": "DOUBLE",
    "interval_method": "VARCHAR",
    "confidence": "DOUBLE",
    "priced_at": "VARCHAR NOT NULL DEFAULT 'estimate'",
    "blocks_used": "INTEGER NOT NULL",
    "blocks_rejected": "INTEGER NOT NULL",
    "blocks_ignored": "INTEGER NOT NULL",
    "rate_function": "VARCHAR NOT NULL",
    "rate_per_core_hour": "DOUBLE NOT NULL",
    "delta": "DOUBLE NOT NULL",
    "standard_price": "DOUBLE NOT NULL",
    "solo_price": "DOUBLE NOT NULL",
    "price": "DOUBLE NOT NULL",
    "dividend": "DOUBLE NOT NULL",
    "adjustment_credit": "DOUBLE NOT NULL DEFAULT 0",  # schema 8: what an operator's adjustment took off
    "code_version": "VARCHAR NOT NULL",
}
#: Columns added after the first ledgers were written: an older file gets them on open, filled with
#: the value the older records read as (the model's default), so ``column_drift`` stays clean.
_ADDED_COLUMNS = ("degradation_shared", "alone_s", "degradation_point", "degradation_low", "degradation_high",
                  "interval_method", "confidence", "priced_at", "adjustment_credit")
_CHAIN_COLUMNS = ("record", "kafka_partition", "kafka_offset", "seq", "prev_hash", "row_hash")
_DDL = (
    "CREATE TABLE IF NOT EXISTS charges ("
    + ", ".join(f'"{c}" {t}' for c, t in _COLUMNS.items())
    + ", record JSON NOT NULL, kafka_partition INTEGER, kafka_offset BIGINT,"
    " seq BIGINT NOT NULL UNIQUE, prev_hash VARCHAR NOT NULL, row_hash VARCHAR NOT NULL,"
    " PRIMARY KEY (job_id, revision))"
)
_CO_RUNNER_DDL = (
    "CREATE TABLE IF NOT EXISTS co_runners (job_id VARCHAR NOT NULL, co_job_id VARCHAR NOT NULL,"
    " shutters BIGINT NOT NULL, PRIMARY KEY (job_id, co_job_id));"
    "CREATE TABLE IF NOT EXISTS shutter_watermarks (node VARCHAR PRIMARY KEY, last_cycle BIGINT NOT NULL)"
)
_INSERT = "INSERT INTO charges (" + ", ".join(f'"{c}"' for c in (*_COLUMNS, *_CHAIN_COLUMNS)) + ") VALUES "
_ROWS_PER_INSERT = 256
_ROW = "(" + ", ".join("?" for _ in range(len(_COLUMNS) + len(_CHAIN_COLUMNS))) + ")"
GENESIS = "0" * 64

#: Views for analysts (documented in the README). Only current revisions are counted.
VIEWS: dict[str, str] = {
    "charges_current": """CREATE OR REPLACE VIEW charges_current AS
        SELECT * EXCLUDE (rn) FROM (
            SELECT *, row_number() OVER (PARTITION BY job_id ORDER BY revision DESC) AS rn FROM charges)
        WHERE rn = 1""",
    "usage_daily": """CREATE OR REPLACE VIEW usage_daily AS
        SELECT CAST(timezone('UTC', end_time) AS DATE) AS day, "user", account, program,
               count(*) AS jobs, sum(cores * run_time_s) / 3600 AS core_hours,
               sum(standard_price) AS standard_price, sum(price) AS charged, sum(dividend) AS dividend,
               sum(dividend) / nullif(sum(standard_price), 0) AS discount, sum(adjustment_credit) AS credited
        FROM charges_current GROUP BY ALL""",
    "usage_monthly": """CREATE OR REPLACE VIEW usage_monthly AS
        SELECT date_trunc('month', day) AS month, "user", account, program, sum(jobs) AS jobs,
               sum(core_hours) AS core_hours, sum(standard_price) AS standard_price, sum(charged) AS charged,
               sum(dividend) AS dividend, sum(dividend) / nullif(sum(standard_price), 0) AS discount,
               sum(credited) AS credited
        FROM usage_daily GROUP BY ALL""",
    "dividend_by_node": """CREATE OR REPLACE VIEW dividend_by_node AS
        SELECT node.node AS node, count(*) AS jobs,
               sum(c.dividend / len(c.nodes)) AS dividend,  -- a job's dividend split evenly over its nodes
               sum(c.standard_price / len(c.nodes)) AS standard_price
        FROM (SELECT dividend, standard_price,
                     from_json(record->'nodes', '[{"node": "VARCHAR"}]') AS nodes FROM charges_current) c,
             unnest(c.nodes) AS t(node)
        GROUP BY ALL""",
    # Seed 002 Fig. 11 as a table: program a's jobs' measured degradation, each job weighted by how
    # many of its shutters had a job of program b paused beside it (sinks/report.pair_degradation).
    "degradation_by_pair": """CREATE OR REPLACE VIEW degradation_by_pair AS
        SELECT a.program, b.program AS co_program, count(DISTINCT a.job_id) AS jobs,
               sum(p.shutters) AS shutters,
               -- D while sharing (schema 4's degradation_shared; the point estimate is never above it,
               -- and a row before version 4 has 0 there and its D applied was the shared-time
               -- estimate; D applied may carry a margin, schema 10, and a row before version 6 no point)
               sum(p.shutters * greatest(coalesce(a.degradation_point, a.degradation), a.degradation_shared))
                   / sum(p.shutters) AS degradation
        FROM co_runners p
        JOIN charges_current a ON a.job_id = p.job_id
        JOIN charges_current b ON b.job_id = p.co_job_id
        WHERE a.estimate_status = 'ok'
        GROUP BY ALL""",
}


def chain_hash(prev_hash: str, record: str) -> str:
    return hashlib.sha256(f"{prev_hash}\n{record}".encode()).hexdigest()


@dataclass(frozen=True)
class ChainCheck:
    ok: bool
    rows: int
    error: str | None = None  # the first break, if any


class Ledger:
    """A DuckDB ledger file. Writers append; readers open it with ``read_only=True``."""

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        if read_only and not self.path.exists():
            raise FileNotFoundError(f"no ledger at {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con = duckdb.connect(str(self.path), read_only=read_only)
        if not read_only:
            self.con.execute(_DDL)
            for column in _ADDED_COLUMNS:
                kind = _COLUMNS[column].replace(" NOT NULL", "")
                self.con.execute(f'ALTER TABLE charges ADD COLUMN IF NOT EXISTS "{column}" {kind}')
            self.con.execute(_CO_RUNNER_DDL)
            for ddl in VIEWS.values():
                self.con.execute(ddl)

    def append(self, rows: list[tuple[Charge, bytes, int | None, int | None]]) -> int:
        """Append charges (with their raw bytes and origin) to the chain; a (job id, revision)
        already in the ledger is skipped, so redelivery never makes a second row. A copy that
        differs from the row held (beyond provenance) is not a redelivery: it is kept in
        ``divergent`` (the charge, its bytes and origin, and the fields that differ) for the caller
        to dead-letter. Returns how many rows were new."""
        self.divergent: list[tuple[tuple[Charge, bytes, int | None, int | None], list[str]]] = []
        self.repriced = 0  # copies that differ from their row only by the interval margin (margin_only)
        if not rows:  # most of the sink's batches are shutter windows only
            return 0
        self.con.execute("BEGIN TRANSACTION")
        try:
            last = self.con.execute("SELECT seq, row_hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()
            seq, prev = (int(last[0]) + 1, str(last[1])) if last else (0, GENESIS)
            jobs = sorted({c.job_id for c, *_ in rows})
            held = {(j, r): record for j, r, record in self.con.execute(
                "SELECT job_id, revision, record FROM charges WHERE job_id IN (SELECT unnest(?))", [jobs]).fetchall()}
            params: list[list[Any]] = []
            for row in rows:
                charge, raw, partition, offset = row
                key = (charge.job_id, charge.revision)
                if key in held:
                    if held[key] != raw.decode():
                        kept = Charge.model_validate_json(held[key])
                        fields = [f for f, _, _ in charge_differences(kept, charge)]
                        if fields and not margin_only(kept, charge, fields):
                            self.divergent.append((row, fields))
                        elif fields:
                            self.repriced += 1
                    continue
                record = held[key] = raw.decode()
                row_hash = chain_hash(prev, record)
                data = charge.model_dump()
                params.append([_sql_value(data[c]) for c in _COLUMNS]
                              + [record, partition, offset, seq, prev, row_hash])
                seq, prev = seq + 1, row_hash
            # multi-row statements: executemany runs one statement per row (40 rows: 70 ms, here 16 ms)
            for i in range(0, len(params), _ROWS_PER_INSERT):
                chunk = params[i:i + _ROWS_PER_INSERT]
                self.con.execute(_INSERT + ", ".join(_ROW for _ in chunk), [v for p in chunk for v in p])
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return len(params)

    def count_shutters(self, windows: list[ShutterWindow]) -> int:
        """Add shutter windows (in the order each node emitted them) to ``co_runners``. A window
        whose cycle is not after the last one counted for its node is a redelivery and is skipped
        (node agents number cycles upwards across restarts). Returns how many windows counted."""
        if not windows:  # a batch of charges only
            return 0
        self.con.execute("BEGIN TRANSACTION")
        try:
            nodes = sorted({w.node for w in windows})
            last = dict(self.con.execute("SELECT node, last_cycle FROM shutter_watermarks WHERE node IN "
                                         "(SELECT unnest(?))", [nodes]).fetchall())
            pairs: Counter[tuple[str, str]] = Counter()
            counted = 0
            for w in windows:
                if w.cycle <= last.get(w.node, -1):
                    continue
                last[w.node] = w.cycle
                pairs.update((w.lone_job, other) for other in w.paused_jobs)
                counted += 1
            if pairs:  # one set-based upsert per table: executemany took 0.9-3.2 ms a row
                keys = sorted(pairs)
                self._upsert("co_runners", "(job_id, co_job_id)", "shutters = co_runners.shutters + excluded.shutters",
                             {"job_id": [a for a, _ in keys], "co_job_id": [b for _, b in keys],
                              "shutters": pa.array([pairs[k] for k in keys], pa.int64())})
                marked = [n for n in nodes if n in last]
                self._upsert("shutter_watermarks", "(node)", "last_cycle = excluded.last_cycle",
                             {"node": marked, "last_cycle": pa.array([last[n] for n in marked], pa.int64())})
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return counted

    def _upsert(self, table: str, key: str, update: str, columns: dict[str, Any]) -> None:
        """INSERT the rows (distinct keys) of ``columns`` into ``table``, updating those already there."""
        self.con.register("_upsert_rows", pa.table(columns))
        try:
            self.con.execute(f"INSERT INTO {table} SELECT * FROM _upsert_rows ON CONFLICT {key} DO UPDATE SET {update}")
        finally:
            self.con.unregister("_upsert_rows")

    def co_runner_counts(self) -> dict[tuple[str, str], int]:
        """(job, co-runner job) -> shutter windows counted (see ``count_shutters``); empty for a
        ledger written before the sink counted them (opened read-only, it has no such table)."""
        present = self.con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'co_runners'").fetchone()
        if not present or not present[0]:
            return {}
        return {(a, b): int(n) for a, b, n in self.con.execute("SELECT * FROM co_runners").fetchall()}

    def verify_chain(self) -> ChainCheck:
        """Walk the rows in order and recompute every hash."""
        prev, n = GENESIS, 0
        for seq, record, prev_hash, row_hash, job, rev in self.con.execute(
                "SELECT seq, record, prev_hash, row_hash, job_id, revision FROM charges ORDER BY seq").fetchall():
            where = f"row seq={seq} ({job}#{rev})"
            if seq != n:
                return ChainCheck(False, n, f"{where}: expected seq {n} (a row was removed or reordered)")
            if prev_hash != prev:
                return ChainCheck(False, n, f"{where}: prev_hash does not match the row before it")
            if chain_hash(prev, record) != row_hash:
                return ChainCheck(False, n, f"{where}: record does not match its hash (edited)")
            prev, n = row_hash, n + 1
        return ChainCheck(True, n)

    def count(self) -> int:
        row = self.con.execute("SELECT count(*) FROM charges").fetchone()
        return int(row[0]) if row else 0

    def charges(self, jobs: Iterable[str] | None = None) -> list[Charge]:
        """Every row (of these jobs), as the charge records that were published, in ledger order."""
        if jobs is not None:
            rows = self.con.execute("SELECT record FROM charges WHERE job_id IN (SELECT unnest(?)) ORDER BY seq",
                                    [list(jobs)]).fetchall()
            return [Charge.model_validate_json(r[0]) for r in rows]
        rows = self.con.execute("SELECT record FROM charges ORDER BY seq").fetchall()
        return [Charge.model_validate_json(r[0]) for r in rows]

    def column_drift(self) -> list[tuple[str, int, str, Any, Any]]:
        """Rows whose SQL columns disagree with their charge record: (job, revision, column, column, record).
        A file no newer sink has opened lacks the columns added since (``_ADDED_COLUMNS``): those are
        not compared (a backup or snapshot taken before an upgrade audits with today's build)."""
        held = {r[0] for r in self.con.execute("SELECT name FROM pragma_table_info('charges')").fetchall()}
        names = [c for c in _COLUMNS if c in held]
        cols = ", ".join(f'"{c}"' for c in names)
        out = []
        for row in self.con.execute(f"SELECT {cols}, record FROM charges ORDER BY job_id, revision").fetchall():
            data = Charge.model_validate_json(row[-1]).model_dump()
            for name, value in zip(names, row[:-1], strict=True):
                expected = _sql_value(data[name])
                if value != expected:
                    out.append((data["job_id"], data["revision"], name, value, expected))
        return out

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What a charge says of where it was made, not of what it is: a copy differing only here is a redelivery.
PROVENANCE = frozenset({"source", "schema_version", "code_version"})


def charge_differences(held: Charge, copy: Charge, provenance: frozenset[str] = PROVENANCE,
                       ) -> list[tuple[str, Any, Any]]:
    """(field, held value, copy value) for each field (``provenance`` aside) in which ``copy`` differs
    from ``held``, among those ``held``'s schema version has (a later copy may carry more). The
    ledger's redelivery check and the audit's comparison, one rule."""
    a, b = held.model_dump(), copy.model_dump()
    return [(f, a[f], b.get(f)) for f in a if f not in provenance and carried(held, f) and a[f] != b.get(f)]


#: The fields an interval margin moves when the charge is priced at its point estimate.
_INTERVAL_ENDS = frozenset({"degradation_low", "degradation_high"})
#: The fields the short-sample margin moves (schema 10): the D priced and everything priced from it.
_SHORT_POLICY = frozenset({"short_margin", "short_sample_us"})
_SHORT_PRICED = _INTERVAL_ENDS | _SHORT_POLICY | {"degradation", "solo_time_s", "solo_price", "price", "dividend",
                                                  "short_margin_applied"}


def margin_only(held: Charge, copy: Charge, fields: list[str]) -> bool:
    """Whether ``copy`` differs from ``held`` only as a stated change of margin makes it differ (a
    worker upgraded across schema 7 or 10 re-sending a charge the older build wrote, or a changed
    margin): under another interval margin, only in its interval's ends (the same price, the same
    point estimate); under another short-sample margin (``short_margin``, ``short_sample_us``),
    only in the D priced from the same point estimate and what is priced from it. Anything else
    that differs is a divergent row."""
    margins = (held.interval_margin_abs, held.interval_margin_rel)
    if set(fields) <= _INTERVAL_ENDS and margins != (copy.interval_margin_abs, copy.interval_margin_rel):
        return True
    short = (held.short_margin, held.short_sample_us)
    if short == (copy.short_margin, copy.short_sample_us) or not set(fields) <= _SHORT_PRICED:
        return False
    # only the stated policy differs (a job the margin does not touch), or with it the interval of an
    # unchecked estimate whose price it does not move, or the price follows from it
    return (set(fields) <= _SHORT_POLICY or (set(fields) <= _SHORT_POLICY | _INTERVAL_ENDS
                                             and _widened_by_its_margin(held, copy))
            or _priced_from_its_margin(held, copy))


def _held_margin(held: Charge) -> float:
    """The short-sample margin ``held`` applied to its price (0 for a row from before the margin)."""
    return held.short_margin_applied if carried(held, "short_margin_applied") else 0.0


def _widened_by_its_margin(held: Charge, copy: Charge) -> bool:
    """Whether ``copy``'s interval is ``held``'s moved by the change of short-sample policy alone,
    for a job whose price carries the margin in neither (an unchecked estimate whose long samples
    were taken, priced at its point estimate)."""
    if _held_margin(held) or copy.short_margin_applied or held.priced_at != "estimate" or copy.priced_at != "estimate":
        return False
    return _ends_follow_the_margin(held, copy)


def _ends_follow_the_margin(held: Charge, copy: Charge) -> bool:
    """Whether ``copy``'s interval ends are ``held``'s moved no further than a change of short-sample
    policy can move them: each end away from the point by at most the change of margin (less where
    it meets 0 or 1), toward it when the margin shrank; either way by up to the larger margin where
    the longest S it covers changed too (an estimate checked under one may be unchecked under the
    other). A row from before the margin (no ``short_sample_us``) had none. The ledger bounds the
    ends; the audit recomputes them from the archive."""
    old, new = held.short_margin or 0.0, copy.short_margin or 0.0
    low, high = (sorted((0.0, new - old)) if held.short_sample_us in (None, copy.short_sample_us)
                 else (-max(old, new), max(old, new)))
    scale, tol = job_degradation(1.0, copy.alone_s, copy.billed_time_s), 1e-12
    outward = (held.degradation_low - copy.degradation_low, copy.degradation_high - held.degradation_high)
    return ((all(low * scale - tol <= m <= high * scale + tol for m in outward)
             or (low * scale - tol <= outward[1] <= high * scale + tol and _low_at_its_trusted_level(copy, tol)))
            and copy.degradation_low <= copy.degradation_point <= copy.degradation_high)


def _low_at_its_trusted_level(copy: Charge, tol: float) -> bool:
    """Whether ``copy``'s lower end is its longest level's own (``confidence.levels_low`` over the
    levels it carries, at its confidence and margins), which an estimate whose shorter samples read
    higher reaches since schema 10: a build before it (schema 9) ended the interval at the point's
    symmetric end, further up than any margin change explains."""
    if copy.estimator != MIXED_S or not copy.levels or None in (copy.confidence, copy.interval_margin_abs,
                                                                copy.interval_margin_rel):
        return False
    low = levels_low(copy.levels, 0.5 * (1.0 + copy.confidence), copy.interval_margin_abs or 0.0,
                     copy.interval_margin_rel or 0.0)
    return low is not None and abs(copy.degradation_low - job_degradation(max(0.0, low), copy.alone_s,
                                                                           copy.billed_time_s)) <= tol


def _priced_from_its_margin(held: Charge, copy: Charge) -> bool:
    """Whether ``copy`` applied another short-sample margin than ``held`` and its D and price are
    what that margin gives from the estimate both share (at the point estimate, no adjustment),
    its interval's ends moved no further than the margin moves them: a re-sent copy that claims a
    margin change but prices otherwise, or states another interval, stays divergent."""
    if (copy.priced_at != "estimate" or copy.adjustment is not None or copy.short_margin_applied == _held_margin(held)
            or copy.short_margin_applied not in (0.0, copy.short_margin)):
        return False
    d = job_degradation(min(1.0, copy.degradation_shared + copy.short_margin_applied), copy.alone_s,
                        copy.billed_time_s)
    amounts = fair_charge(copy.rate_per_core_hour, copy.units, copy.run_time_s, d, copy.rate_function,
                          copy.pause_credit_s)
    return _ends_follow_the_margin(held, copy) and all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in (
        (copy.degradation, d), (copy.price, amounts.price), (copy.dividend, amounts.dividend),
        (copy.solo_price, amounts.solo_price), (copy.solo_time_s, amounts.solo_time_s)))


def _sql_value(v: Any) -> Any:
    return v.value if hasattr(v, "value") else v  # enums as their string values


class LedgerSink(BatchSink):
    """Consumes ``ledger.charges`` into the ledger, and ``node.shutter`` into its co-runner counts.
    A record that does not decode goes to the dead-letter topic; a redelivered charge is ignored by
    the (job id, revision) key, a redelivered shutter window by its node's cycle."""

    def __init__(self, settings: Settings, ledger_path: Path, dead_letters: Any = None) -> None:
        # a charge is durable at most 0.2 s after it arrives; a batch costs one open of the
        # DuckDB file (~35 ms), which is let go between batches for analysts' read-only opens
        super().__init__(settings, [LEDGER_CHARGES.name, NODE_SHUTTER.name], "ledger", max_delay_s=0.2)
        self.shutter_topic = settings.topic(NODE_SHUTTER.name)
        #: with the site secret: a window its signer may not have written is a dead letter, never counted
        self.verifier = settings.verifier()
        self.ledger_path = ledger_path
        self.dead_letters = dead_letters  # an EventProducer, or None to raise instead
        self.rows_inserted = 0
        self.shutter_messages = 0  # node.shutter messages written (counted, redelivered or dead-lettered)
        self.lock_wait_s = 60.0  # how long a write waits for readers to let go of the file
        #: a read-only copy for analysts, rewritten after a batch once ``snapshot_every_s`` has passed
        self.snapshot: Path | None = None
        self.snapshot_every_s = 60.0
        self._snapshot_at: float | None = None  # time.monotonic() of the last one
        self.head_every_s = 3600.0  # how often the chain head goes to the log (to be kept off the host)
        self._head_at: float | None = None
        self._lock = threading.Lock()

    def write(self, messages: list[Message]) -> None:
        rows: list[tuple[Charge, bytes, int | None, int | None]] = []
        windows: list[ShutterWindow] = []
        for m in messages:
            raw = m.value()
            try:
                if m.topic() == self.shutter_topic:
                    self.shutter_messages += 1
                    window = decode(NODE_SHUTTER, raw)
                    if self.verifier is not None:
                        signer = self.verifier.signer(NODE_SHUTTER.name, m.key(), raw, header_value(m.headers()))
                        forged = identity_problem(window, signer)
                        if forged:
                            metrics.DEAD_LETTERS.labels(metrics.FORGED).inc()
                            raise DecodeError(forged, AUTH_FIELD)
                    windows.append(window)
                    continue
                if raw is None:
                    raise DecodeError("empty message (tombstone) on the charges topic")
                rows.append((decode_model(Charge, raw), raw, m.partition(), m.offset()))
            except DecodeError as exc:
                self._reject(m, exc)
        with self._lock, self._open() as ledger:
            new = ledger.append(rows)
            divergent = ledger.divergent
            if ledger.repriced:
                log.warning("%d re-sent charges differ from their ledger rows only as another interval or "
                            "short-sample margin makes them differ (a worker upgraded across schema 7 or 10): the "
                            "rows stay as billed, and the audit checks each under its own", ledger.repriced)
            ledger.count_shutters(windows)
            due = self.snapshot is not None and (self._snapshot_at is None
                                                 or time.monotonic() - self._snapshot_at >= self.snapshot_every_s)
            if due:
                ledger.con.execute("CHECKPOINT")  # the file alone is then the ledger (snapshot below)
            if new and (self._head_at is None or time.monotonic() - self._head_at >= self.head_every_s):
                head = ledger.con.execute("SELECT seq, row_hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()
                if head is not None:  # `nodeshare ledger verify --head` checks a ledger against it later
                    log.info("ledger chain head: %d rows, head %s", head[0] + 1, head[1])
                    self._head_at = time.monotonic()
        if due:
            from .ledger_tools import copy_snapshot

            with self._lock:  # closed, and only this sink writes it: the bytes are one moment of the ledger
                copy_snapshot(self.ledger_path, self.snapshot)  # type: ignore[arg-type]
            self._snapshot_at = time.monotonic()
        for (charge, raw, partition, offset), fields in divergent:
            # The worker re-sends a partition's charges at each rebuild: a copy that differs is a
            # recomputation that disagrees with what was billed (or a forged row), never dropped.
            metrics.DIVERGENT_CHARGES.inc()
            log.error("charge %s#%d: a second, different row (%s differ); the ledger keeps the first",
                      charge.job_id, charge.revision, ", ".join(fields))
            if self.dead_letters is None:
                raise DecodeError(f"a second, different row for {charge.job_id}#{charge.revision}", fields[0])
            self.dead_letters.send(dead_letter(
                LEDGER_CHARGES.name, partition, offset, charge.job_id.encode(), raw, time.time(),
                f"a second, different row for {charge.job_id}#{charge.revision}: {', '.join(fields)} differ from "
                f"the row the ledger holds (kept); an audit of the job says which is right",
                field=fields[0], source=SINK_SOURCE))
        self.rows_inserted += new
        metrics.LEDGER_ROWS.inc(new)
        if new:
            metrics.LEDGER_LAST_ROW.set_to_current_time()
        if self.dead_letters is not None:
            self.dead_letters.flush()

    def _open(self) -> Ledger:
        """The ledger for writing. An analyst's read-only connection holds DuckDB's file lock; the
        sink waits for it (nothing is committed meanwhile) instead of failing, and gives up only
        after ``lock_wait_s``, naming the reason."""
        waited, delay, warned = 0.0, 0.01, 0.0
        while True:
            try:
                return Ledger(self.ledger_path)
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower():
                    raise
                if waited >= self.lock_wait_s:
                    raise RuntimeError(f"the ledger {self.ledger_path} has been held by another process for "
                                       f"{waited:.0f} s (a read-only session left open?): {exc}") from exc
                if waited - warned >= 5.0:
                    log.warning("the ledger is held by another process (%.0f s so far); charges wait", waited)
                    warned = waited
            time.sleep(delay)
            waited += delay
            delay = min(2 * delay, 0.5)

    def _reject(self, m: Message, exc: DecodeError) -> None:
        if self.dead_letters is None:
            raise exc
        topic, partition, offset = position(m)
        _, ts = m.timestamp()
        self.dead_letters.send(dead_letter(topic, partition, offset, m.key(), m.value(), ts / 1000,
                                           exc.reason, field=exc.field, source=SINK_SOURCE))
