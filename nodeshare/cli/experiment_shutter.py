"""The shutter experiments: `nodeshare experiment shutter` (Seed 002 Figs. 5-9) and `adaptive-shutter`
(the fixed shutter against the adaptive schedule, issue 36)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .common import FullJson, err, out, progress_bar
from .experiment_common import (
    DEFAULT_SETTINGS,
    EstimatorOpt,
    LibraryProfiles,
    PeriodMs,
    Programs,
    SampleUs,
    checked_estimator,
    checked_schedule,
    chosen_programs,
    experiment_app,
    experiment_out,
    program_library,
)


@experiment_app.command("shutter")
def experiment_shutter(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/shutter.png"),
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    iterations: Annotated[int, typer.Option(min=1, help="runs per pair and shutter length")] = 3,
    period_ms: Annotated[int, typer.Option(min=1, help="P")] = 200,
) -> None:
    """Seed 002 Figs. 5-9: accuracy and overhead for S from 200 us to 25.6 ms, NPB next to a
    contentious (ADVECT3D) and a moderate (Swim) co-runner, and next to NULL against Eq. 10."""
    from nodeshare.experiments.poppa import SHUTTER_US, plot_shutter
    from nodeshare.experiments.poppa import experiment_shutter as run

    with progress_bar() as bar:
        task = bar.add_task("shutter lengths", total=len(SHUTTER_US))
        r = run(seed=seed, iterations=iterations, period_ms=period_ms,
                progress=lambda done, _total: bar.update(task, completed=done))
    lines = ["overhead at S = 3200 us: " + ", ".join(f"{k} {v:.2f}%" for k, v in r["overhead_at_3200_pct"].items()),
             f"simulated overhead next to NULL vs Eq. 10: max difference {r['eq10_max_abs_diff_pp']:.3f} pp",
             "S (us)   " + "  ".join(f"{j}/{c[:6]:6s}" for c in r["co_runners"] for j in r["jobs"])]
    for s_us in r["shutter_us"]:
        cells = [next(x for x in r["rows"] if x["sample_us"] == s_us and x["job"] == j and x["co_runner"] == c)
                 for c in r["co_runners"] for j in r["jobs"]]
        lines.append(f"{s_us:>6}   " + "  ".join(f"{x['err_refill_corrected_pct']:+9.2f}" for x in cells))
    experiment_out(r, as_json, png, plot_shutter, lines)


@experiment_app.command("adaptive-shutter")
def experiment_adaptive_shutter(
    as_json: FullJson = False,
    profiles: LibraryProfiles = None,
    programs: Programs = None,
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    scenario: Annotated[str, typer.Option(
        help="pairs: every pair of --programs, one run each; short: 600 jobs of solo time 5-60 s on 100 nodes",
    )] = "pairs",
    schedule: Annotated[str, typer.Option(
        help="fixed (S every P) or adaptive (S, 4 S, 16 S at P: streams.core.shutter_policy)")]
    = DEFAULT_SETTINGS["shutter_schedule"],
    sample_us: SampleUs = DEFAULT_SETTINGS["sample_us"],
    period_ms: PeriodMs = DEFAULT_SETTINGS["period_ms"],
    estimator: EstimatorOpt = DEFAULT_SETTINGS["estimator"],
) -> None:
    """Issue 36: the fixed shutter against the adaptive schedule, charged by the fold (with
    --estimator, default mixed_s: at its point estimate, and as priced at the interval's upper end)
    and by the mixed-S prototype (MAE, max, jobs above their solo baseline, blocks, paused share)."""
    from nodeshare.experiments.adaptive_shutter import ESTIMATES, pairs_run, short_run, summary

    if scenario not in ("pairs", "short"):
        err.print("error: --scenario is pairs or short")
        raise typer.Exit(2)
    policy = checked_schedule(schedule, sample_us, period_ms)
    lib = program_library(profiles)
    chosen = chosen_programs(programs, lib, profiles)
    run = pairs_run if scenario == "pairs" else short_run
    with progress_bar() as bar:
        bar.add_task("simulating and charging", total=None)
        r = summary(run(seed, chosen, lib, policy, sample_us, period_ms, estimator=checked_estimator(estimator)))
    if as_json:
        out.print_json(json.dumps(r))
        return
    out.print(f"{r['jobs']} jobs, {schedule} schedule; max paused share {r['paused_share_pct']['max']:.2f}%")
    for est in ESTIMATES:
        e = r[est]
        out.print(f"{est:11s} MAE {e['mae_pp']:.2f} pp, max {e['max_pp']:.1f} pp, "
                  f"{e['over_0_5pct']} jobs above their solo baseline by > 0.5%")
