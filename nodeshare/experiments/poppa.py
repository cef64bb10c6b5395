"""POPPA's evaluation (Seed 002, Section 8) on the calibrated simulator, through the audit path.

Every experiment simulates, then folds the events with the stream worker's own reducer
(``streams.core.accounting.fold_messages``, the fold ``nodeshare audit`` replays; a test shows the
pipeline's ledger equals it). Only then is the ground truth read, to score the charges.

* ``pairwise``: every pair of the library co-located as in Section 7; Fig. 10 (run-time
  prediction error %) for each estimator and Fig. 11 (degradation %).
* ``pricing``: Fig. 12, prices relative to the solo (spread) baseline under SOP, POPPA and the oracle.
* ``shutter``: Figs. 5-9, accuracy and overhead against the shutter length S.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.producers.calibrated import CalibratedConfig, JobTruth, run_pairwise
from nodeshare.producers.calibrated_records import with_records
from nodeshare.producers.mixes import MAX_RUN_S
from nodeshare.producers.workloads import BUILTIN, PAIRWISE, Workload
from nodeshare.schemas import TOPIC_OF_RECORD, Charge, JobEvent, JobLeftNode, ShutterBatch, ShutterBlock, encode
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_messages
from nodeshare.streams.core.degradation import DEFAULT_ESTIMATOR
from nodeshare.streams.core.shutter_overhead import dilated_run_time
from nodeshare.streams.core.shutter_policy import ShutterPolicy

#: The three estimates every charge carries, by the name experiments report them under.
ESTIMATES: dict[str, Callable[[Charge], float | None]] = {
    "refill_corrected": lambda c: c.degradation_corrected,
    "poppa_alg4": lambda c: c.degradation_filtered,
    "unfiltered": lambda c: c.degradation_unfiltered,
}
NPB = ("CG", "FT", "LU", "MG")
SHUTTER_US = (200, 400, 800, 1600, 3200, 6400, 12800, 25600)


def charges_of(events: Sequence[Any], policy: PricingPolicy | None = None) -> dict[str, Charge]:
    """The charges the stream worker's fold produces from these events (the audit path)."""
    msgs = [(Origin(TOPIC_OF_RECORD[type(e)].name, 0, i), e.job_id.encode(), encode(e), 0.0)
            for i, e in enumerate(events) if isinstance(e, (ShutterBatch, ShutterBlock, JobLeftNode, JobEvent))]
    return {c.job_id: c for c in fold_messages(msgs, policy or PricingPolicy())}


def _clamp(d: float | None) -> float:
    return 0.0 if d is None else min(1.0, max(0.0, d))


def predicted_run_time(t: JobTruth, c: Charge, d: float | None) -> float:
    """The co-located run time a degradation estimate implies for the true solo time: the solo
    time stretched by 1 / (1 - D), plus the time the shutters paused the job."""
    return t.solo_time_s / max(1e-9, 1.0 - _clamp(d)) + c.pause_credit_s


def oracle_price(c: Charge, t: JobTruth) -> float:
    """Eq. 4 with the true times: L * (T_solo / T_co) * C * T_solo."""
    return c.rate_per_core_hour * (t.solo_time_s / t.run_time_s) * c.cores * t.solo_time_s / 3600.0


@lru_cache(maxsize=2)
def _pairs_simulated(seed: int, iterations: int, sample_us: int, period_ms: int, programs: tuple[str, ...],
                     library: tuple[Workload, ...], schedule: ShutterPolicy | None = None,
                     ) -> tuple[list[tuple[str, str]], list[JobTruth], list[Any]]:
    """Every ordered pair run to completion, under the fixed shutter (``sample_us``, ``period_ms``)
    or the adaptive ``schedule``."""
    lib = {w.name: w for w in library}
    pairs = [(a, b) for a in programs for b in programs]
    cfg = CalibratedConfig(seed=seed, sample_us=sample_us, period_ms=period_ms, schedule=schedule)
    sim = with_records(cfg, lambda sink: run_pairwise(cfg, pairs, lib, iterations, sink))
    return pairs, sim.truth, sim.events


@lru_cache(maxsize=8)
def _pairs_run(seed: int, iterations: int, sample_us: int, period_ms: int, programs: tuple[str, ...],
               library: tuple[Workload, ...], estimator: str, schedule: ShutterPolicy | None = None,
               ) -> tuple[list[tuple[str, str]], list[JobTruth], dict[str, Charge]]:
    """The pairs simulated once, charged under ``estimator``."""
    pairs, truth, events = _pairs_simulated(seed, iterations, sample_us, period_ms, programs, library, schedule)
    return pairs, truth, charges_of(events, PricingPolicy(estimator=estimator))


def _scored(seed: int, iterations: int, sample_us: int, period_ms: int, programs: Sequence[str],
            library: dict[str, Workload], estimator: str = DEFAULT_ESTIMATOR, schedule: ShutterPolicy | None = None,
            ) -> list[tuple[str, str, JobTruth, Charge]]:
    """(program, co-runner, truth, charge) for every completed run."""
    pairs, truth, charges = _pairs_run(seed, iterations, sample_us, period_ms, tuple(programs),
                                       tuple(library.values()), estimator, schedule)
    out = []
    for t in truth:
        a, b = pairs[int(t.nodes[0].removeprefix("node"))]
        out.append((t.program, b if t.program == a else a, t, charges[t.job_id]))
    return out


#: A pair's run-time prediction error (mean over its runs, %) above this counts as a miss.
ERROR_BOUND_PCT = 6.0


def experiment_pairwise(seed: int = 7, iterations: int = 5, sample_us: int = 3200, period_ms: int = 200,
                        programs: Sequence[str] = PAIRWISE, library: dict[str, Workload] | None = None,
                        estimator: str = DEFAULT_ESTIMATOR, mix: str = "pairs", jobs: int | None = None,
                        trace: Path | None = None, max_run_s: float = MAX_RUN_S,
                        schedule: ShutterPolicy | None = None) -> dict[str, Any]:
    """Every estimator is scored; ``estimator`` is the one the headline numbers name (applied).
    With ``mix`` other than ``pairs``: the mixes' per-job report (:func:`experiment_mixes`),
    whose ``run_time_mae_pct`` is this experiment's run-time prediction error, per job."""
    if mix != "pairs":
        from nodeshare.experiments.mixes import experiment_mixes

        return experiment_mixes("pairwise", mix, seed=seed, iterations=iterations, sample_us=sample_us,
                                period_ms=period_ms, programs=programs, library=library, estimator=estimator,
                                jobs=jobs, trace=trace, max_run_s=max_run_s, schedule=schedule)
    lib = library or BUILTIN
    rows = _scored(seed, iterations, sample_us, period_ms, programs, lib, estimator, schedule)
    # an applied estimator a charge carries no column of (mixed_s): its point estimate over the shared time
    picks = {**ESTIMATES, estimator: ESTIMATES.get(estimator, lambda c: c.degradation_shared)}
    errors: dict[str, dict[tuple[str, str], list[float]]] = {e: defaultdict(list) for e in picks}
    degr: dict[tuple[str, str], list[float]] = defaultdict(list)
    for prog, co, t, c in rows:
        degr[(prog, co)].append(100.0 * t.true_degradation)
        for name, pick in picks.items():
            errors[name][(prog, co)].append(100.0 * (predicted_run_time(t, c, pick(c)) - t.run_time_s) / t.run_time_s)
    # matrices are [co-runner (y)][job (x)], as Figs. 10-11
    mats = {n: [[float(np.mean(e[(x, y)])) for x in programs] for y in programs] for n, e in errors.items()}
    deg = [[float(np.mean(degr[(x, y)])) for x in programs] for y in programs]
    summary = {}
    for name, m in mats.items():
        a = np.abs(np.array(m))
        worst = sorted(((abs(m[i][j]), m[i][j], programs[j], programs[i]) for i in range(len(programs))
                        for j in range(len(programs))), reverse=True)[:10]
        summary[name] = {"mae_pct": float(a.mean()), "max_abs_err_pct": float(a.max()),
                         "bias_pct": float(np.mean(m)), "pairs_above_6_pct": int((a > ERROR_BOUND_PCT).sum()),
                         "column_mae_pct": a.mean(axis=0).tolist(), "row_mae_pct": a.mean(axis=1).tolist(),
                         "worst": [{"job": x, "co_runner": y, "err_pct": e} for _, e, x, y in worst]}
    applied = estimator
    return {"experiment": "pairwise", "estimator": applied, "mae_pct": summary[applied]["mae_pct"],
            "max_abs_err_pct": summary[applied]["max_abs_err_pct"], "pairs": len(programs) ** 2,
            "runs": len(rows), "programs": list(programs), "iterations": iterations, "seed": seed,
            "sample_us": sample_us, "period_ms": period_ms, "estimators": summary, "error_pct": mats,
            "degradation_pct": deg, "mean_degradation_pct": float(np.mean(deg)), "mix": "pairs",
            "schedule": schedule_name(schedule)}


def experiment_pricing(seed: int = 7, iterations: int = 5, sample_us: int = 3200, period_ms: int = 200,
                       programs: Sequence[str] = PAIRWISE, library: dict[str, Workload] | None = None,
                       estimator: str = DEFAULT_ESTIMATOR, mix: str = "pairs", jobs: int | None = None,
                       trace: Path | None = None, max_run_s: float = MAX_RUN_S,
                       schedule: ShutterPolicy | None = None) -> dict[str, Any]:
    """Fig. 12: for every (program, co-runner), the price of its runs relative to the solo
    baseline L * C * T_solo, under SOP (L * C * T_co), POPPA (the ledger's charge) and the oracle.
    With ``mix`` other than ``pairs``: the mixes' per-job report (:func:`experiment_mixes`)."""
    from nodeshare.experiments.mixes import DEGRADATION_TRUTH, experiment_mixes, job_row, mix_metrics

    if mix != "pairs":
        return experiment_mixes("pricing", mix, seed=seed, iterations=iterations, sample_us=sample_us,
                                period_ms=period_ms, programs=programs, library=library, estimator=estimator,
                                jobs=jobs, trace=trace, max_run_s=max_run_s, schedule=schedule)
    scored = _scored(seed, iterations, sample_us, period_ms, programs, library or BUILTIN, estimator, schedule)
    r = _pricing_pairs(scored, programs, estimator, sample_us, period_ms)
    rows = [job_row("pairs", t, c) for _, _, t, c in scored]
    metrics = mix_metrics(rows)
    return {**r, "mix": "pairs", "degradation_truth": DEGRADATION_TRUTH, "mixes": {"pairs": metrics},
            "overall": metrics, "job_rows": rows, "seed": seed, "iterations": iterations,
            "schedule": schedule_name(schedule)}


def schedule_name(schedule: ShutterPolicy | None) -> str:
    return "fixed" if schedule is None else "adaptive"


def _pricing_pairs(rows: Sequence[tuple[str, str, JobTruth, Charge]], programs: Sequence[str], estimator: str,
                   sample_us: int, period_ms: int) -> dict[str, Any]:
    """Fig. 12 on pairs run to completion, per (program, co-runner)."""
    acc: dict[tuple[str, str], np.ndarray] = defaultdict(lambda: np.zeros(4))
    runs = []
    for prog, co, t, c in rows:
        base = c.rate_per_core_hour * c.cores * t.solo_time_s / 3600.0
        v = np.array([base, c.standard_price, c.price, oracle_price(c, t)])
        acc[(prog, co)] += v
        runs.append(v[1:] / base)
    rel = {k: v[1:] / v[0] for k, v in acc.items()}
    jobs = [{"program": p, "co_runner": co, "sop": r[0], "poppa": r[1], "oracle": r[2]}
            for (p, co), r in sorted(rel.items())]
    m = np.array([[j["sop"], j["poppa"], j["oracle"]] for j in jobs])
    over = m[:, 1] > 1.0
    per_run = np.array(runs)
    per_program = {p: float(np.mean([j["poppa"] for j in jobs if j["program"] == p])) for p in programs}
    return {
        "experiment": "pricing", "jobs": len(jobs), "runs": len(runs), "estimator": estimator,
        "sample_us": sample_us, "period_ms": period_ms,
        "sop_mean": float(m[:, 0].mean()), "poppa_mean": float(m[:, 1].mean()), "oracle_mean": float(m[:, 2].mean()),
        "sop_min": float(m[:, 0].min()), "sop_max": float(m[:, 0].max()),
        "poppa_min": float(m[:, 1].min()), "poppa_max": float(m[:, 1].max()),
        "oracle_min": float(m[:, 2].min()), "oracle_max": float(m[:, 2].max()),
        "poppa_minus_oracle_pp": float(100 * (m[:, 1].mean() - m[:, 2].mean())),
        "overcharged_jobs": int(over.sum()),
        "overcharge_mean_pct": float(100 * (m[over, 1] - 1).mean()) if over.any() else 0.0,
        "overcharged_runs": int((per_run[:, 1] > 1.0).sum()),
        "poppa_mean_by_program": per_program, "rows": jobs,
    }


def experiment_shutter(seed: int = 7, iterations: int = 3, period_ms: int = 200,
                       shutter_us: Sequence[int] = SHUTTER_US, jobs: Sequence[str] = NPB,
                       co_runners: Sequence[str] = ("ADVECT3D", "Swim"), library: dict[str, Workload] | None = None,
                       progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Figs. 5-9: for every S, each NPB code next to a contentious and a moderate co-runner
    (prediction error per estimator, and overhead: run time with shutters over run time without),
    and next to NULL (overhead against Eq. 10)."""
    lib = library or BUILTIN
    pairs = [(j, c) for c in (*co_runners, "NULL") for j in jobs]
    base_cfg = CalibratedConfig(seed=seed, period_ms=period_ms)
    plain = run_pairwise(replace(base_cfg, shutters=False), pairs, lib, iterations).truth  # truth only: no records
    no_shutter = _mean_run_by_pair(plain, pairs, jobs)
    rows = []
    for i, s_us in enumerate(shutter_us):
        cfg = replace(base_cfg, sample_us=s_us)
        sim = with_records(cfg, lambda sink, cfg=cfg: run_pairwise(cfg, pairs, lib, iterations, sink))
        charges = charges_of(sim.events)
        mine = _mean_run_by_pair(sim.truth, pairs, jobs)
        for (job, co), truths in _by_pair(sim.truth, pairs, jobs).items():
            row: dict[str, Any] = {"sample_us": s_us, "job": job, "co_runner": co,
                                   "true_degradation_pct": 100 * float(np.mean([t.true_degradation for t in truths]))}
            for name, pick in ESTIMATES.items():
                row[f"err_{name}_pct"] = float(np.mean([
                    100 * (predicted_run_time(t, charges[t.job_id], pick(charges[t.job_id])) - t.run_time_s)
                    / t.run_time_s for t in truths]))
            # the same work with and without the agent: mean run time per solo second
            row["overhead_pct"] = 100 * (mine[(job, co)] / no_shutter[(job, co)] - 1)
            if co == "NULL":
                row["eq10_overhead_pct"] = 100 * (dilated_run_time(1.0, 2, s_us / 1e6, period_ms / 1e3) - 1)
            rows.append(row)
        if progress:
            progress(i + 1, len(shutter_us))
    null = [r for r in rows if r["co_runner"] == "NULL"]
    return {"experiment": "shutter", "period_ms": period_ms, "shutter_us": list(shutter_us), "jobs": list(jobs),
            "co_runners": list(co_runners), "rows": rows,
            "eq10_max_abs_diff_pp": float(max(abs(r["overhead_pct"] - r["eq10_overhead_pct"]) for r in null)),
            "overhead_at_3200_pct": {co: float(np.mean([r["overhead_pct"] for r in rows
                                                         if r["co_runner"] == co and r["sample_us"] == 3200]))
                                     for co in (*co_runners, "NULL")} if 3200 in shutter_us else {}}


def _by_pair(truth: Sequence[JobTruth], pairs: Sequence[tuple[str, str]], jobs: Sequence[str],
             ) -> dict[tuple[str, str], list[JobTruth]]:
    out: dict[tuple[str, str], list[JobTruth]] = defaultdict(list)
    for t in truth:
        job, co = pairs[int(t.nodes[0].removeprefix("node"))]
        if t.program == job and t.program in jobs:
            out[(job, co)].append(t)
    return out


def _mean_run_by_pair(truth: Sequence[JobTruth], pairs: Sequence[tuple[str, str]], jobs: Sequence[str],
                      ) -> dict[tuple[str, str], float]:
    return {k: float(np.sum([t.run_time_s for t in v]) / np.sum([t.solo_time_s for t in v]))
            for k, v in _by_pair(truth, pairs, jobs).items()}


# --------------------------------------------------------------------------- plots


def with_margins(m: np.ndarray) -> np.ndarray:
    """Fig. 10's layout: the matrix, a bottom row with each column's mean absolute value, a right
    column with each row's, and their overall mean in the corner."""
    a = np.abs(m)
    out = np.empty((m.shape[0] + 1, m.shape[1] + 1))
    out[:-1, :-1], out[-1, :-1], out[:-1, -1], out[-1, -1] = m, a.mean(axis=0), a.mean(axis=1), a.mean()
    return out


def _heat(ax: Any, m: np.ndarray, labels: Sequence[str], title: str, cmap: str, center: bool,
          margins: bool = False) -> None:
    lim = float(np.abs(m).max()) or 1.0
    if margins:
        m = with_margins(m)
        labels = [*labels, "mean |err|"]
        n = len(labels) - 1.5
        ax.axhline(n, color="black", lw=1.5)
        ax.axvline(n, color="black", lw=1.5)
    ax.imshow(m, cmap=cmap, vmin=-lim if center else 0, vmax=lim)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            dark = abs(m[i, j]) > 0.6 * lim  # the strong end of either colormap
            ax.text(j, i, f"{m[i, j]:.1f}", ha="center", va="center", fontsize=6, color="white" if dark else "black")
    ax.set(xlabel="job", ylabel="co-runner", title=title)


def plot_pairwise(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    labels = result["programs"]
    fig, axes = plt.subplots(1, 3, figsize=(20, 7))
    for ax, name in zip(axes[:2], (result["estimator"], "poppa_alg4"), strict=True):
        s = result["estimators"][name]
        _heat(ax, np.array(result["error_pct"][name]), labels,
              f"Fig. 10, {name}: prediction error %\nMAE {s['mae_pct']:.2f}%, max {s['max_abs_err_pct']:.2f}%",
              "RdBu_r", True, margins=True)
    _heat(axes[2], np.array(result["degradation_pct"]), labels,
          f"Fig. 11: true degradation %\nmean {result['mean_degradation_pct']:.1f}%", "Reds", False)
    return save(fig, path)


def plot_pricing(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 5))
    data = [[100 * r[k] for r in rows] for k in ("sop", "poppa", "oracle")]
    ax.boxplot(data, showmeans=True)
    ax.set_xticks([1, 2, 3], [f"SOP\nmean {result['sop_mean']:.3f}", f"POPPA ({result['estimator']})\n"
                              f"mean {result['poppa_mean']:.3f}", f"Oracle\nmean {result['oracle_mean']:.3f}"])
    ax.axhline(100, color="grey", lw=0.8, ls="--")
    ax.set(ylabel="price relative to the solo baseline (%)",
           title=f"Fig. 12: {result['jobs']} (program, co-runner) jobs; {result['overcharged_jobs']} charged "
                 f"above their baseline by POPPA")
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_shutter(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    rows = result["rows"]
    cos = [*result["co_runners"]]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, co in zip(axes[:2], cos, strict=True):
        for job in result["jobs"]:
            mine = [r for r in rows if r["job"] == job and r["co_runner"] == co]
            xs = [r["sample_us"] for r in mine]
            line = ax.plot(xs, [r["err_refill_corrected_pct"] for r in mine], "o-", label=f"{job} corrected")
            ax.plot(xs, [r["err_poppa_alg4_pct"] for r in mine], "s--", color=line[0].get_color(), alpha=0.6,
                    label=f"{job} Alg. 4")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="shutter S (us)", ylabel="run-time prediction error (%)",
               title=f"accuracy next to {co} (Figs. 6-7)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
    ax = axes[2]
    for co, marker in zip((*cos, "NULL"), "o^s", strict=True):
        xs = sorted({r["sample_us"] for r in rows})
        ax.plot(xs, [np.mean([r["overhead_pct"] for r in rows if r["co_runner"] == co and r["sample_us"] == x])
                     for x in xs], marker=marker, label=f"simulated, next to {co}")
    null = sorted({(r["sample_us"], r["eq10_overhead_pct"]) for r in rows if r["co_runner"] == "NULL"})
    ax.plot([x for x, _ in null], [y for _, y in null], "k--", label="Eq. 10 model (n = 2)")
    ax.set(xscale="log", xlabel="shutter S (us)", ylabel="run-time overhead (%)",
           title=f"overhead at P = {result['period_ms']} ms (Figs. 5, 8-9)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


# --------------------------------------------------------------------------- the simulator's own speed


def bench_simulate(nodes: int = 10_000, hours: float = 1.0, out_dir: Path | None = None, seed: int = 7,
                   progress: Callable[[float, float], None] | None = None) -> dict[str, Any]:
    """A full cluster (two jobs per node at the start, arrivals keeping it full) for ``hours`` of
    simulated time, its whole event stream written as typed Parquet: events per second of wall time."""
    import shutil
    import tempfile
    import time

    from nodeshare.producers.calibrated import run_cluster
    from nodeshare.producers.calibrated_records import ParquetSink
    from nodeshare.producers.job_mix import synthetic_jobs

    span = hours * 3600.0
    cfg = CalibratedConfig(nodes=nodes, seed=seed)
    specs = synthetic_jobs(int(nodes * 2.2), seed, mean_work_s=900.0, span_s=1.0)
    specs += synthetic_jobs(int(nodes * 2.0 * span / 900.0), seed + 1, mean_work_s=900.0, span_s=span)
    tmp = Path(tempfile.mkdtemp(prefix="nodeshare-sim-")) if out_dir is None else Path(out_dir)
    try:
        sink = ParquetSink(cfg, tmp)
        t0 = time.perf_counter()
        res = run_cluster(cfg, specs, sink=sink, until_s=span,
                          progress=(lambda t: progress(t, span)) if progress else None)
        sink.close()
        wall = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in tmp.glob("*.parquet"))
    finally:
        if out_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    events = sum(sink.rows.values()) + nodes  # + one inventory record per node
    return {"nodes": nodes, "simulated_s": res.simulated_s, "cycles": res.cycles, "wall_s": wall,
            "events": events, "events_per_s": events / wall, "blocks": sink.rows["blocks"],
            "windows": sink.rows["windows"], "lifecycle": sink.rows["lifecycle"], "left": sink.rows["left"],
            "jobs_ended": len(res.truth), "parquet_bytes": size, "simulated_s_per_wall_s": res.simulated_s / wall}
