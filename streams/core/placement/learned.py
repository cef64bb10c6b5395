"""What placement learns from the pipeline's own measurements (issue 37).

The ``learned`` policy (``placement.sns.LEARNED``) shares nodes by cores, as compact sharing
does, and books no contention of its own: its prior prediction for a job next to co-runners
is "no slowdown", the same as CS's and, at SNS's booked ways, what SNS expects. What it
corrects that prediction with is what the fold measured: every ended job's final
``DegradationEstimate`` (POPPA's D: its IPC next to co-runners against its IPC while they
were paused) and the lifecycle saying which programs ran on its nodes while it ran.

``InterferenceModel`` folds exactly those two record types (nothing else is accepted; no
ground truth has a way in) into a residual model of the log slowdown ``-ln(1 - D)`` per
ordered program pair, with a shrinkage prior (Paragon's spirit, from a few measurements):

    global   g   = sum / (n + K0)                    (toward 0: no measured contention)
    program  m_p = (sum_p + K0 g) / (n_p + K0)
    pair     m_pq = (sum_pq + K0 m_p) / (n_pq + K0)

and its uncertainty, the residuals' spread over sqrt(n_pq + K0) (``predict`` gives both). Where
little is measured the policy does what carries least risk, compact sharing: the shrunk mean is
near the prior, so nothing is refused. A node is refused when the shrunk mean (with the scale
factor's run-time ratio from the profile) exceeds ln(1/alpha) for the job or for a co-runner next
to it; a program measured slowed beyond 1/alpha next to everything waits for nodes of its own
(exclusive). A job refused that way waits at most the age limit: past it (when, as in
Spread-n-Share, it would block every younger job) it takes the best-fitting node with room, the
least measured slowdown first among equals. The scale factor is CS's, the smallest that fits
now: trying the fastest first once a program was measured (SNS's order) cost 23-43% of
throughput against CE in testbed
sequences (seed 7), because a spread job takes the cores other jobs wait for, a cost D (the
job's own slowdown) does not measure.

Pure and order-independent within a job (a job is learned once, when both its final estimate
and its end are known).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeshare.schemas.events import TERMINAL_STATES, DegradationEstimate, JobEvent, JobState, Record

#: Prior strength of the shrinkage: a pair measured K0 times weighs as much as its program's mean.
K0 = 2.0
#: Standard errors added to the shrunk mean before admission (the uncertainty's weight).
Z = 1.0
#: D above this is read as this: a measured slowdown of 20x is as good as any larger one.
MAX_D = 0.95


@dataclass
class _Stat:
    n: int = 0
    s: float = 0.0
    ss: float = 0.0

    def add(self, y: float) -> None:
        self.n += 1
        self.s += y
        self.ss += y * y


@dataclass
class _Job:
    program: str | None = None
    nodes: tuple[str, ...] = ()
    start: float | None = None
    end: float | None = None
    ok: bool = False
    degradation: float | None = None


@dataclass
class InterferenceModel:
    """Measured slowdown per program pair with a shrinkage prior, folded from the pipeline's records."""

    k0: float = K0
    z: float = Z
    jobs: dict[str, _Job] = field(default_factory=dict)
    on_node: dict[str, set[str]] = field(default_factory=dict)
    learned: set[str] = field(default_factory=set)
    total: _Stat = field(default_factory=_Stat)
    by_program: dict[str, _Stat] = field(default_factory=dict)
    by_pair: dict[tuple[str, str], _Stat] = field(default_factory=dict)

    def apply(self, record: Record) -> None:
        """Fold one record of the pipeline: a lifecycle event or a degradation estimate (the
        fold's output). Anything else is refused: the model sees only what the pipeline measured."""
        if isinstance(record, JobEvent):
            job = self.jobs.setdefault(record.job_id, _Job())
            job.program = record.program
            job.nodes = record.nodes or job.nodes
            for n in job.nodes:
                self.on_node.setdefault(n, set()).add(record.job_id)
            if record.start_time is not None:
                job.start = record.start_time.timestamp()
            if record.state in TERMINAL_STATES:
                job.end = (record.end_time or record.event_time).timestamp()
                job.ok = record.state is JobState.ENDED
        elif isinstance(record, DegradationEstimate):
            if not record.final:
                return
            self.jobs.setdefault(record.job_id, _Job()).degradation = record.degradation
        else:
            raise TypeError("the interference model learns from lifecycle and estimates only, "
                            f"not {type(record).__name__}")
        self._learn(record.job_id)

    def _learn(self, job_id: str) -> None:
        job = self.jobs[job_id]
        if job_id in self.learned or job.degradation is None or job.end is None or not job.ok \
                or job.program is None or job.start is None:
            return
        self.learned.add(job_id)
        y = -math.log(1.0 - min(max(job.degradation, 0.0), MAX_D))
        co = self.co_programs(job_id)
        self.total.add(y)
        self.by_program.setdefault(job.program, _Stat()).add(y)
        for q in co:
            self.by_pair.setdefault((job.program, q), _Stat()).add(y)

    def co_programs(self, job_id: str) -> set[str]:
        """Programs of the jobs that ran on this job's nodes while it ran."""
        job = self.jobs[job_id]
        out = set()
        for other_id in {j for n in job.nodes for j in self.on_node.get(n, ())} - {job_id}:
            o = self.jobs[other_id]
            if o.program is None or o.start is None or job.start is None:
                continue
            if (o.end is None or o.end > job.start) and (job.end is None or o.start < job.end):
                out.add(o.program)
        return out

    @property
    def measured_jobs(self) -> int:
        """How many measured jobs the model has learned from."""
        return len(self.learned)

    def evidence(self, program: str | None) -> int:
        s = self.by_program.get(program) if program else None
        return s.n if s else 0

    def _sd(self) -> float:
        t = self.total
        if t.n < 2:
            return 0.0
        return math.sqrt(max(0.0, (t.ss - t.s * t.s / t.n) / (t.n - 1)))

    def predict(self, program: str | None, co: Iterable[str | None]) -> tuple[float, float]:
        """The log slowdown of ``program`` next to the programs ``co`` (the worst of them; 0 alone):
        the shrunk mean and its upper bound (mean + Z standard errors). Unknown programs fall back
        to the global mean, unmeasured pairs to their program's."""
        co = list(co)
        if not co:
            return 0.0, 0.0
        g = self.total.s / (self.total.n + self.k0)
        p = self.by_program.get(program) if program else None
        m_p = (p.s + self.k0 * g) / (p.n + self.k0) if p else g
        sd = self._sd()
        mean = upper = 0.0
        for q in co:
            pq = self.by_pair.get((program, q)) if program and q else None
            n, s = (pq.n, pq.s) if pq else (0, 0.0)
            m = (s + self.k0 * m_p) / (n + self.k0)
            mean, upper = max(mean, m), max(upper, m + self.z * sd / math.sqrt(n + self.k0))
        return mean, upper
