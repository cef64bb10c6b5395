"""The node agent applies ``decisions.power``: the caps the power manager decided for this node.

The caps a node must hold are the newest state the power manager stated for it: read at start from
the compacted ``decisions.power.nodes`` (keyed by node: every node's latest state, whatever the age
of the cluster) as ``follower.Follower`` reads (history folded without writing, then the caps it
ends with), then each change as it arrives on either topic. ``decisions.power`` is read from its end
only (issue 42: a start used to fold every decision retention kept, 30 days of the whole machine's).
A refused cap (no domain, out of range, no permission) is logged and counted; the processor keeps
its limit and the agent goes on. A cap that cannot be made safe (the watchdog is gone) stops the
follower: every limit is restored and the agent exits (``follower``).

The fold is ``streams.core.power.caps.CapFold``: ``decisions.power`` has several partitions (keyed
by job) and Kafka orders records only within one, so each decision carries, per node it changes,
the node's sequence number and all its caps after it; the newest state wins whatever the
interleaving. The worker sends the same states to ``decisions.power.nodes`` after each decision and
restates every node's after each rebuild, so the compacted topic holds what a decision before the
agent's start decided, also one that ``decisions.power``'s retention deleted. A decision of a
worker from before schema 6 (no node states) counts only if it comes after the agent's start: the
upgrade order (worker first, docs/upgrades.md) and the restatement after the upgraded worker's
rebuild put every such node's caps on the compacted topic.
"""

from __future__ import annotations

import logging
from typing import Any

from nodeshare.runtime import metrics
from nodeshare.schemas import DecodeError, NodePowerState, PowerDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_POWER, DECISIONS_POWER_NODES
from nodeshare.streams.core.power.caps import CapChanges, CapFold

from .follower import Follower
from .powercap import CapRefused, Powercap

log = logging.getLogger(__name__)


class CapFollower(Follower):
    """Folds ``decisions.power`` for ``node`` and writes its caps through ``powercap``."""

    topic_name = DECISIONS_POWER.name
    also_topics = (DECISIONS_POWER_NODES.name,)  # each node's latest state, kept past decisions.power's retention
    from_end = (DECISIONS_POWER.name,)  # its history is on decisions.power.nodes
    purpose = "power"

    def __init__(self, settings: Any, node: str, powercap: Powercap) -> None:
        super().__init__(settings, node)
        self.powercap = powercap
        self.caps = CapFold(node)
        self.applied = 0
        self.refused: list[str] = []

    def handle(self, value: bytes | None, write: bool, topic: str | None = None) -> None:
        topic = topic or DECISIONS_POWER.name
        if value is None:
            return  # a tombstone: compaction's, nothing to fold
        model = NodePowerState if topic == DECISIONS_POWER_NODES.name else PowerDecision
        try:
            decision = decode_model(model, value)
        except DecodeError as exc:  # the worker dead-letters its own input; here a bad record is skipped
            log.warning("%s: skipped a record that does not decode: %s", topic, exc.reason)
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
