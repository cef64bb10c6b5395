"""A small cluster simulator that emits the same events as real node agents and a real
resource manager: lifecycle events, shutter blocks, shutter windows and end-of-stream markers.

Model (deliberately simple; the calibrated simulator is a separate piece of work):

* nodes are grouped into *node groups* of one or two nodes; a group runs 2-4 jobs side by
  side, every job spanning every node of its group, jobs queued FIFO per group;
* a job's progress is measured in solo-seconds: alone it advances 1 s per s; next to
  co-runners it advances at 1 / (1 + sensitivity * sum of co-runners' pressure);
  while paused by a shutter it does not advance at all;
* its IPC is ``solo_ipc * phase factor * progress rate``; the phase factor changes with the
  program's position, so some shutter blocks straddle phase boundaries;
* POPPA's agent loop (Alg. 3) runs on every group with two or more jobs: S before, S with one
  job alone, S after, then P, rotating the lone job; a group with one job is never shuttered;
* each sample's instruction count gets multiplicative Gaussian noise.

The generator is pure and deterministic for a seed. Ground truth (solo and co-located run
time, true degradation) is returned separately and must never reach the pricing path.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from nodeshare.schemas import (
    CounterSource,
    IpcSample,
    JobEvent,
    JobLeftNode,
    JobState,
    NodeInventory,
    Record,
    ShutterBatch,
    ShutterBlock,
    ShutterWindow,
)

from .batching import Batcher, FlushPolicy

SIM_NAMESPACE = uuid.UUID("0b6f6b8e-5c1d-4c55-8d0f-3f2f4a1c7e21")


@dataclass(frozen=True)
class Program:
    name: str
    solo_ipc: float
    pressure: float  # how hard it presses on shared caches and memory bandwidth
    sensitivity: float  # how much it suffers from co-runners' pressure


#: Four archetypes spanning the space: they are illustrative, not calibrated on any machine.
PROGRAMS: tuple[Program, ...] = (
    Program("membound", solo_ipc=0.6, pressure=0.9, sensitivity=0.5),
    Program("compute", solo_ipc=1.8, pressure=0.1, sensitivity=0.05),
    Program("cachey", solo_ipc=1.2, pressure=0.5, sensitivity=0.6),
    Program("balanced", solo_ipc=1.0, pressure=0.4, sensitivity=0.3),
)
USERS: tuple[tuple[str, str], ...] = (("alice", "physics"), ("bob", "physics"), ("carol", "climate"))


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 6
    jobs: int = 12
    seed: int = 7
    k: int = 1  # samples per region (POPPA: K = 1)
    sample_us: int = 3200  # S (POPPA's default choice, Seed 002 Section 8.2)
    period_ms: int = 200  # P
    max_corunners: int = 3
    cores_per_node: int = 16
    clock_ghz: float = 2.6
    noise: float = 0.02  # relative standard deviation of a sample's instruction count
    mean_runtime_s: float = 40.0  # mean solo run time of a job
    multi_node_share: float = 0.3  # chance that a node group has two nodes
    start: datetime = datetime(2026, 1, 1, tzinfo=UTC)
    flush: FlushPolicy = field(default_factory=FlushPolicy)  # how blocks are batched (producers.batching)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.jobs < 1:
            raise ValueError("nodes and jobs must be at least 1")
        if not 2 <= self.max_corunners <= 4:
            raise ValueError("max_corunners must be between 2 and 4")


@dataclass(frozen=True)
class JobTruth:
    """What really happened to a job: only experiments may read this."""

    job_id: str
    program: str
    nodes: tuple[str, ...]
    solo_time_s: float
    run_time_s: float
    paused_s: float
    true_degradation: float  # 1 - T_solo / T_co
    co_runners: tuple[str, ...] = ()  # programs it shared a node with (the calibrated simulator fills it)


@dataclass
class Simulation:
    events: list[Record]
    truth: list[JobTruth]

    def count(self, kind: type[Record]) -> int:
        return sum(isinstance(e, kind) for e in self.events)


@dataclass
class _Job:
    job_id: str
    program: Program
    user: str
    account: str
    work_s: float
    phases: list[tuple[float, float]]  # (progress at which the phase ends, IPC factor)
    submit_s: float
    start_s: float = -1.0
    done_s: float = 0.0
    paused_s: float = 0.0
    alone_s: float = 0.0  # with no other job on the nodes: never shuttered
    blocks: dict[str, int] = field(default_factory=dict)
    last_cycle: dict[str, int] = field(default_factory=dict)

    def phase_factor(self) -> float:
        for end, factor in self.phases:
            if self.done_s < end:
                return factor
        return self.phases[-1][1]


class _Emitter:
    """Records in event-time order; shutter blocks leave in batches, as the node agent sends them."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.out: list[tuple[float, int, Record]] = []
        self.batcher = Batcher(cfg.flush, lambda b: self.eid("bat", b.job_id, b.node, b.seq))

    def at(self, t_s: float) -> datetime:
        return self.cfg.start + timedelta(microseconds=round(t_s * 1e6))

    def eid(self, *parts: object) -> str:
        return str(uuid.uuid5(SIM_NAMESPACE, "/".join(map(str, (self.cfg.seed, *parts)))))

    def emit(self, t_s: float, record: Record) -> None:
        if isinstance(record, ShutterBlock):
            for b in [*self.batcher.add_block(record), *self.batcher.due(record.event_time)]:
                self._at_event_time(b)
            return
        if isinstance(record, JobLeftNode):  # the stream's open batch goes first
            last = self.batcher.close(record.job_id, record.node)
            if last is not None:
                self._at_event_time(last)
        self.out.append((t_s, len(self.out), record))

    def _at_event_time(self, b: ShutterBatch) -> None:
        """A batch stands at its newest block's time (an aged one is flushed later than that)."""
        self.out.append(((b.event_time - self.cfg.start).total_seconds(), len(self.out), b))


def simulate(cfg: SimConfig) -> Simulation:
    """Run the cluster and return its events in event-time order, and the ground truth."""
    rng = np.random.default_rng(cfg.seed)
    em = _Emitter(cfg)
    node_names = [f"node{i:03d}" for i in range(cfg.nodes)]
    for n in node_names:
        em.emit(0.0, NodeInventory(event_id=em.eid("inv", n), source="sim/inventory", event_time=em.at(0.0),
                                   node=n, cores=cfg.cores_per_node, llc_ways=20, mem_bandwidth_gbps=100.0))
    groups: list[list[str]] = []
    i = 0
    while i < len(node_names):
        size = 2 if i + 1 < len(node_names) and rng.random() < cfg.multi_node_share else 1
        groups.append(node_names[i:i + size])
        i += size
    queues: list[list[_Job]] = [[] for _ in groups]
    for j in range(cfg.jobs):
        prog = PROGRAMS[int(rng.integers(len(PROGRAMS)))]
        user, account = USERS[int(rng.integers(len(USERS)))]
        work = float(rng.uniform(0.5, 1.5) * cfg.mean_runtime_s)
        phases, pos = [], 0.0
        while pos < work:
            pos += float(rng.uniform(1.0, 8.0))
            phases.append((pos, float(rng.uniform(0.75, 1.25))))
        g = int(rng.integers(len(groups)))
        submit = float(rng.uniform(0.0, cfg.mean_runtime_s))
        queues[g].append(_Job(str(100000 + j), prog, user, account, work, phases, submit))
    truth: list[JobTruth] = []
    for nodes, queue in zip(groups, queues, strict=True):
        slots = int(rng.integers(2, cfg.max_corunners + 1))
        truth += _run_group(cfg, rng, em, nodes, slots, sorted(queue, key=lambda q: q.submit_s))
    em.out.sort(key=lambda e: (e[0], e[1]))
    return Simulation([r for _, _, r in em.out], sorted(truth, key=lambda t: t.job_id))


def _run_group(cfg: SimConfig, rng: np.random.Generator, em: _Emitter, nodes: list[str], slots: int,
               pending: list[_Job]) -> list[JobTruth]:
    s = cfg.sample_us / 1e6
    p = cfg.period_ms / 1e3
    cycles_per_sample = round(cfg.clock_ghz * 1e9 * s)
    threads = cfg.cores_per_node // slots
    truth: list[JobTruth] = []
    running: list[_Job] = []
    t, cycle = 0.0, 0

    for job in pending:
        em.emit(job.submit_s, _lifecycle(em, job, JobState.SUBMITTED, job.submit_s, nodes, threads))

    def advance(dur: float, paused: set[str]) -> float:
        """Advance every running job by dur seconds, finishing jobs on the way. Returns the end time."""
        nonlocal t
        end = t + dur
        while t < end and running:
            rates = _rates(running, paused)
            left = end - t
            step = min([left] + [(j.work_s - j.done_s) / r for j, r in zip(running, rates, strict=True) if r > 0])
            for j, r in zip(running, rates, strict=True):
                j.done_s += r * step
                if r == 0:
                    j.paused_s += step
            if len(running) == 1:
                running[0].alone_s += step
            t += step
            for j in [j for j in running if j.work_s - j.done_s <= 1e-9]:
                running.remove(j)
                truth.append(_finish(em, j, t, nodes, threads))
        t = end if running else t
        return t

    while pending or running:
        while pending and len(running) < slots and pending[0].submit_s <= t:
            job = pending.pop(0)
            job.start_s = t
            running.append(job)
            em.emit(t, _lifecycle(em, job, JobState.STARTED, t, nodes, threads))
        if not running:
            t = max(t, pending[0].submit_s)
            continue
        if len(running) < 2:  # the agent refuses to shutter a node with one job
            advance(3 * s + p, set())
            cycle += 1
            continue
        lone = running[cycle % len(running)]
        others = {j.job_id for j in running if j is not lone}
        window_start = t
        samples: dict[str, list[float]] = {}
        for region, paused in (("before", set()), ("during", others), ("after", set())):
            ipc = lone.program.solo_ipc * lone.phase_factor() * _rates([lone] + [
                j for j in running if j is not lone], paused)[0]
            samples[region] = [ipc]
            advance(s, paused)
            if lone not in running:
                break
        if lone in running and len(samples) == 3:
            shutter_start = window_start + s
            for node in nodes:
                block = _block(cfg, rng, em, lone, node, cycle, t, samples, cycles_per_sample, threads)
                em.emit(t, block)
                lone.blocks[node] = lone.blocks.get(node, 0) + 1
                lone.last_cycle[node] = cycle
                em.emit(shutter_start + s, ShutterWindow(
                    event_id=em.eid("win", node, cycle), source=f"sim/{node}", event_time=em.at(shutter_start + s),
                    node=node, cycle=cycle, lone_job=lone.job_id, paused_jobs=tuple(sorted(others)),
                    start=em.at(shutter_start), end=em.at(shutter_start + s)))
        advance(p, set())
        cycle += 1
    return truth


def _rates(running: list[_Job], paused: set[str]) -> list[float]:
    active = [j for j in running if j.job_id not in paused]
    pressure = sum(j.program.pressure for j in active)
    return [0.0 if j.job_id in paused else 1.0 / (1.0 + j.program.sensitivity * (pressure - j.program.pressure))
            for j in running]


def _block(cfg: SimConfig, rng: np.random.Generator, em: _Emitter, job: _Job, node: str, cycle: int, t: float,
           ipc: dict[str, list[float]], cycles_per_sample: int, threads: int) -> ShutterBlock:
    def region(name: str) -> tuple[IpcSample, ...]:
        cyc = cycles_per_sample * threads
        return tuple(
            IpcSample(instructions=max(0, round(ipc[name][0] * cyc * (1.0 + cfg.noise * float(rng.standard_normal())))),
                      cycles=cyc, threads=threads)
            for _ in range(cfg.k)
        )

    return ShutterBlock(
        event_id=em.eid("blk", job.job_id, node, cycle), source=f"sim/{node}", event_time=em.at(t),
        job_id=job.job_id, node=node, cycle=cycle, k=cfg.k, sample_us=cfg.sample_us,
        counter=CounterSource.SIMULATED, before=region("before"), during=region("during"), after=region("after"),
    )


def _lifecycle(em: _Emitter, job: _Job, state: JobState, t: float, nodes: list[str], threads: int,
               end_s: float | None = None) -> JobEvent:
    ran = state is not JobState.SUBMITTED
    return JobEvent(
        event_id=em.eid("job", job.job_id, state.value), source="sim/slurm", event_time=em.at(t),
        job_id=job.job_id, state=state, user=job.user, account=job.account, program=job.program.name,
        cores=threads * len(nodes), nodes=tuple(nodes) if ran else (), submit_time=em.at(job.submit_s),
        start_time=em.at(job.start_s) if ran else None, end_time=em.at(end_s) if end_s is not None else None,
    )


def _finish(em: _Emitter, job: _Job, t: float, nodes: list[str], threads: int) -> JobTruth:
    for node in nodes:
        em.emit(t, JobLeftNode(event_id=em.eid("left", job.job_id, node), source=f"sim/{node}", event_time=em.at(t),
                               job_id=job.job_id, node=node, blocks_sent=job.blocks.get(node, 0),
                               last_cycle=job.last_cycle.get(node, -1), paused_us=round(job.paused_s * 1e6),
                               alone_us=round(job.alone_s * 1e6)))
    em.emit(t, _lifecycle(em, job, JobState.ENDED, t, nodes, threads, end_s=t))
    run = em.at(t) - em.at(job.start_s)  # the run time as the events will state it
    run_s = run.total_seconds()
    return JobTruth(job.job_id, job.program.name, tuple(nodes), job.work_s, run_s, job.paused_s,
                    1.0 - job.work_s / run_s if run_s > 0 else 0.0)
