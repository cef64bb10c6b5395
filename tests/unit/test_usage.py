"""sacct/sreport-style views of the ledger."""

import json

import pytest
from factories import build
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.sinks.analysis.usage import QueryError, charges, elapsed, parsable2, parse_time, usage_by_account
from nodeshare.sinks.ledger import Ledger

runner = CliRunner()


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    _, path, _ = build(tmp_path_factory.mktemp("usage"))
    return path


def test_sacct_time_forms_and_elapsed():
    assert parse_time("2026-01-01").isoformat() == "2026-01-01T00:00:00+00:00"
    assert parse_time("2026-01-01T05:30").hour == 5
    with pytest.raises(QueryError, match="invalid time"):
        parse_time("yesterday-ish")
    assert elapsed(3725) == "01:02:05" and elapsed(90061) == "1-01:01:01"


def test_parsable2_has_no_trailing_delimiter():
    text = parsable2(["JobID", "SOP"], [("1", 0.5), ("2", 1.25)])
    assert text.splitlines() == ["JobID|SOP", "1|0.5000", "2|1.2500"]
    assert parsable2(["JobID"], [("1",)], noheader=True) == "1"


def test_filters_and_columns(ledger):
    with Ledger(ledger, read_only=True) as led:
        every = led.charges()
    header, rows = charges(ledger, fmt="jobid,user,charged")
    assert header == ["JobID", "User", "Charged"] and len(rows) == len(every)
    alice = [c for c in every if c.user == "alice"]
    _, rows = charges(ledger, users=["alice"], fmt="JobID")
    assert sorted(r[0] for r in rows) == sorted(c.job_id for c in alice)
    earliest = min(c.start_time for c in every)
    assert charges(ledger, end=earliest, fmt="JobID")[1] == []  # nothing ran before the first start
    last_end = max(c.end_time for c in every)
    _, rows = charges(ledger, start=last_end, fmt="JobID")  # only jobs still running at the last end
    assert sorted(r[0] for r in rows) == sorted(c.job_id for c in every if c.end_time >= last_end)
    with pytest.raises(QueryError, match="unknown column"):
        charges(ledger, fmt="JobID,Shoesize")


def test_usage_adds_up_per_account_and_user(ledger):
    rows = usage_by_account(ledger)
    with Ledger(ledger, read_only=True) as led:
        every = led.charges()
    totals = [r for r in rows if r[1] == ""]
    assert sum(r[2] for r in totals) == len(every)
    assert sum(r[4] for r in totals) == pytest.approx(sum(c.standard_price for c in every))
    for acc in {c.account for c in every}:
        users = [r for r in rows if r[0] == acc and r[1]]
        total = next(r for r in totals if r[0] == acc)
        assert sum(r[6] for r in users) == pytest.approx(total[6])  # dividend of users = account's


def test_cli_charges_parsable2_json_and_report_usage(ledger):
    result = runner.invoke(app, ["charges", "--ledger", str(ledger), "-P", "-o", "JobID,User,Elapsed"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 0 and lines[0] == "JobID|User|Elapsed" and not lines[1].endswith("|")
    result = runner.invoke(app, ["charges", "--ledger", str(ledger), "--json", "-A", "physics"])
    assert result.exit_code == 0 and all(r["Account"] == "physics" for r in json.loads(result.output))
    result = runner.invoke(app, ["report-usage", "--ledger", str(ledger), "-P"])
    assert result.exit_code == 0 and result.output.startswith("Account|Login|Jobs|CoreHours|SOP|Charged|Dividend")
    result = runner.invoke(app, ["charges", "--ledger", str(ledger), "-o", "Nope"])
    assert result.exit_code == 2 and "unknown column" in result.output
