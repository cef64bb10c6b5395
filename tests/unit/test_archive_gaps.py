"""The archive is gap-free by construction: one file per batch run, resume at the contiguous prefix,
each offset of an epoch once, a restarted topic archived as a new epoch; ``archive check``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.runtime.config import Settings
from nodeshare.sinks import archive as archive_mod
from nodeshare.sinks.archive import (
    ARCHIVE_SCHEMA,
    ArchivedEvent,
    ArchiveSink,
    ParquetArchive,
    archive_gaps,
    file_range,
    offset_gaps,
)

MIDNIGHT = int(datetime(2026, 3, 2, tzinfo=UTC).timestamp() * 1000)


def ev(offset: int, ts: int = MIDNIGHT, value: bytes = b"{}", partition: int = 0) -> ArchivedEvent:
    return ArchivedEvent("node.ipc", partition, offset, ts, b"j%d" % offset, value)


def offsets(archive: ParquetArchive) -> list[int]:
    return [e.offset for _, e in archive.events(["node.ipc"])]


@pytest.mark.parametrize(("held", "low", "high", "gaps"), [
    ([(0, 9)], None, None, []),
    ([(0, 3), (5, 9)], None, None, [(4, 4, "hole")]),
    ([(0, 3), (5, 6), (9, 9)], None, None, [(4, 4, "hole"), (7, 8, "hole")]),
    ([(0, 9)], 0, 10, []),
    ([(0, 9)], 0, 5, []),  # the bundled broker's high watermark can be low: never a false tail
    ([(5, 9)], 2, 10, [(2, 4, "head")]),
    ([(5, 9)], 7, 10, []),  # the broker's retention removed 0-6, the archive holds them
    ([(0, 9)], 0, 14, [(10, 13, "tail")]),
    ([(0, 3), (6, 9)], 0, 12, [(4, 5, "hole"), (10, 11, "tail")]),
    ([], 3, 8, [(3, 7, "tail")]),
    ([], 0, 0, []),
])
def test_offset_gaps(held, low, high, gaps) -> None:
    assert offset_gaps(held, low, high) == gaps


def test_a_batch_across_midnight_is_one_file_whatever_its_timestamps(tmp_path: Path, monkeypatch) -> None:
    rows = [ev(100, MIDNIGHT - 100), ev(101, MIDNIGHT + 50), ev(102, MIDNIGHT - 150)]  # clocks differ by 0.2 s
    real, calls = archive_mod._atomic_write, []

    def killed_after_first(table, path, *a, **k):
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt("SIGKILL between two files")
        return real(table, path, *a, **k)

    monkeypatch.setattr(archive_mod, "_atomic_write", killed_after_first)
    ParquetArchive(tmp_path).write("node.ipc", rows)
    assert calls == ["p0000-000000000100-000000000102.parquet"]  # under its latest date, 2026-03-02
    assert offsets(ParquetArchive(tmp_path)) == [100, 101, 102]


def _legacy_file(root: Path, day: str, rows: list[ArchivedEvent]) -> None:
    """A file as the sink wrote them before: per date, its name spanning offsets it does not hold."""
    d = root / "topic=node.ipc" / f"date={day}"
    d.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([r.__dict__ for r in rows], schema=ARCHIVE_SCHEMA)
    pq.write_table(table, d / f"p0000-{rows[0].offset:012d}-{rows[-1].offset:012d}.parquet")


def test_a_hole_left_by_the_old_layout_is_filled_on_resume(tmp_path: Path) -> None:
    _legacy_file(tmp_path, "2026-03-01", [ev(o) for o in range(101)] + [ev(102)])  # 101's file never written
    archive = ParquetArchive(tmp_path)
    gaps, _ = archive_gaps(archive)
    assert [(g.first, g.last, g.kind) for g in gaps] == [(101, 101, "hole")]
    log = archive.partition_log("node.ipc", 0)
    assert log.ranges == [(0, 100), (102, 102)] and log.resume_at() == 100  # not after 102
    assert archive.append("node.ipc", [ev(o) for o in range(100, 110)]) == set()  # redelivered from 100
    assert offsets(ParquetArchive(tmp_path)) == list(range(110))  # each once
    assert archive_gaps(ParquetArchive(tmp_path))[0] == []
    new = [f.name for f in ParquetArchive(tmp_path).files() if "2026-03-01" not in str(f)]
    assert new == ["p0000-000000000101-000000000101.parquet", "p0000-000000000103-000000000109.parquet"]


def test_a_redelivered_batch_adds_no_row(tmp_path: Path) -> None:
    archive = ParquetArchive(tmp_path)
    archive.append("node.ipc", [ev(o) for o in range(10)])
    files = ParquetArchive(tmp_path).files()
    assert archive.append("node.ipc", [ev(o) for o in range(10)]) == set()
    again = ParquetArchive(tmp_path)
    assert again.files() == files and again.count() == 10
    assert again.append("node.ipc", [ev(o) for o in range(9, 12)]) == set()  # the resume point is read again
    assert ParquetArchive(tmp_path).count() == 12


def test_a_topic_that_restarted_is_archived_as_a_new_epoch(tmp_path: Path) -> None:
    archive = ParquetArchive(tmp_path)
    archive.append("node.ipc", [ev(o) for o in range(10)])
    # the broker restarted with memory storage: the consumer's position is reset to the new log's start
    fresh = [ev(o, value=b'{"new": true}') for o in range(4)]
    assert archive.append("node.ipc", fresh) == {0}
    assert json.loads((tmp_path / "epochs" / "node.ipc" / "p0000.json").read_text()) == {"epoch": 1}
    restarted = ParquetArchive(tmp_path)  # even after a crash here, the sink reads the new log from its start
    assert restarted.partition_log("node.ipc", 0).epoch == 1
    assert restarted.partition_log("node.ipc", 0).resume_at() is None
    assert restarted.append("node.ipc", fresh) == set()
    assert restarted.append("node.ipc", [*fresh[2:], ev(4, value=b'{"new": true}')]) == set()
    events = [(e.offset, e.value) for _, e in ParquetArchive(tmp_path).events(["node.ipc"])]
    assert events == [(o, b"{}") for o in range(10)] + [(o, b'{"new": true}') for o in range(5)]
    names = sorted(f.name for f in ParquetArchive(tmp_path).files())
    assert names == ["p0000-000000000000-000000000009.parquet", "p0000-e0001-000000000000-000000000003.parquet",
                     "p0000-e0001-000000000004-000000000004.parquet"]
    # the fast audit's overlap test (by file_range) sees no overlap between two epochs
    assert file_range(Path(names[1]))[1] > file_range(Path(names[0]))[2]
    assert ParquetArchive(tmp_path).high_water() == {("node.ipc", 0): 4}
    assert archive_gaps(ParquetArchive(tmp_path), {("node.ipc", 0): (0, 5)})[0] == []


def test_a_restarted_topic_that_grew_past_the_resume_point_is_seen(tmp_path: Path) -> None:
    archive = ParquetArchive(tmp_path)
    archive.append("node.ipc", [ev(o) for o in range(10)])
    resume = ParquetArchive(tmp_path).partition_log("node.ipc", 0).resume_at()
    assert resume == 9
    # what the new log has at 9 and after: other bytes at an offset held
    assert ParquetArchive(tmp_path).append("node.ipc", [ev(o, value=b"other") for o in range(9, 20)]) == {0}
    assert ParquetArchive(tmp_path).count() == 10  # nothing of the new log yet: it is read from its start


def test_the_sink_reads_a_restarted_partition_again_from_its_start(tmp_path: Path) -> None:
    class Msg:
        def __init__(self, e: ArchivedEvent) -> None:
            self.e = e

        def topic(self) -> str: return self.e.kafka_topic
        def partition(self) -> int: return self.e.partition
        def offset(self) -> int: return self.e.offset
        def timestamp(self) -> tuple[int, int]: return (1, self.e.timestamp_ms)
        def key(self) -> bytes | None: return self.e.key
        def value(self) -> bytes | None: return self.e.value
        def headers(self) -> list[tuple[str, bytes]] | None: return None

    class Seeks:
        seeks: ClassVar[list[TopicPartition]] = []

        def seek(self, tp: TopicPartition) -> None:
            self.seeks.append(tp)

    sink = ArchiveSink(Settings.model_validate({"topic_prefix": ""}), tmp_path, ["node.ipc"])
    sink._consumer = Seeks()  # type: ignore[assignment]
    sink.write([Msg(ev(o)) for o in range(5)])  # type: ignore[arg-type]
    sink.write([Msg(ev(0, value=b"new"))])  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in Seeks.seeks] == [(0, OFFSET_BEGINNING)]
    partitions = [TopicPartition("node.ipc", 0)]
    ArchiveSink(sink.settings, tmp_path, ["node.ipc"]).resume_offsets(partitions)
    assert partitions[0].offset == OFFSET_BEGINNING  # the new epoch holds nothing yet


def test_pruning_keeps_the_resume_point_of_the_latest_epoch(tmp_path: Path) -> None:
    archive = ParquetArchive(tmp_path)
    archive.append("node.ipc", [ev(o) for o in range(10)])
    archive.append("node.ipc", [ev(0, value=b"new")])
    archive.append("node.ipc", [ev(o, MIDNIGHT + 86_400_000 * (o >= 3), b"new") for o in range(6)])
    archive.prune(datetime(2026, 3, 3).date())  # epoch 0 whole, epoch 1's 0-2
    log = ParquetArchive(tmp_path).partition_log("node.ipc", 0)
    assert (log.epoch, log.ranges, log.resume_at()) == (1, [(0, 5)], 5)
    assert ParquetArchive(tmp_path).retention() == {("node.ipc", 0): 9}  # the audit's: any epoch's offset


def test_archive_check_cli(tmp_path: Path, monkeypatch) -> None:
    archive = ParquetArchive(tmp_path)
    archive.write("node.ipc", [ev(o) for o in (0, 1, 2, 6)])
    monkeypatch.delenv("NODESHARE_BOOTSTRAP", raising=False)
    res = CliRunner().invoke(app, ["archive", "check", "--archive", str(tmp_path)])
    assert res.exit_code == 1 and "node.ipc[0] epoch 0: offsets 3..5 missing (3, hole)" in res.output
    archive.write("node.ipc", [ev(o) for o in (3, 4, 5)])
    res = CliRunner().invoke(app, ["archive", "check", "--archive", str(tmp_path), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["gaps"] == []

    monkeypatch.setattr(archive_mod, "broker_watermarks", lambda settings, topics: {("node.ipc", 0): (0, 9)})
    res = CliRunner().invoke(app, ["archive", "check", "--archive", str(tmp_path), "--bootstrap", "b:9092"])
    assert res.exit_code == 1 and "offsets 7..8 missing (2, tail)" in res.output

    def unreachable(settings, topics):
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))

    monkeypatch.setattr(archive_mod, "broker_watermarks", unreachable)
    res = CliRunner().invoke(app, ["archive", "check", "--archive", str(tmp_path), "--bootstrap", "b:9092"])
    assert res.exit_code == 2 and "cannot be reached" in res.output and len(res.output.strip().splitlines()) == 1
