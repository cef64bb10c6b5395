"""`nodeshare report`: the pair matrix by hand, and real PNG and HTML files."""

import math

import pytest
from factories import POLICY, block, build, job_event, left
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.schemas import JobState, encode
from nodeshare.sinks.report import build_report, pair_degradation
from nodeshare.streams.accounting import Origin, fold_messages


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


def test_report_writes_pictures_and_a_page(tmp_path):
    archive, ledger, _ = build(tmp_path)
    files = build_report(ledger, archive, tmp_path / "report")
    assert [p.name for p in files.pngs] == ["prices.png", "pairs.png", "dividend.png", "confidence.png"]
    for p in files.pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5_000
    page = files.html.read_text()
    assert all(f'src="{p.name}"' in page for p in files.pngs) and "dividend (SU)" in page


def test_report_cli_refuses_an_empty_ledger(tmp_path):
    from nodeshare.sinks.ledger import Ledger

    Ledger(tmp_path / "empty.duckdb").close()
    result = CliRunner().invoke(app, ["report", "--ledger", str(tmp_path / "empty.duckdb"), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no charges" in result.output
