"""Seed 001's experiments on a simulated cluster, under CE, CS and SNS: Section 6.4 (a real job
trace in Standard Workload Format, on one or several cluster sizes), Section 6.2 (the paper's
8-node testbed, sequences of 20 jobs) and Section 6.3 (the scaling-ratio sweep); throughput,
wait, run and turnaround times, alpha violations.

As in the paper, each trace job is mapped to a program of the workload library, sampled with a
bias (the *scaling ratio*: the chance a job runs a scaling program), and its trace run time is
its CE run time. What the scheduler does not know and the simulation decides is how fast each
job really runs where it was put:

* **Nodes** are one contention domain each (:mod:`nodeshare.producers.contention`): the
  paper's testbed node (28 cores, 70 MB of LLC, 118.26 GB/s; ``testbed_machine``) with loaded
  latency from an Intel MLC measurement, or the model node (16 cores, 22 LLC ways and 76 GB/s,
  two of the library's sockets taken as one).
* **Exclusive runs at scale k** (the profile): c = ceil(P / n) processes per node alone on the
  node; compute speeds up by the IPC gained from more ways and bandwidth per process, and the
  program's communication share grows by ``COMM_GROWTH`` per doubling of nodes (so
  communication-heavy programs come out compact, memory-bound ones scaling).
* **Shared nodes**: a job runs at the IPC its node's co-runners leave it, with the slowest of
  its nodes setting its pace (bulk-synchronous codes). Under SNS every job holds its allocated
  LLC ways (CAT) and unallocated ways are shared equally (Seed 001 Section 4.4), and its
  booked bandwidth is a partition of its own plus an equal share of what is unbooked (MBA);
  under CS the ways go by access rates and bandwidth is one pool, as without RDT.

A job's speed changes whenever its nodes' co-runners do; the simulation integrates progress
between events. The scheduler sees only profiles (program-level: exclusive run times per scale
and IPC-LLC / BW-LLC curves), never this truth.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.producers.contention import MLC_LOADED_LATENCY, Socket, at_ways, equilibrium
from nodeshare.producers.workloads import BUILTIN, WAYS, Workload, interp_ways
from nodeshare.schemas.events import ProgramClass
from nodeshare.streams.placement.sns import (
    POLICIES,
    SCALE_FACTORS,
    LlcDemand,
    NodeCapacity,
    PendingJob,
    Scheduler,
    classify,
    llc_demand,
    spread,
)

#: One node of the simulated cluster: two of the library's sockets as one contention domain.
NODE = Socket(ways=2.0 * WAYS, bw_gbps=76.0)
NODE_CORES = 16
#: How much a program's communication time grows per doubling of its node count (an assumption:
#: more of its messages leave the node).
COMM_GROWTH = 0.5
#: The share of a node's peak memory bandwidth SNS hands out. Seed 001 adds up solo bandwidths
#: against the node's capacity; near capacity, loaded latency (the model's queueing curve) slows
#: every co-runner, so a budget below it trades wait time for fewer alpha violations.
BANDWIDTH_BUDGET = NODE.max_util


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    run_s: float  # the trace's run time: the job's CE run time here
    procs: int  # processes on the simulated nodes


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


class Machine:
    """The simulated truth for a library of programs on NODE (cached: the same co-runner sets recur)."""

    def __init__(self, programs: Sequence[Workload], cores: int = NODE_CORES, node: Socket = NODE,
                 comm_growth: float = COMM_GROWTH, mba: bool = True) -> None:
        self.programs = list(programs)
        self.cores = cores
        self.node = node
        self.comm_growth = comm_growth
        self.mba = mba
        self.ipc = np.array([w.ipc for w in programs])
        self.bw = np.array([w.bw_gbps for w in programs])
        self.stall = np.array([w.mem_stall for w in programs])
        self.rpki = np.array([w.llc_rpki for w in programs])
        self.comm = np.array([w.comm for w in programs])
        self.exclusive_ipc = lru_cache(maxsize=None)(self._exclusive_ipc)
        self.node_ipc = lru_cache(maxsize=1 << 16)(self._node_ipc)
        self.curves = lru_cache(maxsize=None)(self._curves)

    def _exclusive_ipc(self, prog: int, procs: int) -> float:
        return float(self._node_ipc(((prog, procs, 0, 0.0),), cat=False)[0])

    def _node_ipc(self, jobs: tuple[tuple[int, int, int, float], ...], cat: bool) -> np.ndarray:
        """IPC of each (program, processes, allocated ways, allocated GB/s) on one node. With
        ``cat`` each job holds its ways and the rest are shared equally (CAT), and with the
        machine's ``mba`` its bandwidth too: a partition of its allocation plus an equal share of
        what is unallocated (MBA). Without ``cat``, ways go by access rates and bandwidth is one pool."""
        prog = np.array([j[0] for j in jobs])
        procs = np.array([float(j[1]) for j in jobs])
        active = np.ones(len(jobs), bool)
        if cat:
            spare = max(0.0, self.node.ways - sum(j[2] for j in jobs)) / len(jobs)
            ways = (np.array([float(j[2]) for j in jobs]) + spare) / procs
            share = None
            if self.mba:
                gbps = np.array([j[3] for j in jobs])
                share = (gbps + max(0.0, self.node.bw_gbps - gbps.sum()) / len(jobs)) / self.node.bw_gbps
            st = at_ways(self.ipc[prog], self.bw[prog], self.stall[prog], ways, active, self.node, procs, share)
        else:
            st = equilibrium(self.ipc[prog], self.bw[prog], self.stall[prog], self.rpki[prog], active, self.node,
                             procs=procs)
        return st.ipc

    def stretch(self, prog: int, procs: int, scale: int, ipc: float) -> float:
        """Run time relative to the CE run of a ``procs``-process job computing at ``ipc`` on scale ``scale``."""
        _, c_ce = spread(procs, self.cores, 1)
        comm = float(self.comm[prog])
        return (1.0 - comm) * self.exclusive_ipc(prog, c_ce) / ipc + comm * (1.0 + self.comm_growth * math.log2(scale))

    def runtime_by_scale(self, prog: int, procs: int) -> dict[int, float]:
        """Exclusive run time per scale factor, relative to CE (what a profile holds)."""
        out = {}
        for k in SCALE_FACTORS:
            _, c = spread(procs, self.cores, k)
            out[k] = self.stretch(prog, procs, k, self.exclusive_ipc(prog, c))
        return out

    def _curves(self, prog: int, procs: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """IPC-LLC and BW-LLC curves of ``procs`` processes on a node, at 1 .. all its ways
        (what CAT profiling measures): per-process curves at ways / procs; bandwidth capped by the node."""
        ways = np.arange(1, int(self.node.ways) + 1) / procs
        cap = self.node.bw_gbps * self.node.max_util
        ipc = interp_ways(np.broadcast_to(self.ipc[prog], (len(ways), WAYS)), ways)
        bw = np.minimum(procs * interp_ways(np.broadcast_to(self.bw[prog], (len(ways), WAYS)), ways), cap)
        return tuple(ipc.tolist()), tuple(bw.tolist())


@dataclass(frozen=True)
class ModelProfile:
    """A program's profile as SNS keeps it: program-level run times per scale (measured with one
    node's worth of processes, like Seed 001 Fig. 13) and CAT curves at the job's density."""

    machine: Machine
    prog: int
    runtimes: Mapping[int, float]

    def runtime_by_scale(self) -> Mapping[int, float]:
        return self.runtimes

    def demand(self, cores_per_node: int, alpha: float) -> LlcDemand | None:
        ipc, bw = self.machine.curves(self.prog, cores_per_node)
        return llc_demand(ipc, bw, alpha)


@dataclass
class Running:
    job: TraceJob
    prog: int
    scale: int
    nodes: tuple[str, ...]
    remaining: float  # CE seconds of work left
    rate: float = 1.0  # CE seconds of work per second
    since: float = 0.0  # when remaining and rate were last brought up to date


def simulate(jobs: Sequence[TraceJob], assignment: Sequence[int], machine: Machine, policy: str, nodes: int,
             alpha: float = 0.9, age_limit_s: float = 3600.0, bandwidth_budget: float = BANDWIDTH_BUDGET,
             progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Replay ``jobs`` (program ``assignment[i]``) under one policy; per job: start, end, scale."""
    pol = POLICIES[policy]
    cap = NodeCapacity(machine.cores, int(machine.node.ways), machine.node.bw_gbps * bandwidth_budget)
    sched = Scheduler({f"n{i:04d}": cap for i in range(nodes)}, pol, age_limit_s)
    profiles = {p: ModelProfile(machine, p, machine.runtime_by_scale(p, machine.cores)) for p in set(assignment)}
    index = {j.job_id: i for i, j in enumerate(jobs)}
    start, end, scale = np.full(len(jobs), np.nan), np.full(len(jobs), np.nan), np.zeros(len(jobs), int)
    running: dict[str, Running] = {}  # what runs where: the scheduler's node loads
    now, arrivals, done = 0.0, 0, 0
    ends: list[tuple[float, str, int]] = []  # (end time, job, version) heap; stale versions skipped
    version: dict[str, int] = {}

    def rerate(changed: set[str]) -> None:
        touched = {j for n in changed for j in sched.loads[n].jobs}
        for jid in touched:
            r = running[jid]
            r.remaining = max(0.0, r.remaining - r.rate * (now - r.since))
            r.since = now
            ipc = min(node_ipc(n, jid) for n in r.nodes)
            r.rate = 1.0 / machine.stretch(r.prog, r.job.procs, r.scale, ipc)
            version[jid] = version.get(jid, 0) + 1
            heapq.heappush(ends, (now + r.remaining / r.rate, jid, version[jid]))

    def node_ipc(name: str, jid: str) -> float:
        held = sched.loads[name].jobs  # job -> (cores, ways, bandwidth)
        ids = sorted(held)
        key = tuple((running[j].prog, held[j][0], held[j][1], held[j][2]) for j in ids)
        return float(machine.node_ipc(key, pol.resource_aware)[ids.index(jid)])

    while done < len(jobs):
        t_arrive = jobs[arrivals].submit_s if arrivals < len(jobs) else math.inf
        while ends and version.get(ends[0][1]) != ends[0][2]:
            heapq.heappop(ends)
        t_end = ends[0][0] if ends else math.inf
        changed: set[str] = set()
        if t_end <= t_arrive:
            now, jid, _ = heapq.heappop(ends)
            r = running.pop(jid)
            del version[jid]
            end[index[jid]] = now
            sched.release(jid)
            changed.update(r.nodes)
            done += 1
            if progress and (done % 500 == 0 or done == len(jobs)):
                progress(done, len(jobs))
        else:
            now = t_arrive
            while arrivals < len(jobs) and jobs[arrivals].submit_s <= now:
                j = jobs[arrivals]
                sched.submit(PendingJob(j.job_id, j.procs, alpha, j.submit_s, profiles[assignment[arrivals]]))
                arrivals += 1
        for d in sched.schedule(now):
            if d.placement is None:
                continue
            i = index[d.job.job_id]
            p = d.placement
            running[d.job.job_id] = Running(jobs[i], assignment[i], p.scale, p.nodes, jobs[i].run_s, 1.0, now)
            start[i], scale[i] = now, p.scale
            changed.update(p.nodes)
        rerate(changed)
    return {"start": start, "end": end, "scale": scale}


def assign_programs(n: int, classes: Sequence[ProgramClass], scaling_ratio: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Seed 001 Section 6.4: a job runs a scaling program with probability ``scaling_ratio``, else a
    non-scaling one; uniform within each group."""
    scaling = [i for i, c in enumerate(classes) if c is ProgramClass.SCALING]
    other = [i for i, c in enumerate(classes) if c is not ProgramClass.SCALING]
    if not scaling or not other:
        raise ValueError("the library needs scaling and non-scaling programs to set a scaling ratio")
    pick = rng.random(n) < scaling_ratio
    return np.where(pick, rng.choice(scaling, n), rng.choice(other, n))


def experiment_sns(trace: Path, scaling_ratio: float = 0.5, nodes: int | None = None, min_procs: int = 8,
                   limit: int | None = None, alpha: float = 0.9, age_limit_s: float = 3600.0, seed: int = 7,
                   bandwidth_budget: float = BANDWIDTH_BUDGET,
                   policies: Sequence[str] = ("CE", "CS", "SNS"), cores_per_node: float | None = None,
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
    classes = [classify(ref[i]) for i in range(len(machine.programs))]
    assignment = assign_programs(len(jobs), classes, scaling_ratio, np.random.default_rng(seed))
    ce_run = np.array([j.run_s for j in jobs])
    submit = np.array([j.submit_s for j in jobs])
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        report: Callable[[int, int], None] | None = None
        if progress is not None:
            report = (lambda pol: lambda d, t: progress(pol, d, t))(name)
        out = simulate(jobs, assignment.tolist(), machine, name, nodes, alpha=alpha, age_limit_s=age_limit_s,
                       bandwidth_budget=bandwidth_budget,
                       progress=report)
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
    ce_turn = results["CE"]["mean_turnaround_s"] if "CE" in results else None
    core_s = np.array([j.procs * j.run_s for j in jobs])
    scaling = np.array([classes[a] is ProgramClass.SCALING for a in assignment])
    return {
        "experiment": "sns", "trace": str(trace), "jobs": len(jobs), "skipped_too_big": len(too_big),
        "nodes": nodes, "node": {"cores": machine.cores, "llc_mb": machine.node.ways * machine.node.way_mb,
                                 "bandwidth_gbps": round(machine.node.bw_gbps * machine.node.max_util, 2),
                                 "latency": "measured" if machine.node.latency_curve else "mm1", "mba": machine.mba},
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
    runs = []
    for ratio in scaling_ratios:
        for n in nodes:
            report = None if progress is None else \
                (lambda label: lambda pol, d, t: progress(f"{label} {pol}", d, t))(f"{n} nodes, ratio {ratio}")
            r = experiment_sns(trace, scaling_ratio=ratio, nodes=n, min_procs=min_procs, limit=limit, seed=seed,
                               cores_per_node=cores_per_node, max_job_nodes=min(nodes), progress=report)
            ce = r["policies"]["CE"]["mean_turnaround_s"]
            runs.append({
                "nodes": n, "scaling_ratio": ratio, "jobs": r["jobs"], "skipped_too_big": r["skipped_too_big"],
                "throughput_gain_vs_ce_pct": r["throughput_gain_vs_ce_pct"],
                "alpha_violations": r["alpha_violations"],
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
    pols = ("CE", "CS", "SNS")
    for ax, ratio in zip(axes[0], ratios, strict=True):
        runs = [r for r in result["runs"] if r["scaling_ratio"] == ratio]
        for k, pol in enumerate(pols):
            x = np.arange(len(runs)) + (k - 1) * 0.27
            wait = [r["breakdown"][pol]["wait"] for r in runs]
            run = [r["breakdown"][pol]["run"] for r in runs]
            ax.bar(x, wait, 0.25, color=f"C{k}", alpha=0.45, label=f"{pol} wait")
            ax.bar(x, run, 0.25, bottom=wait, color=f"C{k}", label=f"{pol} run")
        ax.set_xticks(np.arange(len(runs)),
                      [f"{r['nodes']} nodes\nSNS {r['throughput_gain_vs_ce_pct']['SNS']:+.1f}%" for r in runs])
        ax.set(ylabel="time / CE mean turnaround", title=f"scaling ratio {ratio}")
        ax.legend(fontsize=7, ncol=3)
    fig.suptitle(f"{Path(result['trace']).name}: run/wait breakdown by cluster size (Seed 001 Fig. 20)")
    return save(fig, path)


# --------------------------------------------------------------------------- Section 6.2: the testbed

#: Seed 001 Section 6.1: 8 nodes of two Xeon E5-2680 v4 (2 x 14 cores, 2 x 35 MB of LLC in 20 ways
#: each), whose STREAM-like bandwidth reaches 118.26 GB/s with all 28 cores (Section 3, Fig. 4).
#: The library's curves are per 2.5 MB way (Socket.way_mb), so the node's 70 MB are 28 such ways;
#: 118.26 GB/s is what the node delivers, Socket.max_util of its peak.
TESTBED_NODE = Socket(ways=28.0, bw_gbps=118.26 / Socket().max_util)
TESTBED_CORES = 28
TESTBED_NODES = 8


#: Seed 001's 12 test programs by class (Sections 6.1 and 6.4: 5 scaling, 4 neutral, 3 compact).
PAPER_CLASS_MIX: Mapping[ProgramClass, int] = {ProgramClass.SCALING: 5, ProgramClass.NEUTRAL: 4,
                                               ProgramClass.COMPACT: 3}
#: How a testbed sequence draws its programs: by the paper's class mix, or uniformly from the library.
PROGRAM_MIXES = ("paper", "library")


def testbed_sequence(programs: Sequence[Workload], jobs: int, rng: np.random.Generator,
                     run_scale_s: float = 10.0, classes: Sequence[ProgramClass] | None = None,
                     mix: Mapping[ProgramClass, int] = PAPER_CLASS_MIX,
                     scaling_ratio: float | None = None) -> tuple[list[TraceJob], list[int]]:
    """One Section 6.2 job sequence: ``jobs`` jobs submitted at once with 16 or 28 processes; a
    program's CE run time is fixed (the paper sizes each program's input once), ``run_scale_s``
    times its library solo time.

    Programs are drawn uniformly from the library, or, given each program's class, as the paper
    draws from its 12 programs: a class with the weight ``mix`` gives it (5 scaling, 4 neutral,
    3 compact of 12), then a program of that class uniformly. A class the library lacks is left out.
    With ``scaling_ratio`` (and ``classes``), a job runs a scaling program with that chance
    instead (Section 6.3's sequences, ``assign_programs``)."""
    if scaling_ratio is not None:
        if classes is None:
            raise ValueError("a scaling ratio needs the programs' classes")
        prog = assign_programs(jobs, classes, scaling_ratio, rng)
    elif classes is None:
        prog = rng.integers(len(programs), size=jobs)
    else:
        members = {c: [i for i, k in enumerate(classes) if k is c] for c in mix}
        kinds = [c for c in mix if members[c]]
        if not kinds:
            raise ValueError("no program of the library is in a class of the mix")
        weight = np.array([mix[c] for c in kinds], dtype=float)
        drawn = rng.choice(len(kinds), size=jobs, p=weight / weight.sum())
        prog = np.array([rng.choice(members[kinds[k]]) for k in drawn])
    procs = rng.choice([16, 28], size=jobs)
    seq = [TraceJob(f"j{i:02d}", 0.0, programs[p].solo_s * run_scale_s, int(n))
           for i, (p, n) in enumerate(zip(prog, procs, strict=True))]
    return seq, [int(p) for p in prog]


#: The loaded-latency curves a node can have: the measured one (Intel MLC) or the M/M/1 shape.
LATENCY_CURVES = ("measured", "mm1")


def testbed_machine(comm_growth: float = COMM_GROWTH, latency: str = "measured",
                    loaded_latency_queue: float = TESTBED_NODE.queue, mba: bool = True) -> Machine:
    """The testbed's node with the library's programs: loaded latency ``measured``
    (MLC_LOADED_LATENCY) or ``mm1`` (1 + q rho / (1 - rho), q = ``loaded_latency_queue``); with
    ``mba``, SNS's bandwidth allocations are partitions of their own."""
    if latency not in LATENCY_CURVES:
        raise ValueError(f"latency must be one of {LATENCY_CURVES}, got {latency!r}")
    node = replace(TESTBED_NODE, queue=loaded_latency_queue,
                   latency_curve=MLC_LOADED_LATENCY if latency == "measured" else None)
    programs = [w for name, w in BUILTIN.items() if name != "NULL"]
    return Machine(programs, cores=TESTBED_CORES, node=node, comm_growth=comm_growth, mba=mba)


def experiment_sns_testbed(sequences: int = 36, jobs: int = 20, seed: int = 7, alpha: float = 0.9,
                           nodes: int = TESTBED_NODES, comm_growth: float = COMM_GROWTH,
                           latency: str = "measured", loaded_latency_queue: float = TESTBED_NODE.queue,
                           mba: bool = True, programs_mix: str = "paper",
                           progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Seed 001 Section 6.2: random job sequences, all jobs submitted at once, on the paper's
    8-node testbed, under CE, CS and SNS. Per sequence: the scaling ratio (core-hours of scaling
    jobs under CE) and the throughput gain of CS and SNS over CE (throughput = 1 / mean
    submit-to-finish time); the means over sequences and how often SNS beats CS.
    ``comm_growth`` (communication's growth per doubling of nodes), ``latency`` (the
    loaded-latency curve) and ``mba`` (bandwidth partitions) are the model's assumptions that
    move SNS most (see ``testbed_machine``). ``programs_mix``: ``paper`` draws programs by the
    paper's class mix, ``library`` uniformly (see ``testbed_sequence``)."""
    if programs_mix not in PROGRAM_MIXES:
        raise ValueError(f"programs mix must be one of {PROGRAM_MIXES}, got {programs_mix!r}")
    machine = testbed_machine(comm_growth, latency, loaded_latency_queue, mba)
    programs, node = machine.programs, machine.node
    classes = [classify(machine.runtime_by_scale(i, machine.cores)) for i in range(len(programs))]
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    promised: list[float] = []  # each SNS job's run time over its exclusive run time at its scale
    for s in range(sequences):
        seq, assignment = testbed_sequence(programs, jobs, rng,
                                           classes=classes if programs_mix == "paper" else None)
        core_s = np.array([j.procs * j.run_s for j in seq])
        scaling = np.array([classes[a] is ProgramClass.SCALING for a in assignment])
        turnaround: dict[str, float] = {}
        wait: dict[str, float] = {}
        for name in ("CE", "CS", "SNS"):
            out = simulate(seq, assignment, machine, name, nodes, alpha=alpha)
            turnaround[name] = float(out["end"].mean())  # every job was submitted at 0
            wait[name] = float(out["start"].mean())
        promised += [float(end - start) / (machine.runtime_by_scale(prog, j.procs)[int(k)] * j.run_s)
                     for j, prog, k, start, end in zip(seq, assignment, out["scale"], out["start"], out["end"],
                                                       strict=True)]
        rows.append({
            "scaling_ratio": float(core_s[scaling].sum() / core_s.sum()),
            "throughput_gain_vs_ce_pct": {p: 100.0 * (turnaround["CE"] / turnaround[p] - 1.0) for p in ("CS", "SNS")},
            "sns_vs_cs_pct": 100.0 * (turnaround["CS"] / turnaround["SNS"] - 1.0),
            "mean_turnaround_s": turnaround, "mean_wait_s": wait,
        })
        if progress is not None:
            progress(s + 1, sequences)
    gains = {p: [r["throughput_gain_vs_ce_pct"][p] for r in rows] for p in ("CS", "SNS")}
    return {
        "experiment": "sns-testbed", "sequences": sequences, "jobs_per_sequence": jobs, "nodes": nodes,
        "node": {"cores": TESTBED_CORES, "llc_mb": node.ways * node.way_mb,
                 "bandwidth_gbps": round(node.bw_gbps * node.max_util, 2)},
        "alpha": alpha, "seed": seed, "comm_growth": comm_growth, "latency": latency, "mba": mba,
        "programs_mix": programs_mix,
        **({"loaded_latency_queue": loaded_latency_queue} if latency == "mm1" else {}),
        "programs": {w.name: {"class": classes[i].value,
                              "speedup_by_scale": {str(k): 1.0 / v for k, v in
                                                   machine.runtime_by_scale(i, 16).items()}}
                     for i, w in enumerate(programs)},
        "throughput_gain_vs_ce_pct": {p: float(np.mean(v)) for p, v in gains.items()},
        "throughput_gain_vs_ce_range_pct": {p: [float(min(v)), float(max(v))] for p, v in gains.items()},
        "sns_beats_cs": sum(r["sns_vs_cs_pct"] > 0 for r in rows),
        "sns_below_ce": sum(g < 0 for g in gains["SNS"]),
        # SNS promises each job alpha of its exclusive speed at the scale it picked (Section 4.3)
        "sns_run_vs_exclusive_at_scale": {"mean": float(np.mean(promised)), "p90": float(np.percentile(promised, 90)),
                                          "beyond_1_over_alpha_pct": 100.0 * float(np.mean(
                                              np.array(promised) > 1.0 / alpha + 1e-9))},
        "scaling_ratio": [r["scaling_ratio"] for r in rows],
        "per_sequence": rows,
        "paper": {"throughput_gain_vs_ce_pct": {"CS": 13.7, "SNS": 19.8}, "sns_beats_cs": 26, "sequences": 36,
                  # Fig. 13: 16 processes spread on 8 nodes (CG: at 2), exclusive, vs one node
                  "best_speedup": {"MG": "> 1.3", "LU": "> 1.3", "TS": "> 1.3", "BW": "> 1.3", "CG": 1.13}},
    }


def experiment_sns_sweep(ratios: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                         sequences: int = 10,
                         jobs: int = 20, seed: int = 7, alpha: float = 0.9,
                         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Seed 001 Section 6.3 (Fig. 19) on the testbed: sequences whose jobs run a scaling program
    with the chance ``ratio`` (0 .. 1); per ratio, the mean over sequences of SNS's and CS's mean
    run, wait and turnaround time, each relative to CE's."""
    machine = testbed_machine()
    classes = [classify(machine.runtime_by_scale(i, machine.cores)) for i in range(len(machine.programs))]
    rng = np.random.default_rng(seed)
    rows = []
    total, done = len(ratios) * sequences, 0
    for ratio in ratios:
        rel: dict[str, dict[str, list[float]]] = {p: {"run": [], "wait": [], "turnaround": []} for p in ("CS", "SNS")}
        for _ in range(sequences):
            seq, assignment = testbed_sequence(machine.programs, jobs, rng, classes=classes, scaling_ratio=ratio)
            means = {}
            for name in ("CE", "CS", "SNS"):
                out = simulate(seq, assignment, machine, name, TESTBED_NODES, alpha=alpha)
                means[name] = {"run": float((out["end"] - out["start"]).mean()), "wait": float(out["start"].mean()),
                               "turnaround": float(out["end"].mean())}
            for p in ("CS", "SNS"):
                for m in ("run", "wait", "turnaround"):
                    rel[p][m].append(means[p][m] / max(means["CE"][m], 1e-9))
            done += 1
            if progress is not None:
                progress(done, total)
        rows.append({"scaling_ratio": ratio,
                     **{p: {m: float(np.mean(v)) for m, v in rel[p].items()} for p in ("CS", "SNS")}})
    return {"experiment": "sns-sweep", "sequences_per_ratio": sequences, "jobs_per_sequence": jobs, "seed": seed,
            "alpha": alpha, "ratios": rows,
            "paper": {"sns_turnaround_cut_pct_between_0.35_and_0.85": "> 10", "sns_at_ratio_0": "equal to CE"}}


def plot_sns_sweep(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 19: SNS's (and CS's) run, wait and turnaround time relative to CE by scaling ratio."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["scaling_ratio"] for r in result["ratios"]]
    for k, m in enumerate(("run", "wait", "turnaround")):
        ax.plot(x, [r["SNS"][m] for r in result["ratios"]], marker="o", color=f"C{k}", label=f"SNS {m}")
        ax.plot(x, [r["CS"][m] for r in result["ratios"]], ls="--", color=f"C{k}", alpha=0.6, label=f"CS {m}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="scaling ratio (chance a job runs a scaling program)", ylabel="relative to CE",
           title=f"{result['sequences_per_ratio']} sequences of {result['jobs_per_sequence']} jobs per ratio "
                 "on the 8-node testbed (Seed 001 Fig. 19)")
    ax.legend(fontsize=8, ncol=2)
    return save(fig, path)


def plot_sns_testbed(result: dict[str, Any], path: Path) -> Path:
    """Seed 001 Fig. 14: each sequence's throughput gain over CE against its scaling ratio."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = result["scaling_ratio"]
    for p, marker in (("CS", "o"), ("SNS", "^")):
        ys = [r["throughput_gain_vs_ce_pct"][p] for r in result["per_sequence"]]
        ax.scatter(x, ys, marker=marker, label=f"{p} (mean {result['throughput_gain_vs_ce_pct'][p]:+.1f}%; "
                                               f"paper {result['paper']['throughput_gain_vs_ce_pct'][p]:+.1f}%)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="scaling ratio (core-hours of scaling jobs under CE)", ylabel="throughput vs CE (%)",
           title=f"{result['sequences']} sequences of {result['jobs_per_sequence']} jobs on {result['nodes']} "
                 f"nodes of {result['node']['cores']} cores (Seed 001 Fig. 14); SNS beats CS in "
                 f"{result['sns_beats_cs']}")
    ax.legend()
    return save(fig, path)
