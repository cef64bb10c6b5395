"""PPartition (Seed 004, Section 6): the machine's power budget split across jobs as they start.

A dispatched job asks for n processors. When the machine's unused power covers its proportional
share n/Nmax * Pm/c, PTune tunes it under that share. Otherwise power is repartitioned (Fig. 10):
the job's fair share is Pm/c * n / (n + N_alloc) (Eq. 5), re-computed with n = n_opt until n stops
shrinking; the unused power is taken first and the rest is stolen from running jobs in proportion
to their budgets, each re-tuned on the same processors (moldable, not malleable). When too little
power can be found the job is deferred and nothing changes.

Beyond the paper, two rules a running system needs, both policies (``PowerPolicy``):

- ``min_share``: a job runs on at least ceil(min_share * n) processors (PTune searches n from there)
  or is deferred; the paper leaves open how far the fixed-point loop may shrink a job.
- ``release``: when a job ends, deferred jobs are retried first (oldest first); what is still unused
  then goes back to the running jobs in proportion to their budgets, each up to what its processors
  can draw, and they are re-tuned (``proportional``); or it stays unused for the next jobs (``pool``).

- ``admit``: ``fair`` starts every job that gets its fair share (the paper); ``throughput`` also defers
  a job whose predicted IPS is less than what the power stolen for it costs the running jobs.
- ``margin``: PTune keeps uniform power on the requested processors unless its own plan is predicted
  to be this fraction better; the characterization is measured, and a smaller predicted gain can be
  a loss in truth.

A job's budget is what PTune actually assigns (the sum of its caps): power its processors cannot
draw is not hoarded. Every function here is pure over ``Machine``; the stream shell only moves
events in and decisions out.

A job the resource manager has already placed (``JobRequest.per_node``: the stream dispatches a job
at its ``started`` event, on its real nodes) is not the paper's job: it occupies all its processors
whatever PTune would prefer, so every one of them is capped (n is fixed), power is stolen from
running jobs down to their min power when that is what it takes, and it is deferred (uncapped, said
why, retried at each release) when its processors are unknown or all held already; when even
that cannot find its processors' min power it is suspended (a power-gated start: ``suspend``, the
Slurm adapter suspends it until its ``start``): uncapped, it would take the machine over its
budget. Inventory changes are reconciled (``set_node``, ``refit``): a processor a running job holds keeps its limits
until the job ends, and caps are re-fitted into changed limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .curves import MIN_CAP_MW, Characterization, Curve, ProcessorId, curves_for
from .ptune import by_efficiency, distribute_power, ptune


@dataclass(frozen=True)
class PowerPolicy:
    release: Literal["proportional", "pool"] = "proportional"
    min_share: float = 0.5
    admit: Literal["fair", "throughput"] = "fair"  # throughput: defer a job that lowers the machine's IPS
    margin: float = 0.01  # PTune keeps uniform power unless it predicts this much more IPS

    def __post_init__(self) -> None:
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError("min_share: must be in (0, 1]")


@dataclass(frozen=True)
class JobRequest:
    job_id: str
    program: str
    n_req: int  # processors requested
    nodes: tuple[str, ...] = ()  # where the resource manager put it; empty: anywhere
    trigger: str = ""  # the event that dispatched it
    #: placed by the resource manager: (node, processors it occupies there); None: the power manager
    #: chooses its processors anywhere (the paper's setting, the experiments)
    per_node: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class Plan:
    """One job's power plan as decided: its processors and caps (their sum is its budget), and
    predicted IPS."""

    job_id: str
    processors: tuple[ProcessorId, ...]
    caps_mw: tuple[int, ...]
    ips: float

    @property
    def budget_mw(self) -> int:
        return sum(self.caps_mw)


@dataclass(frozen=True)
class RunningJob(Plan):
    """A running job: its current plan and the request it came from."""

    request: JobRequest


@dataclass(frozen=True)
class Outcome:
    """What one dispatch or release decided, with the inputs that justify it."""

    action: Literal["start", "defer", "release", "retune", "suspend"]
    request: JobRequest
    plan: Plan | None
    updates: tuple[Plan, ...]  # running jobs whose caps changed
    reason: str
    fair_share_mw: int = 0
    unused_before_mw: int = 0
    n_lo: int = 0
    n_hi: int = 0
    candidates: int = 0
    characterized: int = 0
    stolen_mw: tuple[tuple[str, int], ...] = ()
    resumes: bool = False  # a start of a job a suspend gated


@dataclass
class Machine:
    """The power manager's state: processors, characterization, running and deferred jobs."""

    budget_mw: int
    policy: PowerPolicy = field(default_factory=PowerPolicy)
    limits: dict[ProcessorId, tuple[int, int]] = field(default_factory=dict)  # (min, max) mW from inventory
    char: Characterization = field(default_factory=Characterization)
    running: dict[str, RunningJob] = field(default_factory=dict)  # in start order
    deferred: list[JobRequest] = field(default_factory=list)  # oldest first
    #: processors gone from the inventory that a running job still holds (offered to no new job;
    #: forgotten when the job ends)
    retired: set[ProcessorId] = field(default_factory=set)
    budget_from_limits: bool = False  # the budget is the sum of the known processors' max power
    gated: set[str] = field(default_factory=set)  # deferred jobs told to suspend (a power-gated start)

    @property
    def allocated_mw(self) -> int:
        return sum(j.budget_mw for j in self.running.values())

    @property
    def unused_mw(self) -> int:
        return self.budget_mw - self.allocated_mw

    @property
    def n_max(self) -> int:
        return len(self.limits)

    @property
    def n_alloc(self) -> int:
        return sum(len(j.processors) for j in self.running.values())

    def owner(self) -> dict[ProcessorId, str]:
        return {p: job_id for job_id, j in self.running.items() for p in j.processors}

    def curves(self, program: str, processors: Sequence[ProcessorId]) -> list[Curve]:
        return curves_for(self.char, program, processors, self.limits)


def _retune(machine: Machine, job: RunningJob, budget_mw: int) -> RunningJob:
    caps, ips = distribute_power(machine.curves(job.request.program, job.processors), budget_mw)
    return replace(job, caps_mw=caps, ips=ips)


def _plan(job_id: str, job: RunningJob) -> Plan:
    return Plan(job_id, job.processors, job.caps_mw, job.ips)  # without the request: what a decision says


def _min_n(policy: PowerPolicy, n_req: int) -> int:
    return max(1, math.ceil(policy.min_share * n_req - 1e-9))


def _floor(machine: Machine, job: RunningJob) -> int:
    return sum(c.min_mw for c in machine.curves(job.request.program, job.processors))


def _steal(machine: Machine, want: int, exhaust: bool) -> dict[str, int]:
    """Power taken from running jobs: ``want`` in proportion to their budgets, none below its min
    power; with ``exhaust``, what that leaves short is then taken from any job above its min power."""
    stolen: dict[str, int] = {}
    total_budgets = machine.allocated_mw
    floors: dict[str, int] = {}
    for job_id, job in machine.running.items():
        if want == 0 or total_budgets == 0:
            break
        floors[job_id] = _floor(machine, job)
        got = min(want * job.budget_mw // total_budgets, job.budget_mw - floors[job_id])
        if got > 0:
            stolen[job_id] = got
    short = want - sum(stolen.values())
    for job_id, job in machine.running.items():
        if not exhaust or short <= 0:
            break
        floor = floors[job_id] if job_id in floors else _floor(machine, job)
        more = min(short, job.budget_mw - floor - stolen.get(job_id, 0))
        if more > 0:
            stolen[job_id] = stolen.get(job_id, 0) + more
            short -= more
    return stolen


def _occupied(machine: Machine, req: JobRequest, owner: Mapping[ProcessorId, str]) -> tuple[list[ProcessorId], str]:
    """A placed job's processors: on each of its nodes, the first free ones it occupies; and why
    it has none when so."""
    out: list[ProcessorId] = []
    unknown, held = [], []
    for node, k in req.per_node or ():
        on_node = sorted(p for p in machine.limits if p[0] == node and p not in machine.retired)
        if not on_node:
            unknown.append(node)
            continue
        free = [p for p in on_node if p not in owner][:k]
        if len(free) < k:
            held.append(node)
        out += free
    if out:
        return out, ""
    if unknown:
        return out, (f"no processor known on {', '.join(unknown)}: cluster.inventory lists none (the site must "
                     f"publish each package's min and max watts); the job runs uncapped")
    return out, f"its processors on {', '.join(held)} are held by running jobs: it runs under their caps"


def dispatch(machine: Machine, req: JobRequest) -> Outcome:
    """PPartition for one dispatched job: start it (possibly shrinking running jobs) or defer it.
    Mutates ``machine`` only when the job starts."""
    owner = machine.owner()
    unused = machine.unused_mw
    placed = req.per_node is not None
    if placed:  # every processor it occupies is capped: n is fixed
        free, why = _occupied(machine, req, owner)
        if not free:
            return Outcome("defer", req, None, (), why, unused_before_mw=unused)
        need_n = len(free)
    else:
        free = [p for p in machine.limits
                if p not in owner and p not in machine.retired and (not req.nodes or p[0] in req.nodes)]
        need_n = _min_n(machine.policy, req.n_req)
        if len(free) < need_n:
            return Outcome("defer", req, None, (), f"{len(free)} free processors, at least {need_n} needed",
                           unused_before_mw=unused, candidates=len(free))
    ordered = by_efficiency(machine.curves(req.program, free))[: len(free) if placed else req.n_req]
    # with the inventory max, as ``curves`` asks: a curve is cached by its bounds, and another max rebuilt it
    characterized = sum(1 for c in ordered
                        if machine.char.curve(req.program, c.processor, c.min_mw, machine.limits[c.processor][1])
                        is not None)
    n = len(ordered)
    # The proportional share, raised to what the fewest allowed processors need at min power.
    share = max(machine.budget_mw * n // max(machine.n_max, 1), sum(c.min_mw for c in ordered[:need_n]))
    stolen: dict[str, int] = {}
    shrunk: dict[str, RunningJob] = {}
    if unused >= share:
        tuning = ptune(share, n, ordered, machine.policy.margin, need_n)
        reason = "unused power covers the proportional share n/Nmax * Pm/c"
    else:
        share = machine.budget_mw * n // (n + machine.n_alloc)  # Eq. 5
        if placed:  # its processors run whatever: at least their min power
            share = max(share, sum(c.min_mw for c in ordered))
        tuning = ptune(share, n, ordered, machine.policy.margin, need_n)
        while need_n <= tuning.n_opt < n:  # Fig. 10: to a fixed point of n
            n = tuning.n_opt
            share = machine.budget_mw * n // (n + machine.n_alloc)
            tuning = ptune(share, n, ordered, machine.policy.margin, need_n)
        stolen = _steal(machine, max(0, share - unused), exhaust=placed)
        shrunk = {j: _retune(machine, machine.running[j], machine.running[j].budget_mw - s) for j, s in stolen.items()}
        found = min(share, unused + sum(stolen.values()))
        if found < share:
            share = found
            tuning = ptune(share, n, ordered, machine.policy.margin, need_n)
        reason = "repartitioned: fair share Pm/c * n / (n + N_alloc), stolen in proportion to budgets"
    inputs = Outcome("defer", req, None, (), "", fair_share_mw=share, unused_before_mw=unused, n_lo=tuning.n_lo,
                     n_hi=tuning.n_hi, candidates=len(free), characterized=characterized)
    if tuning.n_opt < need_n and placed:  # power-gated: it may not run on processors the budget cannot hold
        return replace(inputs, action="suspend",
                       reason=f"over budget: its {need_n} processors need "
                              f"{sum(c.min_mw for c in ordered) / 1000:g} W at min power and only "
                              f"{share / 1000:g} W can be found (the budget is below the busy processors' "
                              "min power); suspended until power is freed")
    if tuning.n_opt < need_n:
        return replace(inputs, reason=f"power for {tuning.n_opt} processors, at least {need_n} needed")
    job = RunningJob(req.job_id, tuning.processors, tuning.caps_mw, tuning.ips, req)
    # Power stolen beyond what the job used goes back to the jobs it came from, largest loss first.
    surplus = sum(stolen.values()) - max(0, job.budget_mw - unused)
    for job_id in sorted(stolen, key=lambda j: (-stolen[j], j)):
        if surplus <= 0:
            break
        back = min(surplus, stolen[job_id])
        stolen[job_id] -= back
        surplus -= back
        shrunk[job_id] = _retune(machine, machine.running[job_id], machine.running[job_id].budget_mw - stolen[job_id])
    if machine.policy.admit == "throughput":
        lost = sum(machine.running[j].ips - shrunk[j].ips for j in shrunk)
        if job.ips < lost:
            why = f"throughput policy: starting would add {job.ips:.1f} GIPS and cost running jobs {lost:.1f}"
            return replace(inputs, action="suspend" if placed else "defer", reason=why)
    for job_id, new in shrunk.items():
        machine.running[job_id] = new
    machine.running[req.job_id] = job
    updates = tuple(_plan(j, shrunk[j]) for j in shrunk if stolen[j] > 0)
    return replace(inputs, action="start", plan=_plan(req.job_id, job), updates=updates, reason=reason,
                   stolen_mw=tuple((j, s) for j, s in stolen.items() if s > 0))


def release(machine: Machine, job_id: str, trigger: str = "") -> list[Outcome]:
    """A job ended: free its processors and power, retry deferred jobs, then apply the release
    policy to what is left. Returns the release outcome (the freed plan, and the new caps of jobs that
    were already running) followed by the start of each deferred job that now fits, with its final caps."""
    unused_before = machine.unused_mw
    job = machine.running.pop(job_id, None)
    if machine.retired:
        forget_retired(machine)
    if job is None:
        before = len(machine.deferred)
        machine.deferred = [r for r in machine.deferred if r.job_id != job_id]
        machine.gated.discard(job_id)
        req = JobRequest(job_id, "", 0, trigger=trigger)
        why = "ended while deferred" if len(machine.deferred) < before else "was never started by the power manager"
        return [Outcome("release", req, None, (), why)]
    started = retry_deferred(machine)
    updates: dict[str, Plan] = {}
    if machine.policy.release == "proportional":
        updates = give_back(machine, machine.unused_mw)
    # A job started here is announced once, with its final caps; the release lists the others.
    started = [replace(o, plan=updates.pop(o.request.job_id, o.plan)) for o in started]
    freed = Outcome("release", replace(job.request, trigger=trigger or job.request.trigger), _plan(job_id, job),
                    tuple(updates.values()), f"freed {len(job.processors)} processors; "
                    f"{sum(o.action == 'start' for o in started)} deferred jobs started; "
                    f"policy {machine.policy.release}",
                    unused_before_mw=unused_before)
    return [freed, *started]


def retry_deferred(machine: Machine) -> list[Outcome]:
    """Dispatch the deferred jobs again, oldest first (after a job ends or processors appear);
    returns the starts, and the first suspend of each job that must now be suspended; keeps the
    others deferred in their order."""
    started: list[Outcome] = []
    waiting, machine.deferred = machine.deferred, []
    for req in waiting:
        out = dispatch(machine, req)
        if out.action == "start":
            if req.job_id in machine.gated:
                machine.gated.discard(req.job_id)
                out = replace(out, resumes=True)
            started.append(out)
        else:
            machine.deferred.append(req)
            if out.action == "suspend" and req.job_id not in machine.gated:  # e.g. its processors became known
                machine.gated.add(req.job_id)
                started.append(out)
    return started


def give_back(machine: Machine, power_mw: int) -> dict[str, Plan]:
    """Unused power to running jobs in proportion to their budgets, each up to what its processors
    can draw; re-tuned on the same processors. Returns the plans that changed."""
    headroom = {j: sum(c.max_mw for c in machine.curves(r.request.program, r.processors)) - r.budget_mw
                for j, r in machine.running.items()}
    extra = dict.fromkeys(machine.running, 0)
    left = power_mw
    while left > 0:
        open_jobs = [j for j in machine.running if headroom[j] - extra[j] > 0]
        weight = sum(machine.running[j].budget_mw for j in open_jobs)
        if not open_jobs or weight == 0:
            break
        given = 0
        for j in open_jobs:
            add = min(left * machine.running[j].budget_mw // weight, headroom[j] - extra[j])
            extra[j] += add
            given += add
        if given == 0:  # rounding left less than a milliwatt per job
            break
        left -= given
    out = {}
    for j, add in extra.items():
        if add > 0:
            machine.running[j] = _retune(machine, machine.running[j], machine.running[j].budget_mw + add)
            out[j] = _plan(j, machine.running[j])
    return out


def set_node(machine: Machine, node: str, processors: Mapping[int, tuple[int, int]]) -> set[ProcessorId]:
    """Inventory: the node's processors and their (min, max) power; returns the processors whose
    limits changed. A processor removed from the inventory is offered to no new job; one a running
    job holds keeps its limits until the job ends (``refit`` fits running caps to changed limits).
    Min power is at least ``MIN_CAP_MW`` (an agent refuses a 0 W cap), max power at least min."""
    held = machine.owner()
    for p in [p for p in machine.limits if p[0] == node and p[1] not in processors]:
        if p in held:
            machine.retired.add(p)
        else:
            del machine.limits[p]
    changed = set()
    for idx, (lo, hi) in sorted(processors.items()):
        lo = max(lo, MIN_CAP_MW)
        lim, p = (lo, max(lo, hi)), (node, idx)
        machine.retired.discard(p)
        if machine.limits.get(p) != lim:
            changed.add(p)
            machine.limits[p] = lim
    _rebudget(machine)
    return changed


def _rebudget(machine: Machine) -> None:
    if machine.budget_from_limits:
        machine.budget_mw = sum(hi for _, hi in machine.limits.values())


def forget_retired(machine: Machine) -> None:
    """Forget the retired processors no running job holds any more."""
    held = machine.owner()
    for p in [p for p in machine.retired if p not in held]:
        machine.retired.discard(p)
        del machine.limits[p]
    _rebudget(machine)


def refit(machine: Machine, processors: set[ProcessorId]) -> dict[str, Plan]:
    """Running jobs on processors whose limits changed, re-tuned inside the new limits (their budget
    kept where the new limits allow it); when that puts the machine over its budget, power is taken
    from the other running jobs, down to their min power. Returns the plans that changed. Over the
    budget only when the busy processors' min power alone exceeds it."""
    before = {j: job.caps_mw for j, job in machine.running.items()}
    for job_id, job in list(machine.running.items()):
        if processors & set(job.processors):
            curves = machine.curves(job.request.program, job.processors)
            lo, hi = sum(c.min_mw for c in curves), sum(c.max_mw for c in curves)
            machine.running[job_id] = _retune(machine, job, min(max(job.budget_mw, lo), hi))
    over = machine.allocated_mw - machine.budget_mw
    if over > 0:
        for job_id, got in _steal(machine, over, exhaust=True).items():
            machine.running[job_id] = _retune(machine, machine.running[job_id], machine.running[job_id].budget_mw - got)
    return {j: _plan(j, job) for j, job in machine.running.items() if job.caps_mw != before.get(j)}


def check(machine: Machine) -> None:
    """The invariants every decision keeps (raises AssertionError naming the broken one). A cap is
    inside its processor's inventory limits; it may lie above the end of the processor's curve when
    later readings lowered the measured draw (it then buys nothing; PTune never plans it so)."""
    assert machine.allocated_mw <= machine.budget_mw, f"machine {machine.allocated_mw} > {machine.budget_mw} mW"
    seen: set[ProcessorId] = set()
    for job_id, job in machine.running.items():
        for c, cap in zip(machine.curves(job.request.program, job.processors), job.caps_mw, strict=True):
            assert c.min_mw <= cap, f"{job_id} {c.processor}: cap {cap} below min power {c.min_mw}"
            lo, hi = machine.limits[c.processor]
            assert max(lo, MIN_CAP_MW) <= cap <= hi, f"{job_id} {c.processor}: cap {cap} outside [{lo}, {hi}]"
        assert not seen & set(job.processors), f"{job_id}: a processor is given to two jobs"
        seen |= set(job.processors)

