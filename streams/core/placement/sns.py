"""Spread-n-Share (Seed 001, Section 4): choose a job's scale factor, its per-node demand in
cores, LLC ways and memory bandwidth, and the nodes it runs on.

Pure and deterministic: no clock (the caller passes ``now``), no I/O. CE (compact-exclusive)
and CS (compact-share) are the same scheduler with other settings (``Policy``):

* **CE**: scale factor 1, every node exclusive: the conventional HPC policy.
* **CS**: nodes shared by cores only; the smallest scale factor that fits now.
* **SNS**: scale factors fastest first (from the program's profile); per node ``c`` cores,
  ``w`` LLC ways (the least that keeps IPC >= alpha * F-IPC on the IPC-LLC curve) and ``b``
  memory bandwidth (the BW-LLC curve at ``w``); nodes with the lowest Co + Bo + 2 * Wo.

A job that fits nowhere is delayed; the queue is scanned oldest first and a job that has
waited ``age_limit_s`` stops the scan, so no younger job takes what it waits for (ageing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nodeshare.schemas.events import ProgramClass

from .learned import InterferenceModel

#: Seed 001 Section 5.1: the candidate scale factors of Uberun.
SCALE_FACTORS = (1, 2, 4, 8)
#: Seed 001 Section 4.3: slowdown threshold when the user gives none.
DEFAULT_ALPHA = 0.9
#: Seed 001 Section 4.2: a neutral program's run time varies within 5% over all scale factors.
NEUTRAL_BAND = 0.05
#: Seed 001 Section 4.4: beta, the weight of occupied LLC ways in a node's load (2 in Uberun).
WAYS_WEIGHT = 2.0
#: How long a job may be passed over before it blocks younger jobs (Seed 001 gives no number).
DEFAULT_AGE_LIMIT_S = 3600.0


def classify(runtime_by_scale: Mapping[int, float], band: float = NEUTRAL_BAND) -> ProgramClass:
    """Seed 001 Section 4.2: neutral when the run time varies within ``band`` of its minimum over
    the profiled scale factors; else scaling when some k > 1 beats k = 1, compact when none does.
    Unknown without the k = 1 run and at least one other."""
    if 1 not in runtime_by_scale or len(runtime_by_scale) < 2:
        return ProgramClass.UNKNOWN
    times = list(runtime_by_scale.values())
    if max(times) <= (1.0 + band) * min(times):
        return ProgramClass.NEUTRAL
    best_spread = min(t for k, t in runtime_by_scale.items() if k > 1)
    return ProgramClass.SCALING if best_spread < runtime_by_scale[1] else ProgramClass.COMPACT


def fastest_first(runtime_by_scale: Mapping[int, float], allowed: Iterable[int] = SCALE_FACTORS) -> list[int]:
    """Profiled scale factors by run time, fastest first (ties: the smaller factor); scale 1
    alone when nothing is profiled yet (the first run is the CE run, Seed 001 Section 4.2)."""
    known = [k for k in allowed if k in runtime_by_scale]
    return sorted(known, key=lambda k: (runtime_by_scale[k], k)) or [1]


def sns_scales(runtime_by_scale: Mapping[int, float]) -> list[int]:
    """The scale factors SNS tries, in order (Seed 001 Sections 4.4 and 6.1): fastest first, except
    for a neutral program, which gains nothing from spreading and is spread only "passively", to
    use residual cores: smallest first."""
    if classify(runtime_by_scale) is ProgramClass.NEUTRAL:
        return [k for k in SCALE_FACTORS if k in runtime_by_scale]
    return fastest_first(runtime_by_scale)


def spread(procs: int, cores_per_node: int, scale: int) -> tuple[int, int]:
    """Seed 001 Section 4.3: ``n = k * ceil(P / T)`` nodes and ``c = ceil(P / n)`` cores on each."""
    if procs < 1 or cores_per_node < 1 or scale < 1:
        raise ValueError("processes, cores per node and scale factor must be positive")
    n = scale * math.ceil(procs / cores_per_node)
    return n, math.ceil(procs / n)


@dataclass(frozen=True)
class Layout:
    """A way to lay a job out: ``scale`` (k), ``nodes`` (n) and ``cores`` per node (c). ``asked``:
    the count the job asked for nearest compact, its own baseline, which the alpha check does not
    charge for spreading (the job chose it)."""

    scale: int
    nodes: int
    cores: int
    asked: bool = False


def layouts(procs: int, cores_per_node: int, scales: Iterable[int], min_nodes: int = 1,
            max_nodes: int | None = None, cluster_nodes: int | None = None) -> list[Layout]:
    """The layouts to try, in the order of ``scales``: ``spread``'s for each scale factor, on no more
    nodes than the ``cluster_nodes`` there are. A job that
    asked for a node count (``min_nodes`` above 1 or a ``max_nodes``: Slurm's ``-N min[-max]``) keeps
    to it, and to at most one node per process and the ``cluster_nodes`` there are: the scale
    factors whose n falls in that range, then the count in it nearest compact (``ceil(P / T)``),
    ``asked``, so a job whose scale factors all miss or cannot be placed still has one (``-N 5-8 -n
    8`` on 6 nodes: 5 nodes; ``-N 1 -n 32`` where the smallest node has 16 cores: 1 node of 32 cores,
    which only a bigger node holds). Its scale factor counts from ``ceil(P / T)`` nodes, as the
    profiles do (``profiles.scale_of``); the nearest count's is n // ceil(P / T), at least 1. A job
    that asked for no count is Seed 001's: every scale factor, unchanged."""
    plain = [x for x in (Layout(k, *spread(procs, cores_per_node, k)) for k in scales)
             if cluster_nodes is None or x.nodes <= cluster_nodes]
    if min_nodes <= 1 and max_nodes is None:
        return plain
    upper = min([procs, *(x for x in (max_nodes, cluster_nodes) if x is not None)])
    if min_nodes > upper:
        return []  # no count it asked for exists here (Slurm would not start it either)
    compact = math.ceil(procs / cores_per_node)
    n = min(max(compact, min_nodes), upper)
    return [x for x in plain if min_nodes <= x.nodes <= upper] + \
        [Layout(max(1, n // compact), n, math.ceil(procs / n), asked=True)]


@dataclass(frozen=True)
class LlcDemand:
    ways: int  # LLC ways the job's processes on one node need
    bandwidth_gbps: float  # memory bandwidth they use at those ways
    ipc_share: float  # IPC at those ways / IPC at full ways (>= alpha)


def llc_demand(ipc_by_ways: Sequence[float], bw_by_ways: Sequence[float], alpha: float) -> LlcDemand:
    """Seed 001 Fig. 10: T-IPC = alpha * F-IPC (F-IPC: the IPC at the curve's last point, every
    way); ``w`` is the fewest ways whose IPC reaches T-IPC; ``b`` the BW-LLC curve at ``w``.
    Curves are sampled at 1, 2, ... ways."""
    if not ipc_by_ways or len(ipc_by_ways) != len(bw_by_ways):
        raise ValueError("IPC-LLC and BW-LLC curves need the same, non-zero number of points")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be within (0, 1], got {alpha}")
    full = ipc_by_ways[-1]
    for i, ipc in enumerate(ipc_by_ways):
        if ipc >= alpha * full:
            return LlcDemand(i + 1, float(bw_by_ways[i]), float(ipc / full) if full > 0 else 1.0)
    raise AssertionError("unreachable: the last point always reaches alpha * itself")


class JobProfile(Protocol):
    """What placement needs to know about a job's program."""

    def runtime_by_scale(self) -> Mapping[int, float]:
        """Exclusive run time per scale factor (any unit; only ratios matter)."""
        ...

    def demand(self, cores_per_node: int, alpha: float) -> LlcDemand | None:
        """Per-node LLC ways and bandwidth of ``cores_per_node`` processes at slowdown ``alpha``;
        None when the program has no IPC-LLC curve yet."""
        ...


@dataclass(frozen=True)
class Policy:
    name: str
    share_nodes: bool  # False: a node runs one job (CE)
    resource_aware: bool  # check LLC ways and bandwidth as well as cores (SNS)
    scales: Callable[[Mapping[int, float]], list[int]]  # scale factors to try, in order
    learned: bool = False  # admission and scale by the measured interference model (placement.learned)


CE = Policy("CE", share_nodes=False, resource_aware=False, scales=lambda _profile: [1])
CS = Policy("CS", share_nodes=True, resource_aware=False, scales=lambda _profile: list(SCALE_FACTORS))
SNS = Policy("SNS", share_nodes=True, resource_aware=True, scales=sns_scales)
#: Issue 37: shares by cores like CS; admission and scale from what the pipeline measured.
def smallest_first(_runtime_by_scale: Mapping[int, float]) -> list[int]:
    """CS's order: every scale factor, the smallest first (the first that fits now is taken)."""
    return list(SCALE_FACTORS)


LEARNED = Policy("learned", share_nodes=True, resource_aware=False, scales=smallest_first, learned=True)
POLICIES = {p.name: p for p in (CE, CS, SNS, LEARNED)}


@dataclass(frozen=True)
class NodeCapacity:
    cores: int
    llc_ways: int
    bandwidth_gbps: float
    usable: bool = True  # False: the resource manager runs no new job there (down, drained, ...)


@dataclass
class NodeLoad:
    """What is allocated on a node: cores, ways and bandwidth by job. Change it through ``hold``
    and ``free``: the totals are kept, not summed again for every candidate job."""

    capacity: NodeCapacity
    jobs: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # job -> (cores, ways, bandwidth)
    _used: tuple[int, int, float] | None = field(default=None, repr=False, compare=False)

    def used(self) -> tuple[int, int, float]:
        if self._used is None:
            self._used = (sum(j[0] for j in self.jobs.values()), sum(j[1] for j in self.jobs.values()),
                          sum(j[2] for j in self.jobs.values()))
        return self._used

    def hold(self, job_id: str, cores: int, ways: int, bandwidth: float) -> None:
        self.jobs[job_id] = (cores, ways, bandwidth)
        self._used = None

    def free(self, job_id: str) -> None:
        if self.jobs.pop(job_id, None) is not None:
            self._used = None

    def score(self, beta: float = WAYS_WEIGHT) -> float:
        """Seed 001 Section 4.4: Co + Bo + beta * Wo, the occupied shares of cores, bandwidth, ways."""
        c, w, b = self.used()
        cap = self.capacity
        return c / cap.cores + b / cap.bandwidth_gbps + beta * w / cap.llc_ways

    def fits(self, cores: int, ways: int, bandwidth: float, policy: Policy) -> bool:
        if not self.capacity.usable:
            return False
        if not policy.share_nodes:  # CE: a node runs one job
            return not self.jobs and cores <= self.capacity.cores
        c, w, b = self.used()
        if c + cores > self.capacity.cores:
            return False
        if policy.resource_aware:
            return w + ways <= self.capacity.llc_ways and b + bandwidth <= self.capacity.bandwidth_gbps + 1e-9
        return True


@dataclass(frozen=True)
class Placement:
    """A job's allocation: its scale factor, nodes and per-node demand, and the slowdown the
    profile predicts against its CE run (scale factor's run time ratio / IPC share kept). When the
    scheduler chose it: the chosen nodes' scores and the jobs already on them, before this one."""

    scale: int
    nodes: tuple[str, ...]
    cores_per_node: int
    ways: int | None
    bandwidth_gbps: float | None
    predicted_slowdown: float | None
    node_scores: tuple[float, ...] = ()
    co_jobs: tuple[str, ...] = ()


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    procs: int
    alpha: float
    submitted: float  # event time, seconds
    profile: JobProfile
    program: str | None = None  # the program's name, for what was measured of it (the learned policy)
    min_nodes: int = 1  # the fewest nodes it asked for (JobEvent.nodes_requested); a snapshot's older job: 1
    max_nodes: int | None = None  # the most (JobEvent.nodes_max; None: no bound)


@dataclass(frozen=True)
class Decision:
    job: PendingJob
    placement: Placement | None  # None: delayed
    reason: str
    refused: bool = False  # delayed because the veto refused where it would have gone
    partner: str | None = None  # placed together with this job (Seed 003 pairing)


def choose_nodes(loads: Mapping[str, NodeLoad], n: int, cores: int, ways: int, bandwidth: float,
                 policy: Policy) -> tuple[str, ...] | None:
    """Seed 001 Section 4.4: nodes grouped by idle cores; within the fullest group that can hold
    the job (best fit keeps big holes for big jobs), the ``n`` idlest by Co + Bo + 2 Wo; if no
    single group can, the ``n`` idlest of the whole cluster; None when fewer than ``n`` fit."""
    fit = [name for name, load in loads.items() if load.fits(cores, ways, bandwidth, policy)]
    if len(fit) < n:
        return None
    groups: dict[int, list[str]] = {}
    for name in fit:
        loads_c = loads[name]
        groups.setdefault(loads_c.capacity.cores - loads_c.used()[0], []).append(name)
    for _idle, names in sorted(groups.items()):
        if len(names) >= n:
            return tuple(sorted(names, key=lambda m: (loads[m].score(), m))[:n])
    return tuple(sorted(fit, key=lambda m: (loads[m].score(), m))[:n])


class Scheduler:
    """One policy over one cluster: a queue of pending jobs and the allocation of every node."""

    def __init__(self, nodes: Mapping[str, NodeCapacity], policy: Policy = SNS,
                 age_limit_s: float = DEFAULT_AGE_LIMIT_S,
                 veto: Callable[[PendingJob, Placement], str | None] | None = None,
                 model: InterferenceModel | None = None) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        self.loads = {name: NodeLoad(cap) for name, cap in sorted(nodes.items())}
        self.policy = policy
        self.age_limit_s = age_limit_s
        self.veto = veto  # a reason not to run the job there (e.g. a pair predicted too slow), or None
        self.queue: dict[str, PendingJob] = {}  # insertion order = submission order
        self.delayed: set[str] = set()  # queued jobs whose delay was already reported
        self.model = model  # the learned policy's measured interference (None: nothing measured yet)
        self.program_of: dict[str, str] = {}  # placed job -> its program, for the learned policy
        self._sizes()

    def _sizes(self) -> None:
        """The smallest usable node's size (of every node when none is usable): processes are
        spread over nodes of this many cores."""
        caps = [x.capacity for x in self.loads.values() if x.capacity.usable] or \
            [x.capacity for x in self.loads.values()]
        self.smallest = NodeCapacity(min(c.cores for c in caps), min(c.llc_ways for c in caps),
                                     min(c.bandwidth_gbps for c in caps))

    def add_node(self, name: str, capacity: NodeCapacity) -> None:
        load = self.loads.get(name)
        self.loads[name] = NodeLoad(capacity, dict(load.jobs) if load else {})
        self._sizes()

    def submit(self, job: PendingJob) -> None:
        self.queue.setdefault(job.job_id, job)

    def withdraw(self, job_id: str) -> None:
        """Take a job off the queue (placed, started elsewhere, or cancelled)."""
        self.queue.pop(job_id, None)
        self.delayed.discard(job_id)

    def place_for(self, job: PendingJob, now: float | None = None) -> tuple[Placement | None, str | None]:
        """The first scale factor, in the policy's order, whose nodes are free now; else None and
        the veto's reason when it refused a candidate."""
        if self.policy.learned:
            return self._place_learned(job, aged=now is not None and now - job.submitted >= self.age_limit_s)
        runtimes = job.profile.runtime_by_scale()
        base = runtimes.get(1)
        refused = None
        for lay in layouts(job.procs, self.smallest.cores, self.policy.scales(runtimes), job.min_nodes,
                           job.max_nodes, len(self.loads)):
            k, n, c = lay.scale, lay.nodes, lay.cores
            llc = None
            if self.policy.resource_aware:
                # alpha bounds the slowdown against the CE run (Seed 001 Section 4.3), and a scale
                # factor already changes the run time by T_k / T_1: only the rest may go to sharing
                # (not for the count the job asked for: its own baseline).
                share = job.alpha * (runtimes[k] / base if base and k in runtimes and not lay.asked else 1.0)
                if share > 1.0:
                    continue  # spreading alone already costs more than alpha allows
                llc = self._demand(job, c, share)
            ways, bw = (llc.ways, llc.bandwidth_gbps) if llc else (0, 0.0)
            nodes = choose_nodes(self.loads, n, c, ways, bw, self.policy)
            if nodes is None:
                continue
            placement = self._placement(runtimes, k, nodes, c, llc)
            why = self.veto(job, placement) if self.veto else None
            if why is None:
                return placement, None
            refused = why
        return None, refused

    def _place_learned(self, job: PendingJob, aged: bool = False) -> tuple[Placement | None, str | None]:
        """The learned policy (placement.learned): CS's sharing by cores, the smallest scale factor
        that fits now, on nodes where the measured slowdown next to the co-runners (for the job,
        with the scale factor's run-time ratio, and for each of them) keeps within 1/alpha; an
        ``aged`` job (waited the age limit, so it blocks younger ones) takes any node with room."""
        model = self.model if self.model is not None else InterferenceModel()
        runtimes = job.profile.runtime_by_scale()
        base = runtimes.get(1)
        limit = -math.log(job.alpha)
        refused = None
        # CS's order, the smallest scale that fits now (see placement.learned)
        for lay in layouts(job.procs, self.smallest.cores, SCALE_FACTORS, job.min_nodes, job.max_nodes,
                           len(self.loads)):
            k, n, c = lay.scale, lay.nodes, lay.cores
            ratio = runtimes[k] / base if base and k in runtimes and not lay.asked else 1.0
            cand = []
            for name, load in self.loads.items():
                if not load.fits(c, 0, 0.0, self.policy):
                    continue
                co = [self.program_of.get(j) for j in load.jobs]
                mean, _upper = model.predict(job.program, co)
                own = math.log(ratio) + mean
                if not aged and (own > limit or any(model.predict(q, [job.program])[0] > limit for q in co)):
                    if co:
                        refused = "measured slowdown next to the co-runners beyond 1/alpha"
                    continue
                idle = load.capacity.cores - load.used()[0] - c
                cand.append((idle, round(mean, 2), load.score(), name, own))  # best fit, then least measured slowdown
            if len(cand) < n:
                continue
            chosen = sorted(cand)[:n]
            nodes = tuple(x[3] for x in chosen)
            placement = self._placement(runtimes, k, nodes, c, None)
            placement = Placement(placement.scale, placement.nodes, c, None, None,
                                  math.exp(max(x[4] for x in chosen)), placement.node_scores, placement.co_jobs)
            return placement, None
        return None, refused

    def _placement(self, runtimes: Mapping[int, float], k: int, nodes: tuple[str, ...], cores: int,
                   llc: LlcDemand | None, partner: str | None = None) -> Placement:
        """The placement on ``nodes`` as chosen now: the slowdown its profile predicts against the
        CE run (T_k / T_1 over the IPC share kept), the nodes' scores and the jobs already there
        (and the partner it starts with)."""
        base = runtimes.get(1)
        slowdown = runtimes[k] / base / (llc.ipc_share if llc else 1.0) if base and k in runtimes else None
        co = {j for m in nodes for j in self.loads[m].jobs} | ({partner} if partner else set())
        return Placement(k, nodes, cores, llc.ways if llc else None, llc.bandwidth_gbps if llc else None, slowdown,
                         tuple(self.loads[m].score() for m in nodes), tuple(sorted(co)))

    def _demand(self, job: PendingJob, cores: int, share: float) -> LlcDemand | None:
        """The profile's per-node demand, capped at the smallest node: what a job uses alone is at
        most what a node has, so alone it always fits."""
        llc = job.profile.demand(cores, share)
        if llc is None:
            return None
        return LlcDemand(min(llc.ways, self.smallest.llc_ways), min(llc.bandwidth_gbps, self.smallest.bandwidth_gbps),
                         llc.ipc_share)

    def place_pair(self, a: PendingJob, b: PendingJob) -> tuple[Placement, Placement] | None:
        """Seed 003: two jobs started together on one node, each at scale factor 1 with its
        alpha's LLC demand under SNS; the node the policy's choice picks for both, or None when
        no node holds the pair now (or the policy does not share nodes)."""
        if not self.policy.share_nodes or a.procs + b.procs > self.smallest.cores:
            return None
        llc = [self._demand(j, j.procs, j.alpha) if self.policy.resource_aware else None for j in (a, b)]
        ways = sum(x.ways for x in llc if x)
        bw = sum(x.bandwidth_gbps for x in llc if x)
        nodes = choose_nodes(self.loads, 1, a.procs + b.procs, ways, bw, self.policy)
        if nodes is None:
            return None
        return (self._placement(a.profile.runtime_by_scale(), 1, nodes, a.procs, llc[0], b.job_id),
                self._placement(b.profile.runtime_by_scale(), 1, nodes, b.procs, llc[1], a.job_id))

    def allocate(self, job_id: str, placement: Placement) -> None:
        queued = self.queue.get(job_id)
        if queued is not None and queued.program is not None:
            self.program_of[job_id] = queued.program
        for name in placement.nodes:
            self.loads[name].hold(job_id, placement.cores_per_node, placement.ways or 0,
                                  placement.bandwidth_gbps or 0.0)

    def release(self, job_id: str) -> None:
        """A job ended: free what it held (it may hold nothing, e.g. placed by someone else)."""
        for load in self.loads.values():
            load.free(job_id)
        self.program_of.pop(job_id, None)

    def nodes_of(self, job_id: str) -> set[str]:
        """The nodes a job is booked on."""
        return {name for name, load in self.loads.items() if job_id in load.jobs}

    def schedule(self, now: float) -> list[Decision]:
        """Place what fits, oldest first. A job that does not fit is delayed; one older than the
        age limit stops the scan. Delays are reported once per job."""
        out: list[Decision] = []
        for job in list(self.queue.values()):
            placement, refused = self.place_for(job, now)
            if placement is not None:
                self.allocate(job.job_id, placement)
                self.withdraw(job.job_id)
                out.append(Decision(job, placement, f"{self.policy.name}: scale {placement.scale}"))
                continue
            if job.job_id not in self.delayed:
                self.delayed.add(job.job_id)
                why = refused or "no scale factor fits now"
                out.append(Decision(job, None, f"{self.policy.name}: {why}", refused=refused is not None))
            if now - job.submitted >= self.age_limit_s:
                break  # aged out: younger jobs wait behind it
        return out
