"""Issue 36 part 3: ``experiment pricing`` / ``pairwise`` on mixes beyond pairs run to completion.

Every mix (``producers.mixes``) is simulated, its events folded by the stream worker's reducer
(``charges_of``, the audit path), and only then scored against the simulator's ground truth, job
by job. The report per mix and overall:

* ``mae_pct``, ``max_abs_err_pct``, ``bias_pct``: |D - D_true| in percentage points, D the charge's
  applied ``degradation`` and D_true = 1 - T_solo / (T_co - paused): the degradation of the billed
  (unpaused) time, the quantity a charge's D estimates (T_solo = (1 - D) x billed time).
  ``JobTruth.true_degradation`` (1 - T_solo / T_co) also counts the shutters' own pauses, which
  are credited, not estimated: ``mae_vs_true_degradation_pct`` is the error against it;
* ``run_time_mae_pct``, ``run_time_max_abs_err_pct``: ``pairwise``'s run-time prediction error;
* ``overcharged_jobs`` (price > solo baseline L x C x T_solo), ``overcharged_jobs_over_0_5pct``
  (price > 1.005 x baseline), ``coverage`` (share of jobs whose D_true lies in the charge's
  [degradation_low, degradation_high]; null when charges carry no interval), ``coverage_clamped``
  (the same with D_true clamped to [0, 1], the range of a charge's D: a job that ran faster shared
  than alone has D_true < 0, which no interval of D holds), ``above_interval`` (share of jobs whose
  D_true is above ``degradation_high``: the side that overcharges when priced at the bound),
  ``revenue_vs_oracle_pp`` (sum of prices against the sum of oracle prices, in points of the
  oracle's), ``charged_vs_solo_baseline`` (sum of prices over the sum of solo baselines).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.experiments.poppa import _scored, charges_of, oracle_price, predicted_run_time, schedule_name
from nodeshare.producers.calibrated import CalibratedConfig, JobTruth, run_pairwise
from nodeshare.producers.calibrated_records import with_records
from nodeshare.producers.mixes import (
    MAX_RUN_S,
    MIN_RUN_S,
    arrivals_lanes,
    llc_demand,
    random_pairs,
    run_lanes,
    short_phase_variants,
    thrashing_programs,
    trace_run_times,
    trace_times_lanes,
)
from nodeshare.producers.workloads import BUILTIN, PAIRWISE, Workload
from nodeshare.schemas import Charge
from nodeshare.streams.core.accounting import PricingPolicy
from nodeshare.streams.core.degradation import DEFAULT_ESTIMATOR
from nodeshare.streams.core.shutter_policy import ShutterPolicy

MIXES = ("pairs", "trace-times", "arrivals", "short-phases", "thrashing")
ALL_MIXES = "all-mixes"
MIX_NAMES = (*MIXES, ALL_MIXES)
DEGRADATION_TRUTH = "1 - T_solo / (T_co - paused): the degradation of the billed time, which a charge's D estimates"
OVER_TOLERANCE = 0.005  # overcharged_jobs_over_0_5pct: price above the baseline by more than 0.5% of it


def job_row(mix: str, t: JobTruth, c: Charge) -> dict[str, Any]:
    """One job, scored: its truth next to its charge."""
    d_true = 1.0 - t.solo_time_s / max(1e-9, t.run_time_s - t.paused_s)
    base = c.rate_per_core_hour * c.cores * t.solo_time_s / 3600.0
    low, high = getattr(c, "degradation_low", None), getattr(c, "degradation_high", None)
    return {
        "mix": mix, "job_id": t.job_id, "program": t.program, "co_runners": list(t.co_runners),
        "solo_time_s": t.solo_time_s, "run_time_s": t.run_time_s, "paused_s": t.paused_s,
        "blocks_used": c.blocks_used, "alone_s": c.alone_s,
        "true_degradation": d_true, "true_degradation_run": t.true_degradation, "degradation": c.degradation,
        "err_pp": 100.0 * (c.degradation - d_true),
        "run_time_err_pct": 100.0 * (predicted_run_time(t, c, c.degradation) - t.run_time_s) / t.run_time_s,
        "solo_baseline": base, "price": c.price, "standard_price": c.standard_price, "oracle": oracle_price(c, t),
        "degradation_low": low, "degradation_high": high,
        "short_margin_applied": c.short_margin_applied,
        "covered": None if low is None or high is None else bool(low <= d_true <= high),
        "covered_clamped": None if low is None or high is None else bool(low <= min(1.0, max(0.0, d_true)) <= high),
        "above_interval": None if high is None else bool(d_true > high),
    }


def _share(flags: Sequence[bool | None]) -> float | None:
    """The share of true flags; None when any is unknown (charges without an interval)."""
    return None if any(f is None for f in flags) else float(np.mean([bool(f) for f in flags]))


def mix_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-job figures of a set of rows (see the module's docstring)."""
    if not rows:
        return {"jobs": 0}
    err = np.array([r["err_pp"] for r in rows])
    err_run = np.array([100.0 * (r["degradation"] - r["true_degradation_run"]) for r in rows])
    rt = np.array([r["run_time_err_pct"] for r in rows])
    price, base, oracle, sop = (np.array([r[k] for r in rows]) for k in ("price", "solo_baseline", "oracle",
                                                                           "standard_price"))
    covered = [r["covered"] for r in rows]
    solo = np.array([r["solo_time_s"] for r in rows])
    worst = max(rows, key=lambda r: abs(r["err_pp"]))
    return {
        "jobs": len(rows), "mae_pct": float(np.abs(err).mean()), "max_abs_err_pct": float(np.abs(err).max()),
        "bias_pct": float(err.mean()), "mae_vs_true_degradation_pct": float(np.abs(err_run).mean()),
        "run_time_mae_pct": float(np.abs(rt).mean()), "run_time_max_abs_err_pct": float(np.abs(rt).max()),
        "overcharged_jobs": int((price > base).sum()),
        "overcharged_jobs_over_0_5pct": int((price > (1.0 + OVER_TOLERANCE) * base).sum()),
        "coverage": _share(covered),
        "coverage_clamped": _share([r["covered_clamped"] for r in rows]),
        "above_interval": _share([r["above_interval"] for r in rows]),
        "revenue_vs_oracle_pp": float(100.0 * (price.sum() - oracle.sum()) / oracle.sum()),
        "charged_vs_solo_baseline": float(price.sum() / base.sum()),
        "oracle_vs_solo_baseline": float(oracle.sum() / base.sum()),
        "sop_vs_solo_baseline": float(sop.sum() / base.sum()),
        "mean_true_degradation_pct": float(100.0 * np.mean([r["true_degradation"] for r in rows])),
        "solo_time_s": {"min": float(solo.min()), "median": float(np.median(solo)), "max": float(solo.max())},
        "worst": {k: worst[k] for k in ("job_id", "program", "co_runners", "err_pp", "true_degradation")},
    }


def simulate_mix(mix: str, cfg: CalibratedConfig, iterations: int, programs: Sequence[str],
                 library: dict[str, Workload], jobs: int, trace: Path | None, max_run_s: float,
                 ) -> tuple[list[JobTruth], list[Any], set[str] | None, dict[str, Any]]:
    """A mix other than pairs, simulated: (truth, events, ids of the scored jobs (None: all), what it was)."""
    seed = cfg.seed
    if mix == "trace-times":
        if trace is None:
            raise ValueError("the trace-times mix needs --trace (a Standard Workload Format file)")
        times = trace_run_times(trace, jobs, seed, max_run_s)
        lanes = trace_times_lanes(times, programs, seed + 1)
        info = {"trace": Path(trace).name, "run_time_s": {"min": MIN_RUN_S, "max": max_run_s},
                "capped_jobs": int((times >= max_run_s).sum()), "raised_to_min_jobs": int((times <= MIN_RUN_S).sum()),
                "about": f"run times drawn from the trace, clipped to [{MIN_RUN_S:g}, {max_run_s:g}] s; each job "
                         "next to a library co-runner restarting all along"}
    elif mix == "arrivals":
        lanes = arrivals_lanes(jobs, programs, library, seed)
        info = {"about": "jobs of 2-4x their solo run; 2+ co-runners arrive and leave in turn, alone in between"}
    elif mix in ("short-phases", "thrashing"):
        if mix == "short-phases":
            variants = short_phase_variants(programs, library, cfg.sample_us, seed)
            lib = {**library, **variants}
            pairs = random_pairs(list(variants), jobs, seed)
            info = {"about": "variants bursting faster than one sample S (micro period < S)",
                    "micro_period_us": {n: w.micro.period_us for n, w in variants.items() if w.micro}}
        else:
            lib = library
            top = thrashing_programs(programs, library)
            pairs = [(a, b) for a in top for b in top]
            info = {"about": "every pair of the programs with the largest LLC demand (refs per kilo-cycle)",
                    "programs": {p: llc_demand(library[p]) for p in top}}
        sim = with_records(cfg, lambda sink: run_pairwise(cfg, pairs, lib, iterations, sink))
        return sim.truth, sim.events, None, {**info, "pairs": len(pairs)}
    else:
        raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIX_NAMES)}")
    holder: dict[str, set[str]] = {}

    def go(sink: Any) -> Any:
        result, scored = run_lanes(cfg, lanes, library, sink)
        holder["scored"] = scored
        return result

    sim = with_records(cfg, go)
    return sim.truth, sim.events, holder["scored"], info


def experiment_mixes(kind: str, mix: str, seed: int = 7, iterations: int = 5, sample_us: int = 3200,
                     period_ms: int = 200, programs: Sequence[str] = PAIRWISE,
                     library: dict[str, Workload] | None = None, estimator: str = DEFAULT_ESTIMATOR,
                     jobs: int | None = None, trace: Path | None = None, max_run_s: float = MAX_RUN_S,
                     progress: Callable[[str], None] | None = None,
                     schedule: ShutterPolicy | None = None) -> dict[str, Any]:
    """One mix, or every mix (``all-mixes``; trace-times only with a ``trace``): per mix and overall.
    ``schedule``: issue 36's adaptive shutter schedule (its shortest S and K are ``sample_us`` and 1)."""
    lib = library or BUILTIN
    if mix != ALL_MIXES and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIX_NAMES)}")
    n = jobs or 4 * len(programs)
    names = [m for m in MIXES if mix in (m, ALL_MIXES) and not (mix == ALL_MIXES and m == "trace-times"
                                                                 and trace is None)]
    cfg = CalibratedConfig(seed=seed, sample_us=sample_us, period_ms=period_ms, schedule=schedule)
    policy = PricingPolicy(estimator=estimator)
    per_mix: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for m in names:
        info: dict[str, Any]
        if progress:
            progress(m)
        t0 = time.perf_counter()
        if m == "pairs":
            mine = [job_row(m, t, c) for _, _, t, c in _scored(seed, iterations, sample_us, period_ms, programs, lib,
                                                             estimator, schedule)]
            info = {"about": "every ordered pair of the programs, run to completion", "pairs": len(programs) ** 2}
        else:
            truth, events, scored, info = simulate_mix(m, cfg, iterations, programs, lib, n, trace, max_run_s)
            charges = charges_of(events, policy)
            mine = [job_row(m, t, charges[t.job_id]) for t in truth if scored is None or t.job_id in scored]
        per_mix[m] = {**mix_metrics(mine), **info, "wall_s": time.perf_counter() - t0}
        rows.extend(mine)
    skipped = {"trace-times": "no --trace given"} if mix == ALL_MIXES and trace is None else {}
    return {"experiment": kind, "mix": mix, "mixes": per_mix, "overall": mix_metrics(rows), "skipped": skipped,
            "degradation_truth": DEGRADATION_TRUTH, "estimator": estimator, "sample_us": sample_us,
            "period_ms": period_ms, "schedule": schedule_name(schedule),
            "seed": seed, "iterations": iterations, "jobs_per_mix": n,
            "programs": list(programs), "max_run_s": max_run_s, "job_rows": rows}


def mixes_table(r: dict[str, Any]) -> list[str]:
    """The human-readable table of a mixes report, one line per mix and one overall."""
    head = (f"{'mix':13s} {'jobs':>6s} {'MAE pp':>7s} {'max pp':>7s} {'over':>5s} {'>0.5%':>6s} {'cover':>6s} "
            f"{'above':>6s} {'rev-orc pp':>10s} {'chg/solo':>8s}")
    lines = [head]
    for name, m in [*r["mixes"].items(), ("overall", r["overall"])]:
        if not m.get("jobs"):
            lines.append(f"{name:13s} {0:>6d}")
            continue
        cov, above = ("n/a" if m.get(k) is None else f"{100 * m[k]:.1f}%"
                      for k in ("coverage_clamped", "above_interval"))
        lines.append(f"{name:13s} {m['jobs']:>6d} {m['mae_pct']:>7.2f} {m['max_abs_err_pct']:>7.2f} "
                     f"{m['overcharged_jobs']:>5d} {m['overcharged_jobs_over_0_5pct']:>6d} {cov:>6s} {above:>6s} "
                     f"{m['revenue_vs_oracle_pp']:>+10.2f} {m['charged_vs_solo_baseline']:>8.4f}")
    lines.append("cover: D_true (clamped to [0, 1]) within the charge's interval; above: D_true above its upper end")
    lines.append(f"error: |D - D_true| in points, D_true = {r['degradation_truth']}; estimator {r['estimator']}, "
                 f"{r['schedule']} shutter schedule, S {r['sample_us']} us, P {r['period_ms']} ms")
    lines.extend(f"skipped {k}: {v}" for k, v in r.get("skipped", {}).items())
    return lines


def plot_mixes(result: dict[str, Any], path: Path) -> Path:
    """Price over the solo baseline and the degradation error, per job, for every mix."""
    plt = pyplot()
    rows = result["job_rows"]
    names = list(result["mixes"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    by = {m: [r for r in rows if r["mix"] == m] for m in names}
    axes[0].boxplot([[100 * r["price"] / r["solo_baseline"] for r in by[m]] or [np.nan] for m in names],
                    showmeans=True)
    axes[0].axhline(100, color="grey", lw=0.8, ls="--")
    axes[0].set(ylabel="price / solo baseline (%)", title="price per job")
    axes[1].boxplot([[r["err_pp"] for r in by[m]] or [np.nan] for m in names], showmeans=True)
    axes[1].axhline(0, color="grey", lw=0.8)
    axes[1].set(ylabel="D - D_true (points)", title=f"degradation error per job ({result['estimator']})")
    for ax in axes:
        ax.set_xticks(range(1, len(names) + 1), [f"{m}\n{result['mixes'][m]['jobs']} jobs" for m in names])
        ax.grid(alpha=0.3)
    return save(fig, path)
