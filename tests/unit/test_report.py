"""`nodeshare report`: the pair matrix by hand, and real PNG and HTML files."""

import math
from datetime import timedelta

import duckdb
import pytest
from factories import POLICY, T0, block, build, job_event, left
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.schemas import JobState, ShutterWindow, encode
from nodeshare.sinks.analysis.report import build_report, pair_degradation
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import Origin, fold_messages


def _charge(job, program, d_block):
    msgs = [block(1.0, d_block, 1.0, job=job), left(job, "n1", 1, 0),
            job_event(job, JobState.ENDED).model_copy(update={"program": program})]
    topics = ["node.ipc", "node.ipc", "jobs.lifecycle"]
    [c] = fold_messages([(Origin(t, 0, i), job.encode(), encode(r), 0.0) for i, (t, r) in
                         enumerate(zip(topics, msgs, strict=True))], POLICY)
    return c


def test_pair_matrix_by_hand():
    a1, a2, b1 = _charge("a1", "A", 2.0), _charge("a2", "A", 4.0), _charge("b1", "B", 1.25)  # D = .5, .75, .2
    counts = {("a1", "b1"): 1, ("a2", "b1"): 3, ("b1", "a1"): 2, ("a1", "a2"): 5}
    programs, m = pair_degradation([a1, a2, b1], counts)
    assert programs == ["A", "B"]
    assert m[0, 1] == pytest.approx((1 * 0.5 + 3 * 0.75) / 4)  # A next to B, weighted by shutters
    assert m[1, 0] == pytest.approx(0.2) and m[0, 0] == pytest.approx(0.5) and math.isnan(m[1, 1])


def _window(node, cycle, lone, *paused):
    t = T0 + timedelta(seconds=cycle)
    return ShutterWindow(event_id=f"{node}/{cycle}", source="t", event_time=t, node=node, cycle=cycle,
                         lone_job=lone, paused_jobs=paused, start=t, end=t)


def test_the_ledger_view_by_program_pair_matches_the_matrix_by_hand(tmp_path):
    charges = [_charge("a1", "A", 2.0), _charge("a2", "A", 4.0), _charge("b1", "B", 1.25)]  # D = .5, .75, .2
    # the counts of the test above: a1 beside b1 once, a2 beside b1 3x, b1 beside a1 2x, a1 beside a2 5x
    windows = ([_window("n1", 0, "a1", "b1")] + [_window("n2", c, "a2", "b1") for c in range(3)]
               + [_window("n1", c, "b1", "a1") for c in (1, 2)] + [_window("n3", c, "a1", "a2") for c in range(5)])
    with Ledger(tmp_path / "l.duckdb") as ledger:
        ledger.append([(c, encode(c), 0, i) for i, c in enumerate(charges)])
        assert ledger.count_shutters(windows) == 11
        assert ledger.count_shutters(windows[:4]) == 0  # redelivered: the nodes' cycles were counted
        assert ledger.count_shutters([_window("n2", 2, "a2", "b1"), _window("n2", 3, "a2", "b1")]) == 1
        assert ledger.co_runner_counts() == {("a1", "b1"): 1, ("a2", "b1"): 4, ("b1", "a1"): 2, ("a1", "a2"): 5}
        view = {(a, b): (jobs, n, d) for a, b, jobs, n, d in ledger.con.execute(
            "SELECT program, co_program, jobs, shutters, degradation FROM degradation_by_pair").fetchall()}
    assert view.keys() == {("A", "B"), ("B", "A"), ("A", "A")}
    assert view[("A", "B")] == (2, 5, pytest.approx((1 * 0.5 + 4 * 0.75) / 5))
    assert view[("B", "A")] == (1, 2, pytest.approx(0.2))
    assert view[("A", "A")] == (1, 5, pytest.approx(0.5))


def test_report_writes_pictures_and_a_page(tmp_path):
    archive, ledger, _ = build(tmp_path)
    files = build_report(ledger, archive, tmp_path / "report")
    assert [p.name for p in files.pngs] == ["prices.png", "pairs.png", "dividend.png", "confidence.png"]
    for p in files.pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5_000
    page = files.html.read_text()
    assert all(f'src="{p.name}"' in page for p in files.pngs) and "dividend (SU)" in page
    # the test ledger is priced at the point estimates without the short-sample margin (factories.POLICY):
    # nothing given up for the bound or the margin
    assert "<th>given up for the confidence and the short-sample margin (SU)</th><td>0.0000</td>" in page
    assert "<th>jobs priced with the short-sample margin (schema 10)</th><td>0</td>" in page
    assert "<th>priced at the interval&#x27;s upper end</th><td>0 of " in page


def test_a_ledger_from_before_the_co_runner_counts_still_reports_from_the_archive(tmp_path):
    archive, ledger, _ = build(tmp_path)
    con = duckdb.connect(str(ledger))
    con.execute("DROP VIEW degradation_by_pair")
    con.execute("DROP TABLE co_runners")
    con.close()
    files = build_report(ledger, archive, tmp_path / "report")  # opens the ledger read-only: no DDL runs
    assert (tmp_path / "report" / "pairs.png") in files.pngs


def test_report_cli_refuses_an_empty_ledger(tmp_path):
    from nodeshare.sinks.ledger import Ledger

    Ledger(tmp_path / "empty.duckdb").close()
    result = CliRunner().invoke(app, ["report", "--ledger", str(tmp_path / "empty.duckdb"), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no charges" in result.output


def test_bench_ledger_counts_every_window_and_reports_its_rate(tmp_path):
    import json

    from typer.testing import CliRunner

    from nodeshare.cli import app

    result = CliRunner().invoke(app, ["bench", "ledger", "--windows", "2000", "--nodes", "50",
                                      "--out", str(tmp_path / "ledger.json")])
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "ledger.json").read_text())
    assert body["windows"] == 2000 and body["nodes"] == 50 and body["windows_per_s"] > 0
    assert body["decode_us_per_window"] > 0 and body["count_us_per_window"] > 0
    # the rate is one window per (decode + count) time, not another figure under its name
    per_window_us = body["decode_us_per_window"] + body["count_us_per_window"]
    assert body["windows_per_s"] == pytest.approx(1e6 / per_window_us, rel=0.02)
