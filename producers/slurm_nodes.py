"""Slurm's nodes as the placement and power managers' inventory (``cluster.inventory``), for the
Slurm adapter (``nodeshare slurm scheduler``): published at its start and whenever a node's shape
changes or its state turns it usable or unusable (DOWN, DRAIN, ...: ``usable`` false, no job is
placed there)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.schemas import NodeInventory

if TYPE_CHECKING:
    from .slurm_scheduler import SchedulerCommands

log = logging.getLogger("nodeshare.slurm.scheduler")

SOURCE = "nodeshare.slurm.scheduler"  # the adapter's records (inventory, dead letters)
#: Node state flags (``scontrol show node``: ``State=IDLE+DRAIN``) under which Slurm starts no new
#: job there, or not for nodeshare's jobs (RESERVED: an advance reservation they do not carry).
#: POWERED_DOWN / POWER_DOWN are usable: Slurm resumes a powered-down node for a job.
UNUSABLE = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "MAINT",
                      "RESERVED", "FUTURE", "UNKNOWN", "ERROR", "INVALID_REG", "REBOOT_ISSUED", "POWERING_DOWN"})


def parse_nodes(text: str) -> list[dict[str, str]]:
    """``scontrol show node -o``: one line per node of ``Key=Value`` pairs (values may hold spaces
    only in the last, free-text fields, which nodeshare does not read)."""
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines() if line.startswith("NodeName=")]


def usable(state: str) -> bool:
    """Whether Slurm starts jobs on a node in this ``State`` (``IDLE+DRAIN``, ``DOWN*``, ...)."""
    flags = {f.strip("*~#!%$@^-").upper() for f in state.split("+")}
    return bool(state) and not flags & UNUSABLE


def inventory(nodes: Sequence[dict[str, str]], cluster: str, llc_ways: int, mem_bandwidth_gbps: float,
              at: datetime) -> list[NodeInventory]:
    """Slurm's nodes as the placement manager's inventory. Slurm knows cores and sockets, not LLC
    ways or memory bandwidth: those come from the site (the same for every node). A node in a
    state Slurm runs no new job in is ``usable=False``. The event id names the node, its shape and
    whether it is unusable, so publishing it again unchanged is de-duplicated."""
    out = []
    for n in nodes:
        cores, sockets = int(n["CPUTot"]), int(n.get("Sockets") or 1)
        ok = usable(n.get("State", ""))
        out.append(NodeInventory(
            event_id=f"slurm/{cluster}/node/{n['NodeName']}/{cores}x{sockets}/{llc_ways}/{mem_bandwidth_gbps:g}"
                     + ("" if ok else "/unusable"),
            source=SOURCE, event_time=at, node=n["NodeName"], cores=cores, sockets=sockets,
            llc_ways=llc_ways, mem_bandwidth_gbps=mem_bandwidth_gbps, usable=ok))
    return out


@dataclass
class NodeWatch:
    """The inventory as last published, node by node: ``changes`` gives the records to publish now
    (a new node, a changed shape, a node turned usable or unusable; a node Slurm no longer lists is
    published again unusable)."""

    published: dict[str, NodeInventory] = field(default_factory=dict)

    def changes(self, records: Sequence[NodeInventory], at: datetime) -> list[NodeInventory]:
        now = {r.node: r for r in records}
        gone = [r.model_copy(update={"event_id": f"{r.event_id}/unusable", "event_time": at, "usable": False})
                for node, r in sorted(self.published.items()) if node not in now and r.usable]
        out = [r for r in records if self.published.get(r.node, None) is None
               or self.published[r.node].event_id != r.event_id] + gone
        self.published.update({r.node: r for r in out})
        return out


def publish_inventory(producer: EventProducer, commands: SchedulerCommands, watch: NodeWatch, *, cluster: str,
                      llc_ways: int, mem_bandwidth_gbps: float) -> list[NodeInventory]:
    """Slurm's nodes that changed since ``watch`` last published them, on ``cluster.inventory``
    (acknowledged before this returns)."""
    at = datetime.now(UTC)
    before = dict(watch.published)
    records = watch.changes(inventory(commands.nodes(), cluster, llc_ways, mem_bandwidth_gbps, at), at)
    if records:
        try:
            producer.send_all(records)
            producer.flush(30)
        except BaseException:
            watch.published = before  # not acknowledged: published again at the next look
            raise
    return records


def watch_nodes(producer: EventProducer, commands: SchedulerCommands, watch: NodeWatch, stop: threading.Event, *,
                every_s: float, **shape: Any) -> None:
    """Publish node changes every ``every_s`` until ``stop`` is set; a failed look is logged and
    tried again."""
    while not stop.wait(every_s):
        try:
            for r in publish_inventory(producer, commands, watch, **shape):
                log.info("node %s: %s", r.node, "usable" if r.usable else "unusable (no job is placed there)")
        except Exception as exc:  # a Slurm or broker hiccup: the next look tries again
            log.error("Slurm's nodes not published, trying again in %.0f s: %s", every_s, exc)
