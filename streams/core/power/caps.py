"""The power caps one node must hold, folded from ``decisions.power`` (Seed 004's plans applied).

A ``PowerDecision`` names, per job, the processors it runs on and each one's cap (``plan``), and
re-tunes jobs already running when PPartition repartitions the machine (``running_updates``). A
node agent keeps one ``NodeCaps`` for its node: which job holds each of its processors and at
what cap. ``apply`` returns only what changed, processor by processor: a new cap, or None when no
job holds the processor any more and its original limit comes back. Pure: the agent's shell
(``producers.agent.powercap``) writes the limits and restores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeshare.schemas.events import JobPowerPlan, PowerAction, PowerDecision

#: processor -> the cap to write (watts), or None to restore the processor's original limit
CapChanges = dict[int, float | None]


@dataclass
class NodeCaps:
    """Which job holds each processor of ``node``, and its cap in watts."""

    node: str
    held: dict[int, tuple[str, float]] = field(default_factory=dict)

    def apply(self, decision: PowerDecision) -> CapChanges:
        """Fold one decision; the changes it makes to this node's caps."""
        before = dict(self.held)
        if decision.action is PowerAction.START and decision.plan is not None:
            self._hold(decision.plan)
        elif decision.action is PowerAction.RELEASE:
            self._drop(decision.job_id)
        for plan in decision.running_updates:  # a running job's partition changed: its caps are re-tuned
            self._drop(plan.job_id)
            self._hold(plan)
        return {p: (self.held[p][1] if p in self.held else None)
                for p in sorted(before.keys() | self.held.keys()) if before.get(p) != self.held.get(p)}

    def caps(self) -> dict[int, float]:
        """The cap of every processor a job holds now."""
        return {p: watts for p, (_, watts) in sorted(self.held.items())}

    def _hold(self, plan: JobPowerPlan) -> None:
        for cap in plan.caps:
            if cap.node == self.node:
                self.held[cap.processor] = (plan.job_id, cap.cap_watts)

    def _drop(self, job_id: str) -> None:
        for p in [p for p, (job, _) in self.held.items() if job == job_id]:
            del self.held[p]
