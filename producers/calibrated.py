"""The calibrated cluster simulator: programs from the workload library on shared nodes,
per-socket contention, and POPPA's shutters, emitting the same events as real node agents.

Longer than 500 lines because it is the engine alone (its jobs, traces and outputs live in
job_mix.py, swf.py and calibrated_records.py): the event loop, the shutter schedule and the
phase state it advances are one piece.

Model
-----
* A node has two sockets of eight cores and two *slots*: a job in a slot holds four cores of
  each socket (Seed 002, Section 7: "each socket has half its cores run one application and
  the other half run the other"). Both sockets hold the same two jobs, so one socket is
  solved and stands for both. A job of C cores spans ceil(C / 8) nodes, in the *same slot
  index* on each, so its node agents shutter it on all its nodes at the same time.
* Contention comes from :mod:`contention`: for every pair of program phases the steady
  co-located IPC, the lone job's IPC while its co-runner is paused (its LLC share refilling),
  and both jobs' IPC right after the shutter (the resumed job starts cold) are solved once into
  tables; a region of a cycle is then a table lookup per slot.
* A job's progress is counted in solo-seconds: it advances at ``IPC / solo IPC`` of its current
  phase, and an MPI job advances at the pace of its slowest node (its faster ranks wait, polling).
  A paused job makes no progress at all, so the shutter's overhead (Eq. 9-10) emerges.
* Measured samples: the instructions a node's counters see are the useful ones, plus polling
  while waiting for slower ranks, plus MPI-polling jitter (Seed 002, Section 6.2) and counter
  noise. Phases of tens to hundreds of milliseconds cross sample boundaries; programs with a
  ``micro`` pattern alternate below a millisecond, so a sample sees a varying mix.
* POPPA's agent loop (Alg. 3) on every node holding two jobs: K*S before, K*S with the slot
  ``cycle % 2`` alone, K*S after, then P. A node with one job is never shuttered.

Ground truth (solo time = the job's work, co-located run time, paused time, true degradation)
is returned next to the events and never travels with them.

This module is the engine. Where a run's jobs come from is ``job_mix`` (a synthetic mix, the
program library) and ``swf`` (a Standard Workload Format trace); what it emits, as records or as
typed Parquet, is ``calibrated_records``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import numpy as np

from nodeshare.schemas import (
    JobState,
)
from nodeshare.streams.core.shutter_policy import LevelStats, ShutterPolicy

from .contention import Socket, at_ways, equilibrium, fill_path
from .simulator import JobTruth
from .workloads import BUILTIN, Workload

SIM_NAMESPACE = uuid.UUID("6a0c1c52-3b0e-4f43-9d1e-8b7d6f3b2a10")
#: The LLC way counts (of a node's, both sockets) a started job is profiled at with CAT, like
#: Uberun's 2, 4, 8 and all 20 ways (Seed 001 Section 5.1).
CAT_WAYS = (2, 4, 8, 16, 22)
CAT_EPISODE_S = 5.0  # Uberun changes the allocation every 5 s
SLOTS = 2
USERS: tuple[tuple[str, str], ...] = (("alice", "physics"), ("bob", "physics"), ("carol", "climate"),
                                      ("dave", "climate"), ("erin", "bio"))


@dataclass(frozen=True)
class CalibratedConfig:
    nodes: int = 8
    seed: int = 7
    k: int = 1  # samples per region (POPPA: K = 1)
    sample_us: int = 3200  # S
    period_ms: int = 200  # P
    cores_per_node: int = 16
    clock_ghz: float = 2.6
    socket: Socket = field(default_factory=Socket)
    counter_noise: float = 0.003  # relative noise of a sample's instruction count
    poll_jitter: float = 0.25  # MPI polling: the communication share of a sample varies by this share
    poll_ipc: float = 1.8  # IPC of a polling loop
    run_noise: float = 0.01  # run-to-run variation of a job's work (lognormal sigma)
    shutters: bool = True  # False: no agent at all (the overhead baseline)
    #: An adaptive schedule (issue 36): each cycle, a node's lone job is shuttered with the S its
    #: policy chooses, or not at all; None: every node is shuttered with S every cycle (POPPA).
    #: The cycle stays 3*K*sample_us + P long; a longer S eats into that cycle's P.
    schedule: ShutterPolicy | None = None
    start: datetime = datetime(2026, 1, 1, tzinfo=UTC)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("nodes must be at least 1")
        if self.k < 1 or self.sample_us < 1 or self.period_ms < 0:
            raise ValueError("K and S must be >= 1 and P >= 0")
        if self.cores_per_node % SLOTS:
            raise ValueError(f"cores_per_node must be a multiple of {SLOTS}")
        if self.schedule is not None:
            if self.schedule.k != self.k or self.schedule.ladder_us[0] != self.sample_us:
                raise ValueError("the schedule's K and shortest S are the config's k and sample_us")
            if 3 * self.k * self.schedule.ladder_us[-1] > self.cycle_us:
                raise ValueError("the schedule's longest shutter (3*K*S) does not fit in one cycle")

    @property
    def cycle_us(self) -> int:
        return 3 * self.k * self.sample_us + 1000 * self.period_ms

    @property
    def slot_cores(self) -> int:
        return self.cores_per_node // SLOTS

    @property
    def cycles_per_sample(self) -> int:
        """Cycles a job's threads in one slot run through in one sample of S."""
        return self.cycles_per(self.sample_us)

    def cycles_per(self, sample_us: int) -> int:
        return round(self.clock_ghz * 1e9 * sample_us / 1e6) * self.slot_cores


@dataclass(frozen=True)
class JobSpec:
    """A job to run: the program, its work in solo-seconds, when it is submitted and how many nodes it spans."""

    program: str
    work_s: float
    submit_s: float = 0.0
    nodes: int = 1
    user: str = "alice"
    account: str = "physics"


# --------------------------------------------------------------------------- contention tables


@dataclass(frozen=True)
class StateTables:
    """Every (program, phase, micro burst) state and the contention between any two of them.

    State 0 is an empty slot. ``co[x, y]`` is the IPC of a process of state x next to state y;
    ``during[x, y]`` the IPC of x alone in the shutter window right after y was paused;
    ``after_lone[x, y]`` and ``after_resumed[y, x]`` the IPC of x and of y in the window right
    after x's shutter."""

    names: tuple[str, ...]  # program of every state ("" for the empty state)
    offset: dict[str, int]  # first state of every program
    co: np.ndarray
    during: np.ndarray
    after_lone: np.ndarray
    after_resumed: np.ndarray

    @property
    def solo(self) -> np.ndarray:
        return self.co[:, 0]


def state_tables(programs: Sequence[Workload], socket: Socket, window_ms: float) -> StateTables:
    names, ipc_rows, bw_rows, stall, rpki = [""], [np.ones(11)], [np.zeros(11)], [0.0], [0.0]
    offset: dict[str, int] = {}
    for w in programs:
        offset[w.name] = len(names)
        for ph in w.phases:
            variants = [(1.0, 1.0)] + ([(w.micro.ipc_factor, w.micro.bw_factor)] if w.micro else [])
            for fi, fb in variants:
                names.append(w.name)
                ipc_rows.append(np.asarray(w.ipc) * ph.ipc_factor * fi)
                bw_rows.append(np.asarray(w.bw_gbps) * ph.bw_factor * fb)
                stall.append(w.mem_stall)
                rpki.append(w.llc_rpki * fb)
    n = len(names)
    ipc_t, bw_t = np.array(ipc_rows), np.array(bw_rows)
    st, rp = np.array(stall), np.array(rpki)
    x, y = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    pair = np.stack([x, y], axis=-1)  # (n, n, 2): slot 0 holds x, slot 1 holds y
    act = pair > 0
    co = equilibrium(ipc_t[pair], bw_t[pair], st[pair], rp[pair], act, socket)
    alone = equilibrium(ipc_t[pair[..., :1]], bw_t[pair[..., :1]], st[pair[..., :1]], rp[pair[..., :1]],
                        act[..., :1], socket)
    # x alone right after y paused: its misses evict y's lines, from its co-located share towards its solo share.
    w0, w1 = co.ways[..., 0], alone.ways[..., 0]
    bw_x = np.broadcast_to(bw_t[x], (*x.shape, bw_t.shape[-1]))
    w_path, w_end = fill_path(bw_x, w0, w1, window_ms, socket)
    pts = w_path.shape[-1]

    def over_points(a: np.ndarray) -> np.ndarray:  # (n, n, ...) -> (n, n, points, ...)
        return np.broadcast_to(a[:, :, None], (*a.shape[:2], pts, *a.shape[2:]))

    during = at_ways(over_points(ipc_t[x])[..., None, :], over_points(bw_t[x])[..., None, :],
                     over_points(st[x])[..., None], w_path[..., None], over_points(act[..., :1]),
                     socket).ipc[..., 0].mean(axis=-1)
    # right after: y starts with what x left it and takes back what it misses, at its own miss bandwidth.
    y_start = np.maximum(co.ways[..., 1] - (w_end - w0), 0.05)
    bw_y = np.broadcast_to(bw_t[y], (*y.shape, bw_t.shape[-1]))
    y_path, _ = fill_path(bw_y, y_start, co.ways[..., 1], window_ms, socket)
    x_path = w_end[..., None] - (y_path - y_start[..., None])
    after = at_ways(over_points(ipc_t[pair]), over_points(bw_t[pair]), over_points(st[pair]),
                    np.stack([x_path, y_path], axis=-1), over_points(act), socket).ipc.mean(axis=-2)
    during = np.where(y > 0, during, co.ipc[..., 0])
    return StateTables(tuple(names), offset, co.ipc[..., 0], during, after[..., 0], after[..., 1].T)


# --------------------------------------------------------------------------- the engine


class JobTable:
    """Per-job arrays, grown as jobs are created."""

    def __init__(self) -> None:
        self.n = 0
        cap = 64
        self.prog = np.zeros(cap, np.int64)
        self.work = np.zeros(cap)
        self.done = np.zeros(cap)
        self.paused = np.zeros(cap)
        self.start = np.full(cap, -1.0)
        self.end = np.full(cap, -1.0)
        self.submit = np.zeros(cap)
        self.loop_ms = np.ones(cap)
        self.phase_off = np.zeros(cap)
        self.bounds = np.full((cap, 8), np.inf)
        self.comm = np.zeros(cap)
        self.micro = np.zeros((cap, 2))  # period_us, burst share (0 when none)
        self.nodes: list[list[int]] = []
        self.specs: list[JobSpec] = []
        self.co_runners: list[set[str]] = []

    def _grow(self) -> None:
        for name in ("prog", "work", "done", "paused", "start", "end", "submit", "loop_ms", "phase_off", "comm"):
            a = getattr(self, name)
            fill = -1.0 if name in ("start", "end") else 0
            setattr(self, name, np.concatenate([a, np.full_like(a, fill)]))
        self.bounds = np.concatenate([self.bounds, np.full_like(self.bounds, np.inf)])
        self.micro = np.concatenate([self.micro, np.zeros_like(self.micro)])

    def add(self, spec: JobSpec, prog: int, w: Workload, work: float, rng: np.random.Generator) -> int:
        if self.n == len(self.prog):
            self._grow()
        j = self.n
        self.n += 1
        durations = np.array([p.duration_ms for p in w.phases]) * rng.uniform(0.85, 1.15, len(w.phases))
        if len(durations) > self.bounds.shape[1]:
            raise ValueError(f"{w.name}: at most {self.bounds.shape[1]} phases")
        self.prog[j], self.work[j], self.submit[j] = prog, work, spec.submit_s
        self.loop_ms[j] = durations.sum()
        self.bounds[j, :len(durations) - 1] = np.cumsum(durations)[:-1]
        self.phase_off[j] = rng.uniform(0.0, self.loop_ms[j])
        self.comm[j] = w.comm
        if w.micro:
            self.micro[j] = (w.micro.period_us, w.micro.burst_share)
        self.nodes.append([])
        self.specs.append(spec)
        self.co_runners.append(set())
        return j


def _burst_share(offset_us: np.ndarray, length_us: float | np.ndarray, period_us: np.ndarray,
                 share: np.ndarray) -> np.ndarray:
    """Share of [offset, offset + length) that falls in the bursts [0, share * period) of each period."""
    period = np.where(period_us > 0, period_us, 1.0)
    b = share * period

    def covered(t: np.ndarray) -> np.ndarray:
        return np.floor(t / period) * b + np.minimum(np.mod(t, period), b)

    return np.where(period_us > 0, (covered(offset_us + length_us) - covered(offset_us)) / length_us, 0.0)


class Sink:
    """Receives the simulation's output as columns, cycle by cycle (see :class:`RecordSink`)."""

    def bind(self, engine: Engine) -> None:
        """Called once by the engine before anything is emitted; job and node lookups go through it."""
    def inventory(self, t: float, nodes: list[str], cores: int) -> None: ...
    def lifecycle(self, t: float, job: int, state: JobState) -> None: ...
    def blocks(self, t: float, cycle: int, nodes: np.ndarray, jobs: np.ndarray, samples: np.ndarray,
               sample_us: int | None = None) -> None:
        """``samples`` (n, 3, K) IPC; ``sample_us`` the S they were taken with (None: the config's)."""
    def windows(self, t_start: float, t_end: float, cycle: int, nodes: np.ndarray, lone: np.ndarray,
                paused: np.ndarray) -> None: ...
    def left(self, t: float, job: int, node: int, blocks: int, last_cycle: int, paused_us: int,
             alone_us: int) -> None: ...


@dataclass
class Result:
    truth: list[JobTruth]
    cycles: int
    simulated_s: float
    blocks: int  # as many shutter windows were sent


class Engine:
    """One simulated cluster: jobs are submitted and started by a scenario (``run_pairwise``,
    ``run_cluster``); ``step`` runs one shutter cycle on every node."""

    def __init__(self, cfg: CalibratedConfig, programs: dict[str, Workload], sink: Sink) -> None:
        self.cfg = cfg
        self.sink = sink
        self.rng = np.random.default_rng(cfg.seed)
        self.programs = programs
        self.prog_list = list(programs.values())
        self.prog_index = {w.name: i for i, w in enumerate(self.prog_list)}
        s_ms = cfg.k * cfg.sample_us / 1000.0
        self.tables = state_tables(self.prog_list, cfg.socket, s_ms)
        self.offset = np.array([self.tables.offset[w.name] for w in self.prog_list])
        self.stride = np.array([2 if w.micro else 1 for w in self.prog_list])
        self.max_phases = max(len(w.phases) for w in self.prog_list)
        self.jobs = JobTable()
        self.slot_job = np.full((cfg.nodes, SLOTS), -1, np.int64)
        self.slot_blocks = np.zeros((cfg.nodes, SLOTS), np.int64)
        self.slot_last = np.full((cfg.nodes, SLOTS), -1, np.int64)
        self.slot_paused = np.zeros((cfg.nodes, SLOTS))
        self.slot_alone = np.zeros((cfg.nodes, SLOTS))  # time with no other job on the node: never shuttered
        self.alone_now = np.zeros((cfg.nodes, SLOTS), bool)  # the current region's lone slots
        self.region_end = 0.0
        self.node_names = [f"node{i:05d}" for i in range(cfg.nodes)]
        self.t = 0.0
        self.cycle = 0
        self.n_blocks = 0  # one shutter window is sent with every block
        self.truth: list[JobTruth] = []
        self.on_finish: Callable[[int, int], None] | None = None  # (job, slot) after a job ends
        # the adaptive schedule's state: tables per S, each job's accepted-block moments per S and next turn
        self.level_tables: dict[int, StateTables] = {cfg.sample_us: self.tables}
        self.levels: dict[int, dict[int, LevelStats]] = {}
        self.due: dict[int, float] = {}
        self.node_t = np.zeros(cfg.nodes)  # a node's clock inside an adaptive cycle
        sink.bind(self)
        sink.inventory(0.0, self.node_names, cfg.cores_per_node)

    # -- jobs
    def submit(self, spec: JobSpec) -> int:
        if spec.program not in self.prog_index:
            raise ValueError(f"unknown program {spec.program!r}; the library has {sorted(self.prog_index)}")
        if not 1 <= spec.nodes <= self.cfg.nodes:
            raise ValueError(f"a job spans 1..{self.cfg.nodes} nodes, got {spec.nodes}")
        w = self.programs[spec.program]
        work = spec.work_s * math.exp(self.cfg.run_noise * float(self.rng.standard_normal()))
        j = self.jobs.add(spec, self.prog_index[spec.program], w, work, self.rng)
        self.sink.lifecycle(spec.submit_s, j, JobState.SUBMITTED)
        return j

    def start(self, j: int, nodes: Sequence[int], slot: int) -> None:
        if (self.slot_job[list(nodes), slot] >= 0).any():
            raise ValueError(f"slot {slot} is taken on one of nodes {list(nodes)}")
        self.slot_job[list(nodes), slot] = j
        self.slot_blocks[list(nodes), slot] = 0
        self.slot_last[list(nodes), slot] = -1
        self.slot_paused[list(nodes), slot] = 0.0
        self.slot_alone[list(nodes), slot] = 0.0
        self.jobs.nodes[j] = list(nodes)
        self.jobs.start[j] = self.t
        for other in set(self.slot_job[list(nodes), 1 - slot].tolist()) - {-1}:  # who shares with whom (truth only)
            self.jobs.co_runners[j].add(self.jobs.specs[other].program)
            self.jobs.co_runners[other].add(self.jobs.specs[j].program)
        self.sink.lifecycle(self.t, j, JobState.STARTED)

    def free_nodes(self, slot: int) -> np.ndarray:
        return np.flatnonzero(self.slot_job[:, slot] < 0)

    # -- one cycle
    def _states(self, occ: np.ndarray, jobs: np.ndarray, window_ms: float | np.ndarray,
                ) -> tuple[np.ndarray, ...]:
        J = self.jobs
        prog = J.prog[jobs]
        pos = np.mod(J.done[jobs] * 1000.0 + J.phase_off[jobs], J.loop_ms[jobs])
        phase = (pos[..., None] >= J.bounds[:, :self.max_phases - 1][jobs]).sum(axis=-1)
        base = np.where(occ, self.offset[prog] + phase * self.stride[prog], 0)
        burst = np.where(occ, base + (self.stride[prog] - 1), 0)
        micro = J.micro[jobs]
        frac = np.where(occ, _burst_share(np.mod(J.done[jobs] * 1e6, np.maximum(micro[..., 0], 1.0)),
                                          window_ms * 1000.0, micro[..., 0], micro[..., 1]), 0.0)
        seen = np.where(frac > 0.5, burst, base)  # what a co-runner sees
        return base, burst, frac, seen

    def _region(self, dur_s: float, kind: str, shuttered: np.ndarray, lone: int, measure: bool,
                ) -> np.ndarray | None:
        T = self.tables
        occ = self.slot_job >= 0
        jobs = np.where(occ, self.slot_job, 0)
        base, burst, frac, seen = self._states(occ, jobs, dur_s * 1000.0)
        other_seen = seen[:, ::-1]

        def mix(table: np.ndarray, mine_b: np.ndarray, mine_u: np.ndarray, other: np.ndarray) -> np.ndarray:
            return (1.0 - frac) * table[mine_b, other] + frac * table[mine_u, other]

        ipc = mix(T.co, base, burst, other_seen)
        sh = shuttered & occ.all(axis=1)  # when a job exits mid-cycle its node's agent resumes everyone
        if kind != "co" and sh.any():
            o = 1 - lone
            if kind == "during":
                ipc[sh, lone] = mix(T.during, base, burst, other_seen)[sh, lone]
                ipc[sh, o] = 0.0
            else:  # after
                ipc[sh, lone] = mix(T.after_lone, base, burst, other_seen)[sh, lone]
                ipc[sh, o] = mix(T.after_resumed, base, burst, other_seen)[sh, o]
        solo = (1.0 - frac) * T.solo[base] + frac * T.solo[burst]
        x = np.where(occ, ipc / np.where(occ, solo, 1.0), 1.0)
        speed = np.full(self.jobs.n, np.inf)  # jobs outside the slots are never read
        np.minimum.at(speed, jobs[occ], x[occ])
        self.alone_now = occ & (occ.sum(axis=1) == 1)[:, None]
        self.slot_alone[self.alone_now] += dur_s  # a job that ends inside the region gives back the rest
        paused_slots = occ & (ipc == 0.0)
        if paused_slots.any():
            self.slot_paused[paused_slots] += dur_s
            pj = np.unique(jobs[paused_slots])
            self.jobs.paused[pj] += dur_s
        out = None
        if measure and shuttered.any():
            out = self._samples(shuttered, sh, jobs, lone, solo, x, lambda j, nodes: speed[j])
        self._advance(jobs[occ], speed, dur_s)
        return out

    def _samples(self, shuttered: np.ndarray, sh: np.ndarray, jobs: np.ndarray, lone: int, solo: np.ndarray,
                 x: np.ndarray, speed_of: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """The measured IPC samples (one row of K per node shuttered at the cycle's start; NaN where the
        cycle was cut short: step() sends no block for those) of the lone jobs, whose speed (solo-
        seconds per second) ``speed_of(job, node)`` gives: useful instructions, polling while they
        wait for slower ranks, its jitter and counter noise. Noise is drawn for every row so a
        cut-short cycle does not shift the random stream of the others."""
        noise = self.rng.standard_normal((2, int(shuttered.sum()), self.cfg.k))
        alive = sh[shuttered]
        nodes = np.flatnonzero(sh)
        j = jobs[nodes, lone]
        s = speed_of(j, nodes)
        meas = solo[nodes, lone] * s + np.clip(1.0 - s / x[nodes, lone], 0.0, 1.0) * self.cfg.poll_ipc
        jitter = ((self.cfg.poll_ipc - meas) * self.jobs.comm[j])[:, None] * self.cfg.poll_jitter * noise[0, alive]
        out = np.full((len(alive), self.cfg.k), np.nan)
        out[alive] = np.maximum((meas[:, None] + jitter) * (1.0 + self.cfg.counter_noise * noise[1, alive]), 0.0)
        return out

    def _advance(self, running: np.ndarray, speed: np.ndarray, dur_s: float) -> None:
        """Move the running jobs on by ``dur_s`` of wall time; those that finish end inside it.

        ``running`` has one entry per occupied slot, so a multi-node job appears once per node:
        the update writes the same value for each, and only the few finishers are de-duplicated
        (sorting every slot in every region would cost more than the whole update)."""
        J = self.jobs
        before = J.done[running]
        J.done[running] = np.minimum(before + speed[running] * dur_s, J.work[running])
        done = np.flatnonzero(J.done[running] >= J.work[running])
        finishers, first = np.unique(running[done], return_index=True)
        self.region_end = self.t + dur_s
        for j, i in zip(finishers.tolist(), done[first].tolist(), strict=True):
            self._finish(j, self.t + (J.work[j] - before[i]) / speed[j])
        self.t += dur_s

    def _finish(self, j: int, t_end: float) -> None:
        J = self.jobs
        J.end[j] = t_end
        nodes = J.nodes[j]
        slot = int(np.flatnonzero(self.slot_job[nodes[0]] == j)[0])
        for nd in nodes:
            if self.alone_now[nd, slot]:  # credited the whole region, but it ran only until t_end
                end = self.region_end[nd] if isinstance(self.region_end, np.ndarray) else self.region_end
                self.slot_alone[nd, slot] -= end - t_end
            self.sink.left(t_end, j, nd, int(self.slot_blocks[nd, slot]), int(self.slot_last[nd, slot]),
                           round(self.slot_paused[nd, slot] * 1e6), round(self.slot_alone[nd, slot] * 1e6))
            self.slot_job[nd, slot] = -1
        self.sink.lifecycle(t_end, j, JobState.ENDED)
        run = t_end - J.start[j]
        spec = J.specs[j]
        self.truth.append(JobTruth(
            job_id=job_id(j), program=spec.program, nodes=tuple(self.node_names[n] for n in nodes),
            solo_time_s=float(J.work[j]), run_time_s=float(run), paused_s=float(J.paused[j]),
            true_degradation=float(1.0 - J.work[j] / run) if run > 0 else 0.0,
            co_runners=tuple(sorted(J.co_runners[j]))))
        if self.on_finish is not None:
            self.on_finish(j, slot)

    def step(self) -> None:
        cfg = self.cfg
        if cfg.schedule is not None:
            self._step_adaptive()
            return
        s = cfg.k * cfg.sample_us / 1e6
        occ = self.slot_job >= 0
        shuttered = np.logical_and(occ.all(axis=1), cfg.shutters)
        lone = self.cycle % SLOTS
        t0 = self.t
        samples = [self._region(s, kind, shuttered, lone, True) for kind in ("co", "during", "after")]
        still = shuttered & (self.slot_job >= 0).all(axis=1)  # a job that ended mid-cycle sends no block
        if still.any():
            keep = still[shuttered]
            nodes = np.flatnonzero(still)
            jobs = self.slot_job[nodes, lone]
            stacked = np.stack([smp[keep] for smp in samples if smp is not None], axis=1)  # (n, 3, k)
            self.sink.blocks(t0 + 3 * s, self.cycle, nodes, jobs, stacked)
            self.sink.windows(t0 + s, t0 + 2 * s, self.cycle, nodes, jobs, self.slot_job[nodes, 1 - lone])
            self.slot_blocks[nodes, lone] += 1
            self.slot_last[nodes, lone] = self.cycle
            self.n_blocks += len(nodes)
        self._region(cfg.period_ms / 1e3, "co", shuttered, lone, False)
        self.cycle += 1

    # -- the adaptive schedule (issue 36): per node, the lone job's S (or no shutter) each cycle
    def _tables_at(self, sample_us: int) -> StateTables:
        t = self.level_tables.get(sample_us)
        if t is None:
            t = self.level_tables[sample_us] = state_tables(self.prog_list, self.cfg.socket,
                                                            self.cfg.k * sample_us / 1000.0)
        return t

    def _decide(self, t0: float, lone: int, pair: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each node's sample this cycle and whether it is shuttered: the lone job's policy decides,
        once per job (a multi-node job is shuttered with one sample on all its nodes), within the
        pause budget of every co-runner it would pause."""
        cfg, J = self.cfg, self.jobs
        pol = cfg.schedule
        assert pol is not None
        sample = np.full(cfg.nodes, cfg.sample_us, np.int64)
        shuttered = np.zeros(cfg.nodes, bool)
        cand = np.flatnonzero(pair)
        if not cand.size:
            return sample, shuttered
        lone_jobs = self.slot_job[cand, lone].tolist()
        budget: dict[int, float] = {}
        for j, o in zip(lone_jobs, self.slot_job[cand, 1 - lone].tolist(), strict=True):
            b = pol.pause_budget_s(t0 - float(J.start[o]), float(J.paused[o]))
            budget[j] = min(budget.get(j, math.inf), b)
        choice = {}
        for j, b in budget.items():
            if self.due.get(j, -math.inf) > t0 + 1e-9:
                continue
            ch = pol.choose(self.levels.get(j, {}), b)
            if ch is not None:
                choice[j] = ch
                self.due[j] = t0 + 3 * ch.k * ch.sample_us / 1e6 + ch.period_ms / 1e3
        for n, j in zip(cand.tolist(), lone_jobs, strict=True):
            ch = choice.get(j)
            if ch is not None:
                sample[n] = ch.sample_us
                shuttered[n] = True
        return sample, shuttered

    def _step_adaptive(self) -> None:
        cfg = self.cfg
        tick = cfg.cycle_us / 1e6
        occ = self.slot_job >= 0
        pair = np.logical_and(occ.all(axis=1), cfg.shutters)
        lone = self.cycle % SLOTS
        t0 = self.t
        sample, shuttered = self._decide(t0, lone, pair)
        d = cfg.k * sample / 1e6
        self.node_t[:] = t0
        samples = [self._region_at(d, kind, shuttered, lone, True, sample) for kind in ("co", "during", "after")]
        still = shuttered & (self.slot_job >= 0).all(axis=1)
        if still.any():
            keep = still[shuttered]
            nodes = np.flatnonzero(still)
            jobs = self.slot_job[nodes, lone]
            stacked = np.stack([smp[keep] for smp in samples if smp is not None], axis=1)  # (n, 3, k)
            for s_us in np.unique(sample[nodes]).tolist():
                m = sample[nodes] == s_us
                w = cfg.k * s_us / 1e6
                self.sink.blocks(t0 + 3 * w, self.cycle, nodes[m], jobs[m], stacked[m], sample_us=s_us)
                self.sink.windows(t0 + w, t0 + 2 * w, self.cycle, nodes[m], jobs[m],
                                  self.slot_job[nodes[m], 1 - lone])
            means = stacked.mean(axis=2)  # what the agent's policy sees: each block's mean IPCs
            for j, s_us, (b, dr, a) in zip(jobs.tolist(), sample[nodes].tolist(), means.tolist(), strict=True):
                self.levels.setdefault(j, {}).setdefault(s_us, LevelStats()).add(b, dr, a)
            self.slot_blocks[nodes, lone] += 1
            self.slot_last[nodes, lone] = self.cycle
            self.n_blocks += len(nodes)
        self._region_at(tick - 3 * d, "co", shuttered, lone, False, sample)
        self.t = t0 + tick
        self.cycle += 1

    def _region_at(self, dur: np.ndarray, kind: str, shuttered: np.ndarray, lone: int, measure: bool,
                   sample: np.ndarray) -> np.ndarray | None:
        """``_region`` with a duration per node (``dur``, s) and the shutter tables of each node's sample."""
        T = self.tables
        J = self.jobs
        occ = self.slot_job >= 0
        jobs = np.where(occ, self.slot_job, 0)
        base, burst, frac, seen = self._states(occ, jobs, dur[:, None] * 1000.0)
        other_seen = seen[:, ::-1]

        def mix(table: np.ndarray, mine_b: np.ndarray, mine_u: np.ndarray, other: np.ndarray) -> np.ndarray:
            return (1.0 - frac) * table[mine_b, other] + frac * table[mine_u, other]

        ipc = mix(T.co, base, burst, other_seen)
        sh = shuttered & occ.all(axis=1)
        if kind != "co" and sh.any():
            o = 1 - lone
            for s_us in np.unique(sample[sh]).tolist():
                Ts = self._tables_at(s_us)
                m = sh & (sample == s_us)
                if kind == "during":
                    ipc[m, lone] = mix(Ts.during, base, burst, other_seen)[m, lone]
                    ipc[m, o] = 0.0
                else:
                    ipc[m, lone] = mix(Ts.after_lone, base, burst, other_seen)[m, lone]
                    ipc[m, o] = mix(Ts.after_resumed, base, burst, other_seen)[m, o]
        solo = (1.0 - frac) * T.solo[base] + frac * T.solo[burst]
        x = np.where(occ, ipc / np.where(occ, solo, 1.0), 1.0)
        dslot = np.broadcast_to(dur[:, None], occ.shape)
        progress = np.full(J.n, np.inf)  # solo-seconds of work per job: its slowest node's
        np.minimum.at(progress, jobs[occ], (x * dslot)[occ])
        self.alone_now = occ & (occ.sum(axis=1) == 1)[:, None]
        self.slot_alone[self.alone_now] += dslot[self.alone_now]
        paused_slots = occ & (ipc == 0.0)
        if paused_slots.any():
            self.slot_paused[paused_slots] += dslot[paused_slots]
            add = np.zeros(J.n)
            np.maximum.at(add, jobs[paused_slots], dslot[paused_slots])
            J.paused[:J.n] += add
        out = None
        if measure and shuttered.any():
            out = self._samples(shuttered, sh, jobs, lone, solo, x, lambda j, nodes: progress[j] / dur[nodes])
        running = jobs[occ]
        before = J.done[running]
        J.done[running] = np.minimum(before + progress[running], J.work[running])
        done = np.flatnonzero(J.done[running] >= J.work[running])
        finishers, first = np.unique(running[done], return_index=True)
        self.region_end = self.node_t + dur
        for jj, i in zip(finishers.tolist(), done[first].tolist(), strict=True):
            n0 = J.nodes[jj][0]
            rate = progress[jj] / dur[n0]
            self._finish(jj, float(self.node_t[n0] + (J.work[jj] - before[i]) / rate))
        self.node_t += dur
        return out

    def result(self) -> Result:
        return Result(sorted(self.truth, key=lambda t: int(t.job_id)), self.cycle, self.t, self.n_blocks)


def job_id(j: int) -> str:
    return str(1_000_000 + j)


# --------------------------------------------------------------------------- scenarios


def run_pairwise(cfg: CalibratedConfig, pairs: Sequence[tuple[str, str]], programs: dict[str, Workload] | None = None,
                 iterations: int = 5, sink: Sink | None = None, max_s: float = 36_000.0) -> Result:
    """Seed 002 Section 7: each node runs one pair; a program that ends is restarted at once,
    until both have finished ``iterations`` runs (runs still going then are not counted)."""
    programs = programs or BUILTIN
    cfg = replace(cfg, nodes=len(pairs))
    eng = Engine(cfg, programs, sink or Sink())
    done = np.zeros((len(pairs), SLOTS), np.int64)

    def launch(node: int, slot: int) -> None:
        prog = pairs[node][slot]
        user, account = USERS[(node + slot) % len(USERS)]
        j = eng.submit(JobSpec(prog, programs[prog].solo_s, eng.t, 1, user, account))
        eng.start(j, [node], slot)

    pending: list[tuple[int, int]] = []

    def finished(j: int, slot: int) -> None:
        node = eng.jobs.nodes[j][0]
        done[node, slot] += 1
        if done[node].min() < iterations:
            pending.append((node, slot))

    eng.on_finish = finished
    for node in range(len(pairs)):
        for slot in range(SLOTS):
            launch(node, slot)
    while (done.min(axis=1) < iterations).any() and eng.t < max_s:
        eng.step()
        for node, slot in pending:
            if done[node].min() < iterations:
                launch(node, slot)
        pending.clear()
        stop = done.min(axis=1) >= iterations
        eng.slot_job[stop] = -1  # data collection stops: the node is left alone
    return eng.result()


def run_cluster(cfg: CalibratedConfig, specs: Sequence[JobSpec], programs: dict[str, Workload] | None = None,
                sink: Sink | None = None, until_s: float | None = None,
                progress: Callable[[float], None] | None = None) -> Result:
    """Jobs arrive at their submit times and start first-come first-served (a job that does not
    fit lets smaller ones behind it start) in a free slot on as many nodes as it spans."""
    programs = programs or BUILTIN
    eng = Engine(cfg, programs, sink or Sink())
    order = sorted(range(len(specs)), key=lambda i: (specs[i].submit_s, i))
    arrivals = iter(order)
    nxt = next(arrivals, None)
    queue: list[int] = []
    horizon = until_s if until_s is not None else math.inf
    while eng.t < horizon:
        while nxt is not None and specs[nxt].submit_s <= eng.t:
            queue.append(eng.submit(specs[nxt]))
            nxt = next(arrivals, None)
        if queue:
            free = [eng.free_nodes(s).tolist() for s in range(SLOTS)]
            waiting = []
            for i, j in enumerate(queue):
                most = max(len(f) for f in free)
                if most == 0:  # the cluster is full: everything else keeps waiting
                    waiting.extend(queue[i:])
                    break
                need = eng.jobs.specs[j].nodes
                slot = max(range(SLOTS), key=lambda s: len(free[s]))
                if most >= need:
                    nodes, free[slot] = free[slot][:need], free[slot][need:]
                    eng.start(j, nodes, slot)
                else:
                    waiting.append(j)
            queue = waiting
        running = bool((eng.slot_job >= 0).any())
        if not running and not queue and nxt is None:
            break
        if not running and not queue and nxt is not None:  # idle cluster: jump to the next arrival
            cyc = 3 * cfg.k * cfg.sample_us / 1e6 + cfg.period_ms / 1e3
            skip = max(0, math.floor((specs[nxt].submit_s - eng.t) / cyc))
            eng.t += skip * cyc
            eng.cycle += skip
            if skip:
                continue
        eng.step()
        if progress is not None:
            progress(eng.t)
    return eng.result()


# --------------------------------------------------------------------------- workloads from traces


# --------------------------------------------------------------------------- output as records


# --------------------------------------------------------------------------- output as typed Parquet


