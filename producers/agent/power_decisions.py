"""The node agent applies ``decisions.power``: the caps the power manager decided for this node.

The caps a node must hold are a fold of every decision, read from the topic's start as
``follower.Follower`` reads (history folded without writing, then the caps it ends with, then each
change as it arrives). A refused cap (no domain, out of range, no permission) is logged and
counted; the processor keeps its limit and the agent goes on. A cap that cannot be made safe (the
watchdog is gone) stops the follower: every limit is restored and the agent exits (``follower``).

The fold is ``CapFold``, not the manager's own ``NodeCaps``: ``decisions.power`` has several
partitions (keyed by job) and Kafka orders records only within one, so the agent must reach the
same caps whatever the interleaving. It keeps, per job, the newest plan it has seen, newest by an
order that does not depend on arrival:

* a job's own ``start`` comes before every re-tune of it (the manager re-tunes running jobs only),
  and its ``release`` after all of them, for good (the manager never dispatches an ended job again);
* re-tunes of a running job (``running_updates`` of other jobs' decisions) are ordered by the
  decision's ``event_time`` (its trigger's time), then the lower caps (a tie is one input record's
  decisions, where each start takes more power from the running jobs), then the event id.

That is a pure function of the set of decisions read, so every interleaving (and every redelivery)
ends at the same caps; they are the manager's when its log order follows its inputs' event times.
The manager's log does not promise that (a late ``ended`` event, a re-published ``submitted``):
an exact order needs the manager's own sequence number on each decision (docs/deployment.md).
A processor two live plans claim (one of them stale) goes to the newer plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nodeshare import metrics
from nodeshare.schemas import DecodeError, PowerDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_POWER
from nodeshare.schemas.events import JobPowerPlan, PowerAction
from nodeshare.streams.core.power.caps import CapChanges

from .follower import Follower
from .powercap import CapRefused, Powercap

log = logging.getLogger(__name__)

#: A plan's place among one job's plans: (stage, trigger time, total watts negated, event id).
#: Stage 0 is the job's own start, 1 a re-tune, 2 its release (final).
Order = tuple[int, datetime, float, str]


@dataclass
class CapFold:
    """The newest plan of each job with caps on ``node``, whatever order the decisions came in."""

    node: str
    plans: dict[str, tuple[Order, dict[int, float] | None]] = field(default_factory=dict)  # None: released

    def apply(self, decision: PowerDecision) -> CapChanges:
        """Fold one decision; the changes it makes to this node's caps."""
        before = self.caps()
        if decision.action is PowerAction.START and decision.plan is not None:
            self._offer(decision.plan, 0, decision)
        elif decision.action is PowerAction.RELEASE:
            self._offer(None, 2, decision)
        for plan in decision.running_updates:
            self._offer(plan, 1, decision)
        after = self.caps()
        return {p: after.get(p) for p in sorted(before.keys() | after.keys()) if before.get(p) != after.get(p)}

    def _offer(self, plan: JobPowerPlan | None, stage: int, decision: PowerDecision) -> None:
        job = plan.job_id if plan is not None else decision.job_id
        caps = None if plan is None else {c.processor: c.cap_watts for c in plan.caps if c.node == self.node}
        order = (stage, decision.event_time, -sum((caps or {}).values()), decision.event_id)
        held = self.plans.get(job)
        if held is None or order > held[0]:
            self.plans[job] = (order, caps)

    def caps(self) -> dict[int, float]:
        """The cap of every processor a live job holds now (a processor two plans claim: the newer plan's)."""
        claims: dict[int, tuple[tuple[datetime, float, str], float]] = {}
        for order, caps in self.plans.values():
            for processor, watts in (caps or {}).items():
                rank = order[1:]
                if processor not in claims or rank > claims[processor][0]:
                    claims[processor] = (rank, watts)
        return {p: watts for p, (_, watts) in sorted(claims.items())}


class CapFollower(Follower):
    """Folds ``decisions.power`` for ``node`` and writes its caps through ``powercap``."""

    topic_name = DECISIONS_POWER.name
    purpose = "power"

    def __init__(self, settings: Any, node: str, powercap: Powercap) -> None:
        super().__init__(settings, node)
        self.powercap = powercap
        self.caps = CapFold(node)
        self.applied = 0
        self.refused: list[str] = []

    def handle(self, value: bytes | None, write: bool) -> None:
        try:
            decision = decode_model(PowerDecision, value)
        except DecodeError as exc:  # the worker dead-letters its own input; here a bad record is skipped
            log.warning("decisions.power: skipped a record that does not decode: %s", exc.reason)
            return
        changes = self.caps.apply(decision)
        if write:
            self.write(changes)

    def settle(self) -> None:
        self.write(dict(self.caps.caps()))  # what the history ends with, once

    def idle(self) -> None:
        self.powercap.retry_restores()  # a package released while its write-back was refused

    def failed(self, exc: BaseException) -> None:
        restored = self.powercap.restore_all()
        log.error("decisions.power: restored %d power limits; %d could not be (the state file keeps them)",
                  restored, len(self.powercap.originals))

    def write(self, changes: CapChanges) -> None:
        for processor, watts in changes.items():
            try:
                self.powercap.set(processor, watts)
            except CapRefused as exc:
                self.refused.append(str(exc))
                metrics.POWER_CAPS.labels("refused").inc()
                log.warning("power cap refused: %s", exc)
                continue
            self.applied += 1
            metrics.POWER_CAPS.labels("applied" if watts is not None else "restored").inc()
            log.info("processor %d: %s", processor, f"capped at {watts:g} W" if watts is not None else "limit restored")
