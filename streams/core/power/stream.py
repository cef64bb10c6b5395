"""The power manager as a deterministic fold: input events in, ``decisions.power`` records out.

``PowerManager.apply`` takes one record of ``cluster.inventory``, ``node.power`` or
``jobs.lifecycle`` (as bytes, in the order the single-partition ``power.machine`` log holds them)
and returns the decisions it causes. The same log folded again gives the same decisions with the
same event ids, which is how a restarted worker rebuilds its state and how duplicates are removed.

A job is dispatched at its ``started`` event, on the nodes it really runs on: it occupies, on each,
the processors its cores need there, and every one of them is capped (``submitted`` decides nothing:
a job not yet placed has no processors; a job the budget cannot hold is suspended, ``suspend``,
and later started with ``resumes``). Each decision states every node whose caps it changed, with
the node's sequence number (``node_caps``: the agents' fold needs no order across partitions).
``config`` names what a snapshot must share to be used (``streams.core.snapshot``). Lifecycle
events that do not move a job forward change nothing (``streams.core.lifecycle``, the rule the
placement manager follows). An inventory record without processors (the Slurm adapter's) says
nothing about them: the processors known stay; one that changes limits re-fits running caps
(a ``retune`` decision carries them).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    INPUT_TOPICS,
    JOBS_LIFECYCLE,
    NODE_POWER,
    TopicSpec,
    key_of,
    spec_for_topic,
)
from nodeshare.schemas.dead_letters import dead_letter
from nodeshare.schemas.events import (
    TERMINAL_STATES,
    DeadLetter,
    HeldCap,
    JobEvent,
    JobPowerPlan,
    JobState,
    NodeCapState,
    NodeInventory,
    NodePowerState,
    PowerAction,
    PowerDecision,
    PowerInputs,
    PowerReading,
    ProcessorCap,
    clock_problem,
)
from nodeshare.schemas.serde import DecodeError, decode
from nodeshare.schemas.signing import AUTH_FIELD, identity_problem

from ..lifecycle import JobPhases, Phase
from .caps import node_caps
from .curves import to_mw, to_w
from .ppartition import (
    JobRequest,
    Machine,
    Outcome,
    Plan,
    PowerPolicy,
    dispatch,
    refit,
    release,
    retry_deferred,
    set_node,
)

NAMESPACE = uuid.UUID("0d0e5a1c-9a8c-4772-62f0-02c6b0000004")
#: ``decided_by`` of a node state the manager restated after a rebuild rather than decided
RESTATED = "restated"
SOURCE = "nodeshare/power"


def screen(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, timestamp_s: float,
           prefix: str = "", screened: tuple[TopicSpec, ...] = (NODE_POWER, CLUSTER_INVENTORY),
           signer: str | None = None) -> DeadLetter | None:
    """The dead letter for a message that a router must not forward, else None: of a ``screened``
    topic (by default ``node.power`` and ``cluster.inventory``), undecodable or with a wrong clock;
    with ``signer`` (the identity that signed it, "" none: the site checks identities), a record of
    any input topic its signer may not have written (``schemas.signing``; its ``field`` is
    ``auth``). The router publishes the dead letters of screened topics only: the agent that owns
    another topic dead-letters its records itself, once."""
    spec = spec_for_topic(topic, prefix)
    checks_identity = signer is not None and spec in INPUT_TOPICS
    if spec not in screened and not checks_identity:
        return None
    try:
        record = decode(spec, value)
        problem, field_name = None, AUTH_FIELD
        if checks_identity:  # before the clock, as the charge fold checks: a forgery is counted as one
            assert signer is not None
            problem = identity_problem(record, signer)
            if problem is None and key != key_of(record):  # on a compacted topic the key is what a record replaces
                problem = f"message key {key!r} is not the record's key {key_of(record)!r}"
        if problem is None:
            problem, field_name = clock_problem(record, timestamp_s), "event_time"
    except DecodeError as exc:
        problem, field_name = exc.reason, exc.field
    if problem is None:
        return None
    return dead_letter(topic, partition, offset, key, value, timestamp_s, problem, field=field_name,
                       source=SOURCE)


def envelope(topic: str, value: bytes | None) -> bytes:
    """How the router puts an input record on the power log: its topic, a newline, its bytes."""
    return topic.encode() + b"\n" + (value or b"")


def open_envelope(raw: bytes) -> tuple[str, bytes]:
    topic, _, value = raw.partition(b"\n")
    return topic.decode(), value


@dataclass
class PowerManager:
    """State of the machine's power manager, folded from the power log."""

    budget_watts: float | None  # None: no bound (the sum of the processors' max caps)
    policy: PowerPolicy = field(default_factory=PowerPolicy)
    prefix: str = ""
    machine: Machine = field(init=False)
    cores_per_processor: dict[str, float] = field(default_factory=dict)
    phases: JobPhases = field(default_factory=JobPhases)  # duplicate and late lifecycle events change nothing
    requests: dict[str, JobEvent] = field(default_factory=dict)  # the dispatching event of each running job
    skipped: int = 0  # records that could not be decoded (``screen`` dead-letters them before the log)
    #: the latest decision's time: a decision is stamped with its trigger's time, or this when later,
    #: so decisions' times never go back in log order (an agent orders a job's plans by them)
    clock: datetime | None = None
    #: per node, the sequence of the last decision that changed its caps (increasing, at least the
    #: decision's time in microseconds), and the caps it stated
    sequences: dict[str, int] = field(default_factory=dict)
    stated: dict[str, tuple[HeldCap, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.machine = Machine(budget_mw=to_mw(self.budget_watts or 0.0), policy=self.policy,
                               budget_from_limits=self.budget_watts is None)

    def config(self) -> tuple[object, ...]:
        """What the manager was configured with (a snapshot under another is not used)."""
        return (self.budget_watts, self.policy, self.prefix)

    def apply(self, topic: str, value: bytes | None) -> list[PowerDecision]:
        try:
            spec = spec_for_topic(topic, self.prefix)
            record = decode(spec, value)
        except (KeyError, DecodeError):
            self.skipped += 1
            return []
        if spec is CLUSTER_INVENTORY and isinstance(record, NodeInventory):
            updates = self._inventory(record)
            out = [] if not updates else [self._record(Outcome(
                "retune", JobRequest(next(iter(updates)), "", 0, trigger=record.event_id), None,
                tuple(updates.values()), f"{record.node}: processor limits changed, running caps re-fitted"),
                record.event_time)]
            # New processors can take jobs that were waiting for them (sized by what is now known).
            self.machine.deferred = [self._request(self.requests[r.job_id]) for r in self.machine.deferred]
            return out + [self._record(o, record.event_time) for o in retry_deferred(self.machine)]
        elif spec is NODE_POWER and isinstance(record, PowerReading):
            program = record.program or self._program_on((record.node, record.processor))
            self.machine.char.add_reading(record, program)
        elif spec is JOBS_LIFECYCLE and isinstance(record, JobEvent):
            return self._job(record)
        return []

    def _inventory(self, inv: NodeInventory) -> dict[str, Plan]:
        """The node's shape and processors; running jobs whose processors' limits changed, re-fitted.
        A record without processors (Slurm's) changes none: it does not know them."""
        self.cores_per_processor[inv.node] = inv.cores / (len(inv.processors) or inv.sockets)
        if not inv.processors:
            return {}
        changed = set_node(self.machine, inv.node, {p.processor: (to_mw(p.min_watts), to_mw(p.max_watts))
                                                    for p in inv.processors})
        return refit(self.machine, changed) if changed else {}

    def _program_on(self, processor: tuple[str, int]) -> str | None:
        """The program of the job running on a processor (for readings that do not name it)."""
        return next((j.request.program for j in self.machine.running.values() if processor in j.processors), None)

    def _request(self, job: JobEvent) -> JobRequest:
        """A started job as PPartition sees it: on each of its nodes, the processors its cores there
        need (its cores split evenly over its nodes, over the node's cores per processor; none on a
        node whose processors are not known yet)."""
        cores_here = math.ceil(job.cores / len(job.nodes))
        known: dict[str, int] = {}
        for node, _ in self.machine.limits.keys() - self.machine.retired:
            known[node] = known.get(node, 0) + 1
        per_node = tuple((n, min(known.get(n, 0), math.ceil(cores_here / self.cores_per_processor[n])))
                         if n in self.cores_per_processor else (n, 0) for n in job.nodes)
        return JobRequest(job.job_id, job.program, sum(k for _, k in per_node), tuple(job.nodes), job.event_id,
                          per_node=per_node)

    def _job(self, job: JobEvent) -> list[PowerDecision]:
        before = self.phases.get(job.job_id)
        if not self.phases.advance(job):
            return []  # a duplicate or late event
        if job.state is JobState.STARTED:
            self.requests[job.job_id] = job
            req = self._request(job)
            out = dispatch(self.machine, req)
            if out.action in ("defer", "suspend"):
                self.machine.deferred.append(req)
            if out.action == "suspend":
                self.machine.gated.add(req.job_id)
            return [self._record(out, job.event_time)]
        if job.state in TERMINAL_STATES:
            self.requests.pop(job.job_id, None)
            if before is not Phase.STARTED:
                return []  # never started: nothing was decided for it
            return [self._record(o, job.event_time) for o in release(self.machine, job.job_id, job.event_id)]
        return []  # submitted: not placed yet, no processors to cap

    def restatement(self) -> list[NodePowerState]:
        """Every node's caps as this manager last stated them, at the sequence it stated them with
        (``decisions.power.nodes``): published after each rebuild, so a node whose state was decided
        before that topic existed (an upgrade), or whose record was lost, has one there. An agent
        already holding that sequence changes nothing."""
        at = self.clock or _EPOCH
        return [NodePowerState(
            event_id=str(uuid.uuid5(NAMESPACE, f"restated/{node}/{seq}")), source=SOURCE, event_time=at, node=node,
            state=NodeCapState(node=node, sequence=seq, caps=self.stated.get(node, ())), decided_by=RESTATED)
            for node, seq in sorted(self.sequences.items())]

    def _plan(self, plan: Plan) -> JobPowerPlan:
        return JobPowerPlan(job_id=plan.job_id, budget_watts=to_w(plan.budget_mw), predicted_gips=round(plan.ips, 6),
                            caps=tuple(ProcessorCap(node=n, processor=i, cap_watts=to_w(c))
                                       for (n, i), c in zip(plan.processors, plan.caps_mw, strict=True)))

    def _record(self, out: Outcome, at: datetime) -> PowerDecision:
        req, pol = out.request, self.machine.policy
        at = self.clock = at if self.clock is None or at > self.clock else self.clock
        trigger = req.trigger
        now = node_caps((j, zip(job.processors, map(to_w, job.caps_mw), strict=True))
                        for j, job in self.machine.running.items())
        states = []
        for node in sorted(now.keys() | self.stated.keys()):
            if now.get(node, ()) != self.stated.get(node, ()):
                # grows across restarts too: a manager rebuilt without its snapshot (a changed budget,
                # a log whose head retention deleted) starts from its decision's time, later than any
                # sequence it stated before, so agents never drop its states as stale
                self.sequences[node] = seq = max(self.sequences.get(node, 0) + 1, _micros(at))
                states.append(NodeCapState(node=node, sequence=seq, caps=now.get(node, ())))
                if node in now:
                    self.stated[node] = now[node]
                else:
                    del self.stated[node]
        return PowerDecision(
            event_id=str(uuid.uuid5(NAMESPACE, f"{trigger}/{req.job_id}/{out.action}")), source=SOURCE,
            event_time=at, job_id=req.job_id, action=PowerAction(out.action),
            plan=self._plan(out.plan) if out.plan else None,  # for a release: what is freed
            running_updates=tuple(self._plan(p) for p in out.updates),
            machine_budget_watts=to_w(self.machine.budget_mw), machine_allocated_watts=to_w(self.machine.allocated_mw),
            reason=out.reason, node_caps=tuple(states), resumes=out.resumes,
            inputs=PowerInputs(
                trigger_event_id=trigger, program=req.program, requested_processors=req.n_req,
                candidate_processors=out.candidates, characterized_processors=out.characterized,
                fair_share_watts=to_w(out.fair_share_mw), unused_watts_before=to_w(out.unused_before_mw),
                n_lo=out.n_lo, n_hi=out.n_hi, stolen_watts={j: to_w(s) for j, s in out.stolen_mw},
                policy=f"admit={pol.admit} release={pol.release} min_share={pol.min_share} margin={pol.margin}"),
        )


def _micros(at: datetime) -> int:
    """A decision's time as whole microseconds since the epoch: a floor for its nodes' sequences."""
    return (at - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
