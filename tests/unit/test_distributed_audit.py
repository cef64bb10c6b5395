"""The audit beyond one process (issue 29): one Dask task per archive partition on a LocalCluster
of real worker processes gives the report the single process gives, field by field, on clean and
tampered simulated archives; each tampering is found by the task whose partition holds the job.
(Mutations: a task comparing every ledger row instead of its own jobs' double-counts and fails the
equality; dropping the jobs no partition holds loses their mismatch.)"""

from __future__ import annotations

import json

import duckdb
import pyarrow.parquet as pq
import pytest
from factories import POLICY, build

from nodeshare.schemas import encode
from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.audit import audit, audit_partitions, dask_client
from nodeshare.sinks.ledger import Ledger

PARTITIONS = 4


@pytest.fixture(scope="module")
def client():
    with dask_client(workers=2) as c:
        yield c


def _both(archive, ledger, client):
    calls: list[tuple[int, int, int]] = []
    single = audit(archive, ledger, POLICY)
    spread = audit(archive, ledger, POLICY, client=client, progress=lambda *a: calls.append(a))
    assert spread.as_dict() == single.as_dict()  # the same report, field by field, the same order
    assert spread.mismatches == single.mismatches
    held = ParquetArchive(archive).partitions_held(["node.ipc", "jobs.lifecycle"])
    assert [(d, t) for d, t, _ in calls] == [(i + 1, len(held)) for i in range(len(held))]  # one task each
    return single, calls


def test_a_clean_archive_on_four_partitions_audits_the_same_in_tasks(tmp_path, client):
    archive, ledger, n = build(tmp_path, partitions=PARTITIONS, jobs=16)
    assert ParquetArchive(archive).partitions_held(["node.ipc"]) == list(range(PARTITIONS))
    report, calls = _both(archive, ledger, client)
    assert report.ok and report.charges_checked == report.matches == n == 16
    assert report.fast_path_jobs == 16
    assert calls[-1][2] > 0  # samples checked, as the progress bar shows them


def test_tampering_is_found_by_the_task_that_owns_the_job(tmp_path, client):
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
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", [values]), f)
    report, _ = _both(archive, ledger, client)
    assert not report.ok and {m.job_id for m in report.mismatches} == {edited, rec["job_id"]}
    # the task of partition 3 alone finds the edited event, and holds none of the other partitions' jobs
    part = audit_partitions(str(archive), str(ledger), (3,), set(), POLICY, True)
    assert rec["job_id"] in part.held
    assert {key[0] for key, diffs in part.checked if diffs} >= {rec["job_id"]}
    assert all(key[0] in part.held for key, _ in part.checked)


def test_a_ledger_row_no_partition_holds_is_reported_as_in_one_process(tmp_path, client):
    archive, ledger, n = build(tmp_path, partitions=PARTITIONS, jobs=8)
    with Ledger(ledger) as led:
        c = led.charges()[0]
        ghost = c.model_copy(update={"job_id": "ghost-job"})
        led.append([(ghost, encode(ghost), 0, 10_000)])
    report, _ = _both(archive, ledger, client)
    assert [(m.job_id, m.field, m.recomputed) for m in report.mismatches] == [
        ("ghost-job", "*", "no charge from the archive")]
    assert report.charges_checked == n + 1


def test_the_cli_audits_on_local_workers_with_the_same_json(tmp_path):
    from typer.testing import CliRunner

    from nodeshare.cli import app

    archive, ledger, _ = build(tmp_path, partitions=PARTITIONS, jobs=8)
    args = ["audit", "--archive", str(archive), "--ledger", str(ledger), "--json"]
    single = CliRunner().invoke(app, args)
    spread = CliRunner().invoke(app, [*args, "--workers", "2"])
    assert single.exit_code == spread.exit_code == 0, spread.output
    assert json.loads(spread.stdout) == json.loads(single.stdout)
    both = CliRunner().invoke(app, [*args, "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"])
    assert both.exit_code == 2 and "give one of them" in both.output


def test_partitions_are_handed_out_largest_first(tmp_path):
    """Longest processing time first: on 2 workers the last task to start is a small one."""
    archive, _, _ = build(tmp_path, partitions=PARTITIONS, jobs=16)
    view = ParquetArchive(archive)
    topics = ["node.ipc", "jobs.lifecycle"]
    size = {p: sum(f.stat().st_size for t in topics for f in ParquetArchive(archive, (p,)).files(t))
            for p in view.partitions_held(topics)}
    order = view.largest_partitions_first(topics)
    assert sorted(order) == sorted(size) and [size[p] for p in order] == sorted(size.values(), reverse=True)
    assert len(set(size.values())) > 1  # the sizes differ, so the order says something
