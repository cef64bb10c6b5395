"""Every benchmark writes one result shape: name, date, machine, targets and whether each was met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nodeshare.bench.result import ENVELOPE, bench_result, met
from nodeshare.cli import app


def test_targets_are_judged_by_hand():
    figures = {"blocks_per_s": 120_000.0, "latency_p99_s": 2.5, "ratio": 0.3}
    targets = {"blocks_per_s": (">=", 100_000), "latency_p99_s": ("<=", 2.0), "ratio": (">=", 0.3), "absent": ("<=", 1)}
    assert met(figures, targets) == {"blocks_per_s": True, "latency_p99_s": False, "ratio": True, "absent": None}
    with pytest.raises(ValueError, match="'>=' or '<='"):
        met(figures, {"ratio": ("==", 0.3)})


def test_the_envelope_replaces_a_benchmarks_own_machine_and_keeps_its_figures():
    r = bench_result("power", {"benchmark": "power", "machine": "old", "cores": 2, "ptune_550_ms": 12.0},
                     {"ptune_550_ms": ("<=", 20.0)})
    assert list(r)[:5] == list(ENVELOPE) and r["bench"] == "power" and "cores" in r["machine"]
    assert r["targets"] == {"ptune_550_ms": "<= 20"} and r["met"] == {"ptune_550_ms": True}
    assert r["ptune_550_ms"] == 12.0 and "benchmark" not in r and "cores" not in r


def test_a_bench_command_writes_the_envelope(tmp_path: Path):
    out = tmp_path / "ledger.json"
    result = CliRunner().invoke(app, ["bench", "ledger", "--windows", "2000", "--nodes", "50", "--out", str(out)])
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    assert body["bench"] == "ledger" and set(ENVELOPE) <= set(body) and body["windows"] == 2000
