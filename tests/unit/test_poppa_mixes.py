"""Issue 36 part 3: experiment pricing / pairwise on mixes beyond pairs run to completion."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from cli_runs import run_json as run
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.experiments.mixes import MIXES, simulate_mix
from nodeshare.experiments.poppa import _pricing_pairs, _scored, charges_of, experiment_pricing
from nodeshare.producers.calibrated import CalibratedConfig
from nodeshare.producers.mixes import (
    MIN_RUN_S,
    arrivals_lanes,
    llc_demand,
    random_pairs,
    short_phase_variants,
    thrashing_programs,
    trace_run_times,
    trace_times_lanes,
)
from nodeshare.producers.workloads import BUILTIN, PAIRWISE
from nodeshare.schemas import Charge, JobLeftNode
from nodeshare.streams.core.confidence import DEFAULT_SHORT_MARGIN

#: Every program's run shortened, so a mix simulates in seconds.
FAST = {k: replace(w, solo_s=8.0) for k, w in BUILTIN.items()}
KEYS = {"jobs", "mae_pct", "max_abs_err_pct", "overcharged_jobs", "overcharged_jobs_over_0_5pct", "coverage",
        "coverage_clamped", "above_interval", "revenue_vs_oracle_pp", "charged_vs_solo_baseline"}


def swf(path: Path) -> Path:
    """A tiny Standard Workload Format trace: run times 1 s (raised to 5 s) to 3 hours."""
    lines = ["; MaxNodes: 4", *(f"{i} {10 * i} 0 {r} 8 -1 -1 8 3600 -1 1 1 1 -1 -1 0 -1 -1"
                                for i, r in enumerate((1, 7, 12, 30, 0, 10_800), start=1))]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_mix_is_generated_deterministically_per_seed(tmp_path: Path) -> None:
    trace = swf(tmp_path / "t.swf")
    progs = ("MILC", "LAMMPS", "CG")
    times = trace_run_times(trace, 20, seed=3, max_run_s=60.0)
    assert (times == trace_run_times(trace, 20, seed=3, max_run_s=60.0)).all()
    assert times.min() >= MIN_RUN_S and times.max() <= 60.0 and 60.0 in times  # 3 h capped, 1 s raised
    assert (trace_run_times(trace, 20, seed=4, max_run_s=60.0) != times).any()
    assert trace_times_lanes(times, progs, 1) == trace_times_lanes(times, progs, 1)
    assert arrivals_lanes(6, progs, BUILTIN, 5) == arrivals_lanes(6, progs, BUILTIN, 5)
    assert arrivals_lanes(6, progs, BUILTIN, 5) != arrivals_lanes(6, progs, BUILTIN, 6)
    assert short_phase_variants(progs, BUILTIN, 3200, 2) == short_phase_variants(progs, BUILTIN, 3200, 2)
    assert random_pairs(progs, 4, 9) == random_pairs(progs, 4, 9) and len(set(random_pairs(progs, 4, 9))) == 4
    cfg = CalibratedConfig(seed=7)
    a = simulate_mix("arrivals", cfg, 1, progs, FAST, 3, None, 60.0)
    b = simulate_mix("arrivals", cfg, 1, progs, FAST, 3, None, 60.0)
    assert a[0] == b[0] and a[2] == b[2]


def test_the_arrivals_mix_shares_each_job_for_only_part_of_its_run() -> None:
    lanes = arrivals_lanes(4, ("MILC", "CG", "LAMMPS"), FAST, 1)
    assert all(len(lane.slots[1]) >= 2 and lane.slots[1][0].start_s > 0 for lane in lanes)  # in sequence, late
    truth, events, scored, _ = simulate_mix("arrivals", CalibratedConfig(seed=7), 1, ("MILC", "CG", "LAMMPS"), FAST,
                                            4, None, 60.0)
    assert scored and len(scored) == 4 and scored <= {t.job_id for t in truth}
    left = {e.job_id: e for e in events if isinstance(e, JobLeftNode)}
    charges = charges_of(events)
    for t in (t for t in truth if t.job_id in scored):
        mark = left[t.job_id]
        alone_s = mark.alone_us / 1e6
        assert mark.blocks_sent > 0 and t.co_runners  # it shared its node ...
        assert 0.1 * t.run_time_s < alone_s < 0.9 * t.run_time_s  # ... for only part of its run
        assert charges[t.job_id].alone_s > 0


def test_short_phase_programs_alternate_faster_than_a_sample() -> None:
    s_us = 3200
    variants = short_phase_variants(("MILC", "LAMMPS"), BUILTIN, s_us, 1)
    assert set(variants) == {"MILC-short", "LAMMPS-short"} and "MILC-short" not in BUILTIN
    assert BUILTIN["MILC"].micro is None  # the built-ins are untouched
    for w in variants.values():
        assert w.micro is not None
        burst = w.micro.period_us * w.micro.burst_share
        assert 0 < burst < s_us and 0 < w.micro.period_us - burst < s_us  # both parts shorter than S
    truth, _, _, info = simulate_mix("short-phases", CalibratedConfig(seed=7, sample_us=s_us), 1, ("MILC", "LAMMPS"),
                                     FAST, 2, None, 60.0)
    assert {t.program for t in truth} <= set(variants) and all(p < s_us for p in info["micro_period_us"].values())


def test_thrashing_pairs_are_picked_by_llc_demand_not_by_name() -> None:
    top = thrashing_programs(PAIRWISE, BUILTIN, 3)
    assert top == sorted(PAIRWISE, key=lambda p: -llc_demand(BUILTIN[p]))[:3]
    renamed = {"aaa": replace(BUILTIN["LAMMPS"], name="aaa"), "zzz": replace(BUILTIN["MILC"], name="zzz"),
               "mmm": replace(BUILTIN["NekBone"], name="mmm")}
    assert thrashing_programs(list(renamed), renamed, 1) == ["zzz"]


def test_all_mixes_json_per_mix_and_overall_and_overcharges_from_rows(tmp_path: Path) -> None:
    csv_programs = "MILC,LAMMPS"
    r = run("experiment", "pricing", "--json", "--png", str(tmp_path / "m.png"), "--mix", "all-mixes",
            "--programs", csv_programs, "--iterations", "1", "--jobs", "2", "--trace", str(swf(tmp_path / "t.swf")),
            "--max-run-s", "20")
    assert list(r["mixes"]) == list(MIXES) and r["skipped"] == {}
    has_interval = "degradation_low" in Charge.model_fields
    for name, m in [*r["mixes"].items(), ("overall", r["overall"])]:
        assert set(m) >= KEYS, name
        rows = [x for x in r["job_rows"] if name == "overall" or x["mix"] == name]
        assert m["jobs"] == len(rows) > 0
        assert m["overcharged_jobs"] == sum(x["price"] > x["solo_baseline"] for x in rows)
        assert m["overcharged_jobs_over_0_5pct"] == sum(x["price"] > 1.005 * x["solo_baseline"] for x in rows)
        assert m["max_abs_err_pct"] == pytest.approx(max(abs(x["err_pp"]) for x in rows))
        assert (m["coverage"] is None) is not has_interval
        clamped = [x["degradation_low"] <= min(1.0, max(0.0, x["true_degradation"])) <= x["degradation_high"]
                   for x in rows]
        assert m["coverage_clamped"] == pytest.approx(sum(clamped) / len(rows))
        assert m["coverage_clamped"] >= m["coverage"]
        assert m["above_interval"] == pytest.approx(sum(x["true_degradation"] > x["degradation_high"]
                                                        for x in rows) / len(rows))
    assert r["mixes"]["trace-times"]["jobs"] == 2 and r["mixes"]["arrivals"]["jobs"] == 2
    assert max(x["solo_time_s"] for x in r["job_rows"] if x["mix"] == "trace-times") < 21  # capped (+ run noise)
    text = CliRunner().invoke(app, ["experiment", "pairwise", "--png", str(tmp_path / "w.png"), "--mix", "thrashing",
                                    "--programs", csv_programs, "--iterations", "1"])
    assert text.exit_code == 0 and "thrashing" in text.stdout and "overall" in text.stdout


def test_mix_pairs_is_todays_pricing() -> None:
    """Golden numbers of the pricing experiment before mixes existed (seed 7, MILC and LAMMPS, one
    iteration); the charged side is compared with today's function, whose pricing may evolve."""
    r = experiment_pricing(iterations=1, programs=("MILC", "LAMMPS"))
    assert (r["mix"], r["jobs"], r["runs"]) == ("pairs", 4, 8)
    assert r["sop_mean"] == pytest.approx(1.0990722272370643, rel=1e-12)
    assert r["oracle_mean"] == pytest.approx(0.9200210670979101, rel=1e-12)
    scored = _scored(7, 5 - 4, 3200, 200, ("MILC", "LAMMPS"), BUILTIN, "mixed_s")
    old = _pricing_pairs(scored, ("MILC", "LAMMPS"), "mixed_s", 3200, 200)
    assert {k: v for k, v in r.items() if k in old} == old
    # the default estimator, mixed_s, is the refill-corrected estimate itself on blocks of one S; at
    # 3.2 ms, with nothing longer to check it, priced with the short-sample margin
    corrected = _scored(7, 5 - 4, 3200, 200, ("MILC", "LAMMPS"), BUILTIN, "refill_corrected")
    for (*_, m), (*_, c) in zip(scored, corrected, strict=True):
        assert m.degradation_shared == c.degradation_shared and (m.short_margin_applied, c.short_margin_applied) == (
            DEFAULT_SHORT_MARGIN, 0.0)
        assert m.degradation > c.degradation or c.degradation == 1.0
    assert r["mixes"]["pairs"]["jobs"] == 8 and r["overall"] == r["mixes"]["pairs"]


def test_unknown_mix_and_trace_times_without_a_trace_are_clear_errors() -> None:
    bad = CliRunner().invoke(app, ["experiment", "pricing", "--mix", "bursty"])
    assert bad.exit_code == 2 and "all-mixes" in bad.output
    none = CliRunner().invoke(app, ["experiment", "pricing", "--mix", "trace-times"])
    assert none.exit_code == 2 and "--trace" in none.output
