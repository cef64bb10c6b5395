"""The power caps one node must hold, folded from ``decisions.power`` (Seed 004's plans applied).

``decisions.power`` has several partitions (keyed by job) and Kafka orders records only within
one, so a node agent must reach the manager's caps whatever the interleaving. Since version 6 a
decision carries, for each node whose caps it changed, the node's sequence number and every cap
the node must hold after it (``node_caps``). ``CapFold`` keeps the state with the highest sequence
number: a pure function of the set of decisions read, so every interleaving (and every
redelivery, and a log whose head retention deleted) ends at the manager's caps, and at every
prefix the node holds caps the manager decided for it at some point (never a mix of two states).
A job that no longer holds a cap on the node is forgotten with its state.

The same states go, one per node, to the compacted ``decisions.power.nodes`` (``node_states``):
``decisions.power`` is deleted after its retention, so a node whose caps did not change for that
long would restart with none while the manager counts them; compaction keeps each node's newest
state for ever. An agent folds both topics: the highest sequence wins whichever topic it came from.

A decision without states (version 5 or earlier, or one written by hand) is applied as it
arrives (its plan, its release, the re-tuned plans of running jobs), exact only in the manager's
order. Once a node has a sequenced state, such decisions change nothing there. (The manager's own
decisions without a state for a node are ones that did not change its caps, or whose caps another
decision of the same input already stated: applying them before that state arrives is replaced by it.)

``apply`` returns only what changed, processor by processor: a new cap, or None when no job holds
the processor any more and its original limit comes back. Pure: the agent's shell
(``producers.agent.powercap``) writes the limits and restores them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeshare.schemas.events import HeldCap, JobPowerPlan, NodeCapState, NodePowerState, PowerAction, PowerDecision

#: processor -> the cap to write (watts), or None to restore the processor's original limit
CapChanges = dict[int, float | None]
#: node -> every cap it holds: processor -> (job, watts)
Held = dict[int, tuple[str, float]]


def node_caps(plans: Iterable[tuple[str, Iterable[tuple[tuple[str, int], float]]]]) -> dict[str, tuple[HeldCap, ...]]:
    """Every node's caps from the running jobs' plans ((job, ((node, processor), watts)...)...),
    processors in order: what a version-6 decision states for each node it changed."""
    out: dict[str, list[HeldCap]] = {}
    for job_id, caps in plans:
        for (node, processor), watts in caps:
            out.setdefault(node, []).append(HeldCap(processor=processor, job_id=job_id, cap_watts=watts))
    return {n: tuple(sorted(c, key=lambda h: h.processor)) for n, c in out.items()}


def node_states(decision: PowerDecision) -> list[NodePowerState]:
    """The ``decisions.power.nodes`` records of a decision: each node state it states, on its own,
    keyed by node (compaction keeps each node's newest; the agents' fold takes the highest
    sequence, so an older state compacted late or read after a newer one changes nothing)."""
    return [NodePowerState(event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{decision.event_id}/{s.node}")),
                           source=decision.source,
                           event_time=decision.event_time, node=s.node, state=s, decided_by=decision.event_id)
            for s in decision.node_caps]


@dataclass
class CapFold:
    """Which job holds each processor of ``node``, and its cap in watts, whatever order the
    decisions came in."""

    node: str
    held: Held = field(default_factory=dict)
    sequence: int = 0  # the node's state held (0: none yet; version-5 decisions apply in arrival order)

    def apply(self, decision: PowerDecision | NodePowerState) -> CapChanges:
        """Fold one decision (or one node state of ``decisions.power.nodes``); the changes it makes
        to this node's caps."""
        before = dict(self.held)
        states = (decision.state,) if isinstance(decision, NodePowerState) else decision.node_caps
        state = next((s for s in states if s.node == self.node), None)
        if state is not None:
            self._newer(state)
        elif isinstance(decision, PowerDecision) and not decision.node_caps and self.sequence == 0:
            # a version-5 decision: in arrival order
            if decision.action is PowerAction.START and decision.plan is not None:
                self._hold(decision.plan)
            elif decision.action is PowerAction.RELEASE:
                self._drop(decision.job_id)
            for plan in decision.running_updates:  # a running job's partition changed: its caps are re-tuned
                self._drop(plan.job_id)
                self._hold(plan)
        return {p: (self.held[p][1] if p in self.held else None)
                for p in sorted(before.keys() | self.held.keys()) if before.get(p) != self.held.get(p)}

    def _newer(self, state: NodeCapState) -> None:
        if state.sequence > self.sequence:  # a newer state replaces the node's caps whole
            self.sequence = state.sequence
            self.held = {c.processor: (c.job_id, c.cap_watts) for c in state.caps}

    def caps(self) -> dict[int, float]:
        """The cap of every processor a job holds now."""
        return {p: watts for p, (_, watts) in sorted(self.held.items())}

    def jobs(self) -> set[str]:
        """The jobs holding a cap on the node (no other job is remembered)."""
        return {job for job, _ in self.held.values()}

    def _hold(self, plan: JobPowerPlan) -> None:
        for cap in plan.caps:
            if cap.node == self.node:
                self.held[cap.processor] = (plan.job_id, cap.cap_watts)

    def _drop(self, job_id: str) -> None:
        for p in [p for p, (job, _) in self.held.items() if job == job_id]:
            del self.held[p]
