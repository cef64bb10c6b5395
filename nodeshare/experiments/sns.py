"""The model behind Seed 001's experiments: a simulated cluster whose jobs run under CE, CS or
SNS and whose truth the scheduler never sees. The experiments are beside it: a real trace
(Section 6.4, :mod:`.sns_trace`) and the paper's testbed (Sections 6.2-6.3, :mod:`.sns_testbed`).

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
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

import numpy as np

from nodeshare.producers.contention import MLC_LOADED_LATENCY, Socket, at_ways, equilibrium
from nodeshare.producers.workloads import BUILTIN, WAYS, Workload, interp_ways
from nodeshare.schemas.events import DegradationEstimate, EstimateStatus, JobEvent, JobState, ProgramClass
from nodeshare.streams.core.degradation import degradation_from_sums
from nodeshare.streams.core.placement.learned import InterferenceModel
from nodeshare.streams.core.placement.sns import (
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

    def classes(self) -> list[ProgramClass]:
        """Each program's class from its exclusive run times on a full node's processes (Section 4.2)."""
        return [classify(self.runtime_by_scale(i, self.cores)) for i in range(len(self.programs))]

    def describe(self) -> dict[str, Any]:
        """The node as the experiments' JSON reports it."""
        return {"cores": self.cores, "llc_mb": self.node.ways * self.node.way_mb,
                "bandwidth_gbps": round(self.node.bw_gbps * self.node.max_util, 2)}

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
    ipc: float = 0.0  # the IPC its slowest node's counters see now
    ipc_s: float = 0.0  # IPC integrated over its run so far (what its counters summed)
    cores: int = 1  # its processes per node


#: Where simulated seconds start on the records' clock.
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
#: Sd of the measured D around the counters' (the pipeline's estimates are off by about a point:
#: docs/measured.md, experiment pairwise).
MEASURE_NOISE = 0.01


class Measurements:
    """The pipeline as the learned policy sees it: each job's lifecycle and, when it ends, its final
    degradation estimate, D = 1 - (its mean IPC over the run) / (its IPC alone on the same
    number of cores per node) from its counters (POPPA's Alg. 4 ratio, ``degradation_from_sums``),
    with the estimates' error. These records, and nothing else, reach the interference model."""

    def __init__(self, machine: Machine, model: InterferenceModel, seed: int = 0,
                 noise: float = MEASURE_NOISE) -> None:
        self.machine, self.model, self.noise = machine, model, noise
        self.rng = np.random.default_rng(seed)

    def _event(self, r: Running, state: JobState, start: float, end: float | None) -> JobEvent:
        at = EPOCH + timedelta(seconds=end if end is not None else start)
        return JobEvent(event_id=f"{r.job.job_id}:{state.value}", source="nodeshare.experiments.sns", event_time=at,
                        job_id=r.job.job_id, state=state, user="sim", account="sim",
                        program=self.machine.programs[r.prog].name, cores=r.job.procs, nodes=r.nodes,
                        submit_time=EPOCH + timedelta(seconds=r.job.submit_s),
                        start_time=EPOCH + timedelta(seconds=start),
                        end_time=None if end is None else EPOCH + timedelta(seconds=end))

    def started(self, r: Running, now: float) -> None:
        self.model.apply(self._event(r, JobState.STARTED, now, None))

    def ended(self, r: Running, start: float, now: float) -> None:
        self.model.apply(self._event(r, JobState.ENDED, start, now))
        alone = self.machine.exclusive_ipc(r.prog, r.cores)
        d = degradation_from_sums(alone, r.ipc_s / max(now - start, 1e-9)) or 0.0
        d = float(min(max(d + self.noise * self.rng.standard_normal(), 0.0), 1.0))
        self.model.apply(DegradationEstimate(
            event_id=f"{r.job.job_id}:estimate", source="nodeshare.experiments.sns",
            event_time=EPOCH + timedelta(seconds=now), job_id=r.job.job_id, status=EstimateStatus.OK,
            degradation=d, filtered=d, unfiltered=d, blocks_used=1, blocks_rejected=0, delta=0.05, final=True))


def simulate(jobs: Sequence[TraceJob], assignment: Sequence[int], machine: Machine, policy: str, nodes: int,
             alpha: float = 0.9, age_limit_s: float = 3600.0, bandwidth_budget: float = BANDWIDTH_BUDGET,
             progress: Callable[[int, int], None] | None = None,
             model: InterferenceModel | None = None) -> dict[str, np.ndarray]:
    """Replay ``jobs`` (program ``assignment[i]``) under one policy; per job: start, end, scale,
    and how many measured jobs the learned policy had learned from when it started (``learned``;
    0 for the other policies). The learned policy's ``model`` (a new one if None) learns from
    ``Measurements``' records only, and may be passed on to the next replay."""
    pol = POLICIES[policy]
    cap = NodeCapacity(machine.cores, int(machine.node.ways), machine.node.bw_gbps * bandwidth_budget)
    if pol.learned and model is None:
        model = InterferenceModel()
    measure = Measurements(machine, model, seed=len(jobs)) if pol.learned and model is not None else None
    sched = Scheduler({f"n{i:04d}": cap for i in range(nodes)}, pol, age_limit_s, model=model)
    profiles = {p: ModelProfile(machine, p, machine.runtime_by_scale(p, machine.cores)) for p in set(assignment)}
    index = {j.job_id: i for i, j in enumerate(jobs)}
    start, end, scale = np.full(len(jobs), np.nan), np.full(len(jobs), np.nan), np.zeros(len(jobs), int)
    learned = np.zeros(len(jobs), int)
    running: dict[str, Running] = {}  # what runs where: the scheduler's node loads
    now, arrivals, done = 0.0, 0, 0
    ends: list[tuple[float, str, int]] = []  # (end time, job, version) heap; stale versions skipped
    version: dict[str, int] = {}

    def rerate(changed: set[str]) -> None:
        touched = {j for n in changed for j in sched.loads[n].jobs}
        for jid in touched:
            r = running[jid]
            r.remaining = max(0.0, r.remaining - r.rate * (now - r.since))
            r.ipc_s += r.ipc * (now - r.since)
            r.since = now
            ipc = min(node_ipc(n, jid) for n in r.nodes)
            r.ipc = ipc
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
            if measure is not None:
                r.ipc_s += r.ipc * (now - r.since)
                measure.ended(r, float(start[index[jid]]), now)
            sched.release(jid)
            changed.update(r.nodes)
            done += 1
            if progress and (done % 500 == 0 or done == len(jobs)):
                progress(done, len(jobs))
        else:
            now = t_arrive
            while arrivals < len(jobs) and jobs[arrivals].submit_s <= now:
                j = jobs[arrivals]
                sched.submit(PendingJob(j.job_id, j.procs, alpha, j.submit_s, profiles[assignment[arrivals]],
                                        machine.programs[assignment[arrivals]].name))
                arrivals += 1
        for d in sched.schedule(now):
            if d.placement is None:
                continue
            i = index[d.job.job_id]
            p = d.placement
            running[d.job.job_id] = Running(jobs[i], assignment[i], p.scale, p.nodes, jobs[i].run_s, 1.0, now,
                                            cores=p.cores_per_node)
            start[i], scale[i] = now, p.scale
            if measure is not None:
                learned[i] = measure.model.measured_jobs
                measure.started(running[d.job.job_id], now)
            changed.update(p.nodes)
        rerate(changed)
    return {"start": start, "end": end, "scale": scale, "learned": learned}


#: The policies every placement experiment compares (issue 37: the learned one beside Seed 001's).
COMPARED = ("CE", "CS", "SNS", "learned")


def run_policies(jobs: Sequence[TraceJob], assignment: Sequence[int], machine: Machine, nodes: int,
                 alpha: float, policies: Sequence[str] = COMPARED,
                 model: InterferenceModel | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The same jobs under each policy (``simulate``'s output per policy); the learned policy
    carries ``model`` (what it measured in earlier runs) on."""
    return {p: simulate(jobs, assignment, machine, p, nodes, alpha=alpha, model=model if p == "learned" else None)
            for p in policies}


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


# --------------------------------------------------------------------------- Section 6.2: the testbed

#: Seed 001 Section 6.1: 8 nodes of two Xeon E5-2680 v4 (2 x 14 cores, 2 x 35 MB of LLC in 20 ways
#: each), whose STREAM-like bandwidth reaches 118.26 GB/s with all 28 cores (Section 3, Fig. 4).
#: The library's curves are per 2.5 MB way (Socket.way_mb), so the node's 70 MB are 28 such ways;
#: 118.26 GB/s is what the node delivers, Socket.max_util of its peak.
TESTBED_NODE = Socket(ways=28.0, bw_gbps=118.26 / Socket().max_util)
TESTBED_CORES = 28
TESTBED_NODES = 8


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
