"""Issue 36, part 2: the fixed shutter against the adaptive schedule (streams.core.shutter_policy),
in the calibrated simulator.

Every run is charged twice: by the stream fold (``fold``: its point estimate and the price at it,
with the estimator given, by default ``mixed_s``, which keeps the blocks' sums per S; ``charged``:
the charge as the default policy prices it, the point estimate plus the short-sample margin where it
applies) and by the mixed-S prototype outside the fold
(``mixed``: :func:`~nodeshare.streams.core.shutter_policy.mixed_estimate` over the blocks grouped by
``sample_us`` in float running sums; the price is recomputed from it with the charge's own rate
function, run time, pause credit and time alone). With ``mixed_s`` the fold's numbers are the
prototype's. ``every_block``: the same prototype over every block, Alg. 4's filter left out (what
docs/charges.md measured against the filter's bias at small D). Truth is the simulator's: D over
the billed time, 1 - T_solo / (T_co - pause credit).

    python -m nodeshare.experiments.adaptive_shutter pairs --programs-csv FILE --seed 7
    python -m nodeshare.experiments.adaptive_shutter short --programs-csv FILE --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.producers.calibrated import CalibratedConfig, JobSpec, run_cluster, run_pairwise
from nodeshare.producers.calibrated_records import with_records
from nodeshare.producers.workloads import BUILTIN, Workload, load_profiles
from nodeshare.schemas import ShutterBatch
from nodeshare.streams.core.accounting import PricingPolicy
from nodeshare.streams.core.blocks import block_rows
from nodeshare.streams.core.degradation import MIXED_S
from nodeshare.streams.core.pricing import RATE_FUNCTIONS, job_degradation
from nodeshare.streams.core.shutter_policy import LevelStats, ShutterPolicy, levels_of, mixed_estimate

from .poppa import charges_of

OVER = 1.005  # "charged above the solo baseline by more than 0.5% of it"
ESTIMATES = ("fold", "charged", "mixed", "every_block")


def _charged(c: Any, d_shared: float) -> float:
    d = job_degradation(min(1.0, max(0.0, d_shared)), c.alone_s, c.billed_time_s)
    return RATE_FUNCTIONS[c.rate_function](c.rate_per_core_hour, c.cores, c.run_time_s, d, c.pause_credit_s)


def every_block_levels(groups: Sequence[tuple[int, np.ndarray]]) -> dict[int, LevelStats]:
    """Per-S moments of the refill-corrected estimate over every block (no Alg. 4 filter)."""
    out: dict[int, LevelStats] = {}
    for s, m in groups:
        out.setdefault(int(s), LevelStats()).add_xy(m[:, 1] + m[:, 2] - m[:, 0], m[:, 0])
    return out


def score(truth: Sequence[Any], events: Sequence[Any], estimator: str = MIXED_S) -> list[dict[str, Any]]:
    """One row per finished job: true D, the fold's (with ``estimator``) and the prototype's D and price ratio."""
    charges = charges_of(events, PricingPolicy(estimator=estimator))
    groups: dict[str, list[tuple[int, np.ndarray]]] = defaultdict(list)
    for e in events:
        if isinstance(e, ShutterBatch):
            r = block_rows(e)
            v = r.valid
            groups[e.job_id].append((e.sample_us, np.stack([r.before[v], r.during[v], r.after[v]], 1)))
    rows = []
    for t in truth:
        c = charges[t.job_id]
        levels = levels_of(groups.get(t.job_id, []))
        est = mixed_estimate(levels)
        base = c.rate_per_core_hour * c.cores * t.solo_time_s / 3600.0
        true_d = 1.0 - t.solo_time_s / c.billed_time_s if c.billed_time_s > 0 else 0.0
        d_mixed_shared = est.degradation if est.degradation is not None else 0.0
        every = mixed_estimate(every_block_levels(groups.get(t.job_id, []))).degradation
        d_every_shared = 0.0 if every is None else every
        rows.append({
            "job": t.job_id, "program": t.program, "solo_s": t.solo_time_s, "run_s": t.run_time_s,
            "paused_share": t.paused_s / t.run_time_s if t.run_time_s > 0 else 0.0,
            "true": true_d, "fold": c.degradation_point, "charged": c.degradation,
            "mixed": job_degradation(min(1.0, max(0.0, d_mixed_shared)), c.alone_s, c.billed_time_s),
            "ratio_fold": _charged(c, c.degradation_shared) / base if base > 0 else 1.0,
            "ratio_charged": c.price / base if base > 0 else 1.0,
            "ratio_mixed": _charged(c, d_mixed_shared) / base if base > 0 else 1.0,
            "every_block": job_degradation(min(1.0, max(0.0, d_every_shared)), c.alone_s, c.billed_time_s),
            "ratio_every_block": _charged(c, d_every_shared) / base if base > 0 else 1.0,
            "blocks": {str(s): st.n for s, st in sorted(levels.items())}, "mixed_levels": list(est.levels_used),
            "levels": {str(s): [st.n, st.degradation, st.se if math.isfinite(st.se) else None]
                       for s, st in sorted(levels.items())},
            "mixed_se": est.se if math.isfinite(est.se) else None,
        })
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": len(rows)}
    tD = np.array([r["true"] for r in rows])
    for est in ESTIMATES:
        err = np.array([r[est] for r in rows]) - tD
        ratio = np.array([r[f"ratio_{est}"] for r in rows])
        out[est] = {"mae_pp": round(100 * float(np.abs(err).mean()), 3),
                    "max_pp": round(100 * float(np.abs(err).max()), 2),
                    "bias_pp": round(100 * float(err.mean()), 3), "over_0_5pct": int((ratio > OVER).sum()),
                    "over": int((ratio > 1.0).sum())}
    blocks = np.array([sum(r["blocks"].values()) for r in rows])
    paused = np.array([r["paused_share"] for r in rows])
    out["blocks_accepted"] = {"min": int(blocks.min()), "p10": float(np.percentile(blocks, 10)),
                              "median": float(np.median(blocks))}
    out["paused_share_pct"] = {"max": round(100 * float(paused.max()), 3),
                               "median": round(100 * float(np.median(paused)), 3)}
    return out


def per_program(rows: Sequence[dict[str, Any]], programs: Sequence[str]) -> dict[str, dict[str, float]]:
    out = {}
    for p in programs:
        sel = [r for r in rows if r["program"] == p]
        if not sel:
            continue
        out[p] = {"true_pct": round(100 * float(np.mean([r["true"] for r in sel])), 2),
                  "fold_pct": round(100 * float(np.mean([r["fold"] for r in sel])), 2),
                  "mixed_pct": round(100 * float(np.mean([r["mixed"] for r in sel])), 2),
                  "over_0_5pct_mixed": sum(r["ratio_mixed"] > OVER for r in sel), "jobs": len(sel)}
    return out


def pairs_run(seed: int, programs: Sequence[str], library: dict[str, Workload], schedule: ShutterPolicy | None,
              sample_us: int = 3200, period_ms: int = 200, iterations: int = 1,
              estimator: str = MIXED_S) -> list[dict[str, Any]]:
    pairs = [(a, b) for a in programs for b in programs]
    cfg = CalibratedConfig(seed=seed, schedule=schedule, sample_us=sample_us, period_ms=period_ms)
    sim = with_records(cfg, lambda sink: run_pairwise(cfg, pairs, library, iterations, sink))
    return score(sim.truth, sim.events, estimator)


def short_run(seed: int, programs: Sequence[str], library: dict[str, Workload], schedule: ShutterPolicy | None,
              sample_us: int = 3200, period_ms: int = 200, nodes: int = 100, jobs: int = 600, lo_s: float = 5.0,
              hi_s: float = 60.0, estimator: str = MIXED_S) -> list[dict[str, Any]]:
    """Short jobs: ``jobs`` jobs of random programs with solo times log-uniform in [lo_s, hi_s], all
    submitted at once onto ``nodes`` nodes (two per node; a finished job's slot is refilled from the queue)."""
    rng = np.random.default_rng(seed + 1000)
    progs = rng.choice(list(programs), jobs)
    work = np.exp(rng.uniform(math.log(lo_s), math.log(hi_s), jobs))
    specs = [JobSpec(str(p), float(w)) for p, w in zip(progs, work, strict=True)]
    cfg = CalibratedConfig(seed=seed, nodes=nodes, schedule=schedule, sample_us=sample_us, period_ms=period_ms)
    sim = with_records(cfg, lambda sink: run_cluster(cfg, specs, library, sink))
    return score(sim.truth, sim.events, estimator)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=("pairs", "short"))
    ap.add_argument("--programs-csv", type=Path, required=True, help="an LLC profile CSV (workloads.load_profiles)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--schedule", choices=("fixed", "adaptive"), default="adaptive")
    ap.add_argument("--sample-us", type=int, default=3200, help="S (the adaptive schedule's shortest)")
    ap.add_argument("--period-ms", type=int, default=200, help="P")
    ap.add_argument("--estimator", default=MIXED_S, help="the fold's estimator (streams.core.degradation.ESTIMATORS)")
    ap.add_argument("--focus", default="", help="comma-separated programs to report one by one")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    spec = load_profiles(a.programs_csv)
    lib = dict(BUILTIN)
    lib.update(spec)
    programs = tuple(sorted(spec))
    schedule = ShutterPolicy.from_shortest(a.sample_us, period_ms=a.period_ms) if a.schedule == "adaptive" else None
    run = pairs_run if a.scenario == "pairs" else short_run
    rows = run(a.seed, programs, lib, schedule, a.sample_us, a.period_ms, estimator=a.estimator)
    res = {"scenario": a.scenario, "seed": a.seed, "schedule": a.schedule, "sample_us": a.sample_us,
           "period_ms": a.period_ms,
           "policy": None if schedule is None else asdict(schedule), **summary(rows)}
    if a.focus:
        res["programs"] = per_program(rows, a.focus.split(","))
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
