"""The archive: every input event, verbatim, in Parquet, hive-partitioned by topic and date.

Layout: ``ROOT/topic=<catalog topic>/date=<YYYY-MM-DD>/p<partition>-<first offset>-<last offset>.parquet``

* each file is written to a temporary name, fsynced, then renamed: readers never see half a file;
  a sink killed mid-write leaves the temporary, which the partition's next owner removes;
* a file's name states its offset range, so on start the sink resumes after the highest offset
  it holds per partition, whatever Kafka's committed offset says: no duplicates, no gaps;
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

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Message, TopicPartition

from nodeshare.config import Settings
from nodeshare.consumer import BatchSink, position
from nodeshare.schemas import INPUT_TOPICS, spec_for_topic

log = logging.getLogger(__name__)

ARCHIVE_SCHEMA = pa.schema([
    ("kafka_topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("timestamp_ms", pa.int64()),
    ("key", pa.binary()),
    ("value", pa.binary()),
])
_FILE = re.compile(r"^p(\d+)-(\d+)-(\d+)\.parquet$")


RETENTION_FILE = "retention.json"


def file_range(path: PurePath) -> tuple[int, int, int] | None:
    """(partition, first offset, last offset) from an archive file's name; None for other files."""
    m = _FILE.match(path.name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


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
    file, which the audit's order check reads in one pass (``fast_audit.out_of_order_streams``)."""
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

    def largest_partitions_first(self, topics: Iterable[str]) -> list[int]:
        """The input partitions the archive holds, by the bytes of their files, largest first: the
        order to hand them to workers in, so that the last task to start is a small one (longest
        processing time first)."""
        size: dict[int, int] = {}
        for t in topics:
            for f in self.files(t):
                if (r := file_range(f)) is not None:
                    n = self._sizes[f] if self.fs is not None else Path(f).stat().st_size
                    size[r[0]] = size.get(r[0], 0) + n
        return sorted(size, key=lambda p: (-size[p], p))

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
        """(catalog topic, partition) -> the highest offset archived (pruned ones included: the
        sink must not archive again what retention removed)."""
        hw = self.retention()
        for f in self.files():
            r = file_range(f)
            if r:
                key = (f.parent.parent.name.removeprefix("topic="), r[0])
                hw[key] = max(hw.get(key, -1), r[2])
        return hw

    def glob_sql(self, topic: str = "*") -> str:
        """The files' glob (of one topic, or all) as a SQL string literal body (quotes doubled)."""
        return self._uri(self.root / f"topic={topic}" / "date=*" / "p*.parquet").replace("'", "''")

    def write(self, topic: str, rows: list[ArchivedEvent]) -> list[Path]:
        """Durably write rows of one catalog topic; one file per (date, partition)."""
        self._local("writing")
        groups: dict[tuple[str, int], list[ArchivedEvent]] = defaultdict(list)
        for r in rows:
            day = datetime.fromtimestamp(r.timestamp_ms / 1000, UTC).strftime("%Y-%m-%d")
            groups[(day, r.partition)].append(r)
        written = []
        for (day, partition), group in sorted(groups.items()):
            group.sort(key=lambda r: r.offset)
            d = self.root / f"topic={topic}" / f"date={day}"
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"p{partition:04d}-{group[0].offset:012d}-{group[-1].offset:012d}.parquet"
            table = pa.Table.from_pydict({
                "kafka_topic": [r.kafka_topic for r in group],
                "partition": [r.partition for r in group],
                "offset": [r.offset for r in group],
                "timestamp_ms": [r.timestamp_ms for r in group],
                "key": [r.key for r in group],
                "value": [r.value for r in group],
            }, schema=ARCHIVE_SCHEMA)
            _atomic_write(with_typed_columns(topic, table), path)
            written.append(path)
        return written

    def events(self, topics: Iterable[str], keys: Iterable[bytes] | None = None,
               con: duckdb.DuckDBPyConnection | None = None) -> Iterator[tuple[str, ArchivedEvent]]:
        """Archived events of the given catalog topics (and message keys, when given), each once, in
        (topic, partition, offset) order; read with ``con`` (a cursor of a database the caller
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
        rows = con.execute(
            f"""SELECT topic, kafka_topic, "partition", "offset", timestamp_ms, key, value
                FROM read_parquet([{globs}], hive_partitioning = true, union_by_name = true)
                {key_filter}
                QUALIFY row_number() OVER (PARTITION BY topic, "partition", "offset") = 1
                ORDER BY topic, "partition", "offset" """,
            params,
        ).fetchall()
        for topic, kt, p, o, ts, k, v in rows:
            yield topic, ArchivedEvent(kt, p, o, ts, k, v)

    def compact(self, *, min_rows: int = 100_000, row_group_rows: int = 131_072) -> tuple[int, int]:
        """Merge each (topic, date, partition)'s small files into files of at least ``min_rows`` rows,
        with row groups of ``row_group_rows`` for scans. Returns (files before, files after).

        Safe against crashes and concurrent readers: the merged file is durable (atomic rename)
        before the files it replaces are removed; until then readers see overlapping offset
        ranges, which every reader here de-duplicates by (topic, partition, offset).
        """
        self._local("compacting")
        for stale in self.root.glob(f"topic=*/date=*/p*.parquet{COMPACT_TMP}"):  # an interrupted compaction
            stale.unlink()
        before = self._local_files()
        groups: dict[tuple[Path, int], list[tuple[int, int, Path]]] = defaultdict(list)
        for f in before:
            r = file_range(f)
            if r:
                groups[(f.parent, r[0])].append((r[1], r[2], f))
        for (directory, partition), files in sorted(groups.items()):
            files.sort()
            run: list[Path] = []
            rows = 0
            for _, _, f in files:
                run.append(f)
                rows += pq.ParquetFile(f).metadata.num_rows
                if rows >= min_rows:
                    self._merge(directory, partition, run, row_group_rows)
                    run, rows = [], 0
            self._merge(directory, partition, run, row_group_rows)  # the remainder
        return len(before), len(self._local_files())

    def _merge(self, directory: Path, partition: int, files: list[Path], row_group_rows: int) -> None:
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
        target = directory / f"p{partition:04d}-{first:012d}-{last:012d}.parquet"
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

    def retention(self) -> dict[tuple[str, int], int]:
        """(catalog topic, partition) -> the highest offset retention removed (none: empty)."""
        marker = self.root / RETENTION_FILE
        if self.fs is not None:
            if not self.fs.exists(str(marker)):
                return {}
            return self._pruned(json.loads(self.fs.cat(str(marker))))
        if not marker.exists():
            return {}
        return self._pruned(json.loads(marker.read_text()))

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
        events = 0
        for f in doomed:
            r = file_range(f)
            if r:
                key = (f.parent.parent.name.removeprefix("topic="), r[0])
                through[key] = max(through.get(key, -1), r[2])
                events += pq.ParquetFile(f).metadata.num_rows
        dates = sorted({f.parent.name.removeprefix("date=") for f in doomed})
        if dry_run or not doomed:
            return Pruned(dates, len(doomed), events)
        marker = {"pruned_before": before.isoformat(),
                  "pruned_through": {f"{t}:{p}": o for (t, p), o in sorted(through.items())}}
        _atomic_write_bytes(json.dumps(marker, indent=1).encode(), self.root / RETENTION_FILE)
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


#: Temporary names (not matched by the *.parquet globs readers use): the sink's files, and compaction's
#: (a sink restart removes its own partitions' leftovers, never a compaction's in progress).
SINK_TMP, COMPACT_TMP = ".tmp", ".compact.tmp"


def _atomic_write(table: pa.Table, path: Path, row_group_rows: int | None = None, suffix: str = SINK_TMP) -> None:
    tmp = path.with_name(path.name + suffix)
    pq.write_table(table, tmp, compression="zstd", row_group_size=row_group_rows)
    _publish(tmp, path)


def _atomic_write_bytes(data: bytes, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    _publish(tmp, path)


def _publish(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it to ``path`` and fsync the directory: ``path`` is whole or absent."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class ArchiveSink(BatchSink):
    """Consumes every input topic into the archive; offsets are committed after the files are durable."""

    def __init__(self, settings: Settings, root: Path, topics: Iterable[str] | None = None) -> None:
        names = list(topics) if topics is not None else [t.name for t in INPUT_TOPICS]
        super().__init__(settings, names, "archive")
        self.archive = ParquetArchive(root)

    def resume_offsets(self, partitions: list[TopicPartition]) -> None:
        hw = self.archive.high_water()
        for p in partitions:
            name = spec_for_topic(p.topic, self.settings.topic_prefix).name
            stale = self.archive.remove_stale_temporaries(name, p.partition)
            if stale:
                log.warning("removed %d half-written archive file(s) of %s[%d] left by a killed sink: %s",
                            len(stale), name, p.partition, ", ".join(f.name for f in stale))
            last = hw.get((name, p.partition))
            if last is not None:
                p.offset = last + 1

    def write(self, messages: list[Message]) -> None:
        by_topic: dict[str, list[ArchivedEvent]] = defaultdict(list)
        for m in messages:
            topic, partition, offset = position(m)
            _, ts = m.timestamp()
            by_topic[spec_for_topic(topic, self.settings.topic_prefix).name].append(
                ArchivedEvent(topic, partition, offset, ts, m.key(), m.value()))
        for topic, rows in by_topic.items():
            self.archive.write(topic, rows)
