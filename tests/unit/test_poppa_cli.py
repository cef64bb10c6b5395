"""POPPA's evaluation from the command line: the JSON fields the issue names, PNGs, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from cli_runs import run_json as run
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.experiments.poppa import with_margins


def test_experiment_pairwise_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "pw.png"
    r = run("experiment", "pairwise", "--json", "--png", str(png), "--programs", "MILC,LAMMPS,CG", "--iterations", "1")
    assert {"mae_pct", "max_abs_err_pct", "pairs"} <= set(r) and r["pairs"] == 9
    # every estimator a charge carries, and the applied one (the settings' mixed_s, a charge's own D)
    assert set(r["estimators"]) == {"refill_corrected", "poppa_alg4", "unfiltered", "mixed_s"}
    assert (r["estimator"], r["schedule"]) == ("mixed_s", "adaptive")
    assert len(r["error_pct"]["poppa_alg4"]) == 3 and r["degradation_pct"][0][0] > 10  # MILC next to MILC
    assert 0 <= r["mae_pct"] <= r["max_abs_err_pct"] < 10
    assert png.stat().st_size > 10_000


def test_fig10_margins_are_mean_absolute_errors_by_hand() -> None:
    m = np.array([[1.0, -3.0], [-2.0, 4.0]])  # [co-runner][job]
    # columns (jobs): (1 + 2) / 2 = 1.5, (3 + 4) / 2 = 3.5; rows (co-runners): 2.0, 3.0; all: 2.5
    assert with_margins(m).tolist() == [[1.0, -3.0, 2.0], [-2.0, 4.0, 3.0], [1.5, 3.5, 2.5]]


def test_experiment_pricing_json(tmp_path: Path) -> None:
    r = run("experiment", "pricing", "--json", "--png", str(tmp_path / "p.png"), "--programs", "MILC,LAMMPS",
            "--iterations", "1")
    assert {"sop_mean", "poppa_mean", "oracle_mean", "overcharged_jobs", "jobs"} <= set(r) and r["jobs"] == 4
    assert r["sop_mean"] > 1.0 > r["poppa_mean"] and r["oracle_mean"] < 1.0  # co-location costs SOP users


def test_pricing_under_another_estimator_and_shutter_length(tmp_path: Path) -> None:
    args = ("experiment", "pricing", "--json", "--png", str(tmp_path / "p.png"), "--programs", "MILC,CG",
            "--iterations", "1")
    base = run(*args)
    other = run(*args, "--estimator", "unfiltered", "--sample-us", "12800", "--period-ms", "800")
    assert (other["estimator"], other["sample_us"], other["period_ms"]) == ("unfiltered", 12800, 800)
    assert (base["estimator"], base["schedule"], base["sample_us"], base["period_ms"]) == ("mixed_s", "adaptive",
                                                                                           3200, 200)
    assert other["poppa_mean"] != base["poppa_mean"]  # what the options name is what was run
    fixed = run(*args, "--schedule", "fixed", "--estimator", "refill_corrected")
    assert (fixed["schedule"], fixed["estimator"]) == ("fixed", "refill_corrected")
    assert fixed["poppa_mean"] != base["poppa_mean"]
    result = CliRunner().invoke(app, ["experiment", "pricing", "--estimator", "magic"])
    assert result.exit_code == 2 and "unknown estimator 'magic'" in result.output


def test_the_experiments_charge_at_the_products_defaults() -> None:
    """An experiment run without options measures what a site is charged: its defaults are the settings'."""
    from nodeshare.cli.experiment_common import DEFAULT_SETTINGS
    from nodeshare.runtime.config import Settings

    assert {k: Settings.model_fields[k].default for k in DEFAULT_SETTINGS} == DEFAULT_SETTINGS


def test_an_adaptive_ladder_that_does_not_fit_the_simulators_cycle_is_a_clear_error(tmp_path: Path) -> None:
    """16 S in three windows must fit in 3 S + P: at P = 100 ms, S <= 2,222 us (an uncaught
    ValueError with a traceback before); the fixed schedule runs there as it always did."""
    for cmd in (["experiment", "pricing"], ["experiment", "adaptive-shutter"]):
        bad = CliRunner().invoke(app, [*cmd, "--programs", "MILC,LAMMPS", "--period-ms", "100"])
        assert bad.exit_code == 2 and "S <= 2222 us at 100 ms" in bad.output, bad.output
    fixed = CliRunner().invoke(app, ["experiment", "pricing", "--programs", "MILC,LAMMPS", "--iterations", "1",
                                     "--period-ms", "100", "--schedule", "fixed", "--png", str(tmp_path / "f.png")])
    assert fixed.exit_code == 0, fixed.output


def test_unknown_program_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["experiment", "pairwise", "--programs", "MILC,HPL"])
    assert result.exit_code == 2 and "unknown: ['HPL']" in result.output


def test_bench_simulate_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["bench", "simulate", "--nodes", "20", "--hours", "0.01", "--out", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["nodes"] == 20 and r["blocks"] > 0 and r["events_per_s"] > 0 and r["simulated_s"] >= 36


def test_programs_all_pairs_every_program_of_the_profiles_file(tmp_path: Path) -> None:
    """--programs all with --profiles: exactly the file's programs (not the built-ins), every pair;
    each estimator reports its pairs above 6% and its worst pairs, largest |error| first."""
    from factories import profile_csv

    csv = profile_csv(tmp_path / "p.csv", "alpha", "beta", "gamma")
    r = run("experiment", "pairwise", "--json", "--png", str(tmp_path / "pw.png"), "--profiles", str(csv),
            "--programs", "all", "--iterations", "1")
    assert r["programs"] == ["alpha", "beta", "gamma"] and r["pairs"] == 9
    for s in r["estimators"].values():
        errors = [abs(e) for row in [s["worst"]] for e in (w["err_pct"] for w in row)]
        assert len(errors) == 9 and errors == sorted(errors, reverse=True)  # fewer than ten pairs: all of them
        assert s["pairs_above_6_pct"] == sum(abs(e) > 6.0 for e in errors)
    assert run("experiment", "pairwise", "--json", "--png", str(tmp_path / "b.png"), "--programs", "all",
               "--iterations", "1")["pairs"] > 100  # no profiles: the whole built-in library
