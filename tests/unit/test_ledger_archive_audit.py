"""Ledger idempotence, archive layout and the audit's verdicts, on real DuckDB and Parquet files."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import POLICY, build
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.schemas import encode
from nodeshare.sinks.archive import ArchivedEvent, ParquetArchive
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger


def test_clean_run_audits_clean(tmp_path):
    archive, ledger, n = build(tmp_path)
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.charges_checked == report.matches == n == 8


def test_a_redelivered_charge_never_makes_a_second_row(tmp_path):
    _, ledger_path, n = build(tmp_path)
    with Ledger(ledger_path) as ledger:
        rows = [(c, encode(c), 0, i) for i, c in enumerate(ledger.charges())]
        assert ledger.append(rows) == 0
        assert ledger.count() == n


def test_a_batch_larger_than_one_insert_statement_lands_whole_and_chained(tmp_path):
    _, ledger_path, n = build(tmp_path)
    with Ledger(ledger_path) as ledger:
        charges = ledger.charges()
        copies = [c.model_copy(update={"job_id": f"{c.job_id}-copy{k}"}) for k in range(70) for c in charges]
        assert len(copies) > 2 * 256  # three multi-row INSERT statements
        assert ledger.append([(c, encode(c), 0, i) for i, c in enumerate(copies)]) == len(copies)
        assert ledger.count() == n + len(copies)
        assert ledger.verify_chain().ok
        assert [c.job_id for c in ledger.charges()[n:]] == [c.job_id for c in copies]


def test_an_edited_ledger_row_is_detected(tmp_path):
    archive, ledger, _ = build(tmp_path)
    con = duckdb.connect(str(ledger))
    job = con.execute("SELECT job_id FROM charges ORDER BY job_id LIMIT 1").fetchone()[0]
    con.execute("UPDATE charges SET record = json_merge_patch(record, '{\"price\": 0.0}') WHERE job_id = ?", [job])
    con.close()
    report = audit(archive, ledger, POLICY)
    assert not report.ok
    # The record no longer matches the archive, nor the row's own SQL column.
    assert sorted((m.job_id, m.field) for m in report.mismatches) == [(job, "column price"), (job, "price")]


def test_an_edited_sql_column_is_detected(tmp_path):
    archive, ledger, _ = build(tmp_path)
    con = duckdb.connect(str(ledger))
    con.execute("UPDATE charges SET price = price / 2 WHERE job_id = (SELECT min(job_id) FROM charges)")
    con.close()
    report = audit(archive, ledger, POLICY)
    assert not report.ok and [m.field for m in report.mismatches] == ["column price"]


def test_an_edited_archive_event_is_detected(tmp_path):
    archive, ledger, _ = build(tmp_path)
    f = sorted((archive / "topic=node.ipc").rglob("*.parquet"))[0]
    table = pq.read_table(f)
    values = table.column("value").to_pylist()
    row = next(i for i, v in enumerate(values) if json.loads(v)["kind"] == "shutter_batch")
    rec = json.loads(values[row])
    rec["during"]["instructions"][0] *= 2  # the shutter "saw" twice the progress
    values[row] = json.dumps(rec).encode()
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", [values]), f)
    report = audit(archive, ledger, POLICY)
    assert not report.ok and {m.job_id for m in report.mismatches} == {rec["job_id"]}


def test_a_deleted_ledger_row_is_reported_missing(tmp_path):
    archive, ledger, _ = build(tmp_path)
    con = duckdb.connect(str(ledger))
    con.execute("DELETE FROM charges WHERE job_id = (SELECT min(job_id) FROM charges)")
    con.close()
    report = audit(archive, ledger, POLICY)
    assert not report.ok and len(report.missing_in_ledger) == 1


def test_audit_cli_json_and_exit_status(tmp_path, monkeypatch):
    archive, ledger, n = build(tmp_path)
    monkeypatch.setenv("NODESHARE_RATE_PER_CORE_HOUR", "1.5")
    ok = CliRunner().invoke(app, ["audit", "--archive", str(archive), "--ledger", str(ledger), "--json"])
    assert ok.exit_code == 0, ok.output
    body = json.loads(ok.output)
    assert body["charges_checked"] == n and body["mismatches"] == 0
    con = duckdb.connect(str(ledger))
    con.execute("UPDATE charges SET record = json_merge_patch(record, '{\"degradation\": 0.5}')")
    con.close()
    bad = CliRunner().invoke(app, ["audit", "--archive", str(archive), "--ledger", str(ledger), "--json"])
    assert bad.exit_code == 1 and json.loads(bad.output)["mismatches"] == 2 * n  # vs archive and vs column


def test_archive_layout_resume_point_and_no_temporary_files(tmp_path):
    archive, _, _ = build(tmp_path, batch=100)
    files = ParquetArchive(archive).files()
    assert all(f.parent.name.startswith("date=") and f.parent.parent.name.startswith("topic=") for f in files)
    assert not list(archive.rglob("*.tmp"))
    hw = ParquetArchive(archive).high_water()
    assert hw[("jobs.lifecycle", 0)] == 3 * 8 - 1  # submitted, started, ended per job


def test_a_restarted_sink_removes_the_half_written_files_of_its_partitions_only(tmp_path):
    from confluent_kafka import TopicPartition

    from nodeshare.runtime.config import Settings
    from nodeshare.sinks.archive import ArchiveSink

    archive, _, _ = build(tmp_path, batch=100)
    day = next((archive / "topic=node.ipc").iterdir())
    mine = day / "p0000-000000009000-000000009099.parquet.tmp"
    other = day / "p0001-000000000000-000000000099.parquet.tmp"
    compacting = day / "p0000-000000000000-000000009099.parquet.compact.tmp"
    for f in (mine, other, compacting):
        f.write_bytes(b"PAR1 half")
    settings = Settings.model_validate({"topic_prefix": ""})
    sink = ArchiveSink(settings, archive)
    partitions = [TopicPartition(settings.topic("node.ipc"), 0)]
    sink.resume_offsets(partitions)
    assert not mine.exists() and other.exists() and compacting.exists()  # partition 1 is not ours; nor compaction's
    # the last offset held is read again, to see that the topic did not restart (the copy is dropped)
    assert partitions[0].offset == ParquetArchive(archive).high_water()[("node.ipc", 0)]
    ParquetArchive(archive).compact()
    assert not compacting.exists()  # the next compaction clears its own leftovers


def test_overlapping_files_are_read_once(tmp_path):
    archive = ParquetArchive(tmp_path)
    evs = [ArchivedEvent("jobs.lifecycle", 0, o, 1_767_225_600_000, b"k", b"v%d" % o) for o in range(10)]
    archive.write("jobs.lifecycle", evs[:6])
    archive.write("jobs.lifecycle", evs[4:])  # a crash between write and commit re-wrote offsets 4-5
    got = [e.offset for _, e in archive.events(["jobs.lifecycle"])]
    assert got == list(range(10))


def test_missing_ledger_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ledger"):
        Ledger(tmp_path / "absent.duckdb", read_only=True)


def _exec(ledger: Path, sql: str, params: list | None = None) -> None:
    con = duckdb.connect(str(ledger))
    con.execute(sql, params or [])
    con.close()


def test_the_chain_holds_for_an_untouched_ledger(tmp_path):
    archive, ledger, n = build(tmp_path)
    with Ledger(ledger, read_only=True) as led:
        check = led.verify_chain()
    assert check.ok and check.rows == n
    report = audit(archive, ledger, POLICY)
    assert report.chain_ok and report.conservation_ok and report.as_dict()["chain_ok"] is True


@pytest.mark.parametrize(("tamper", "expect"), [
    ("UPDATE charges SET record = json_merge_patch(record, '{\"user\": \"mallory\"}') WHERE seq = 3", "edited"),
    ("DELETE FROM charges WHERE seq = 2", "removed or reordered"),
    ("UPDATE charges SET seq = 100 WHERE seq = 1; UPDATE charges SET seq = 1 WHERE seq = 4;"
     " UPDATE charges SET seq = 4 WHERE seq = 100", "prev_hash"),
])
def test_editing_deleting_or_reordering_a_row_breaks_the_chain(tmp_path, tamper, expect):
    archive, ledger, _ = build(tmp_path)
    _exec(ledger, tamper)
    report = audit(archive, ledger, POLICY)
    assert not report.chain_ok and expect in report.chain_error and not report.ok


def test_conservation_is_checked_per_day_and_per_job(tmp_path):
    archive, ledger, _ = build(tmp_path)
    assert audit(archive, ledger, POLICY).conservation_ok
    # A charge above its standard price, kept self-consistent (record and column), still breaks conservation.
    _exec(ledger, "UPDATE charges SET record = json_merge_patch(record, '{\"price\": 99.0}'), price = 99.0 "
                  "WHERE seq = 0")
    report = audit(archive, ledger, POLICY)
    assert not report.conservation_ok
    assert any("outside [0, standard price" in v for v in report.conservation_violations)
    assert any("!= charged" in v for v in report.conservation_violations)


def test_analyst_views_add_up_to_the_ledger(tmp_path):
    _, ledger, n = build(tmp_path)
    con = duckdb.connect(str(ledger), read_only=True)
    total_sop, total_price, total_div = con.execute(
        "SELECT sum(standard_price), sum(price), sum(dividend) FROM charges").fetchone()
    daily = con.execute(
        "SELECT sum(jobs), sum(standard_price), sum(charged), sum(dividend) FROM usage_daily").fetchone()
    assert daily[0] == n and daily[1:] == pytest.approx((total_sop, total_price, total_div))
    monthly = con.execute("SELECT sum(jobs), sum(dividend) FROM usage_monthly").fetchone()
    assert monthly == (n, pytest.approx(total_div))
    by_node = con.execute("SELECT sum(dividend), count(DISTINCT node) FROM dividend_by_node").fetchone()
    assert by_node[0] == pytest.approx(total_div) and by_node[1] == 4
    assert con.execute("SELECT count(*) FROM charges_current").fetchone()[0] == n


def test_compaction_merges_files_and_the_audit_still_passes(tmp_path):
    archive, ledger, n = build(tmp_path, batch=25)
    before_events = [(t, e.offset, e.value) for t, e in ParquetArchive(archive).events(["node.ipc", "jobs.lifecycle"])]
    files_before, files_after = ParquetArchive(archive).compact(min_rows=200)
    assert files_after < files_before
    per_dir: dict = {}
    for f in ParquetArchive(archive).files():
        per_dir.setdefault(f.parent, []).append(pq.ParquetFile(f).metadata.num_rows)
    for rows in per_dir.values():  # every file but a partition's last holds at least min_rows
        assert all(r >= 200 for r in rows[:-1])
    after_events = [(t, e.offset, e.value) for t, e in ParquetArchive(archive).events(["node.ipc", "jobs.lifecycle"])]
    assert after_events == before_events
    assert not list(archive.rglob("*.tmp"))
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == n
    assert ParquetArchive(archive).compact(min_rows=200)[1] == files_after  # idempotent


def test_compaction_resolves_overlapping_files(tmp_path):
    archive = ParquetArchive(tmp_path)
    evs = [ArchivedEvent("jobs.lifecycle", 0, o, 1_767_225_600_000, b"k", b"v%d" % o) for o in range(10)]
    archive.write("jobs.lifecycle", evs[:6])
    archive.write("jobs.lifecycle", evs[4:])
    assert archive.compact(min_rows=100) == (2, 1)
    assert [e.offset for _, e in archive.events(["jobs.lifecycle"])] == list(range(10))
    assert archive.high_water() == {("jobs.lifecycle", 0): 9}


def _move_to_the_day_before(archive: Path, files: list[Path]) -> None:
    for f in files:
        day = archive / f.parent.parent.name / "date=2025-12-31"
        day.mkdir(parents=True, exist_ok=True)
        f.rename(day / f.name)


def test_retention_prunes_dates_and_the_audit_skips_only_the_charges_that_lost_events(tmp_path):
    archive, ledger, n = build(tmp_path, batch=10)
    store = ParquetArchive(archive)
    # the first 10 node.ipc messages become the day before's (the simulated run is all on 2026-01-01)
    _move_to_the_day_before(archive, [f for f in store.files() if f.name == "p0000-000000000000-000000000009.parquet"
                                      and "node.ipc" in str(f)])
    total = store.count()
    assert store.prune(date(2025, 12, 31)).files == 0  # nothing before that day
    dry = store.prune(date(2026, 1, 1), dry_run=True)
    assert dry.dates == ["2025-12-31"] and dry.files == 1 and dry.events == 10 and store.count() == total
    pruned = store.prune(date(2026, 1, 1))
    assert pruned == dry and store.count() == total - pruned.events
    assert store.retention()[("node.ipc", 0)] == 9
    report = audit(archive, ledger, POLICY)
    assert report.ok, report.as_dict()
    assert 0 < report.beyond_retention < n and report.charges_checked == report.matches == n - report.beyond_retention
    assert report.as_dict()["beyond_retention"] == report.beyond_retention


def test_after_pruning_an_edited_retained_event_is_still_detected(tmp_path):
    archive, ledger, _ = build(tmp_path, batch=10)
    store = ParquetArchive(archive)
    _move_to_the_day_before(archive, [f for f in store.files() if f.name == "p0000-000000000000-000000000009.parquet"
                                      and "node.ipc" in str(f)])
    store.prune(date(2026, 1, 1))
    end = sorted(f for f in store.files() if "jobs.lifecycle" in str(f))[-1]  # retained whole
    table = pq.read_table(end)
    rows = table.to_pylist()
    edited = rows[-1]["value"].replace(b'"cores":', b'"cores":1', 1)  # e.g. 8 cores -> 18
    assert edited != rows[-1]["value"]
    rows[-1]["value"] = edited
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), end)
    assert not audit(archive, ledger, POLICY).ok


def test_archive_prune_cli(tmp_path):
    archive, _, _ = build(tmp_path)
    res = CliRunner().invoke(app, ["archive", "prune", "--archive", str(archive), "--before", "2026-01-02",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "would remove" in res.output and ParquetArchive(archive).count() > 0
    resume_after = ParquetArchive(archive).high_water()
    res = CliRunner().invoke(app, ["archive", "prune", "--archive", str(archive), "--before", "2026-01-02"])
    assert res.exit_code == 0, res.output
    assert ParquetArchive(archive).count() == 0 and "removed" in res.output
    assert ParquetArchive(archive).high_water() == resume_after  # the sink resumes after what was pruned
    res = CliRunner().invoke(app, ["archive", "prune", "--archive", str(archive), "--before", "March"])
    assert res.exit_code != 0 and "YYYY-MM-DD" in res.output


def _reader(path: Path, hold_s: float):
    """Another process with the ledger open read-only (as an analyst's session), for ``hold_s``."""
    import subprocess
    import sys

    code = ("import duckdb, sys, time; c = duckdb.connect(sys.argv[1], read_only=True); "
            "print('open', flush=True); time.sleep(float(sys.argv[2]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    return proc


def test_the_ledger_sink_waits_for_a_readers_lock_and_names_a_reader_that_never_lets_go(tmp_path):
    import time

    from nodeshare.runtime.config import Settings
    from nodeshare.sinks.ledger import LedgerSink

    path = tmp_path / "ledger.duckdb"
    with Ledger(path):
        pass
    sink = LedgerSink(Settings.model_validate({}), path)
    reader = _reader(path, 0.8)
    start = time.monotonic()
    sink.write([])  # waits for the reader instead of failing
    assert time.monotonic() - start > 0.3
    reader.wait()
    sink.lock_wait_s = 0.5
    reader = _reader(path, 10)
    try:
        with pytest.raises(RuntimeError, match="held by another process"):
            sink.write([])
    finally:
        reader.kill()
        reader.wait()


def test_events_read_only_the_topics_asked_and_skip_an_emptied_topic(tmp_path):
    store = ParquetArchive(tmp_path)
    store.write("jobs.lifecycle", [ArchivedEvent("jobs.lifecycle", 0, 0, 1_767_225_600_000, b"1", b"{}")])
    store.write("node.power", [ArchivedEvent("node.power", 0, 0, 1_767_225_600_000, b"n1", b"{}")])
    (tmp_path / "topic=node.ipc").mkdir()  # e.g. every date pruned
    got = [(topic, ev.key) for topic, ev in store.events(["jobs.lifecycle", "node.ipc"])]
    assert got == [("jobs.lifecycle", b"1")]


def test_a_ledger_written_before_schema_4_gains_its_columns_and_stays_clean(tmp_path):
    """A ledger file from before version 4 has no degradation_shared or alone_s column: opening it
    adds both, filled with what its version-3 records read as (0), so no column drifts and the
    chain holds; version-4 charges appended after carry their values. (Mutation: no ALTER, or the
    columns filled with NULL, fails here.)"""
    from nodeshare.sinks.ledger import GENESIS, chain_hash

    _, ledger_path, n = build(tmp_path)
    with Ledger(ledger_path) as ledger:
        charges = ledger.charges()
    assert any(c.alone_s > 0 for c in charges)  # the simulated jobs ran alone part of the time
    old = tmp_path / "old.duckdb"
    with duckdb.connect(str(old)) as con:  # the first half as a version-3 ledger held it
        con.execute(f"ATTACH '{ledger_path}' AS src (READ_ONLY)")
        con.execute("CREATE TABLE charges AS SELECT * EXCLUDE (degradation_shared, alone_s) FROM src.charges")
        con.execute(f"DELETE FROM charges WHERE seq >= {n // 2}")
        prev = GENESIS
        for seq, record in con.execute("SELECT seq, record FROM charges ORDER BY seq").fetchall():
            v3 = json.loads(record)
            del v3["degradation_shared"], v3["alone_s"]
            v3.update(schema_version=3, degradation=v3["degradation"])
            text = json.dumps(v3, separators=(",", ":"))
            row_hash = chain_hash(prev, text)
            con.execute("UPDATE charges SET record = ?, prev_hash = ?, row_hash = ? WHERE seq = ?",
                        [text, prev, row_hash, seq])
            prev = row_hash
    with Ledger(old) as ledger:
        assert ledger.column_drift() == [] and ledger.verify_chain().ok
        assert ledger.append([(c, encode(c), 0, i) for i, c in enumerate(charges)]) == n - n // 2
        assert ledger.column_drift() == [] and ledger.verify_chain().ok
        got = dict(ledger.con.execute("SELECT seq, alone_s FROM charges ORDER BY seq").fetchall())
    assert [got[i] for i in range(n // 2)] == [0.0] * (n // 2)
    assert [got[i] for i in range(n // 2, n)] == [c.alone_s for c in charges[n // 2:]]


class _Msg:
    """The few methods of a confluent-kafka Message the ledger sink reads."""

    def __init__(self, topic: str, value: bytes, offset: int) -> None:
        self._topic, self._value, self._offset = topic, value, offset

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b"j1"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_767_225_600_000)


def test_a_second_different_row_for_a_job_revision_is_a_dead_letter_and_a_metric_never_silently_dropped(tmp_path):
    """A re-sent copy of a charge is absorbed; a copy of the same (job, revision) with another price
    (a recomputation that disagrees, or a forged row) is kept out of the ledger, counted and
    dead-lettered with the fields that differ. A copy made by another code version is a copy."""
    from nodeshare.runtime import metrics
    from nodeshare.runtime.config import Settings
    from nodeshare.schemas import DeadLetter
    from nodeshare.sinks.ledger import LedgerSink

    _, ledger_path, _ = build(tmp_path)
    with Ledger(ledger_path, read_only=True) as ledger:
        charge = ledger.charges()[0]
    sent: list[DeadLetter] = []

    class Letters:
        def send(self, record: DeadLetter) -> None:
            sent.append(record)

        def flush(self) -> None:
            pass

    sink = LedgerSink(Settings.model_validate({}), tmp_path / "sink.duckdb", dead_letters=Letters())
    other = charge.model_copy(update={"price": charge.price / 2, "dividend": charge.standard_price - charge.price / 2})
    newer = charge.model_copy(update={"code_version": "9.9.9"})
    before = metrics.DIVERGENT_CHARGES._value.get()
    sink.write([_Msg("ledger.charges", encode(c), i) for i, c in enumerate([charge, charge, newer, other])])
    assert sink.rows_inserted == 1 and metrics.DIVERGENT_CHARGES._value.get() == before + 1
    (dl,) = sent
    assert dl.origin_offset == 3 and "a second, different row" in dl.reason and "price" in dl.reason
    assert dl.field == "price"
    with Ledger(tmp_path / "sink.duckdb", read_only=True) as ledger:
        assert [c.price for c in ledger.charges()] == [charge.price]


def test_a_copy_re_sent_after_an_upgrade_differs_only_in_fields_the_held_row_predates(tmp_path):
    """A version-4 row and the worker's version-5 copy of it (same price, evidence_problems now said):
    a redelivery, not a divergent row."""
    from nodeshare.sinks.ledger import charge_differences

    _, ledger_path, _ = build(tmp_path)
    with Ledger(ledger_path, read_only=True) as ledger:
        charge = ledger.charges()[0]
    old = charge.model_copy(update={"schema_version": 4})
    newer = charge.model_copy(update={"evidence_problems": ("node n1: 1 of the 5 blocks never arrived",)})
    assert charge_differences(old, newer) == []
    assert [f for f, _, _ in charge_differences(charge, newer)] == ["evidence_problems"]


def test_a_copy_re_sent_across_the_margin_upgrade_is_no_divergent_row_but_a_changed_price_is(tmp_path):
    """The ledger holds a schema-6 row (no interval margin); the upgraded worker re-sends it with the
    margin: the interval's ends differ, the price does not. A policy change stated in the row, not a
    divergent charge (no critical alert); a different price stays divergent."""
    from nodeshare.runtime import metrics
    from nodeshare.runtime.config import Settings
    from nodeshare.sinks.ledger import LedgerSink, charge_differences, margin_only

    _, ledger_path, _ = build(tmp_path)
    with Ledger(ledger_path, read_only=True) as ledger:
        charge = ledger.charges()[0]
    held = charge.model_copy(update={"schema_version": 6, "interval_margin_abs": None, "interval_margin_rel": None})
    copy = charge.model_copy(update={"degradation_high": min(1.0, (charge.degradation_high or 0.0) + 0.01)})
    fields = [f for f, _, _ in charge_differences(held, copy)]
    assert fields == ["degradation_high"] and margin_only(held, copy, fields)
    assert not margin_only(charge, copy, fields)  # the same margin: a real divergence
    priced = copy.model_copy(update={"price": copy.price * 0.9})
    assert not margin_only(held, priced, [f for f, _, _ in charge_differences(held, priced)])
    sent: list = []

    class Letters:
        def send(self, record):
            sent.append(record)

        def flush(self) -> None:
            pass

    sink = LedgerSink(Settings.model_validate({}), tmp_path / "sink.duckdb", dead_letters=Letters())
    before = metrics.DIVERGENT_CHARGES._value.get()
    sink.write([_Msg("ledger.charges", encode(c), i) for i, c in enumerate([held, copy, priced])])
    assert sink.rows_inserted == 1 and metrics.DIVERGENT_CHARGES._value.get() == before + 1
    assert [dl.origin_offset for dl in sent] == [2]  # only the copy with another price


def test_a_copy_re_sent_across_the_short_margin_upgrade_is_repriced_not_divergent():
    """The ledger holds a schema-9 row (no short-sample margin); the upgraded worker re-sends it priced
    with the margin: its D, price and what follows from them differ, under a short-sample policy the
    copy states. A stated policy change (the row stays as billed), not a divergent charge; a copy
    that claims the change but prices otherwise (any price, or a margin it did not apply), or that
    also moves the blocks, stays divergent."""
    from dataclasses import replace

    from factories import batch, block, job_event, left

    from nodeshare.schemas import JobState
    from nodeshare.sinks.ledger import charge_differences, margin_only
    from nodeshare.streams.core.accounting import Origin, fold_messages

    records = [batch(*[block(1.0, 1.25, 1.0, cycle=c) for c in range(12)]), left("j1", "n1", 12, 11),
               job_event("j1", JobState.ENDED)]
    messages = [(Origin("jobs.lifecycle" if i == 2 else "node.ipc", 0, i), b"j1", encode(r), 0.0)
                for i, r in enumerate(records)]
    [before] = fold_messages(messages, POLICY)  # POLICY: no short-sample margin
    [copy] = fold_messages(messages, replace(POLICY, short_margin=0.015))
    held = before.model_copy(update={"schema_version": 9, "short_margin": None, "short_sample_us": None})
    fields = [f for f, _, _ in charge_differences(held, copy)]
    assert copy.short_margin_applied == 0.015 and {"degradation", "price", "dividend"} <= set(fields)
    assert margin_only(held, copy, fields)

    def forgiven(update: dict) -> bool:
        c = copy.model_copy(update=update)
        return margin_only(held, c, [f for f, _, _ in charge_differences(held, c)])

    assert not forgiven({"price": copy.price * 0.5})  # any price
    assert not forgiven({"short_sample_us": 3201, "price": 0.0})
    assert not forgiven({"short_margin_applied": 0.0, "price": copy.price * 0.9})  # no margin applied
    assert not forgiven({"short_margin": None, "short_sample_us": None})  # no policy change stated
    assert not forgiven({"blocks_used": copy.blocks_used + 1})
    assert not forgiven({"short_margin_applied": 0.4})  # a margin the policy does not state
    assert not forgiven({"degradation_low": 0.0, "degradation_high": 1.0})  # priced right, another interval
    # a job the margin did not touch: only the stated policy differs (an upgrade, a rollback, a new value)
    untouched = before.model_copy(update={"short_margin": 0.02})
    assert margin_only(before, untouched, [f for f, _, _ in charge_differences(before, untouched)])
    # a job whose long samples Alg. 4 rejected: the margin widens its interval, never its price, so
    # a copy under another margin differs in the interval's ends only; with another price it does not
    from nodeshare.schemas import CounterSource

    longs = [block(1.0, 1.25 if c < 102 else 0.9, 1.0, cycle=c).model_copy(
        update={"sample_us": 51200, "counter": CounterSource.SIMULATED}) for c in range(100, 104)]
    probed = [(Origin("node.ipc", 0, 0), b"j1", encode(records[0]), 0.0),
              (Origin("node.ipc", 0, 1), b"j1", encode(batch(*longs, seq=1)), 0.0),
              (Origin("node.ipc", 0, 2), b"j1", encode(left("j1", "n1", 16, 103)), 0.0),
              (Origin("jobs.lifecycle", 0, 3), b"j1", encode(records[2]), 0.0)]
    [then] = fold_messages(probed, replace(POLICY, short_margin=0.015))
    [now] = fold_messages(probed, replace(POLICY, short_margin=0.03))
    assert then.short_margin_applied == now.short_margin_applied == 0.0 and now.blocks_rejected == 2
    assert {f for f, _, _ in charge_differences(then, now)} == {"short_margin", "degradation_low", "degradation_high"}
    assert margin_only(then, now, [f for f, _, _ in charge_differences(then, now)])
    for update in ({"price": now.price * 0.9}, {"degradation_low": 0.0, "degradation_high": 1.0},
                   {"degradation_low": 0.5, "degradation_high": 0.2},  # ends moved further than the margin
                   {"degradation_high": then.degradation_high - 0.01}):  # inward, the margin grown
        forged = now.model_copy(update=update)
        assert not margin_only(then, forged, [f for f, _, _ in charge_differences(then, forged)]), update
    assert margin_only(now, then, [f for f, _, _ in charge_differences(now, then)])  # a rollback: inward
    # the longest S the margin covers changed alone: at 1.6 ms the 3.2 ms samples are not short, so
    # the estimate is no longer unchecked and its interval narrows by the whole margin
    [moved] = fold_messages(probed, replace(POLICY, short_margin=0.03, short_sample_us=1600))
    assert {f for f, _, _ in charge_differences(now, moved)} == {"short_sample_us", "degradation_low",
                                                                 "degradation_high"}
    assert margin_only(now, moved, [f for f, _, _ in charge_differences(now, moved)])


def test_a_resent_charge_whose_lower_end_moved_to_its_trusted_level_is_forgiven_and_a_forged_one_is_not():
    """A schema-9 build ended every interval at the point's symmetric end; since schema 10 an
    estimate whose kept short samples read higher than its longest S reaches down to that level's
    own interval (streams.core.confidence, "The trusted level's lower end"). A worker upgraded
    across it re-sends such a charge: the ledger finds the lower end where the copy's own levels put
    it, and forgives it; a lower end anywhere else that no margin change explains stays divergent."""
    from factories import batch, block, job_event, left

    from nodeshare.schemas import CounterSource, JobState
    from nodeshare.sinks.ledger import charge_differences, margin_only
    from nodeshare.streams.core.accounting import Origin, fold_messages

    shorts = [block(1.0, 1.25 + 0.01 * (c % 3), 1.0, cycle=c) for c in range(30)]
    longs = [block(1.0, 1.11 + 0.01 * (c % 2), 1.0, cycle=c).model_copy(
        update={"sample_us": 51200, "counter": CounterSource.SIMULATED}) for c in range(100, 106)]
    records = [batch(*shorts), batch(*longs, seq=1), left("j1", "n1", 36, 105), job_event("j1", JobState.ENDED)]
    messages = [(Origin("jobs.lifecycle" if i == 3 else "node.ipc", 0, i), b"j1", encode(r), 0.0)
                for i, r in enumerate(records)]
    [copy] = fold_messages(messages, POLICY)
    assert all(lv.used for lv in copy.levels) and copy.short_margin_applied == 0.0
    symmetric = copy.degradation_point - (copy.degradation_high - copy.degradation_point)
    assert copy.degradation_low < symmetric - 0.05  # the long level's own lower end
    held = copy.model_copy(update={"schema_version": 9, "short_margin": None, "short_sample_us": None,
                                   "degradation_low": symmetric})
    assert margin_only(held, copy, [f for f, _, _ in charge_differences(held, copy)])
    for low in (copy.degradation_low - 0.01, 0.0):
        forged = copy.model_copy(update={"degradation_low": low})
        assert not margin_only(held, forged, [f for f, _, _ in charge_differences(held, forged)]), low
