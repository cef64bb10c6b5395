"""The audit as tasks (issues 29, 38): the archive's row groups are cut into chunks, whatever its
partitions; each task folds its chunk, the folds add up per stream, and the order check holds
across the cuts. In this process on one thread or several, or on a LocalCluster of real Dask
worker processes, the report is the same, field by field, on clean and tampered archives.
(Mutations: a merge that keeps one chunk's first cycle instead of the stream's, or an order
check that only looks inside chunks, fail the cut-stream tests; a task comparing every ledger
row instead of the audit comparing once double-counts and fails the equality.)"""

from __future__ import annotations

import itertools
import json

import duckdb
import pyarrow.parquet as pq
import pytest
from factories import POLICY, archive_records, block, build, job_event, left, scan_order

from nodeshare.schemas import JobState, encode
from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.audit import archived_messages, audit, dask_client, on_dask, recompute
from nodeshare.sinks.fast_audit import (
    _read_sql,
    fast_recompute,
    fold_chunk,
    in_process,
    out_of_order_streams,
    plan_chunks,
)
from nodeshare.sinks.ledger import Ledger

PARTITIONS = 4


@pytest.fixture(scope="module")
def client():
    with dask_client(workers=2) as c:
        yield c


def _both(archive, ledger, client):
    calls: list[tuple[int, int, int]] = []
    single = audit(archive, ledger, POLICY, threads=1)
    threaded = audit(archive, ledger, POLICY, threads=3)
    spread = audit(archive, ledger, POLICY, client=client, progress=lambda *a: calls.append(a))
    assert spread.as_dict() == single.as_dict() == threaded.as_dict()  # the same report, field by field
    assert spread.mismatches == single.mismatches == threaded.mismatches
    tasks = len(plan_chunks(ParquetArchive(archive), on_dask(client).tasks))
    assert [(d, t) for d, t, _ in calls] == [(i + 1, tasks) for i in range(tasks)]  # each chunk once
    return single, calls


def _row_groups(archive, rows):
    """Every node.ipc file rewritten with row groups of ``rows`` rows: many chunks from few jobs."""
    for f in (archive / "topic=node.ipc").rglob("*.parquet"):
        pq.write_table(pq.read_table(f), f, row_group_size=rows)


def test_a_clean_archive_on_four_partitions_audits_the_same_in_tasks(tmp_path, client):
    archive, ledger, n = build(tmp_path, partitions=PARTITIONS, jobs=16)
    assert ParquetArchive(archive).partitions_held(["node.ipc"]) == list(range(PARTITIONS))
    _row_groups(archive, 3)
    report, calls = _both(archive, ledger, client)
    assert report.ok and report.charges_checked == report.matches == n == 16
    assert report.fast_path_jobs == 16
    assert len(calls) > PARTITIONS  # more tasks than partitions: the row groups, not the partitions, set them
    assert calls[-1][2] > 0  # samples folded, as the progress bar shows them


def test_tampering_is_found_by_the_task_whose_chunk_holds_the_event(tmp_path, client):
    archive, ledger, _ = build(tmp_path, partitions=PARTITIONS, jobs=16)
    con = duckdb.connect(str(ledger))
    edited = con.execute("SELECT job_id FROM charges ORDER BY job_id LIMIT 1").fetchone()[0]
    con.execute("UPDATE charges SET record = json_merge_patch(record, '{\"price\": 0.0}') WHERE job_id = ?",
                [edited])
    con.close()
    f = sorted((archive / "topic=node.ipc").rglob("p0003-*.parquet"))[0]  # an event of partition 3
    table = pq.read_table(f)
    values = table.column("value").to_pylist()
    row = next(i for i, v in enumerate(values) if json.loads(v)["kind"] == "shutter_batch")
    rec = json.loads(values[row])
    rec["during"]["instructions"][0] *= 2
    values[row] = json.dumps(rec).encode()
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", [values]), f, row_group_size=3)
    report, _ = _both(archive, ledger, client)
    assert not report.ok and {m.job_id for m in report.mismatches} == {edited, rec["job_id"]}
    # the one task whose chunk holds that row names its job; no other task does
    view = ParquetArchive(archive)
    naming = [c for c in plan_chunks(view, 12)
              if rec["job_id"] in fold_chunk(archive, c, {}, POLICY.delta).suspects.jobs]
    assert len(naming) == 1
    assert any(part[0] == f and (part[2] is None or part[1] <= row < part[2]) for part in naming[0].parts)


def test_a_ledger_row_no_chunk_holds_is_reported_as_in_one_process(tmp_path, client):
    archive, ledger, n = build(tmp_path, partitions=PARTITIONS, jobs=8)
    with Ledger(ledger) as led:
        c = led.charges()[0]
        ghost = c.model_copy(update={"job_id": "ghost-job"})
        led.append([(ghost, encode(ghost), 0, 10_000)])
    report, _ = _both(archive, ledger, client)
    assert [(m.job_id, m.field, m.recomputed) for m in report.mismatches] == [
        ("ghost-job", "*", "no charge from the archive")]
    assert report.charges_checked == n + 1


def test_the_cli_audits_on_threads_and_local_workers_with_the_same_json(tmp_path):
    from typer.testing import CliRunner

    from nodeshare.cli import app

    archive, ledger, _ = build(tmp_path, partitions=PARTITIONS, jobs=8)
    args = ["audit", "--archive", str(archive), "--ledger", str(ledger), "--json"]
    single = CliRunner().invoke(app, [*args, "--threads", "1"])
    threaded = CliRunner().invoke(app, args)
    spread = CliRunner().invoke(app, [*args, "--workers", "2"])
    assert single.exit_code == threaded.exit_code == spread.exit_code == 0, spread.output
    assert json.loads(spread.stdout) == json.loads(single.stdout) == json.loads(threaded.stdout)
    both = CliRunner().invoke(app, [*args, "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"])
    assert both.exit_code == 2 and "give one of them" in both.output
    threads_and_workers = CliRunner().invoke(app, [*args, "--workers", "2", "--threads", "2"])
    assert threads_and_workers.exit_code == 2 and "give one of them" in threads_and_workers.output


def test_the_plan_covers_every_row_once_in_balanced_chunks_largest_first(tmp_path):
    archive, _, _ = build(tmp_path, partitions=PARTITIONS, jobs=16)
    _row_groups(archive, 5)
    view = ParquetArchive(archive)
    files = view.files("node.ipc")
    rows = {f: pq.ParquetFile(f).metadata.num_rows for f in files}
    for tasks in (1, 3, 8, 1000):
        chunks = plan_chunks(view, tasks)
        covered = {f: [] for f in files}
        for chunk in chunks:
            for f, start, end in chunk.parts:
                covered[f].append((start, rows[f] if end is None else end))
        for f, ranges in covered.items():  # each file's rows exactly once, cut at row-group boundaries
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == rows[f]
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            assert all(start % 5 == 0 for start, _ in ranges)
        sizes = [c.size for c in chunks]
        assert sizes == sorted(sizes, reverse=True)
        groups = sum(-(-n // 5) for n in rows.values())
        assert len(chunks) <= min(groups, tasks + 1)
        if tasks == 8:  # about 8 chunks of about equal bytes: none above twice the mean
            assert 6 <= len(chunks) <= 9 and max(sizes) <= 2 * sum(sizes) / len(sizes)
    assert len(plan_chunks(view, 1000)) == groups  # never finer than a row group
    assert all(end is None for c in plan_chunks(view, 1) for _, _, end in c.parts)  # whole files: no row filter


def _cut_stream_archive(tmp_path, cycles):
    """One job on one node whose blocks carry these cycles, in this offset order, in row groups of 2
    rows (a chunk boundary after every second block), and a clean job beside it."""
    records = [*(block(1.0, 1.4, 1.02, job="j", cycle=c) for c in cycles), left("j", "n1", len(cycles), max(cycles)),
               job_event("j", JobState.ENDED),
               *(block(1.0, 1.3, 1.01, job="k", cycle=c) for c in range(6)), left("k", "n1", 6, 5),
               job_event("k", JobState.ENDED)]
    archive, ledger, _ = archive_records(tmp_path, records)
    _row_groups(archive, 2)
    return archive, ledger


@pytest.mark.parametrize("cycles", [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 4, 3, 5, 6, 7], [0, 1, 2, 3, 3, 5],
                                    [0, 1, 3, 2, 4, 5]])
def test_a_stream_cut_across_chunks_folds_and_checks_as_one(tmp_path, cycles):
    """Cycles 4 then 3, or 3 then 3, sit on either side of a chunk boundary (offsets 3 and 4): only
    the check across chunks sees them; 3 then 2 (offsets 2 and 3) sit inside one chunk. Cut or
    whole, the fast path gives the same charges and the same ineligible job as on one thread, and
    a fast charge equals the reference's bit for bit."""
    archive, ledger = _cut_stream_archive(tmp_path, cycles)
    one = fast_recompute(archive, {}, POLICY, runner=in_process(1))
    many = fast_recompute(archive, {}, POLICY, runner=in_process(3))
    view = ParquetArchive(archive)
    groups = sum(len(view.row_groups(f)) for f in view.files("node.ipc"))
    assert len(plan_chunks(view, in_process(3).tasks)) == groups  # a chunk per row group of 2 rows
    assert many.charges == one.charges and many.ineligible == one.ineligible and many.samples == one.samples
    increasing = cycles == sorted(set(cycles))
    assert one.ineligible == (set() if increasing else {"j"})
    reference = recompute(archived_messages(ParquetArchive(archive)), {}, POLICY)
    assert all(reference[key] == charge for key, charge in many.charges.items())
    assert audit(archive, ledger, POLICY, threads=3).ok



def test_a_chunk_of_a_files_tail_and_the_next_whole_file_reads_them_in_order(tmp_path):
    """Files of 10 records in 1-row row groups: on 2 threads one chunk is the tail of the first file
    and the whole second file. Read in that order, the clean job stays on the fast path on 1, 2 and
    3 threads, the same report each time (read whole files first, it went to the reference path
    on 2 threads only). Found by a hostile review."""
    records = [*(block(1.0, 1.4, 1.02, job="j", cycle=c) for c in range(11)), left("j", "n1", 11, 10),
               job_event("j", JobState.ENDED)]
    archive, ledger, _ = archive_records(tmp_path, records, batch=10)
    _row_groups(archive, 1)
    view = ParquetArchive(archive)
    mixed = [c for c in plan_chunks(view, 4)
             if any(end is None for _, _, end in c.parts) and any(end is not None for _, _, end in c.parts)]
    assert mixed  # the case: a row range of one file, then a whole file
    for chunk in mixed:  # read in the parts' order: the offsets go up
        offsets = [o for (o,) in duckdb.connect().execute(f'SELECT "offset" FROM {_read_sql(view, chunk.parts)}'
                                                          ).fetchall()]
        assert offsets == sorted(offsets)
    reports = [audit(archive, ledger, POLICY, threads=n) for n in (1, 2, 3)]
    assert all(r.as_dict() == reports[0].as_dict() for r in reports)
    assert reports[0].ok and reports[0].fast_path_jobs == 1


def test_files_in_any_row_order_are_still_checked_on_the_fast_path(tmp_path):
    """An offset going down starts a new run (a file not sorted by offset, e.g. written by another
    tool): the same records in reversed row order keep every job on the fast path, the same
    charges; a block repeated across the reversal is still refused."""
    archive, _, n = build(tmp_path)
    before = fast_recompute(archive, {}, POLICY)
    for f in (archive / "topic=node.ipc").rglob("*.parquet"):
        table = pq.read_table(f)
        pq.write_table(table.take(list(range(table.num_rows - 1, -1, -1))), f)
    after = fast_recompute(archive, {}, POLICY, runner=in_process(3))
    assert not after.ineligible and after.charges == before.charges and len(after.charges) == n
    rows = [("j", "a", 3, 7), ("j", "a", 2, 6), ("j", "a", 1, 5)]  # reversed, increasing: three runs, fine
    con = duckdb.connect(config={"threads": 1})
    assert out_of_order_streams(con, scan_order(rows)) == set()
    assert out_of_order_streams(con, scan_order([("j", "a", 3, 7), ("j", "a", 2, 7)])) == {("j", "a")}


@pytest.mark.parametrize("differ", [False, True])
def test_copies_of_a_record_in_overlapping_files_must_be_equal(tmp_path, differ):
    """An interrupted compaction leaves two files holding the same offsets: equal copies are one
    record; copies that differ (one edited, value and typed columns alike) fail the audit and are
    named, whichever copy a reader keeps. (Before, each path kept an arbitrary copy: the
    reference-only audit passed or failed from run to run.)"""
    import pyarrow as pa

    archive, ledger, _ = build(tmp_path)
    f = sorted((archive / "topic=node.ipc").rglob("*.parquet"))[0]
    table = pq.read_table(f)
    rows = table.to_pylist()
    i = next(i for i, r in enumerate(rows) if r["kind"] == "shutter_batch")
    if differ:
        rec = json.loads(rows[i]["value"])
        rec["during"]["instructions"][0] *= 3
        rows[i]["value"] = json.dumps(rec, separators=(",", ":")).encode()
        rows[i]["l_d_instructions"][0] *= 3
    copy = f.parent / (f.stem.rsplit("-", 1)[0] + "-999999999999.parquet")  # the same first offset: overlapping
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), copy)
    for fast in (True, False):
        report = audit(archive, ledger, POLICY, fast=fast, threads=2)
        assert report.ok is not differ
        assert report.conflicting_copies == ([f"node.ipc[0]@{rows[i]['offset']}"] if differ else [])
    # every reader keeps the same copy: the lowest (key, value, broker timestamp)
    kept = [ev.value for _, ev in ParquetArchive(archive).events(["node.ipc"]) if ev.offset == rows[i]["offset"]]
    assert kept == [min(table.column("value")[i].as_py(), rows[i]["value"])]


@pytest.mark.parametrize("differ", [False, True])
def test_a_copy_in_the_same_file_is_found_by_its_offset_not_by_file_names(tmp_path, differ):
    """An offset held twice inside one file (or in a file whose name hides it) is found from the
    offsets the files hold: an equal copy is counted once by both paths, a different one (a higher
    cycle, in a run of its own, which the order check alone would let through) fails the audit.
    Found by a hostile review."""
    import pyarrow as pa

    archive, ledger, _ = build(tmp_path)
    f = sorted((archive / "topic=node.ipc").rglob("*.parquet"))[0]
    table = pq.read_table(f)
    rows = table.to_pylist()
    i = next(i for i, r in enumerate(rows) if r["kind"] == "shutter_batch")
    copy = dict(rows[i])
    if differ:
        rec = json.loads(copy["value"])
        rec["cycle"] = [c + 100_000 for c in rec["cycle"]]
        copy["value"] = json.dumps(rec, separators=(",", ":")).encode()
        copy["l_cycle"] = rec["cycle"]
    pq.write_table(pa.Table.from_pylist([*rows, copy], schema=table.schema), f)
    fast = fast_recompute(archive, {}, POLICY, runner=in_process(2))
    assert [d[:4] for d in fast.duplicates] == [("node.ipc", 0, 0, rows[i]["offset"])]
    assert fast.duplicates[0][4] is differ
    reference = recompute(archived_messages(ParquetArchive(archive)), {}, POLICY)
    assert all(reference[k] == c for k, c in fast.charges.items())
    report = audit(archive, ledger, POLICY, threads=2)
    assert report.ok is not differ and len(report.conflicting_copies) == int(differ)
