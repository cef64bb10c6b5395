"""The archive: every input event, verbatim, in Parquet, hive-partitioned by topic and date.

Longer than 500 lines because the write protocol, the resume point, epochs, retention and the
readers are one contract over one file layout: each reader relies on exactly what the writer
guarantees (whole files, one copy of each offset per epoch, the names' ranges), and split across
modules those guarantees would be stated in one place and relied on in another.

Layout: ``ROOT/topic=<catalog topic>/date=<YYYY-MM-DD>/p<partition>[-e<epoch>]-<first offset>-<last offset>.parquet``

* each file is written to a temporary name, fsynced, then renamed: readers never see half a file;
  a sink killed mid-write leaves the temporary, which the partition's next owner removes;
* the sink writes one file per run of consecutive offsets of a partition in a batch (normally one
  a batch), filed under the UTC date of its latest broker timestamp: a batch's offsets are durable
  together or not at all, whatever their timestamps' order (two files by date were not: a crash
  between them left a hole that "resume after the highest offset" never filled);
* a file's name states its offset range; on start the sink resumes per partition at the end of the
  contiguous prefix of the offsets actually held (files whose row count does not fill their range,
  written before this layout, count by their offsets), whatever Kafka's committed offset says, and
  drops every offset it already holds: each offset archived once, no gaps;
* an *epoch* is one life of a topic partition: when the topic restarts at a lower offset (a broker
  with memory storage restarted, the topic was recreated), an offset the archive holds arrives with
  other bytes, or one below everything held arrives; the sink then starts the next epoch (recorded
  in ``epochs/<topic>/p<partition>.json`` before anything of it is written) and reads the new log
  from its beginning. Epoch 0 files keep the old names; (epoch, topic, partition, offset) is unique;
* a row is (kafka_topic, partition, offset, timestamp_ms, key, value) with the value's bytes as
  they were received, so the audit decodes exactly what the stream worker decoded; rows are in
  offset order, but ``node.ipc`` rows are sorted by job, node and offset (readers that need the
  log's order sort by offset, as ``events`` does);
* retention (``prune``) removes whole dates before a cutoff and notes in ``retention.json`` the
  highest offset it removed per (topic, partition); a charge whose event range reaches back to a
  removed offset can no longer be recomputed, and the audit says so instead of diffing it;
* ``node.ipc`` files also carry the value's fields as typed columns (``IPC_FIELDS``), extracted
  in bulk when the file is written. They are a cache for scans, never the record: the audit
  uses a row's typed columns only where re-encoding them reproduces the value's exact bytes
  (``fast_audit.canonical_ipc_sql``), and parses the value otherwise.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import BatchSink, position
from nodeshare.runtime.files import atomic_write_bytes, publish_file
from nodeshare.schemas import INPUT_TOPICS, spec_for_topic
from nodeshare.schemas.signing import header_value

log = logging.getLogger(__name__)

ARCHIVE_SCHEMA = pa.schema([
    ("kafka_topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("timestamp_ms", pa.int64()),
    ("key", pa.binary()),
    ("value", pa.binary()),
    # the record's signature header (nodeshare.schemas.signing), as received; null when unsigned and
    # in files written before it existed (read with this schema, they show null)
    ("auth", pa.binary()),
])
_FILE = re.compile(r"^p(\d+)(?:-e(\d+))?-(\d+)-(\d+)\.parquet$")


RETENTION_FILE = "retention.json"
_EPOCH_IN_NAME = r"/p\d+-e(\d+)-\d+-\d+\.parquet$"  # for SQL over the files' names
EPOCHS_DIR = "epochs"
#: A position orders a partition's epochs one after the other: epoch * EPOCH_STRIDE + offset (epoch
#: 0's positions are its offsets). 2**48 offsets is 9 years at a million messages a second.
EPOCH_STRIDE = 1 << 48


class FileSpan(NamedTuple):
    partition: int
    epoch: int
    first: int  # offset
    last: int


def file_span(path: PurePath) -> FileSpan | None:
    """(partition, epoch, first offset, last offset) from an archive file's name; None for other files."""
    m = _FILE.match(path.name)
    return FileSpan(int(m.group(1)), int(m.group(2) or 0), int(m.group(3)), int(m.group(4))) if m else None


def file_range(path: PurePath) -> tuple[int, int, int] | None:
    """(partition, first position, last position) from an archive file's name (``EPOCH_STRIDE``: the
    offsets themselves in epoch 0), so that files of two epochs never seem to overlap; None for
    other files."""
    span = file_span(path)
    if span is None:
        return None
    base = span.epoch * EPOCH_STRIDE
    return span.partition, base + span.first, base + span.last


def file_name(partition: int, epoch: int, first: int, last: int) -> str:
    tag = f"-e{epoch:04d}" if epoch else ""
    return f"p{partition:04d}{tag}-{first:012d}-{last:012d}.parquet"


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Inclusive offset ranges, sorted, overlapping or adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def runs(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted offsets as inclusive ranges of consecutive ones."""
    return merge_ranges((o, o) for o in offsets)


@dataclass
class PartitionLog:
    """What the archive holds of one topic partition's latest epoch: its offset ranges (files, and
    what retention removed of this epoch) and which of them only retention accounts for."""

    epoch: int
    ranges: list[tuple[int, int]]
    pruned: tuple[int, int] | None = None

    def holds(self, offset: int) -> bool:
        i = bisect.bisect_right(self.ranges, (offset, 1 << 62)) - 1
        return i >= 0 and self.ranges[i][0] <= offset <= self.ranges[i][1]

    def in_files(self, offset: int) -> bool:
        return self.holds(offset) and not (self.pruned and self.pruned[0] <= offset <= self.pruned[1])

    def add(self, first: int, last: int) -> None:
        self.ranges = merge_ranges([*self.ranges, (first, last)])

    def resume_at(self) -> int | None:
        """Where to read this partition from: the last offset of the contiguous prefix held, read
        again to see that the topic did not restart (``ParquetArchive.append`` compares it), or the
        one after it when retention removed it; None when nothing is held (the log's beginning)."""
        if not self.ranges:
            return None
        last = self.ranges[0][1]
        return last if self.in_files(last) else last + 1


#: node.ipc typed columns: (column, Arrow type, JSON path in the value). Absent or mistyped: null.
IPC_FIELDS: list[tuple[str, pa.DataType, str]] = [
    ("kind", pa.string(), "$.kind"), ("event_id", pa.string(), "$.event_id"),
    ("schema_version", pa.int64(), "$.schema_version"), ("source", pa.string(), "$.source"),
    ("event_time", pa.string(), "$.event_time"), ("job_id", pa.string(), "$.job_id"),
    ("node", pa.string(), "$.node"), ("seq", pa.int64(), "$.seq"), ("k", pa.int64(), "$.k"),
    ("sample_us", pa.int64(), "$.sample_us"), ("counter", pa.string(), "$.counter"),
    ("blocks_sent", pa.int64(), "$.blocks_sent"), ("last_cycle", pa.int64(), "$.last_cycle"),
    ("paused_us", pa.int64(), "$.paused_us"), ("alone_us", pa.int64(), "$.alone_us"),
]
#: The blocks' fields as lists, one element per block (K = 1) or per sample: (column, path in a
#: schema-3 batch, path in a version-1/2 single block, which reads as a list of one).
IPC_LISTS: list[tuple[str, str, str]] = [
    ("l_cycle", "$.cycle", "$.cycle"),
    *[(f"l_{region[0]}_{name}", f"$.{region}.{name}", f"$.{region}[0].{name}")
      for region in ("before", "during", "after") for name in ("instructions", "cycles", "threads")],
]


def typed_columns_sql(v: str, prefix: str = "") -> tuple[str, str]:
    """How every typed column is extracted from the JSON text ``v``: the select list (names given
    ``prefix``), which reads ``f``, and the expression to select as ``f`` in the query below it.
    Absent or mistyped: NULL."""
    paths = ", ".join(f"'{path}'" for _, _, path in IPC_FIELDS)
    scalars = ", ".join(
        f"f[{i}] AS {prefix}{name}" if kind == pa.string() else f"TRY_CAST(f[{i}] AS BIGINT) AS {prefix}{name}"
        for i, (name, kind, _) in enumerate(IPC_FIELDS, start=1))
    lists = ", ".join(
        f"""CASE f[1] WHEN 'shutter_batch' THEN TRY_CAST(json_extract({v}, '{batch}') AS BIGINT[])
                      WHEN 'shutter_block' THEN [TRY_CAST(json_extract_string({v}, '{block}') AS BIGINT)]
            END AS {prefix}{name}"""
        for name, batch, block in IPC_LISTS)
    return f"{scalars}, {lists}", f"CASE WHEN json_valid({v}) THEN json_extract_string({v}, [{paths}]) END"


IPC_SCHEMA = pa.schema([*ARCHIVE_SCHEMA, *[(name, kind) for name, kind, _ in IPC_FIELDS],
                        *[(name, pa.list_(pa.int64())) for name, _, _ in IPC_LISTS]])
#: Topics whose files carry typed columns, and their schema.
TYPED = {"node.ipc": IPC_SCHEMA}


def with_typed_columns(topic: str, table: pa.Table) -> pa.Table:
    """The table with its topic's typed columns, parsed from the values by DuckDB in one pass, its
    rows sorted by job, node and offset: each (job, node) block stream is one run of rows per
    file, which the audit's order check reads in one pass (``fast_audit.order_edges``)."""
    schema = TYPED.get(topic)
    if schema is None:
        return table
    with duckdb.connect() as con:
        con.register("batch", table)
        columns, f = typed_columns_sql("v")
        typed = con.sql(f"""
            SELECT * EXCLUDE (v, f), {columns} FROM (
                SELECT *, {f} AS f FROM (SELECT *, try(decode(value)) AS v FROM batch))
            ORDER BY job_id NULLS LAST, node NULLS LAST, "offset"
        """).to_arrow_table()
    return typed.cast(schema)


@dataclass(frozen=True)
class ArchivedEvent:
    kafka_topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    auth: bytes | None = None  # the nodeshare-auth header


class ParquetArchive:
    """The archive under ``root``; with ``partitions``, a view of those input partitions only (what
    one task of a distributed audit reads: a job's records live in one partition of each topic).

    ``root`` is a directory, or a URL of object storage (``s3://bucket/prefix``) that fsspec can
    reach (credentials and endpoint from the environment, e.g. ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``): an archive there is read (audit, replay),
    through a filesystem registered with each DuckDB connection, never written."""

    def __init__(self, root: Path | str, partitions: Iterable[int] | None = None, threads: int | None = None) -> None:
        self.threads = threads  # DuckDB's threads per query (None: its default, every core)
        text = str(root)
        self.url: str | None = None
        self.fs: Any = None
        if "://" in text:  # object storage: read through fsspec
            import fsspec

            self.url = text.rstrip("/")
            self.fs, base = fsspec.core.url_to_fs(self.url)
            self.root = Path(base)
        else:
            self.root = Path(root)
        self.partitions = None if partitions is None else frozenset(partitions)
        self._listed: dict[str, list[PurePath]] = {}  # object storage: topic -> its files
        self._sizes: dict[PurePath, int] = {}  # object storage: each listed file's bytes, from the same listing
        self._held: dict[PurePath, list[tuple[int, int]]] = {}  # file -> the offset ranges it holds
        self._logs: dict[tuple[str, int], PartitionLog] = {}  # the sink's partitions, kept current by append

    @property
    def location(self) -> Path | str:
        """What this archive was opened on: its directory, or its URL."""
        return self.url if self.url is not None else self.root

    def _uri(self, path: PurePath) -> str:
        """A file as DuckDB and pyarrow read it: the path, or the URL on object storage."""
        return f"{self.url.split('://', 1)[0]}://{path}" if self.url is not None else str(path)

    def _local(self, what: str) -> None:
        if self.url is not None:
            raise ValueError(f"{what} needs the archive on a file system; {self.url} is read only here")

    def _local_files(self) -> list[Path]:
        """Every file, on a file system (what compaction and retention rewrite)."""
        self._local("rewriting files")
        return [Path(f) for f in self.files()]

    def connect(self) -> duckdb.DuckDBPyConnection:
        """An in-memory DuckDB that reads this archive's files (object storage registered)."""
        con = duckdb.connect(config={"threads": self.threads} if self.threads else {})
        if self.fs is not None:
            con.register_filesystem(self.fs)
        return con

    def schema_names(self, path: PurePath) -> set[str]:
        """The columns of one archive file."""
        return set(pq.read_schema(str(path), filesystem=self.fs).names)

    def row_groups(self, path: PurePath) -> list[tuple[int, int]]:
        """One file's row groups, in order: (rows, uncompressed bytes) of each (its footer only)."""
        meta = pq.read_metadata(str(path), filesystem=self.fs)
        return [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]

    def uri(self, path: PurePath) -> str:
        """A file as DuckDB reads it: its path, or its URL on object storage."""
        return self._uri(path)

    def files(self, topic: str = "*") -> list[PurePath]:
        """The archive's Parquet files (of one catalog topic, or all; of the view's partitions)."""
        found: list[PurePath]
        if self.fs is not None:  # read only here: listed once, as the audit's snapshot (each listing is requests)
            if topic not in self._listed:
                listing = self.fs.glob(f"{self.root}/topic={topic}/date=*/p*.parquet", detail=True)
                self._sizes.update({PurePosixPath(p): int(info["size"]) for p, info in listing.items()})
                self._listed[topic] = sorted(PurePosixPath(p) for p in listing)
            found = self._listed[topic]
        else:
            found = sorted(self.root.glob(f"topic={topic}/date=*/p*.parquet"))
        if self.partitions is None:
            return found
        return [f for f in found if (r := file_range(f)) is not None and r[0] in self.partitions]

    def partitions_held(self, topics: Iterable[str]) -> list[int]:
        """The input partitions the archive holds files of, for these topics."""
        return sorted({r[0] for t in topics for f in self.files(t) if (r := file_range(f)) is not None})

    def keys(self, topics: Iterable[str]) -> list[str]:
        """The distinct message keys (job ids) of these topics' records, decoded."""
        sources = ", ".join(self.sources_sql(t) for t in topics if self.files(t))
        if not sources:
            return []
        rows = self.connect().execute(
            f"SELECT DISTINCT key FROM read_parquet([{sources}], union_by_name = true) WHERE key IS NOT NULL"
        ).fetchall()
        return sorted(bytes(k).decode(errors="replace") for (k,) in rows)

    def sources_sql(self, topic: str = "*") -> str:
        """The files of one topic (or all) for ``read_parquet([...])``, as quoted SQL strings: the
        glob, or for a view of some partitions its files one by one."""
        if self.partitions is None:
            return f"'{self.glob_sql(topic)}'"
        return ", ".join("'" + self._uri(f).replace("'", "''") + "'" for f in self.files(topic))

    def high_water(self) -> dict[tuple[str, int], int]:
        """(catalog topic, partition) -> the highest offset archived of its latest epoch (pruned ones
        included)."""
        return {key: log.ranges[-1][1] for key, log in self.logs().items() if log.ranges}

    def _epoch_marker(self, topic: str, partition: int) -> Path:
        return self.root / EPOCHS_DIR / topic / f"p{partition:04d}.json"

    def marked_epoch(self, topic: str, partition: int) -> int:
        """The epoch the sink last started for this partition (0: none started)."""
        body = self._read_json(self._epoch_marker(topic, partition))
        return 0 if body is None else int(body["epoch"])

    def held(self, files: Iterable[PurePath] | None = None) -> dict[tuple[str, int, int], list[tuple[int, int]]]:
        """(catalog topic, partition, epoch) -> the offset ranges its files hold. A file whose row
        count fills its name's range holds all of it (the sink writes runs of consecutive offsets);
        another (written before that, by dates) holds the offsets its rows have."""
        ranges: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)
        for f in self.files() if files is None else files:
            span = file_span(f)
            if span is None:
                continue
            key = (f.parent.parent.name.removeprefix("topic="), span.partition, span.epoch)
            if f not in self._held:
                rows = pq.ParquetFile(str(f), filesystem=self.fs).metadata.num_rows
                self._held[f] = [(span.first, span.last)] if rows == span.last - span.first + 1 else runs(
                    pq.read_table(str(f), columns=["offset"], filesystem=self.fs).column("offset").to_pylist())
            ranges[key] += self._held[f]
        return {k: merge_ranges(v) for k, v in ranges.items()}

    def logs(self) -> dict[tuple[str, int], PartitionLog]:
        """(catalog topic, partition) -> what is held of its latest epoch (files, retention, markers)."""
        held = self.held()
        latest: dict[tuple[str, int], int] = {}
        for topic, partition, epoch in held:
            latest[(topic, partition)] = max(latest.get((topic, partition), 0), epoch)
        pruned = self.pruned_spans()
        for key, (epoch, _, _) in pruned.items():
            latest[key] = max(latest.get(key, 0), epoch)
        markers: Iterable[PurePath] = (
            self.root.glob(f"{EPOCHS_DIR}/*/p*.json") if self.fs is None
            else (PurePosixPath(m) for m in self.fs.glob(f"{self.root}/{EPOCHS_DIR}/*/p*.json")))
        for m in markers:
            key = (m.parent.name, int(m.stem[1:]))
            latest[key] = max(latest.get(key, 0), self.marked_epoch(*key))
        return {key: self._log(key, epoch, held, pruned) for key, epoch in latest.items()}

    @staticmethod
    def _log(key: tuple[str, int], epoch: int, held: dict[tuple[str, int, int], list[tuple[int, int]]],
             pruned: dict[tuple[str, int], tuple[int, int, int]]) -> PartitionLog:
        ranges = list(held.get((*key, epoch), []))
        cut = None
        if key in pruned and pruned[key][0] == epoch:
            cut = pruned[key][1:]
            ranges.append(cut)
        return PartitionLog(epoch, merge_ranges(ranges), cut)

    def partition_log(self, topic: str, partition: int) -> PartitionLog:
        """What is held of one partition's latest epoch, read from the files (cached by ``append``)."""
        if (topic, partition) not in self._logs:
            files = [f for f in self.files(topic) if (s := file_span(f)) is not None and s.partition == partition]
            held = self.held(files)
            pruned = self.pruned_spans()
            epochs = [e for (_, _, e) in held] + [self.marked_epoch(topic, partition)]
            if (topic, partition) in pruned:
                epochs.append(pruned[(topic, partition)][0])
            epoch = max(epochs)
            self._logs[(topic, partition)] = self._log((topic, partition), epoch, held, pruned)
        return self._logs[(topic, partition)]

    def forget(self, topic: str, partition: int) -> None:
        """Read this partition's log from the files again when next needed (its owner changed)."""
        self._logs.pop((topic, partition), None)

    def glob_sql(self, topic: str = "*") -> str:
        """The files' glob (of one topic, or all) as a SQL string literal body (quotes doubled)."""
        return self._uri(self.root / f"topic={topic}" / "date=*" / "p*.parquet").replace("'", "''")

    def write(self, topic: str, rows: list[ArchivedEvent], epoch: int = 0) -> list[Path]:
        """Durably write rows of one catalog topic: one file per run of consecutive offsets of a
        partition, under the UTC date of the run's latest timestamp.

        One file per run rather than one per (date, partition): timestamps are not in offset order
        (producers' clocks differ), so a batch around midnight spans two dates in any order, and
        with a file per date a crash between the two left a hole inside the held range. One file is
        whole or absent (atomic rename), which needs no manifest or recovery step. The latest date
        is chosen so that retention (``prune``, by date) never removes an event before its date."""
        self._local("writing")
        by_partition: dict[int, dict[int, ArchivedEvent]] = defaultdict(dict)
        for r in rows:
            by_partition[r.partition].setdefault(r.offset, r)  # a copy in one batch counts once
        written = []
        for partition, got in sorted(by_partition.items()):
            for first, last in runs(got):
                group = [got[o] for o in range(first, last + 1)]
                day = datetime.fromtimestamp(max(r.timestamp_ms for r in group) / 1000, UTC).strftime("%Y-%m-%d")
                d = self.root / f"topic={topic}" / f"date={day}"
                d.mkdir(parents=True, exist_ok=True)
                path = d / file_name(partition, epoch, first, last)
                table = pa.Table.from_pydict({
                    "kafka_topic": [r.kafka_topic for r in group],
                    "partition": [r.partition for r in group],
                    "offset": [r.offset for r in group],
                    "timestamp_ms": [r.timestamp_ms for r in group],
                    "key": [r.key for r in group],
                    "value": [r.value for r in group],
                    "auth": [r.auth for r in group],
                }, schema=ARCHIVE_SCHEMA)
                _atomic_write(with_typed_columns(topic, table), path)
                self._held[path] = [(first, last)]
                if (topic, partition) in self._logs and self._logs[(topic, partition)].epoch == epoch:
                    self._logs[(topic, partition)].add(first, last)
                written.append(path)
        return written

    def append(self, topic: str, rows: list[ArchivedEvent]) -> set[int]:
        """What the sink received (each partition's rows in the order they arrived) into the
        partition's latest epoch, every offset it already holds left out. Returns the partitions
        whose topic restarted: their next epoch is recorded and nothing more of them is written;
        the caller reads them again from their beginning.

        A restart is seen where a run of rows begins (the first row, or one whose offset is not
        above the row before it: the consumer's position was reset): at an offset held whose
        archived copy has other bytes, key or timestamp, at one that only retention accounts for,
        or below everything held. The sink resumes at the last offset held, so a topic that
        restarted and has grown past it is seen too."""
        restarted: set[int] = set()
        by_partition: dict[int, list[ArchivedEvent]] = defaultdict(list)
        for r in rows:
            by_partition[r.partition].append(r)
        for partition, got in sorted(by_partition.items()):
            log = self.partition_log(topic, partition)
            keep: dict[int, ArchivedEvent] = {}
            previous: int | None = None
            for r in got:
                if (previous is None or r.offset <= previous) and self._restarted(topic, log, r, keep):
                    self.write(topic, list(keep.values()), log.epoch)
                    self._start_epoch(topic, partition, log.epoch + 1)
                    restarted.add(partition)
                    keep = {}
                    break
                previous = r.offset
                if not log.holds(r.offset):
                    keep.setdefault(r.offset, r)
            if keep:
                self.write(topic, list(keep.values()), log.epoch)
        return restarted

    def _restarted(self, topic: str, log: PartitionLog, row: ArchivedEvent, batch: dict[int, ArchivedEvent]) -> bool:
        if not log.ranges and not batch:
            return False
        if row.offset in batch:
            copy: ArchivedEvent | None = batch[row.offset]
        elif log.holds(row.offset):
            copy = self.row_at(topic, row.partition, log.epoch, row.offset) if log.in_files(row.offset) else None
        else:
            return bool(log.ranges) and row.offset < log.ranges[0][0]
        return copy is None or (copy.key, copy.value, copy.timestamp_ms) != (row.key, row.value, row.timestamp_ms)

    def row_at(self, topic: str, partition: int, epoch: int, offset: int) -> ArchivedEvent | None:
        """The archived row at one offset of a partition's epoch (None: not in a file)."""
        for f in self.files(topic):
            span = file_span(f)
            if span and (span.partition, span.epoch) == (partition, epoch) and span.first <= offset <= span.last:
                found = pq.read_table(str(f), columns=ARCHIVE_SCHEMA.names, schema=ARCHIVE_SCHEMA,
                                      filters=[("offset", "=", offset)], filesystem=self.fs).to_pylist()
                if found:
                    return ArchivedEvent(**found[0])
        return None

    def _start_epoch(self, topic: str, partition: int, epoch: int) -> None:
        """Record the partition's next epoch before anything of it is written: a sink that restarts
        before the first file of it reads the new log from its beginning."""
        marker = self._epoch_marker(topic, partition)
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(json.dumps({"epoch": epoch}).encode(), marker)
        self._logs[(topic, partition)] = PartitionLog(epoch, [])
        log.warning("%s[%d] restarted at a lower offset (broker restarted or topic recreated): archiving "
                    "its new log as epoch %d", topic, partition, epoch)

    def events(self, topics: Iterable[str], keys: Iterable[bytes] | None = None,
               con: duckdb.DuckDBPyConnection | None = None) -> Iterator[tuple[str, ArchivedEvent]]:
        """Archived events of the given catalog topics (and message keys, when given), each once, in
        (topic, partition, epoch, offset) order; read with ``con`` (a cursor of a database the caller
        already opened: opening one costs 15-30 ms) or a fresh database."""
        wanted = [t for t in topics if self.files(t)]  # a glob that matches nothing is an error
        if not wanted:
            return
        params: list[object] = []
        key_filter = ""
        if keys is not None:
            key_filter = "WHERE key IN (SELECT unnest(?))"
            params.append(list(keys))
        con = con if con is not None else self.connect()
        globs = ", ".join(self.sources_sql(t) for t in wanted)  # only these topics' files are opened
        try:
            rows = self._events(con, globs, key_filter, params, "auth")
        except duckdb.BinderException as exc:  # no file has the column: all were written before signatures
            if "auth" not in str(exc):
                raise
            rows = self._events(con, globs, key_filter, params, "NULL::BLOB")
        for topic, kt, p, o, ts, k, v, auth in rows:
            yield topic, ArchivedEvent(kt, p, o, ts, k, v, auth)

    @staticmethod
    def _events(con: duckdb.DuckDBPyConnection, globs: str, key_filter: str, params: list[object], auth: str
                ) -> list[tuple[Any, ...]]:
        return con.execute(
            f"""SELECT topic, kafka_topic, "partition", "offset", timestamp_ms, key, value, {auth} FROM (
                    SELECT *, coalesce(TRY_CAST(regexp_extract(filename, '{_EPOCH_IN_NAME}', 1) AS INTEGER), 0)
                              AS epoch
                    FROM read_parquet([{globs}], hive_partitioning = true, union_by_name = true, filename = true)
                    {key_filter})
                -- copies (a compaction in progress): one, the same one whichever file is read first
                QUALIFY row_number() OVER (PARTITION BY topic, "partition", epoch, "offset"
                                           ORDER BY key, value, timestamp_ms) = 1
                ORDER BY topic, "partition", epoch, "offset" """,
            params,
        ).fetchall()

    def duplicates(self, topics: Iterable[str]) -> list[tuple[str, int, int, int, bool]]:
        """Every (topic, partition, epoch, offset) archived more than once, from the offsets the files
        hold (not their names, which may lie), and whether its copies differ (key, value or broker
        timestamp). Equal copies are one record (a compaction in progress); copies that differ are an
        edit or a corruption, which no reader's choice of copy may hide (the audit fails on them).
        Reads the narrow columns once; the contents only of the offsets held twice."""
        wanted = [t for t in topics if self.files(t)]
        if not wanted:
            return []
        con = self.connect()
        rows = (f"""SELECT *, coalesce(TRY_CAST(regexp_extract(filename, '{_EPOCH_IN_NAME}', 1) AS INTEGER), 0)
                              AS epoch
                    FROM read_parquet([{", ".join(self.sources_sql(t) for t in wanted)}], hive_partitioning = true,
                                      union_by_name = true, filename = true)""")
        held_twice = con.execute(f"""SELECT topic, "partition", epoch, "offset" FROM ({rows})
                                     GROUP BY ALL HAVING count(*) > 1""").fetchall()
        if not held_twice:
            return []
        con.register("held_twice", pa.table({n: [r[i] for r in held_twice] for i, n in
                                             enumerate(("topic", "partition", "epoch", "offset"))}))
        return [(t, int(p), int(e), int(o), bool(differ)) for t, p, e, o, differ in con.execute(f"""
            SELECT r.topic, r."partition", r.epoch, r."offset", count(DISTINCT (key, value, timestamp_ms)) > 1
            FROM ({rows}) r SEMI JOIN held_twice h
              ON r.topic = h.topic AND r."partition" = h."partition" AND r.epoch = h.epoch AND r."offset" = h."offset"
            GROUP BY ALL ORDER BY ALL""").fetchall()]

    def compact(self, *, min_rows: int = 100_000, row_group_rows: int | None = None) -> tuple[int, int]:
        """Merge each (topic, date, partition)'s small files into files of at least ``min_rows`` rows,
        with row groups of ``row_group_rows`` rows (default ``ROW_GROUP_ROWS``). Returns (files
        before, files after).

        Safe against crashes and concurrent readers: the merged file is durable (atomic rename)
        before the files it replaces are removed; until then readers see overlapping offset
        ranges, which every reader here de-duplicates by (topic, partition, offset).
        """
        self._local("compacting")
        for stale in self.root.glob(f"topic=*/date=*/p*.parquet{COMPACT_TMP}"):  # an interrupted compaction
            stale.unlink()
        before = self._local_files()
        groups: dict[tuple[Path, int, int], list[tuple[int, int, Path]]] = defaultdict(list)
        for f in before:
            span = file_span(f)
            if span:
                groups[(f.parent, span.partition, span.epoch)].append((span.first, span.last, f))
        for (directory, partition, epoch), files in sorted(groups.items()):
            files.sort()
            run: list[Path] = []
            rows = 0
            for _, _, f in files:
                run.append(f)
                rows += pq.ParquetFile(f).metadata.num_rows
                if rows >= min_rows:
                    self._merge(directory, partition, epoch, run, row_group_rows)
                    run, rows = [], 0
            self._merge(directory, partition, epoch, run, row_group_rows)  # the remainder
        return len(before), len(self._local_files())

    def _merge(self, directory: Path, partition: int, epoch: int, files: list[Path], row_group_rows: int | None
               ) -> None:
        if len(files) < 2:
            return
        # Files written before typed columns existed get them here; the value is read as it is.
        topic = directory.parent.name.removeprefix("topic=")
        tables = [pq.read_table(f, columns=ARCHIVE_SCHEMA.names, schema=ARCHIVE_SCHEMA) for f in files]
        table = pa.concat_tables(tables)
        offsets = table.column("offset").to_numpy()
        order = np.argsort(offsets, kind="stable")
        keep = order[np.r_[True, offsets[order][1:] != offsets[order][:-1]]]  # first copy of each offset
        table = with_typed_columns(topic, table.take(pa.array(keep)))
        first, last = int(offsets[keep[0]]), int(offsets[keep[-1]])
        target = directory / file_name(partition, epoch, first, last)
        _atomic_write(table, target, row_group_rows, COMPACT_TMP)
        for f in files:
            if f != target:
                f.unlink()

    def remove_stale_temporaries(self, topic: str, partition: int) -> list[Path]:
        """Remove the half-written files a killed sink left for this catalog topic's partition. The
        partition's new owner calls this when it is assigned. A previous owner still writing after a
        rebalance either fails that write before committing it or publishes a file that the new
        owner's overlap (readers count each offset once); either way nothing is lost."""
        stale = sorted((self.root / f"topic={topic}").glob(f"date=*/p{partition:04d}-*.parquet{SINK_TMP}"))
        for f in stale:
            f.unlink(missing_ok=True)
        return stale

    def _read_json(self, path: PurePath) -> Any:
        """A small JSON file of the archive (absent: None), on a file system or object storage."""
        if self.fs is not None:
            return json.loads(self.fs.cat(str(path))) if self.fs.exists(str(path)) else None
        return json.loads(Path(path).read_text()) if Path(path).exists() else None

    def retention(self) -> dict[tuple[str, int], int]:
        """(catalog topic, partition) -> the highest offset retention removed (none: empty)."""
        body = self._read_json(self.root / RETENTION_FILE)
        return {} if body is None else self._pruned(body)

    def pruned_spans(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """(catalog topic, partition) -> (epoch, first offset, last offset) of what retention removed
        of its latest epoch pruned (a marker from before epochs: epoch 0, from offset 0)."""
        body = self._read_json(self.root / RETENTION_FILE)
        if body is None:
            return {}
        spans = {key: (0, 0, offset) for key, offset in self._pruned(body).items()}
        for name, (epoch, first, last) in body.get("pruned_epochs", {}).items():
            topic, partition = name.rsplit(":", 1)
            spans[(topic, int(partition))] = (int(epoch), int(first), int(last))
        return spans

    @staticmethod
    def _pruned(marker: dict[str, Any]) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for name, offset in marker["pruned_through"].items():
            topic, partition = name.rsplit(":", 1)
            out[(topic, int(partition))] = int(offset)
        return out

    def prune(self, before: date, *, dry_run: bool = False) -> Pruned:
        """Remove every archived event of the dates before ``before`` (UTC, by broker timestamp).

        The marker is durable before any file goes, so a crash in between leaves charges treated
        as beyond retention whose events are still there (a second run removes them), never the
        reverse. Offsets removed need not be a prefix of a partition (late events are filed
        under their old date): the marker's highest offset makes the audit skip every charge
        that may have lost an event, and no other."""
        self._local("pruning")
        doomed = [f for f in self._local_files() if f.parent.name.removeprefix("date=") < before.isoformat()]
        through = self.retention()
        spans = self.pruned_spans()
        events = 0
        for f in doomed:
            span = file_span(f)
            if span:
                key = (f.parent.parent.name.removeprefix("topic="), span.partition)
                through[key] = max(through.get(key, -1), span.last)  # the audit's: any epoch's offset
                e, first, last = spans.get(key, (-1, 0, -1))
                if span.epoch > e:
                    spans[key] = (span.epoch, span.first, span.last)
                elif span.epoch == e:
                    spans[key] = (e, min(first, span.first), max(last, span.last))
                events += pq.ParquetFile(f).metadata.num_rows
        dates = sorted({f.parent.name.removeprefix("date=") for f in doomed})
        if dry_run or not doomed:
            return Pruned(dates, len(doomed), events)
        marker = {"pruned_before": before.isoformat(),
                  "pruned_through": {f"{t}:{p}": o for (t, p), o in sorted(through.items())},
                  # the sink's: what is removed of each partition's latest epoch pruned, as held
                  "pruned_epochs": {f"{t}:{p}": list(span) for (t, p), span in sorted(spans.items())}}
        atomic_write_bytes(json.dumps(marker, indent=1).encode(), self.root / RETENTION_FILE)
        for f in doomed:
            f.unlink()
        for d in {f.parent for f in doomed}:
            if not any(d.iterdir()):
                d.rmdir()
        return Pruned(dates, len(doomed), events)

    def count(self) -> int:
        if not self.files():
            return 0
        row = self.connect().execute(
            f"SELECT count(*) FROM read_parquet([{self.sources_sql()}], union_by_name = true)").fetchone()
        return int(row[0]) if row else 0


@dataclass(frozen=True)
class Pruned:
    dates: list[str]
    files: int
    events: int


@dataclass(frozen=True)
class Gap:
    """Offsets of a topic partition's epoch that the archive lacks: between two ranges it holds
    (``hole``), or that the broker still has before the first held (``head``) or after the last
    (``tail``: the sink is behind or stopped)."""

    topic: str
    partition: int
    epoch: int
    first: int
    last: int
    kind: str

    @property
    def count(self) -> int:
        return self.last - self.first + 1


def offset_gaps(held: list[tuple[int, int]], low: int | None = None, high: int | None = None
                ) -> list[tuple[int, int, str]]:
    """The (first, last, kind) offset ranges missing from ``held`` (sorted, merged inclusive ranges):
    every hole between them, and with the broker's watermarks (``low``: its first offset, ``high``:
    one after its last) the offsets in [low, high) before or after them. Nothing held and a broker
    that has offsets: all of them are missing (``tail``)."""
    missing = [(a[1] + 1, b[0] - 1, "hole") for a, b in itertools.pairwise(held) if b[0] > a[1] + 1]
    if low is None or high is None or high <= low:
        return missing
    if not held:
        return [(low, high - 1, "tail")]
    if low < held[0][0]:
        missing.insert(0, (low, min(held[0][0], high) - 1, "head"))
    if high - 1 > held[-1][1]:
        missing.append((max(held[-1][1] + 1, low), high - 1, "tail"))
    return missing


def archive_gaps(archive: ParquetArchive, watermarks: dict[tuple[str, int], tuple[int, int]] | None = None
                 ) -> tuple[list[Gap], int]:
    """Every gap of the archive (and, with the broker's watermarks per (catalog topic, partition),
    against them: they concern each partition's latest epoch), and how many (topic, partition,
    epoch) logs were checked. Retention's removals count as held."""
    held = archive.held()
    logs = archive.logs()
    for (topic, partition), plog in logs.items():
        held[(topic, partition, plog.epoch)] = plog.ranges  # with what retention removed of it
    for key in watermarks or {}:
        if key not in logs:  # a partition the broker has and the archive lacks entirely
            held.setdefault((*key, 0), [])
    gaps = []
    for (topic, partition, epoch), ranges in sorted(held.items()):
        latest = logs[(topic, partition)].epoch if (topic, partition) in logs else 0
        low, high = (watermarks or {}).get((topic, partition), (None, None)) if epoch == latest else (None, None)
        gaps += [Gap(topic, partition, epoch, *missing) for missing in offset_gaps(ranges, low, high)]
    return gaps, len(held)


def broker_watermarks(settings: Settings, topics: Iterable[str], timeout_s: float = 10.0
                      ) -> dict[tuple[str, int], tuple[int, int]]:
    """(catalog topic, partition) -> the broker's (low, high) watermarks, for the topics it has.
    Raises KafkaException when the broker cannot be reached. On the bundled broker the high
    watermark is the last batch's first offset + 1 (docs/broker.md): a tail can go unreported,
    never be reported falsely."""
    consumer = Consumer(settings.client_config(**{  # an unreachable broker is the caller's one line, not a log per try
        "group.id": f"{settings.app_id}-archive-check", "enable.auto.commit": False, "log_level": 0}))
    try:
        meta = consumer.list_topics(timeout=timeout_s).topics
        out = {}
        for name in topics:
            topic = settings.topic(name)
            for partition in sorted(meta[topic].partitions) if topic in meta else []:
                out[(name, partition)] = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                                        timeout=timeout_s)
        return out
    finally:
        consumer.close()


#: Temporary names (not matched by the *.parquet globs readers use): the sink's files, and compaction's
#: (a sink restart removes its own partitions' leftovers, never a compaction's in progress).
SINK_TMP, COMPACT_TMP = ".tmp", ".compact.tmp"


#: Rows per Parquet row group, in the sink's files and compacted ones: the units the audit's plan cuts
#: into tasks (1,024 records are about 2 MB of the simulator's 60-block batches).
ROW_GROUP_ROWS = 1024


def _atomic_write(table: pa.Table, path: Path, row_group_rows: int | None = None, suffix: str = SINK_TMP) -> None:
    tmp = path.with_name(path.name + suffix)
    pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_rows or ROW_GROUP_ROWS)
    publish_file(tmp, path)


class ArchiveSink(BatchSink):
    """Consumes every input topic into the archive; offsets are committed after the files are durable."""

    def __init__(self, settings: Settings, root: Path, topics: Iterable[str] | None = None) -> None:
        names = list(topics) if topics is not None else [t.name for t in INPUT_TOPICS]
        super().__init__(settings, names, "archive")
        self.archive = ParquetArchive(root)
        self._consumer: Consumer | None = None  # to read a restarted topic partition again from its start

    def consumer(self) -> Consumer:
        self._consumer = super().consumer()
        return self._consumer

    def resume_offsets(self, partitions: list[TopicPartition]) -> None:
        """Each partition from the end of the contiguous prefix it holds (its last offset is read again
        and compared, ``ParquetArchive.append``), or its beginning when its epoch holds nothing."""
        for p in partitions:
            name = spec_for_topic(p.topic, self.settings.topic_prefix).name
            stale = self.archive.remove_stale_temporaries(name, p.partition)
            if stale:
                log.warning("removed %d half-written archive file(s) of %s[%d] left by a killed sink: %s",
                            len(stale), name, p.partition, ", ".join(f.name for f in stale))
            self.archive.forget(name, p.partition)  # another owner may have written it meanwhile
            plog = self.archive.partition_log(name, p.partition)
            at = plog.resume_at()
            if at is not None:
                p.offset = at
            elif plog.epoch > 0:  # a restarted topic's new epoch, nothing of it written yet
                p.offset = OFFSET_BEGINNING

    def write(self, messages: list[Message]) -> None:
        by_topic: dict[str, list[ArchivedEvent]] = defaultdict(list)
        for m in messages:
            topic, partition, offset = position(m)
            _, ts = m.timestamp()
            by_topic[spec_for_topic(topic, self.settings.topic_prefix).name].append(
                ArchivedEvent(topic, partition, offset, ts, m.key(), m.value(), header_value(m.headers())))
        for topic, rows in by_topic.items():
            restarted = self.archive.append(topic, rows)
            if restarted and self._consumer is not None:
                kafka_topic = rows[0].kafka_topic
                for partition in sorted(restarted):
                    self._consumer.seek(TopicPartition(kafka_topic, partition, OFFSET_BEGINNING))
