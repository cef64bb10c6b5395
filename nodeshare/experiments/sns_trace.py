"""Seed 001 Section 6.4 (and Fig. 20): a real job trace in Standard Workload Format, its jobs
re-sized to the simulated nodes as the paper re-sized its Trinity jobs, replayed under CE, CS
and SNS on one cluster size or several (the model: :mod:`nodeshare.experiments.sns`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.schemas.events import ProgramClass
from nodeshare.streams.core.placement.learned import InterferenceModel
from nodeshare.streams.core.placement.sns import POLICIES, SCALE_FACTORS

from .sns import BANDWIDTH_BUDGET, COMPARED, NODE_CORES, Machine, TraceJob, assign_programs, simulate, testbed_machine


def read_swf(path: Path, min_procs: int = 8, limit: int | None = None, node_cores: int = NODE_CORES,
             cores_per_node: float | None = None) -> tuple[list[TraceJob], dict[str, Any]]:
    """Jobs of a Standard Workload Format trace with a positive run time and at least
    ``min_procs`` cores on the trace's machine (parallel jobs, as Seed 001 Section 6.4 selects),
    resized to nodes of ``node_cores`` cores: a job keeps its node count (its trace processors /
    the header's MaxProcs per MaxNodes), as the paper re-sized its Trinity jobs to its testbed's nodes.

    ``cores_per_node``: cores of one node of the trace's machine (default: its processors per
    node). Some sites log whole nodes as processors (MaxProcs equal to MaxNodes); such a trace
    needs it said, since one core per node is not a machine jobs share. Raises ValueError naming
    the line of anything malformed, or what the header lacks."""
    header: dict[str, str] = {}
    rows: list[tuple[str, float, float, float]] = []
    with open(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            text = line.strip()
            if not text:
                continue
            if text.startswith(";"):
                key, _, value = text[1:].partition(":")
                header[key.strip()] = value.strip()
                continue
            fields = text.split()
            if len(fields) < 18:
                raise ValueError(f"{path}:{line_no}: {len(fields)} fields, the Standard Workload Format has 18")
            try:
                num, submit, run, alloc, req = (float(fields[i]) for i in (0, 1, 3, 4, 7))
            except ValueError:
                raise ValueError(f"{path}:{line_no}: a field is not a number: {text[:60]!r}") from None
            procs = alloc if alloc > 0 else req
            if run > 0 and procs > 0:
                rows.append((str(int(num)), submit, run, procs))
    try:
        trace_nodes, trace_procs = int(header["MaxNodes"]), int(header["MaxProcs"])
    except (KeyError, ValueError):
        raise ValueError(f"{path}: the header needs MaxNodes and MaxProcs to resize jobs to the simulated nodes") \
            from None
    if trace_nodes < 1 or trace_procs < trace_nodes:
        raise ValueError(f"{path}: the header's MaxProcs ({trace_procs}) is below its MaxNodes ({trace_nodes}): "
                         "no node has a processor")
    per_node = trace_procs / trace_nodes
    if cores_per_node is None:
        if per_node == 1:
            raise ValueError(f"{path}: MaxProcs = MaxNodes = {trace_nodes}: this trace counts whole nodes as "
                             "processors; say how many cores a node of its machine has with --cores-per-node")
        cores_per_node = per_node
    kept = [r for r in rows if r[3] / per_node * cores_per_node >= min_procs]
    if not kept:
        raise ValueError(f"{path}: no job with a run time and at least {min_procs} cores "
                         f"({cores_per_node:g} per node of {per_node:g} processors)")
    kept.sort(key=lambda r: (r[1], r[0]))
    kept = kept[:limit] if limit else kept
    t0 = kept[0][1]
    resized = [TraceJob(job, submit - t0, run, max(1, math.ceil(procs / per_node * node_cores)))
               for job, submit, run, procs in kept]
    return resized, {"trace_nodes": trace_nodes, "trace_cores_per_node": cores_per_node,
                     "trace_processors_per_node": per_node}



def experiment_sns(trace: Path, scaling_ratio: float = 0.5, nodes: int | None = None, min_procs: int = 8,
                   limit: int | None = None, alpha: float = 0.9, age_limit_s: float = 3600.0, seed: int = 7,
                   bandwidth_budget: float = BANDWIDTH_BUDGET,
                   policies: Sequence[str] = COMPARED, cores_per_node: float | None = None,
                   machine: Machine | None = None, max_job_nodes: int | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """CE vs CS vs SNS on a trace, its jobs re-sized to the paper's testbed nodes (Seed 001
    Section 6.4; ``machine``: another). Throughput is Seed 001's: the reciprocal of the mean
    submit-to-finish time; an alpha violation is a job whose run time exceeds its CE run time / alpha.
    ``cores_per_node``: cores of a node of the trace's machine (see ``read_swf``). Jobs on more
    than ``nodes`` nodes (or ``max_job_nodes``, if fewer) are left out."""
    if not 0.0 < scaling_ratio < 1.0:
        raise ValueError(f"--scaling-ratio must be within (0, 1), got {scaling_ratio}")
    machine = machine or testbed_machine()
    jobs, meta = read_swf(trace, min_procs, limit, node_cores=machine.cores, cores_per_node=cores_per_node)
    nodes = nodes or meta["trace_nodes"]
    fits = min(nodes, max_job_nodes or nodes)
    too_big = [j.job_id for j in jobs if math.ceil(j.procs / machine.cores) > fits]
    jobs = [j for j in jobs if math.ceil(j.procs / machine.cores) <= fits]
    if not jobs:
        raise ValueError(f"{trace}: every kept job needs more than the {fits} simulated nodes")
    ref = {i: machine.runtime_by_scale(i, machine.cores) for i in range(len(machine.programs))}
    classes = machine.classes()
    assignment = assign_programs(len(jobs), classes, scaling_ratio, np.random.default_rng(seed))
    ce_run = np.array([j.run_s for j in jobs])
    submit = np.array([j.submit_s for j in jobs])
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        report: Callable[[int, int], None] | None = None
        if progress is not None:
            report = (lambda pol: lambda d, t: progress(pol, d, t))(name)
        model = InterferenceModel() if POLICIES[name].learned else None
        out = simulate(jobs, assignment.tolist(), machine, name, nodes, alpha=alpha, age_limit_s=age_limit_s,
                       bandwidth_budget=bandwidth_budget,
                       progress=report, model=model)
        wait, run = out["start"] - submit, out["end"] - out["start"]
        turnaround = out["end"] - submit
        slowdown = run / ce_run
        results[name] = {
            "mean_wait_s": float(wait.mean()), "mean_run_s": float(run.mean()),
            "mean_turnaround_s": float(turnaround.mean()), "throughput_per_h": 3600.0 / float(turnaround.mean()),
            "makespan_s": float(out["end"].max()),
            "run_vs_ce_geomean": float(np.exp(np.log(slowdown).mean())),
            "run_vs_ce_max": float(slowdown.max()),
            "alpha_violations": int((slowdown > 1.0 / alpha + 1e-9).sum()),
            "scale_share": {str(k): float((out["scale"] == k).mean()) for k in SCALE_FACTORS},
        }
        if model is not None:
            warm = out["learned"] == 0  # placed before anything was measured
            results[name]["learned"] = {
                "measured_jobs": model.measured_jobs, "warmup_jobs": int(warm.sum()),
                "warmup_alpha_violations": int((slowdown[warm] > 1.0 / alpha + 1e-9).sum()),
                "after_warmup_alpha_violations": int((slowdown[~warm] > 1.0 / alpha + 1e-9).sum()),
                "after_warmup_mean_turnaround_s": float(turnaround[~warm].mean()) if (~warm).any() else None}
            if "CE" in results and (~warm).any():
                ce_out = results["CE"]["_turnaround"]
                results[name]["learned"]["after_warmup_throughput_gain_vs_ce_pct"] = \
                    100.0 * (float(ce_out[~warm].mean()) / float(turnaround[~warm].mean()) - 1.0)
        results[name]["_turnaround"] = turnaround
    for r in results.values():
        del r["_turnaround"]
    ce_turn = results["CE"]["mean_turnaround_s"] if "CE" in results else None
    if "CE" in results:
        ce = results["CE"]
        for r in results.values():
            r["vs_ce"] = {m: r[f"mean_{m}_s"] / max(ce[f"mean_{m}_s"], 1e-9) for m in ("wait", "run", "turnaround")}
    core_s = np.array([j.procs * j.run_s for j in jobs])
    scaling = np.array([classes[a] is ProgramClass.SCALING for a in assignment])
    return {
        "experiment": "sns", "trace": str(trace), "jobs": len(jobs), "skipped_too_big": len(too_big),
        "nodes": nodes,
        "node": {**machine.describe(), "mba": machine.mba,
                 "latency": "measured" if machine.node.latency_curve else "mm1"},
        "min_procs": min_procs, "alpha": alpha, "bandwidth_budget": bandwidth_budget, "age_limit_s": age_limit_s,
        "seed": seed,
        "scaling_ratio": scaling_ratio, "scaling_core_hours_share": float(core_s[scaling].sum() / core_s.sum()),
        "programs": {w.name: {"class": classes[i].value,
                              "runtime_vs_ce_by_scale": {str(k): v for k, v in ref[i].items()}}
                     for i, w in enumerate(machine.programs)},
        "policies": results,
        "throughput_gain_vs_ce_pct": {p: 100.0 * (ce_turn / r["mean_turnaround_s"] - 1.0)
                                      for p, r in results.items() if ce_turn and p != "CE"},
        "alpha_violations": {p: r["alpha_violations"] for p, r in results.items()},
        **meta,
    }


def plot_sns(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 20's breakdown: mean wait and run time per policy, normalized to CE's turnaround."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    pols = list(result["policies"])
    ref = result["policies"].get("CE", result["policies"][pols[0]])["mean_turnaround_s"]
    wait = [result["policies"][p]["mean_wait_s"] / ref for p in pols]
    run = [result["policies"][p]["mean_run_s"] / ref for p in pols]
    ax1.bar(pols, wait, label="wait (submit to start)")
    ax1.bar(pols, run, bottom=wait, label="run (start to finish)")
    for x, p in enumerate(pols):
        gain = result["throughput_gain_vs_ce_pct"].get(p)
        label = f"{gain:+.1f}%" if gain is not None else "baseline"
        ax1.text(x, wait[x] + run[x], label, ha="center", va="bottom")
    ax1.set(ylabel="time / CE mean turnaround",
            title=f"{result['jobs']} jobs on {result['nodes']} nodes, scaling ratio {result['scaling_ratio']}")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=2)
    names = list(result["programs"])
    width = 0.8 / len(SCALE_FACTORS)
    for k_i, k in enumerate(SCALE_FACTORS):
        ys = [result["programs"][n]["runtime_vs_ce_by_scale"][str(k)] for n in names]
        ax2.bar(np.arange(len(names)) + k_i * width, ys, width, label=f"scale {k}")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xticks(np.arange(len(names)) + width * 1.5,
                   [f"{n} ({result['programs'][n]['class'][:4]})" for n in names], fontsize=7, rotation=40,
                   ha="right")
    top = max(v for n in names for v in result["programs"][n]["runtime_vs_ce_by_scale"].values())
    ax2.set_ylim(0.6, top + 0.05)
    ax2.set(ylabel="exclusive run time / CE", title="profiles: run time per scale factor (Seed 001 Fig. 13)")
    ax2.legend(fontsize=8)
    return save(fig, path)


#: Seed 001 Section 6.4's cluster sizes (4K, 8K and 32K nodes) as multiples of the middle one.
CLUSTER_MULTIPLES = (0.5, 1.0, 4.0)


def experiment_sns_clusters(trace: Path, nodes: Sequence[int] | None = None,
                            scaling_ratios: Sequence[float] = (0.5, 0.9), min_procs: int = 8,
                            limit: int | None = None, seed: int = 7, cores_per_node: float | None = None,
                            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Seed 001 Section 6.4 and Fig. 20: the trace on clusters of several sizes (default: the
    trace's own node count times 1/2, 1 and 4, the paper's 4K : 8K : 32K), at each scaling ratio,
    CE against SNS (and CS); jobs on more nodes than the smallest cluster are left out of every
    run, as the paper left out jobs over 4,096 nodes. Each run's mean wait and run time are
    normalized to CE's mean turnaround, as Fig. 20 plots them."""
    if nodes is None:
        trace_nodes = read_swf(trace, min_procs, limit, cores_per_node=cores_per_node)[1]["trace_nodes"]
        nodes = sorted({max(1, round(trace_nodes * m)) for m in CLUSTER_MULTIPLES})
    machine = testbed_machine()  # one model for every run: its caches carry over
    runs = []
    for ratio in scaling_ratios:
        for n in nodes:
            report = None if progress is None else \
                (lambda label: lambda pol, d, t: progress(f"{label} {pol}", d, t))(f"{n} nodes, ratio {ratio}")
            r = experiment_sns(trace, scaling_ratio=ratio, nodes=n, min_procs=min_procs, limit=limit, seed=seed,
                               cores_per_node=cores_per_node, machine=machine, max_job_nodes=min(nodes),
                               progress=report)
            ce = r["policies"]["CE"]["mean_turnaround_s"]
            runs.append({
                "nodes": n, "scaling_ratio": ratio, "jobs": r["jobs"], "skipped_too_big": r["skipped_too_big"],
                "throughput_gain_vs_ce_pct": r["throughput_gain_vs_ce_pct"],
                "alpha_violations": r["alpha_violations"],
                "vs_ce": {p: v["vs_ce"] for p, v in r["policies"].items()},
                **({"learned": r["policies"]["learned"]["learned"]} if "learned" in r["policies"] else {}),
                "breakdown": {p: {"wait": v["mean_wait_s"] / ce, "run": v["mean_run_s"] / ce}
                              for p, v in r["policies"].items()},
            })
    return {"experiment": "sns-clusters", "trace": str(trace), "nodes": list(nodes),
            "scaling_ratios": list(scaling_ratios), "seed": seed, "runs": runs,
            "paper": {"nodes": [4096, 8192, 32768], "sns_gain_vs_ce_pct_at_32k_ratio_0.9": 15.7}}


def plot_sns_clusters(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 20: mean wait and run time of CE, CS and SNS per cluster size, normalized to
    CE's mean turnaround, one panel per scaling ratio."""
    plt = pyplot()
    ratios = result["scaling_ratios"]
    fig, axes = plt.subplots(1, len(ratios), figsize=(6 * len(ratios), 5), squeeze=False)
    pols = tuple(result["runs"][0]["breakdown"]) if result["runs"] else ("CE", "CS", "SNS")
    width = 0.8 / len(pols)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        runs = [r for r in result["runs"] if r["scaling_ratio"] == ratio]
        for k, pol in enumerate(pols):
            x = np.arange(len(runs)) + (k - (len(pols) - 1) / 2) * width
            wait = [r["breakdown"][pol]["wait"] for r in runs]
            run = [r["breakdown"][pol]["run"] for r in runs]
            ax.bar(x, wait, width * 0.92, color=f"C{k}", alpha=0.45, label=f"{pol} wait")
            ax.bar(x, run, width * 0.92, bottom=wait, color=f"C{k}", label=f"{pol} run")
        ax.set_xticks(np.arange(len(runs)),
                      [f"{r['nodes']} nodes\nSNS {r['throughput_gain_vs_ce_pct']['SNS']:+.1f}%" for r in runs])
        ax.set(ylabel="time / CE mean turnaround", title=f"scaling ratio {ratio}")
        ax.legend(fontsize=7, ncol=3)
    fig.suptitle(f"{Path(result['trace']).name}: run/wait breakdown by cluster size (Seed 001 Fig. 20)")
    return save(fig, path)
