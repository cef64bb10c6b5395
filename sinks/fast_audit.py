"""The vectorized audit path: DuckDB checks and folds the archived node.ipc records in bulk.

Longer than 500 lines because its eligibility checks, its SQL fold and the charge it builds from
the fold's rows are one contract with the reference fold, bit for bit.

It reads the same raw bytes as the reference path, so an edited archive event is seen by
both. In tasks over chunks of the files' row groups (``read_streams``): every row's typed columns
are re-encoded and compared with its value, which names the *suspect* rows (edited, another
encoder's bytes, or files from before typed columns), and every row is checked against the rules
of its model that the bytes do not prove; jobs without a suspect row are folded from the typed
columns alone and their cycle order checked across the chunks; jobs with one go to the reference
path, which decodes every value with the models (parsing JSON in SQL would accept what they
refuse: strings for integers, extra or repeated keys). It handles the common, clean case: K = 1
samples, every record well formed and with a plausible clock (``schemas.clock_problem``), block
cycles increasing per node, each offset held once or in equal copies, every node stream closed
once, and one terminal event. A job that does not fit is *ineligible* and goes to the reference
path (``streams.core.accounting.process_message``), and so does any job whose fast result differs
from the ledger. A fast "match" therefore always means the reference functions agree too. The
test suite proves the two paths equal on the same events.

Exactness: IPC is instructions / cycles in float64 (exact conversion below 2**53, which
eligibility checks), Alg. 4's comparisons are the same float operations, and every sum is
exact in 128-bit fixed point, rounded once: the correctly rounded sum that ``math.fsum`` and
``ExactSum`` yield.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, fields, replace
from pathlib import Path, PurePath
from typing import Any, NamedTuple

import duckdb
import pyarrow as pa

from nodeshare.schemas import (
    BY_NAME,
    SCHEMA_VERSION,
    Charge,
    ChargeAdjustment,
    CounterSource,
    DecodeError,
    JobEvent,
    clock_problem,
    decode,
)
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.schemas.events import (
    EARLIEST_EVENT_TIME,
    ID_MAX_LENGTH,
    JOB_ID_CHARS,
    MAX_AHEAD_OF_BROKER_S,
    MAX_BATCH_BLOCKS,
    NAME_MAX_LENGTH,
    NODE_NAME_CHARS,
)
from nodeshare.streams.core.accounting import NodeStream, PricingPolicy, TerminalEvent, build_charge
from nodeshare.streams.core.degradation import MIXED_S, SECOND_MOMENTS, estimate_from_totals

from .archive import ARCHIVE_SCHEMA, IPC_FIELDS, IPC_LISTS, ParquetArchive, file_span

_EXACT_INT = 2**53  # int64 -> float64 is exact below this

#: The typed columns' names: scalar fields and the per-block lists (sinks.archive).
_SCALARS = [name for name, _, _ in IPC_FIELDS]
_LISTS = [name for name, _, _ in IPC_LISTS]
#: The blocks' list columns that the fold reads, unnested to one row per block, with their names there.
_UNNESTED = {"l_cycle": "cycle",
             **{f"l_{r}_{n}": f"{r}_{n}" for r in "bda" for n in ("instructions", "cycles", "threads")}}
#: A block's position in its stream: its message's offset, then its index in the batch.
_POSITION = f'("offset" * {2 * MAX_BATCH_BLOCKS} + idx)'


def canonical_ipc_sql() -> str:
    """SQL for the bytes ``schemas.encode`` writes for the record in a row's typed columns: a schema-3
    batch, a K = 1 single block (versions 1 and 2) or a JobLeftNode (NULL for anything else). Where
    it equals the archived value, the typed columns are exactly what decoding the value gives:
    one ``to_json`` of a struct of them in the model's field order prints the encoder's compact JSON
    (strings escaped, integers in decimal, lists joined with commas), nothing left out; a null would
    print as ``null``, hence the null tests. (One ``to_json`` of the struct: measured 3x faster here
    than concatenating its pieces.)
    """
    head = ("event_id := event_id, schema_version := schema_version, source := source, event_time := event_time, "
            "kind := kind, job_id := job_id, node := node")

    def region(name: str, single: bool) -> str:
        """A region's samples: a K = 1 block (versions 1 and 2) holds a list of one sample object, a
        batch an object of lists."""
        one = "[1]" if single else ""
        sample = ", ".join(f"'{field}': l_{name[0]}_{field}{one}" for field in ("instructions", "cycles", "threads"))
        return f"{name} := [{{{sample}}}]" if single else f"{name} := {{{sample}}}"

    def record(*fields: str) -> str:
        return f"to_json(struct_pack({', '.join([head, *fields])}))"

    block = record("cycle := l_cycle[1]", "k := 1", "sample_us := sample_us", "counter := counter",
                   *(region(r, True) for r in ("before", "during", "after")))
    batch = record("seq := seq", "k := k", "sample_us := sample_us", "counter := counter", "cycle := l_cycle",
                   *(region(r, False) for r in ("before", "during", "after")))
    # alone_us came with version 4: a marker without it reads as 0, which its null column gives the fold
    marker = ["blocks_sent := blocks_sent", "last_cycle := last_cycle", "paused_us := paused_us"]
    left = f"CASE WHEN alone_us IS NULL THEN {record(*marker)} ELSE {record(*marker, 'alone_us := alone_us')} END"
    common = ["event_id", "schema_version", "source", "event_time", "job_id", "node"]
    block_fields = [*common, "sample_us", "counter", *_LISTS]
    batch_fields = [*block_fields, "seq", "k"]
    left_fields = [*common, "blocks_sent", "last_cycle", "paused_us"]
    # a list with a null element (a value that is no integer) prints without it: never canonical
    no_null_elements = " AND ".join(f"list_count({n}) = len({n})" for n in _LISTS)
    # a K = 1 block prints its lists' first elements only: any other element would be unnested unseen
    one_element = " AND ".join(f"len({n}) = 1" for n in _LISTS)

    def unless_null(names: list[str], sql: str, extra: str = "true") -> str:
        return (f"CASE WHEN {' OR '.join(f'{n} IS NULL' for n in names)} OR NOT ({extra}) THEN NULL "
                f"ELSE encode({sql}) END")

    return f"""CASE kind WHEN 'shutter_batch' THEN {unless_null(batch_fields, batch, no_null_elements)}
                         WHEN 'shutter_block' THEN {unless_null(block_fields, block, one_element)}
                         WHEN 'job_left_node' THEN {unless_null(left_fields, left,
                                                                'schema_version < 4 OR alone_us IS NOT NULL')} END"""


#: Alg. 4's sums are exact: each IPC x is a double m * 2**e with e >= -FIXED_POINT_BITS when
#: x >= 2**-30, so x * 2**FIXED_POINT_BITS is an integer and DuckDB sums those in HUGEINT (128 bits)
#: without rounding. Rounding the exact sum once gives the correctly rounded sum, the value of
#: ``math.fsum`` and of the reference path's ``ExactSum``. IPCs outside [2**-30, 2**16) (other
#: than 0) do not fit: their job goes to the reference path.
FIXED_POINT_BITS = 82
_IPC_MIN, _IPC_MAX = 2.0**-30, 2.0**16
_SUMS = ("solo_filtered", "co_filtered", "solo_all", "co_all", "before_filtered", "after_filtered")


@dataclass(frozen=True)
class StreamRow:
    """One (job, node) stream of the archive, aggregated by DuckDB."""

    job: str
    node: str | None
    min_partition: int
    max_partition: int
    clean: bool  # every row well formed, keyed by its job, a plausible clock, a K = 1 block or a marker
    increasing: bool  # block cycles strictly increase in offset order
    blocks: int
    lefts: int
    first_offset: int
    last_offset: int
    left_offset: int | None
    blocks_sent: int | None
    paused_us: int | None
    alone_us: int | None
    first_cycle: int | None
    last_cycle: int | None
    accepted: int
    rejected: int
    sums: tuple[int, ...]  # _SUMS then SECOND_MOMENTS, fixed point
    #: the blocks' sample length S (the fold keeps its sums per S; a row per S and one for the
    #: marker, None), and the stream positions of its first and last block
    sample_us: int | None = None
    first_pos: int | None = None
    last_pos: int | None = None


@dataclass
class FastResult:
    charges: dict[tuple[str, int], Charge] = field(default_factory=dict)
    ineligible: set[str] = field(default_factory=set)
    samples: int = 0
    typed_rows: int = 0  # node.ipc rows read from typed columns that reproduce the value's bytes
    #: node.ipc rows whose typed columns do not reproduce the value's bytes (edited, another encoder,
    #: files from before typed columns): their jobs go to the reference path
    suspect_rows: int = 0
    #: (topic, partition, epoch, offset, copies differ) of every record archived more than once
    duplicates: list[tuple[str, int, int, int, bool]] = field(default_factory=list)


def _source_sql(archive: ParquetArchive, files: list[PurePath], dedupe: bool, read: str | None = None) -> str:
    """The node.ipc ``files`` (``read``: a relation of their rows, default all of them) as one relation
    with every typed column (null where a file has none), with ``dedupe`` each offset once (a
    compaction in progress leaves copies)."""
    read = read if read is not None else f"read_parquet([{archive.sources_sql(NODE_IPC.name)}], union_by_name = true)"
    names = [archive.schema_names(f) for f in files]
    if any("l_cycle" in n for n in names):  # the first one, but for old archives
        source = read
        # typed columns added later (alone_us, version 4) are null in the files written before them
        later = [f"NULL::{'VARCHAR' if kind == pa.string() else 'BIGINT'} AS {name}"
                 for name, kind, _ in IPC_FIELDS if not any(name in n for n in names)]
        if later:
            source = f"(SELECT *, {', '.join(later)} FROM {source})"
    else:
        nulls = ", ".join([*(f"NULL::{'VARCHAR' if kind == pa.string() else 'BIGINT'} AS {name}"
                             for name, kind, _ in IPC_FIELDS), *(f"NULL::BIGINT[] AS {n}" for n in _LISTS)])
        plain = ", ".join(f'"{f.name}"' for f in ARCHIVE_SCHEMA)  # older typed columns are not trusted
        source = f"(SELECT {plain}, {nulls} FROM {read})"
    if dedupe:
        # the copy archived.events keeps too (differing copies fail the audit: conflicting_copies)
        source = (f'(SELECT * FROM {source} QUALIFY row_number() OVER (PARTITION BY "partition", "offset" '
                  f'ORDER BY key, value, timestamp_ms) = 1)')
    return source


_WHEN = "epoch(TRY_CAST(event_time AS TIMESTAMPTZ))"
_COUNTERS = ", ".join(f"'{c.value}'" for c in CounterSource)
#: An event time as the encoder writes it, with its time zone (pydantic's AwareDatetime refuses
#: one without; DuckDB's cast would read it as UTC). Any other spelling goes to the reference path.
_ISO_TIME = (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?"
             r"(Z|[+-]([01]\d|2[0-3]):[0-5]\d)")
#: A message the reference decoder accepts as far as its fields go (the byte check has proven the
#: typed columns are its fields: no field missing, none extra, every one of its type), keyed by its
#: job, with a plausible clock (``schemas.clock_problem``): every rule of the models that the
#: fold's block checks do not cover. Checked once per message, before its blocks are unnested.
_MESSAGE_OK = f"""coalesce(key = encode(job_id)  -- bytes: no UTF-8 decode per row
                   AND schema_version BETWEEN 1 AND {SCHEMA_VERSION}
                   AND length(event_id) BETWEEN 1 AND {ID_MAX_LENGTH} AND length(source) BETWEEN 1 AND {NAME_MAX_LENGTH}
                   AND regexp_full_match(job_id, '{JOB_ID_CHARS}{{1,{ID_MAX_LENGTH}}}')
                   AND regexp_full_match(node, '{NODE_NAME_CHARS}{{1,{ID_MAX_LENGTH}}}')
                   AND regexp_full_match(event_time, '{_ISO_TIME}')
                   AND CASE kind WHEN 'job_left_node' THEN paused_us >= 0
                                 WHEN 'shutter_batch' THEN seq >= 0 AND counter IN ({_COUNTERS})
                                 ELSE counter IN ({_COUNTERS}) END
                   AND {_WHEN} >= {EARLIEST_EVENT_TIME.timestamp()}
                   -- the operations of clock_problem: (event time - broker time) > max is refused
                   AND (timestamp_ms <= 0 OR {_WHEN} - timestamp_ms / 1000 <= {MAX_AHEAD_OF_BROKER_S}), false)"""


def _unnested_sql(rows: str) -> str:
    """One row per block (a JobLeftNode, or a batch with no block, stays one row with null fields),
    ``idx`` its 0-based index in its message; ``single``: one sample per block and a batch's lists
    all of the batch's length (a mismatch pads with nulls, which fail the block checks)."""
    n = "len(coalesce(l_cycle, []))"
    lists = ", ".join(f"unnest(CASE WHEN n > 0 THEN {col} ELSE [NULL::BIGINT] END) AS {name}"
                      for col, name in _UNNESTED.items())
    same = " AND ".join(f"len({c}) = {n}" for c in _LISTS)
    absent = ", ".join(f"coalesce({name}, -1) AS {name}" for name in _UNNESTED.values())
    # Every per-message expression is computed below the unnest, once per message: an expression
    # beside the unnest would be evaluated once per block.
    return f"""SELECT * REPLACE ({absent}) FROM (
               SELECT "partition", "offset", timestamp_ms, key, kind, job_id, node, event_time, sample_us,
                      message_ok, k, paused_us, alone_us, blocks_sent, last_cycle, single,
                      unnest(range(greatest(n, 1))) AS idx, {lists}
               FROM (SELECT * REPLACE (coalesce(k, -1) AS k, coalesce(paused_us, -1) AS paused_us,
                                       coalesce(alone_us, 0) AS alone_us, coalesce(blocks_sent, -1) AS blocks_sent,
                                       coalesce(last_cycle, -1) AS last_cycle,
                                       coalesce(single AND (kind <> 'shutter_batch'
                                                            OR ({n} BETWEEN 1 AND {MAX_BATCH_BLOCKS} AND {same})),
                                                false) AS single),
                            {_MESSAGE_OK} AS message_ok, {n} AS n
                     FROM ({rows})))"""


def _typed_rows_sql(source: str) -> str:
    """Every node.ipc row with the fields of its typed columns, unchecked: the fold over them is
    kept only for jobs none of whose rows ``_suspects`` names."""
    return _unnested_sql(f"SELECT *, true AS single FROM {source}")


@dataclass(frozen=True)
class Suspects:
    """node.ipc rows whose typed columns do not reproduce their value's bytes (edited, written by
    another encoder, or files from before typed columns), and the jobs they may belong to."""

    keys: set[bytes]  # their message keys
    jobs: set[str]  # those keys as job ids, and the job ids their typed columns claim
    rows: int
    verified_rows: int  # the other rows


def _suspects(con: duckdb.DuckDBPyConnection, source: str) -> Suspects:
    """The one check that reads every value's bytes: re-encode each row's typed columns and
    compare. Nothing else is computed here, so the fold and the order check read narrow columns."""
    keys: set[bytes] = set()
    jobs: set[str] = set()
    rows = verified = 0
    for key, job, ok, n in con.execute(f"""
            SELECT CASE WHEN NOT ok THEN key END, CASE WHEN NOT ok THEN job_id END, ok, count(*)
            FROM (SELECT key, job_id, coalesce(({canonical_ipc_sql()}) = value, false) AS ok FROM {source})
            GROUP BY ALL""").fetchall():
        if ok:
            verified += n
            continue
        rows += n
        if key is not None:
            keys.add(key)
            with contextlib.suppress(UnicodeDecodeError):
                jobs.add(key.decode())
        if job is not None:
            jobs.add(job)
    return Suspects(keys, jobs, rows, verified)


class Edge(NamedTuple):
    """The first or last row of a run, or a row out of order inside one (``order_edges``)."""

    job: str
    node: str
    offset: int
    cycle: int | None  # the row's first cycle
    top: int | None  # its last cycle
    first: bool  # first of its run
    last: bool  # last of its run
    backwards: bool


def order_edges(con: duckdb.DuckDBPyConnection, source: str) -> list[Edge]:
    """The order check's pass over the rows of ``source`` (node.ipc rows from the typed columns,
    trusted where ``_suspects`` names no row of the job), in the order the scan meets them, with no
    sort: what ``backwards`` needs of them.

    A *run* is a stretch of consecutive rows of one (job, node) stream (the archive sorts each file
    by job, node and offset, so a stream is one run per file, or per task's part of a file).
    Within a run each row is compared with the row before it: its offset and its first cycle
    must be above the previous row's offset and last cycle, and a batch's own cycles must strictly
    increase; a row that fails is an edge marked backwards. Every run's first and last rows are
    edges too, for the comparison across runs."""
    # a run goes on while the stream does and its offsets do not go down
    same = ('{0}job_id IS NOT DISTINCT FROM job_id AND {0}node IS NOT DISTINCT FROM node '
            'AND coalesce({1}, false)')
    return [Edge(*row) for row in con.execute(f"""
        WITH scan AS (  -- a streaming window: the order the scan produces, no sort
            SELECT job_id, node, "offset", cycle, top, inside, lag(job_id) OVER () AS p_job_id,
                   lag(node) OVER () AS p_node, lead(job_id) OVER () AS n_job_id, lead(node) OVER () AS n_node,
                   lag("offset") OVER () AS p_offset, lead("offset") OVER () AS n_offset, lag(top) OVER () AS p_top
            FROM (SELECT job_id, node, "offset", l_cycle[1] AS cycle, l_cycle[-1] AS top,
                         -- a batch's own cycles strictly increase
                         l_cycle = list_sort(l_cycle) AND len(list_distinct(l_cycle)) = len(l_cycle) AS inside
                  FROM {source} WHERE kind IN ('shutter_block', 'shutter_batch')))
        SELECT job_id, node, "offset", cycle, top, first, last,
               NOT coalesce(inside, false) OR (NOT first AND NOT ("offset" > p_offset AND cycle > p_top))
        FROM (SELECT *, NOT ({same.format("p_", 'p_offset <= "offset"')}) AS first,
                        NOT ({same.format("n_", 'n_offset >= "offset"')}) AS last FROM scan)
        WHERE first OR last OR NOT ("offset" > p_offset AND cycle > p_top) OR NOT coalesce(inside, false)
    """).fetchall()]


def backwards(edges: Iterable[Edge]) -> set[tuple[str, str]]:
    """(job, node) streams whose block cycles do not strictly increase in offset order (and, within a
    batch, in its order), from the edges of every part of the archive (``order_edges``).

    Only the runs' first and last rows are sorted by offset: every run must start after the one
    before it has ended (each first row follows a last row) and at a higher cycle. Runs being
    disjoint and each increasing, that is the whole stream increasing, whatever order the files
    are read in and however they are split; rows in any other order only make more, shorter runs.
    """
    by_stream: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    bad: set[tuple[str, str]] = set()
    for edge in edges:
        if edge.backwards:
            bad.add((edge.job, edge.node))
        by_stream[(edge.job, edge.node)].append(edge)
    for stream, rows in by_stream.items():
        if stream in bad:
            continue
        rows.sort(key=lambda e: e.offset)
        for before, edge in itertools.pairwise(rows):
            # a run starts right after a run ended, at a higher cycle (a null cycle is no verdict here:
            # its row failed the check inside its run)
            if edge.first and (not before.last or not before.offset < edge.offset  # an offset held twice: a copy
                               or (before.top is not None and edge.cycle is not None
                                   and not before.top < edge.cycle)):
                bad.add(stream)
                break
    return bad


def out_of_order_streams(con: duckdb.DuckDBPyConnection, source: str) -> set[tuple[str, str]]:
    """The streams of ``source`` whose block cycles do not strictly increase (``backwards`` of its
    ``order_edges``)."""
    return backwards(order_edges(con, source))


def _fold(con: duckdb.DuckDBPyConnection, rows_sql: str, delta: str, join: str) -> list[StreamRow]:
    """Rows folded per (job, node) stream: the checks that make a job eligible, Alg. 4's verdicts
    (with each job's delta) and exact sums. The order of the blocks is checked apart (``order_edges``)."""
    scale = f"{2.0**FIXED_POINT_BITS:.1f}"
    block = "kind IN ('shutter_block', 'shutter_batch')"
    # every check of streams.core.blocks.CHECKS, so the fast path counts exactly the blocks the reference does
    valid_block = (f"k = 1 AND single AND sample_us > 0 AND cycle >= 0 "
                   f"AND b_cycles > 0 AND d_cycles > 0 AND a_cycles > 0 "
                   f"AND b_instructions >= 0 AND d_instructions >= 0 AND a_instructions >= 0 "
                   f"AND b_threads > 0 AND d_threads > 0 AND a_threads > 0 AND greatest("
                   f"b_instructions, b_cycles, b_threads, d_instructions, d_cycles, d_threads, a_instructions, "
                   f"a_cycles, a_threads) < {_EXACT_INT}")
    # every value summed in fixed point fits it, the co-located IPC 0.5 (b + a) too (half of an IPC
    # just above 2**-30 is not a multiple of 2**-82)
    # ... and every product the second moments sum (SECOND_MOMENTS, in order); (sum, value, over which blocks)
    products = ("b * b", "d * d", "a * a", "b * d", "b * a", "d * a", "d * d", "co * co", "d * co")
    in_range = " AND ".join(f"({x} = 0 OR ({x} >= {_IPC_MIN!r} AND {x} < {_IPC_MAX!r}))" for x in (
        "b", "d", "a", "0.5 * (b + a)", *(p.replace("co", "(0.5 * (b + a))") for p in products)))
    fixed = [*zip(_SUMS, ("d", "co", "d", "co", "b", "a"), ("keep", "keep", "exact", "exact", "keep", "keep"),
                  strict=True),
             *((n, x, "exact" if n.endswith("_all") else "keep") for n, x in zip(SECOND_MOMENTS, products,
                                                                                  strict=True))]
    sums = ", ".join(
        # CASE, not FILTER: the cast must never see an IPC that does not fit (DuckDB casts before filtering)
        f"coalesce(sum(CASE WHEN {when_} THEN CAST({x} * {scale} AS HUGEINT) END), 0) AS {n}"
        for n, x, when_ in fixed)
    rows = con.execute(f"""
        WITH r AS ({rows_sql}),
        m0 AS (
            SELECT r."partition", r."offset", r.idx, {_POSITION} AS pos, r.job_id, r.node, r.sample_us, r.cycle,
                   r.paused_us,
                   r.alone_us, r.blocks_sent,
                   r.{block} AS is_block, r.kind = 'job_left_node' AS is_left,
                   {delta} AS delta,
                   r.message_ok
                     AND CASE WHEN r.{block} THEN {valid_block}
                              WHEN r.kind = 'job_left_node' THEN r.blocks_sent >= 0 AND r.last_cycle >= -1
                                                                 AND r.alone_us >= 0
                              ELSE false END AS row_ok,
                   CASE WHEN r.{block} AND b_cycles > 0 THEN b_instructions::DOUBLE / b_cycles END AS b,
                   CASE WHEN r.{block} AND d_cycles > 0 THEN d_instructions::DOUBLE / d_cycles END AS d,
                   CASE WHEN r.{block} AND a_cycles > 0 THEN a_instructions::DOUBLE / a_cycles END AS a
            FROM r {join}
            WHERE r.job_id IS NOT NULL
        ),
        m1 AS (  -- exact: the block's IPCs fit the fixed point (its job is ineligible otherwise)
            SELECT *, is_block AND ({in_range}) AS exact FROM m0
        ),
        m AS (
            SELECT *, exact AND abs(b - a) < delta AND b < d AND a < d AS keep, 0.5 * (b + a) AS co FROM m1
        )
        SELECT job_id, node, min("partition"), max("partition"),
               bool_and(row_ok AND (NOT is_block OR exact)),
               true,  -- increasing: the order check's (order_edges, backwards)
               count(*) FILTER (WHERE is_block), count(*) FILTER (WHERE is_left),
               min("offset"), max("offset"),
               max("offset") FILTER (WHERE is_left), max(blocks_sent) FILTER (WHERE is_left),
               max(paused_us) FILTER (WHERE is_left), max(alone_us) FILTER (WHERE is_left),
               arg_min(cycle, pos) FILTER (WHERE is_block), arg_max(cycle, pos) FILTER (WHERE is_block),
               count(*) FILTER (WHERE keep), count(*) FILTER (WHERE is_block AND NOT keep),
               {sums},
               any_value(sample_us) FILTER (WHERE is_block),
               min(pos) FILTER (WHERE is_block), max(pos) FILTER (WHERE is_block)
        FROM m
        GROUP BY job_id, node, CASE WHEN is_block THEN sample_us END  -- the blocks per S, and the markers
    """).fetchall()
    names = [f.name for f in fields(StreamRow)][:18]  # the fields before the sums, in the query's order
    n = len(fixed)
    return [StreamRow(**dict(zip(names, r, strict=False)), sums=tuple(int(x) for x in r[18:18 + n]),
                      sample_us=r[18 + n], first_pos=r[19 + n], last_pos=r[20 + n]) for r in rows]


@dataclass(frozen=True)
class Chunk:
    """Rows of the archive's node.ipc files that one task folds: consecutive row groups, as (file,
    first row, end row) ranges (end None: the whole file); with ``dedupe``, every file at once and
    each offset once (a compaction in progress left copies)."""

    parts: tuple[tuple[PurePath, int, int | None], ...]
    size: int  # uncompressed bytes: what the plan balances
    dedupe: bool = False


def plan_chunks(archive: ParquetArchive, tasks: int, dedupe: bool = False) -> list[Chunk]:
    """The node.ipc files cut at row-group boundaries into about ``tasks`` chunks of equal bytes,
    largest first (the last task to start is a small one). Any number of partitions, any layout:
    a job's rows may be in several chunks, whose folds add up (``merge_streams``). With ``dedupe``
    (an offset held twice: ``ParquetArchive.duplicates``), one chunk of every file, which keeps one
    copy of each offset."""
    files = archive.files(NODE_IPC.name)
    if not files:
        return []
    if dedupe:  # copies are found by offset across files: one task sees them all
        return [Chunk(tuple((f, 0, None) for f in files), 0, dedupe=True)]
    groups = {f: archive.row_groups(f) for f in files}
    target = sum(size for g in groups.values() for _, size in g) / max(1, tasks)
    chunks: list[Chunk] = []
    parts: list[tuple[PurePath, int, int | None]] = []
    size = 0
    for f, row_groups in groups.items():
        total = sum(rows for rows, _ in row_groups)
        row = 0
        for rows, bytes_ in row_groups:
            if parts and size + bytes_ - target > target - size:  # nearer the target without this group
                chunks.append(Chunk(_whole_files(parts, f, total), size))
                parts, size = [], 0
            if parts and parts[-1][0] == f:
                parts[-1] = (f, parts[-1][1], row + rows)
            else:
                parts.append((f, row, row + rows))
            row, size = row + rows, size + bytes_
        if parts and parts[-1][0] == f:
            parts = list(_whole_files(parts, f, total))
    if parts:
        chunks.append(Chunk(tuple(parts), size))
    return sorted(chunks, key=lambda c: -c.size)


def _whole_files(parts: list[tuple[PurePath, int, int | None]], f: PurePath, total: int
                 ) -> tuple[tuple[PurePath, int, int | None], ...]:
    """``parts`` with the last one (of file ``f``, ``total`` rows) marked whole when it is."""
    if parts and parts[-1][0] == f and parts[-1][1] == 0 and parts[-1][2] == total:
        parts = [*parts[:-1], (f, 0, None)]
    return tuple(parts)


def _read_sql(archive: ParquetArchive, parts: Iterable[tuple[PurePath, int, int | None]]) -> str:
    """The rows of a chunk's parts as one relation, in the parts' order (the order check compares
    neighbouring rows): consecutive whole files in one scan, a file's row range by its row numbers
    (DuckDB skips the row groups outside it)."""
    def quoted(f: PurePath) -> str:
        return "'" + archive.uri(f).replace("'", "''") + "'"

    reads: list[str] = []
    whole: list[PurePath] = []
    for f, start, end in [*parts, (PurePath(), 0, -1)]:  # a last range flushes the whole files before it
        if end is None:
            whole.append(f)
            continue
        if whole:
            reads.append(f"SELECT * FROM read_parquet([{', '.join(map(quoted, whole))}], union_by_name = true)")
            whole = []
        if end >= 0:
            reads.append(f"SELECT * EXCLUDE (file_row_number) FROM read_parquet({quoted(f)}, file_row_number = true) "
                         f"WHERE file_row_number >= {start} AND file_row_number < {end}")
    return "(" + " UNION ALL BY NAME ".join(reads) + ")"


@dataclass
class ChunkFold:
    """What one task found in its chunk: the typed fold of its rows per stream (partial where a
    stream's rows are in other chunks too), the order check's edges and the suspect rows."""

    streams: list[StreamRow]
    edges: list[Edge]
    suspects: Suspects

    @property
    def blocks(self) -> int:
        return sum(r.blocks for r in self.streams)


_local = threading.local()


def _connection(archive: ParquetArchive) -> duckdb.DuckDBPyConnection:
    """This thread's one-thread database for the archive (opening one costs 15-30 ms; a task is
    a thread's, so a worker reuses one across its tasks)."""
    cache = _local.__dict__.setdefault("connections", {})
    key = str(archive.location)
    if key not in cache:
        cache[key] = archive.connect()
    con: duckdb.DuckDBPyConnection = cache[key]
    return con


def _delta_sql(con: duckdb.DuckDBPyConnection, deltas: dict[str, float], default_delta: float) -> tuple[str, str]:
    """Each block's delta (SQL) and the join it needs: a constant, or a hash join on every row for the
    jobs whose delta is not the default."""
    if not deltas:
        return repr(default_delta), ""
    con.register("deltas", pa.table({"job": list(deltas), "delta": list(deltas.values())}))
    return f"coalesce(dl.delta, {default_delta!r})", "LEFT JOIN deltas dl ON dl.job = r.job_id"


def fold_chunk(location: Path | str, chunk: Chunk, deltas: dict[str, float], default_delta: float) -> ChunkFold:
    """One task of the audit: a chunk's rows re-encoded and compared with their values
    (``_suspects``), folded from their typed columns, and their order's edges, on one thread."""
    archive = ParquetArchive(location, threads=1)
    con = _connection(archive)
    source = _source_sql(archive, [f for f, _, _ in chunk.parts], chunk.dedupe, _read_sql(archive, chunk.parts))
    # Removing copies loses the files' row order; only the order check needs it back.
    in_file_order = f'(SELECT * FROM {source} ORDER BY job_id, node, "offset")' if chunk.dedupe else source
    delta, join = _delta_sql(con, deltas, default_delta)
    suspects = _suspects(con, source)
    folded = _fold(con, _typed_rows_sql(source), delta, join)
    return ChunkFold(folded, order_edges(con, in_file_order), suspects)


def merge_streams(rows: Iterable[StreamRow]) -> list[StreamRow]:
    """Partial folds of the same (job, node, S) stream from several chunks, added up: counts and
    sums add, flags and, ranges widen, a first or last block is the one at the lowest or highest
    stream position."""
    merged: dict[tuple[str, str | None, int | None], StreamRow] = {}
    for r in rows:
        key = (r.job, r.node, r.sample_us)
        m = merged.get(key)
        merged[key] = r if m is None else _merged(m, r)
    return list(merged.values())


def _merged(a: StreamRow, b: StreamRow) -> StreamRow:
    def low(x: int | None, y: int | None) -> int | None:
        return y if x is None else x if y is None else min(x, y)

    def high(x: int | None, y: int | None) -> int | None:
        return y if x is None else x if y is None else max(x, y)

    first = a if b.first_pos is None or (a.first_pos is not None and a.first_pos <= b.first_pos) else b
    last = a if b.last_pos is None or (a.last_pos is not None and a.last_pos >= b.last_pos) else b
    return replace(
        a, min_partition=min(a.min_partition, b.min_partition), max_partition=max(a.max_partition, b.max_partition),
        clean=a.clean and b.clean, increasing=a.increasing and b.increasing, blocks=a.blocks + b.blocks,
        lefts=a.lefts + b.lefts, first_offset=min(a.first_offset, b.first_offset),
        last_offset=max(a.last_offset, b.last_offset), left_offset=high(a.left_offset, b.left_offset),
        blocks_sent=high(a.blocks_sent, b.blocks_sent), paused_us=high(a.paused_us, b.paused_us),
        alone_us=high(a.alone_us, b.alone_us), first_cycle=first.first_cycle, last_cycle=last.last_cycle,
        accepted=a.accepted + b.accepted, rejected=a.rejected + b.rejected,
        sums=tuple(x + y for x, y in zip(a.sums, b.sums, strict=True)),
        first_pos=low(a.first_pos, b.first_pos), last_pos=high(a.last_pos, b.last_pos))


@dataclass(frozen=True)
class Runner:
    """Where the audit's tasks run: ``slots`` at once; ``map`` yields each call's result as it
    completes. ``in_process`` is threads of this process; ``sinks.audit.on_dask`` a Dask cluster."""

    slots: int
    map: Callable[[Callable[..., Any], list[tuple[Any, ...]]], Iterator[Any]]
    processes: bool = False  # its slots are processes: Python work (the reference fold) runs in parallel too

    @property
    def tasks(self) -> int:
        """How many tasks to cut the work into: two per slot, so that a slot that finishes early takes
        another (on 2 cores, 1 M blocks: 1, 2 and 4 per slot gave 3.35, 3.11 and 2.76 M samples/s on
        two threads, 3.04, 2.92 and 2.71 M on two Dask workers: each task costs about 35 ms of query
        planning)."""
        return 2 * self.slots if self.slots > 1 else 1


def in_process(threads: int | None = None) -> Runner:
    """Tasks on ``threads`` threads of this process (default: one per core); DuckDB releases the GIL,
    so they run in parallel."""
    n = max(1, threads or os.cpu_count() or 1)

    def run(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> Iterator[Any]:
        if n == 1 or len(calls) <= 1:
            for args in calls:
                yield fn(*args)
            return
        with ThreadPoolExecutor(max_workers=n) as pool:
            for future in as_completed([pool.submit(fn, *args) for args in calls]):
                yield future.result()

    return Runner(n, run)


#: Seconds per step of a recomputation, added up (``fast_recompute``'s ``timings``): the bench
#: reads from them how much of the audit is the driver's, which more workers do not shorten.
Timings = dict[str, float]


@contextlib.contextmanager
def lap(timings: Timings | None, step: str) -> Iterator[None]:
    """Add the block's wall seconds to ``timings[step]`` (nothing when ``timings`` is None)."""
    if timings is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[step] = timings.get(step, 0.0) + time.perf_counter() - start


def _lapped(timings: Timings | None, step: str, fn: Callable[..., Any], *args: Any) -> Any:
    with lap(timings, step):
        return fn(*args)


#: Reports progress: (tasks done, tasks, shutter samples folded so far).
Progress = Callable[[int, int, int], None]


def read_streams(archive: ParquetArchive, deltas: dict[str, float], default_delta: float,
                 runner: Runner | None = None, progress: Progress | None = None, dedupe: bool = False,
                 timings: Timings | None = None) -> tuple[list[StreamRow], Suspects]:
    """The archive's node.ipc records folded per (job, node) stream by tasks (``runner``: default,
    threads of this process), each on a chunk of the files' row groups: every row's typed columns
    are re-encoded and compared with its value (``_suspects``), the rows are folded from their
    typed columns and their order's edges taken; the chunks' folds add up per stream and the edges
    are checked across chunks. For jobs with no suspect row the typed columns *are* the values'
    fields, so that fold stands; the streams of jobs a suspect row may belong to are left out (the
    reference path, which decodes every value with the models, recomputes them). Returns the
    streams and the suspects; ``timings`` adds the seconds of its steps (``lap``)."""
    runner = runner if runner is not None else in_process(archive.threads)
    with lap(timings, "plan_s"):
        chunks = plan_chunks(archive, runner.tasks, dedupe)
    folds: list[ChunkFold] = []
    with lap(timings, "tasks_s"):
        for fold in runner.map(fold_chunk, [(archive.location, c, deltas, default_delta) for c in chunks]):
            folds.append(fold)
            if progress is not None:
                progress(len(folds), len(chunks), 3 * sum(f.blocks for f in folds))
    with lap(timings, "merge_s"):
        suspects = Suspects(set().union(*(f.suspects.keys for f in folds)),
                            set().union(*(f.suspects.jobs for f in folds)),
                            sum(f.suspects.rows for f in folds), sum(f.suspects.verified_rows for f in folds))
        out_of_order = backwards(e for f in folds for e in f.edges)
        streams = [replace(s, increasing=(s.job, s.node) not in out_of_order)
                   for s in merge_streams(r for f in folds for r in f.streams) if s.job not in suspects.jobs]
    return streams, suspects


def terminal_events(archive: ParquetArchive, con: duckdb.DuckDBPyConnection | None = None
                    ) -> tuple[dict[str, list[TerminalEvent]], set[str]]:
    """Decoded terminal (charged) lifecycle events per job, through the reference decoder (they are
    few), and the jobs left to the reference path: a terminal event the clock rule refuses, an
    operator's adjustment (its revisions are the reducer's to number), or a started event with TRES
    (a terminal event without is priced with them: the reducer's ``allocations``)."""
    out: dict[str, list[TerminalEvent]] = defaultdict(list)
    to_reference: set[str] = set()
    for topic, ev in archive.events([JOBS_LIFECYCLE.name], con=con):
        try:
            rec = decode(BY_NAME[topic], ev.value)
        except DecodeError:
            continue
        if isinstance(rec, ChargeAdjustment) or (isinstance(rec, JobEvent) and rec.tres and not rec.ran):
            to_reference.add(rec.job_id)
        elif isinstance(rec, JobEvent) and rec.ran and ev.key == rec.job_id.encode():
            if clock_problem(rec, ev.timestamp_ms / 1000):
                to_reference.add(rec.job_id)
            out[rec.job_id].append(TerminalEvent(event=rec, topic=topic, partition=ev.partition, offset=ev.offset,
                                                 reason=""))
    return out, to_reference


def fast_recompute(archive_root: Path | str, policies: dict[str, PricingPolicy], default: PricingPolicy,
                   partitions: Iterable[int] | None = None, threads: int | None = None, *,
                   runner: Runner | None = None, progress: Progress | None = None,
                   timings: Timings | None = None) -> FastResult:
    """Every charge the vectorized path can recompute from the archive (of ``partitions``, default
    all), and the jobs it leaves to the reference path. The node.ipc fold runs as tasks on
    ``runner`` (default: ``threads`` threads of this process, one per core when None);
    ``progress`` hears of each task done; ``timings`` (when given) gets the seconds of each step:
    plan_s, tasks_s and merge_s of the fold, terminals_s and duplicates_s (beside the tasks, on
    threads of their own), charges_s and total_s."""
    with lap(timings, "total_s"):
        return _fast_recompute(archive_root, policies, default, partitions, threads, runner, progress, timings)


def _fast_recompute(archive_root: Path | str, policies: dict[str, PricingPolicy], default: PricingPolicy,
                    partitions: Iterable[int] | None, threads: int | None, runner: Runner | None,
                    progress: Progress | None, timings: Timings | None) -> FastResult:
    archive = ParquetArchive(archive_root, partitions, threads)
    # The most common delta is the query's constant; only the others need a per-row lookup.
    common = Counter(p.delta for p in policies.values()).most_common(1)
    default_delta = common[0][0] if common else default.delta
    deltas = {job: p.delta for job, p in policies.items() if p.delta != default_delta}
    # The lifecycle events are decoded in Python while the tasks fold node.ipc (DuckDB releases the GIL).
    if any((span := file_span(f)) is not None and span.epoch for t in (NODE_IPC.name, JOBS_LIFECYCLE.name)
           for f in archive.files(t)):
        # A topic restarted (a new epoch reuses offsets): the queries here key rows by offset, so the
        # reference path, which reads each epoch's offsets apart, recomputes every job.
        ends, _ = terminal_events(archive)
        return FastResult(ineligible=set(ends) | set(archive.keys([NODE_IPC.name])))
    with ThreadPoolExecutor(max_workers=2) as pool:
        held_twice = pool.submit(_lapped, timings, "duplicates_s", archive.duplicates,
                                 [NODE_IPC.name, JOBS_LIFECYCLE.name])
        terminals = pool.submit(_lapped, timings, "terminals_s", terminal_events, archive, archive.connect())
        # folded as if every offset were held once (the common case), while the check runs beside
        streams, suspects = read_streams(archive, deltas, default_delta, runner, progress, timings=timings)
        duplicates = held_twice.result()
        if any(topic == NODE_IPC.name for topic, *_ in duplicates):  # copies: folded again, one of each offset
            streams, suspects = read_streams(archive, deltas, default_delta, runner, progress, dedupe=True,
                                             timings=timings)
        ends, to_reference = terminals.result()
    result = FastResult(typed_rows=suspects.verified_rows, suspect_rows=suspects.rows, duplicates=duplicates,
                        ineligible=set(suspects.jobs))
    by_job: dict[str, dict[str | None, list[StreamRow]]] = defaultdict(lambda: defaultdict(list))
    with lap(timings, "charges_s"):
        for row in streams:
            by_job[row.job][row.node].append(row)  # a row per S of the node's blocks, and one for its marker
        work = [(job, dict(nodes), ends.get(job, []), policies.get(job, default))
                for job, nodes in by_job.items() if job not in to_reference]
        built = dict(_charge_jobs(work) if runner is None or not runner.processes or runner.slots < 2 else
                     (c for group in runner.map(_charge_jobs, [(work[i::runner.slots],) for i in range(runner.slots)])
                      for c in group))
        for job in by_job:  # in the archive's order, however the groups ran
            charge = built.get(job)
            if charge is None:
                result.ineligible.add(job)
            else:
                result.charges[(job, 0)] = charge
                counted = charge.node_summary.blocks if charge.node_summary else sum(n.blocks for n in charge.nodes)
                result.samples += 3 * int(counted)
    # Jobs with a terminal event but no node.ipc record at all: only the reference path can say.
    result.ineligible |= {j for j in ends if j not in by_job}
    return result


def _charge_jobs(work: list[tuple[str, dict[str | None, list[StreamRow]], list[TerminalEvent], PricingPolicy]]
                 ) -> list[tuple[str, Charge | None]]:
    """Each job's charge from its folded streams (None: the reference path's). On a runner of
    processes the driver hands these out in groups, one per slot: building a charge is Python (its
    models, its estimate), and left to the driver alone it was most of what more workers cannot
    shorten (``bench audit``'s ``steps_s``)."""
    return [(job, _job_charge(job, nodes, terminals, policy)) for job, nodes, terminals, policy in work]


def _job_charge(job: str, nodes: dict[str | None, list[StreamRow]], terminals: list[TerminalEvent],
                policy: PricingPolicy) -> Charge | None:
    rows = [r for node_rows in nodes.values() for r in node_rows]
    if len(terminals) != 1 or not all(r.clean for r in rows):
        return None
    partitions = {r.min_partition for r in rows} | {r.max_partition for r in rows}
    if len(partitions) != 1:
        return None
    terminal = terminals[0]
    streams: list[tuple[str, NodeStream]] = []
    width = len(_SUMS) + len(SECOND_MOMENTS)
    sums = [0] * width
    by_s: dict[int, list[int]] = {}  # per sample length S: its sums, then accepted and rejected
    accepted = rejected = 0
    for name in sorted(terminal.event.nodes):
        node_rows = nodes.get(name)
        if not node_rows:
            return None
        lefts = [r for r in node_rows if r.lefts]
        last_offset = max(r.last_offset for r in node_rows)
        if (len(lefts) != 1 or lefts[0].lefts != 1 or lefts[0].left_offset != last_offset
                or not all(r.increasing for r in node_rows)):
            return None  # not closed exactly once, a block after the close, or duplicates / out of order
        left = lefts[0]
        blocks = [r for r in node_rows if r.blocks]
        for row in blocks:
            sums = [a + b for a, b in zip(sums, row.sums, strict=True)]
            accepted += row.accepted
            rejected += row.rejected
            assert row.sample_us is not None  # a clean block has one
            level = by_s.setdefault(row.sample_us, [0] * (width + 2))
            by_s[row.sample_us] = [a + b for a, b in zip(level, (*row.sums, row.accepted, row.rejected), strict=True)]
        first = min(blocks, key=lambda r: r.first_pos or 0, default=None)
        last = max(blocks, key=lambda r: r.last_pos or 0, default=None)
        streams.append((name, NodeStream(
            blocks=sum(r.blocks for r in node_rows),
            first_cycle=-1 if first is None or first.first_cycle is None else first.first_cycle,
            last_cycle=-1 if last is None or last.last_cycle is None else last.last_cycle,
            first_offset=min(r.first_offset for r in node_rows), close_offset=last_offset, closed=True,
            blocks_sent=int(left.blocks_sent or 0), paused_us=max(0, int(left.paused_us or 0)),
            alone_us=int(left.alone_us or 0),
        )))
    totals = [math.ldexp(float(x), -FIXED_POINT_BITS) for x in sums]  # one rounding of each exact sum
    levels = None
    if policy.estimator == MIXED_S:
        levels = {}
        for s_us, level in by_s.items():
            t = [math.ldexp(float(x), -FIXED_POINT_BITS) for x in level[:width]]
            levels[s_us] = (*t[:4], level[width], level[width + 1], *t[4:6], tuple(t[6:]))
    est = estimate_from_totals(*totals[:4], accepted, rejected, *totals[4:6], policy.estimator, totals[6:],
                               levels=levels)
    return build_charge(job, 0, terminal, streams, est, policy, (NODE_IPC.name, partitions.pop()))
