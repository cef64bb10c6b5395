"""Rolling program profiles (Seed 001 Section 4.1, Seed 003 Section 3): what the event stream
has taught us about each program.

* **Run time per scale factor** from each ended job: its solo time (1 - D) * T_co, POPPA's
  estimate of how long it would have run without co-runners, so shared runs profile too and
  not only exclusive ones; the scale factor is its nodes over the fewest that hold its cores.
* **IPC-LLC and BW-LLC curves** from CAT episodes (``node.llc``), averaged per way count,
  missing way counts linearly interpolated (Seed 001 Section 5.1).
* **Class** scaling / compact / neutral by the 5% rule (``placement.sns.classify``).
* **Counter features** (mean, min, max, sd; Seed 003 Table 3's spirit): the job's IPC alone
  (shutter windows), next to co-runners (before and after them), and its memory bandwidth. The
  IPCs come as per-job moments with each running degradation estimate (the stream worker sends
  one per batch of blocks), not block by block: a job's latest moments replace its earlier ones.
* **Measured pairwise degradation**: Deg = 100 (T_co - T_solo) / T_solo (Seed 003 Eq. 1) of each
  job that shared its nodes with jobs of exactly one other program.

The fold is pure and order-independent: sums are exact (``ExactSum``), extremes commutative,
and a job's contribution is replaced, not added, when its estimate is revised; so the profiles
after a replay equal the live ones whatever the interleaving of the input partitions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from nodeshare.schemas.events import (
    TERMINAL_STATES,
    DegradationEstimate,
    JobEvent,
    JobState,
    LlcSample,
    NodeInventory,
    ProgramProfile,
    Record,
)

from .degradation import ExactSum, Moments
from .placement.sns import SCALE_FACTORS, classify

SOURCE = "nodeshare.streams.profiles"  # the producer named in every record: a contract, kept as first released
FEATURES = ("ipc_alone", "ipc_shared", "bandwidth_gbps")
#: Ended jobs are forgotten this long after the newest event (their co-runners have ended too).
JOB_MEMORY = timedelta(days=7)


@dataclass
class Mean:
    """A mean whose terms can be withdrawn exactly (a revised estimate replaces its term)."""

    total: ExactSum = field(default_factory=ExactSum)
    n: int = 0

    def add(self, x: float, sign: int = 1) -> None:
        self.total.add(sign * x)
        self.n += sign

    @property
    def value(self) -> float:
        return self.total.value / self.n


@dataclass
class ProgramNotes:
    runtime: dict[int, Mean] = field(default_factory=dict)  # scale factor -> solo run time (s)
    ipc_at: dict[int, Mean] = field(default_factory=dict)  # LLC ways -> IPC
    bw_at: dict[int, Mean] = field(default_factory=dict)  # LLC ways -> GB/s
    full_ways: int = 0
    features: dict[str, Moments] = field(default_factory=dict)
    next_to: dict[str, Mean] = field(default_factory=dict)  # co-runner program -> Deg (%)
    blocks: int = 0  # shutter blocks folded
    episodes: int = 0  # CAT episodes folded
    last_time: datetime | None = None
    # (episodes folded, the curves): the curves change only with an episode, and placement reads
    # them for every candidate job, scale factor and pass
    _curves: tuple[int, tuple[tuple[float, ...], tuple[float, ...]]] | None = field(default=None, repr=False,
                                                                                 compare=False)

    @property
    def samples(self) -> int:
        """Blocks, CAT episodes and ended jobs that went into the profile."""
        return self.blocks + self.episodes + sum(m.n for m in self.runtime.values())

    def touch(self, at: datetime) -> None:
        self.last_time = max(self.last_time, at) if self.last_time else at


Contribution = tuple[int | None, float, str | None, float]  # (scale, solo s, the one co-runner program, Deg %)


@dataclass
class JobNotes:
    program: str | None = None
    cores: int = 0
    nodes: tuple[str, ...] = ()
    start: datetime | None = None
    end: datetime | None = None
    ended_ok: bool = False
    estimate: DegradationEstimate | None = None  # the latest final one
    seen: set[tuple[str, str]] = field(default_factory=set)  # CAT episodes (event id) folded
    waiting: list[Record] = field(default_factory=list)  # samples that arrived before the program was known
    sampled: DegradationEstimate | None = None  # the estimate whose IPC moments are folded into the program
    contribution: Contribution | None = None


def _blocks(est: DegradationEstimate) -> int:
    return est.blocks_used + est.blocks_rejected


def _evidence(est: DegradationEstimate) -> tuple[int, int, bool, str]:
    """How much an estimate of a job has seen: more samples, then more blocks, then final, wins."""
    alone = est.features.get("ipc_alone")
    return (alone.n if alone else 0, _blocks(est), est.final, est.event_id)


def interpolate(points: dict[int, float], upto: int) -> tuple[float, ...]:
    """Values at 1..upto from the measured ones: linear between them, flat beyond the ends."""
    if not points:
        return ()
    xs = sorted(points)
    out = []
    for w in range(1, upto + 1):
        lo = max((x for x in xs if x <= w), default=xs[0])
        hi = min((x for x in xs if x >= w), default=xs[-1])
        if lo == hi:
            out.append(points[lo])
        else:
            out.append(points[lo] + (points[hi] - points[lo]) * (w - lo) / (hi - lo))
    return tuple(out)


def degradation_pct(d: float) -> float:
    """Seed 003 Eq. 1 from POPPA's D: T_solo = (1 - D) T_co, so Deg = 100 (1 / (1 - D) - 1)."""
    return 100.0 * (1.0 / (1.0 - min(d, 0.999)) - 1.0)


class ProfileBook:
    """Every program's profile, folded from lifecycle, shutter blocks, CAT episodes, node
    inventory and final degradation estimates. ``apply`` returns the programs it changed."""

    def __init__(self) -> None:
        self.programs: dict[str, ProgramNotes] = {}
        self.jobs: dict[str, JobNotes] = {}
        self.on_node: dict[str, set[str]] = {}  # node -> jobs that ran on it (and are remembered)
        self.node_cores: dict[str, int] = {}
        self.newest: datetime | None = None

    def apply(self, record: Record) -> set[str]:
        self.newest = max(self.newest, record.event_time) if self.newest else record.event_time
        if isinstance(record, NodeInventory):
            self.node_cores[record.node] = record.cores
            return self._refresh(sorted(self.on_node.get(record.node, ())))
        if isinstance(record, JobEvent):
            return self._lifecycle(record)
        changed: set[str] = set()
        if isinstance(record, LlcSample) or (isinstance(record, DegradationEstimate) and record.features):
            job = self.jobs.setdefault(record.job_id, JobNotes())
            if job.program is None:
                job.waiting.append(record)
            else:
                changed = self._sample(job, record)
        if isinstance(record, DegradationEstimate) and record.final:
            job = self.jobs.setdefault(record.job_id, JobNotes())
            if job.estimate is None or (record.event_time, record.event_id) > (job.estimate.event_time,
                                                                                job.estimate.event_id):
                job.estimate = record  # revisions: the latest wins, whatever order they came in
            changed |= self._refresh([record.job_id])
        return changed

    def _lifecycle(self, ev: JobEvent) -> set[str]:
        job = self.jobs.setdefault(ev.job_id, JobNotes())
        job.program, job.cores = ev.program, ev.cores
        job.nodes = ev.nodes or job.nodes
        for n in job.nodes:
            self.on_node.setdefault(n, set()).add(ev.job_id)
        job.start = ev.start_time or job.start
        if ev.state in TERMINAL_STATES:
            job.end = ev.end_time or ev.event_time
            job.ended_ok = ev.state is JobState.ENDED
        changed: set[str] = set()
        waiting, job.waiting = job.waiting, []
        for rec in waiting:
            changed |= self._sample(job, rec)
        # this job's facts may complete its own contribution and change its co-runners'
        changed |= self._refresh([ev.job_id, *sorted(self.neighbours(ev.job_id, job))])
        if ev.state in TERMINAL_STATES:
            self._forget_old()
        return changed

    def _sample(self, job: JobNotes, rec: Record) -> set[str]:
        assert job.program is not None
        if isinstance(rec, DegradationEstimate):
            old = job.sampled
            if old is not None and _evidence(old) >= _evidence(rec):
                return set()  # an earlier (or the same) estimate: the job's moments only grow
            notes = self.programs.setdefault(job.program, ProgramNotes())
            for name, m in sorted(rec.features.items()):
                notes.features.setdefault(name, Moments()).add_summary(m)
            if old is not None:
                for name, m in sorted(old.features.items()):
                    notes.features[name].add_summary(m, -1)
            notes.blocks += _blocks(rec) - (_blocks(old) if old is not None else 0)
            job.sampled = rec
        elif isinstance(rec, LlcSample):
            if ("llc", rec.event_id) in job.seen:
                return set()
            job.seen.add(("llc", rec.event_id))
            notes = self.programs.setdefault(job.program, ProgramNotes())
            notes.episodes += 1
            notes.ipc_at.setdefault(rec.llc_ways, Mean()).add(rec.ipc)
            notes.bw_at.setdefault(rec.llc_ways, Mean()).add(rec.bandwidth_gbps)
            notes.full_ways = max(notes.full_ways, rec.node_llc_ways)
            notes.features.setdefault("bandwidth_gbps", Moments()).add(rec.bandwidth_gbps)
        else:
            return set()
        notes.touch(rec.event_time)
        return {job.program}

    def scale_of(self, job: JobNotes) -> int | None:
        """Nodes used over the fewest nodes that hold the job's cores; None when not a profiled factor."""
        cores = [self.node_cores.get(n) for n in job.nodes]
        if not cores or any(c is None for c in cores) or job.cores < 1:
            return None
        per_node = min(c for c in cores if c is not None)
        k = len(job.nodes) / math.ceil(job.cores / per_node)
        return int(k) if k in SCALE_FACTORS else None

    def neighbours(self, job_id: str, job: JobNotes) -> set[str]:
        """The other remembered jobs that ran on any of this job's nodes, at any time."""
        return {j for n in job.nodes for j in self.on_node.get(n, ())} - {job_id}

    def co_programs(self, job_id: str, job: JobNotes) -> set[str]:
        """Programs of the other jobs that ran on any of this job's nodes while it ran."""
        out = set()
        for other_id in self.neighbours(job_id, job):
            other = self.jobs[other_id]
            if other.program is None or other.start is None:
                continue
            overlap = ((other.end is None or job.start is None or other.end > job.start)
                       and (job.end is None or other.start < job.end))
            if overlap:
                out.add(other.program)
        return out

    def _refresh(self, job_ids: Iterable[str]) -> set[str]:
        """Recompute the run-time and pair contributions of these jobs from everything known now,
        replacing what each contributed before: the end state does not depend on arrival order."""
        changed: set[str] = set()
        for job_id in dict.fromkeys(job_ids):
            job = self.jobs[job_id]
            new = self._contribution(job_id, job)
            if new == job.contribution:
                continue
            assert job.program is not None  # a contribution needs the program, and so did the old one
            notes = self.programs.setdefault(job.program, ProgramNotes())
            if job.contribution is not None:
                self._contribute(notes, job.contribution, -1)
            if new is not None:
                self._contribute(notes, new, +1)
                assert job.estimate is not None
                notes.touch(job.estimate.event_time)
            job.contribution = new
            changed.add(job.program)
        return changed

    def _contribution(self, job_id: str, job: JobNotes) -> Contribution | None:
        est = job.estimate
        if est is None or job.program is None or job.start is None or job.end is None or not job.ended_ok:
            return None  # incomplete; failed and cancelled runs say nothing about run time
        t_co = (job.end - job.start).total_seconds()
        co = self.co_programs(job_id, job)
        partner = next(iter(co)) if len(co) == 1 else None
        return self.scale_of(job), (1.0 - est.degradation) * t_co, partner, degradation_pct(est.degradation)

    @staticmethod
    def _contribute(notes: ProgramNotes, c: Contribution, sign: int) -> None:
        scale, solo, partner, deg = c
        if scale is not None and solo > 0:
            notes.runtime.setdefault(scale, Mean()).add(solo, sign)
        if partner is not None:
            notes.next_to.setdefault(partner, Mean()).add(deg, sign)

    def _forget_old(self) -> None:
        if self.newest is None:
            return
        horizon = self.newest - JOB_MEMORY
        for job_id in [j for j, n in self.jobs.items() if n.end is not None and n.end < horizon]:
            for n in self.jobs.pop(job_id).nodes:
                self.on_node[n].discard(job_id)

    def runtime_by_scale(self, program: str) -> dict[int, float]:
        notes = self.programs.get(program)
        return {k: m.value for k, m in sorted(notes.runtime.items()) if m.n > 0} if notes else {}

    def curves(self, program: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        notes = self.programs.get(program)
        if notes is None or not notes.ipc_at:
            return (), ()
        if notes._curves is None or notes._curves[0] != notes.episodes:
            ipc = {w: m.value for w, m in notes.ipc_at.items() if m.n > 0}
            bw = {w: m.value for w, m in notes.bw_at.items() if m.n > 0}
            notes._curves = (notes.episodes, (interpolate(ipc, notes.full_ways), interpolate(bw, notes.full_ways)))
        return notes._curves[1]

    def profile(self, program: str) -> ProgramProfile:
        """The program's profile record; its event id is a hash of its content, so a replay that
        reaches the same state writes the same record."""
        notes = self.programs[program]
        runtimes = self.runtime_by_scale(program)
        ipc, bw = self.curves(program)
        body = {
            "program": program,
            "program_class": classify(runtimes),
            "runtime_s_by_scale": {str(k): v for k, v in runtimes.items() if v > 0},
            "ipc_by_llc_ways": ipc,
            "bandwidth_gbps_by_llc_ways": bw,
            "features": {k: m.feature() for k, m in sorted(notes.features.items()) if m.n > 0},
            "degradation_next_to": {k: m.value for k, m in sorted(notes.next_to.items()) if m.n > 0},
            "samples": notes.samples,
        }
        digest = hashlib.sha256(repr(sorted(body.items())).encode()).hexdigest()[:32]
        assert notes.last_time is not None
        return ProgramProfile(event_id=f"profile:{program}:{digest}", source=SOURCE, event_time=notes.last_time,
                              **body)

    def pair_samples(self) -> Iterable[tuple[str, str, float, int]]:
        """Every measured (program, co-runner program, mean Deg %, jobs measured), for the pair model."""
        for program, notes in sorted(self.programs.items()):
            for other, m in sorted(notes.next_to.items()):
                if m.n > 0:
                    yield program, other, m.value, m.n
