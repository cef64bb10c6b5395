"""The power experiments and benchmark from the command line: JSON fields the issue names, PNGs."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runs import run_json as run
from typer.testing import CliRunner

from nodeshare.cli import app


def test_experiment_ppartition_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "pp.png"
    r = run("experiment", "ppartition", "--json", "--png", str(png), "--processors", "120", "--budget-watts", "6200")
    assert {"jobs_scheduled", "jobs_scheduled_uniform", "throughput_gain_pct"} <= set(r)
    assert 0 < r["jobs_scheduled"] <= r["queue"]["jobs"] and r["allocated_watts"] <= 6200
    assert png.stat().st_size > 10_000


def test_experiment_ptune_never_slower_than_uniform(tmp_path: Path) -> None:
    r = run("experiment", "ptune", "--json", "--png", str(tmp_path / "pt.png"))
    assert {"max_speedup_pct", "max_freed_pct"} <= set(r)
    assert r["slower_than_uniform"] == 0 and r["min_speedup_pct"] >= 0  # the 1% margin keeps uniform otherwise
    assert r["max_speedup_pct"] > 5 and r["max_freed_pct"] > 10


def test_bench_power_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "power.json"
    result = CliRunner().invoke(app, ["bench", "power", "--repeats", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["ptune_550_ms"] > 0 and r["ppartition_100_ms"] > 0 and r["ppartition_running_jobs"] == 100
    # the headline is the slowest program's median, and the dispatch had to repartition to start the job
    assert r["ptune_550_ms"] == max(r["ptune_550_ms_by_program"].values())
    assert r["ppartition_action"] == "start" and r["ppartition_jobs_shrunk"] >= 1
    assert r["bench"] == "power" and set(r["met"]) == {"ptune_550_ms", "ppartition_100_ms"}


def test_ppartition_rejects_an_unknown_admission_policy(tmp_path: Path) -> None:
    png = str(tmp_path / "x.png")
    result = CliRunner().invoke(app, ["experiment", "ppartition", "--admit", "greedy", "--png", png])
    assert result.exit_code != 0 and "fair" in result.output
