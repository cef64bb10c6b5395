"""Placement decisions that act on a real Slurm: ``nodeshare slurm scheduler``.

Jobs are submitted held (``sbatch --hold``, or a job_submit rule that holds them). The adapter
publishes Slurm's nodes on ``cluster.inventory`` so the placement manager knows the machine, then
follows ``decisions.placement``:

* ``place`` / ``pair``: the held job is pinned to the decided node(s) (``scontrol update JobId=..
  NodeList=.. NumNodes=..``) and released; both jobs of a pair are pinned to the same node and run
  side by side (node sharing: each holds its own cores, as the placement booked them);
* ``delay`` / ``serialize``: the job stays held;
* a decision for a job Slurm no longer has, or no longer holds (released already, running,
  finished), is logged and skipped: Slurm's own state is the record of what was applied, so a
  decision applied twice (the adapter died before it committed its offset) places nothing twice.

``plan`` is pure: the commands a decision turns into, given the job as Slurm reports it. The
adapter commits its consumer offsets only after Slurm accepted the commands (the sinks' rule), so
while it is down jobs simply stay held and no decision is lost.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from confluent_kafka import Message

from nodeshare import metrics
from nodeshare.config import Settings
from nodeshare.consumer import BatchSink
from nodeshare.logs import fields
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.schemas import DecodeError, NodeInventory, PlacementDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_PLACEMENT
from nodeshare.schemas.events import PlacementAction

from .slurm import SlurmCommands

log = logging.getLogger("nodeshare.slurm.scheduler")

#: squeue's reasons for a job held by its user (sbatch --hold, scontrol hold) or by an admin
HELD = frozenset({"JobHeldUser", "JobHeldAdmin"})


@dataclass(frozen=True)
class SlurmJob:
    """A job as ``squeue`` reports it."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, ...
    reason: str  # JobHeldUser, Resources, None, ...

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and self.reason in HELD


@dataclass(frozen=True)
class Plan:
    """What one decision does to Slurm: commands to run (none when it does nothing) and why."""

    commands: tuple[tuple[str, ...], ...]
    outcome: str  # applied, kept_held, skipped
    why: str


def plan(decision: PlacementDecision, job: SlurmJob | None) -> Plan:
    """The scontrol commands that apply ``decision`` to ``job`` (None: Slurm does not know it)."""
    jid = decision.job_id
    if job is None:
        return Plan((), "skipped", f"job {jid}: Slurm no longer has it ({decision.action} not applied)")
    if decision.action in (PlacementAction.DELAY, PlacementAction.SERIALIZE):
        return Plan((), "kept_held", f"job {jid}: {decision.action}, stays held: {decision.reason}")
    if not job.held:
        return Plan((), "skipped", f"job {jid} is {job.state} ({job.reason}), not held: {decision.action} "
                    "skipped (applied before, or started outside nodeshare)")
    if not decision.nodes:
        return Plan((), "kept_held", f"job {jid}: {decision.action} names no node, stays held")
    nodes = ",".join(decision.nodes)
    update = ("scontrol", "update", f"JobId={jid}", f"NodeList={nodes}", f"NumNodes={len(decision.nodes)}")
    partner = f" next to {decision.paired_with}" if decision.paired_with else ""
    return Plan((update, ("scontrol", "release", jid)), "applied",
                f"job {jid}: {decision.action} on {nodes}{partner}, released")


def parse_nodes(text: str) -> list[dict[str, str]]:
    """``scontrol show node -o``: one line per node of ``Key=Value`` pairs (values may hold spaces
    only in the last, free-text fields, which nodeshare does not read)."""
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines() if line.startswith("NodeName=")]


def inventory(nodes: Sequence[dict[str, str]], cluster: str, llc_ways: int, mem_bandwidth_gbps: float,
              at: datetime) -> list[NodeInventory]:
    """Slurm's nodes as the placement manager's inventory. Slurm knows cores and sockets, not LLC
    ways or memory bandwidth: those come from the site (the same for every node). The event id
    names the node and its shape, so publishing it again at each start is de-duplicated."""
    out = []
    for n in nodes:
        cores, sockets = int(n["CPUTot"]), int(n.get("Sockets") or 1)
        out.append(NodeInventory(
            event_id=f"slurm/{cluster}/node/{n['NodeName']}/{cores}x{sockets}/{llc_ways}/{mem_bandwidth_gbps:g}",
            source="nodeshare.slurm.scheduler", event_time=at, node=n["NodeName"], cores=cores, sockets=sockets,
            llc_ways=llc_ways, mem_bandwidth_gbps=mem_bandwidth_gbps))
    return out


class SchedulerCommands(SlurmCommands):
    """The Slurm commands the adapter needs beyond the lifecycle source's."""

    def job(self, job_id: str) -> SlurmJob | None:
        try:
            out = self._run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T|%r")
        except RuntimeError as exc:
            if "Invalid job id" in str(exc):
                return None
            raise
        for line in out.splitlines():
            jid, state, reason = line.split("|", 2)
            if jid == job_id:
                return SlurmJob(jid, state, reason)
        return None

    def nodes(self) -> list[dict[str, str]]:
        return parse_nodes(self._run("scontrol", "show", "node", "-o"))

    def run(self, command: Sequence[str]) -> None:
        self._run(*command)


class SlurmScheduler(BatchSink):
    """Follows ``decisions.placement`` and applies each decision to Slurm; offsets are committed
    after Slurm accepted the batch's commands."""

    def __init__(self, settings: Settings, commands: SchedulerCommands,
                 on_plan: Callable[[PlacementDecision, Plan], None] | None = None) -> None:
        super().__init__(settings, [DECISIONS_PLACEMENT.name], "slurm-scheduler", max_batch=100, max_delay_s=0.1)
        self.commands = commands
        self.on_plan = on_plan
        self.outcomes: dict[str, int] = {"applied": 0, "kept_held": 0, "skipped": 0, "undecodable": 0}

    def write(self, messages: list[Message]) -> None:
        for m in messages:
            try:
                decision = decode_model(PlacementDecision, m.value())
            except DecodeError as exc:  # the worker wrote it; a record that does not decode is not ours to act on
                self.outcomes["undecodable"] += 1
                metrics.SLURM_PLACEMENTS.labels("undecodable").inc()
                log.error("decisions.placement: skipped a record that does not decode: %s", exc.reason)
                continue
            p = plan(decision, self.commands.job(decision.job_id))
            for command in p.commands:  # a failure raises: nothing is committed, the batch comes again
                self.commands.run(command)
            self.outcomes[p.outcome] += 1
            metrics.SLURM_PLACEMENTS.labels(p.outcome).inc()
            (log.warning if p.outcome == "skipped" else log.info)(p.why, extra=fields(job_id=decision.job_id))
            if self.on_plan is not None:
                self.on_plan(decision, p)


def publish_inventory(settings: Settings, commands: SchedulerCommands, *, llc_ways: int,
                      mem_bandwidth_gbps: float) -> list[NodeInventory]:
    """Slurm's nodes on ``cluster.inventory`` (acknowledged before this returns)."""
    records = inventory(commands.nodes(), commands.cluster_name(), llc_ways, mem_bandwidth_gbps, datetime.now(UTC))
    with EventProducer(settings, client_id="nodeshare-slurm-scheduler") as producer:
        producer.send_all(records)
        producer.flush(30)
    return records


def run_scheduler(settings: Settings, commands: SchedulerCommands, stop: threading.Event, *, llc_ways: int,
                  mem_bandwidth_gbps: float, on_plan: Callable[[PlacementDecision, Plan], None] | None = None,
                  ) -> SlurmScheduler:
    """Publish the inventory, then apply decisions until ``stop`` is set."""
    nodes = publish_inventory(settings, commands, llc_ways=llc_ways, mem_bandwidth_gbps=mem_bandwidth_gbps)
    log.info("published %d Slurm nodes on cluster.inventory: %s", len(nodes), ", ".join(n.node for n in nodes))
    scheduler = SlurmScheduler(settings, commands, on_plan)
    scheduler.run(stop)
    return scheduler
