"""Placement decisions that act on a real Slurm: ``nodeshare slurm scheduler``.

Jobs are submitted held (``sbatch --hold``, or a job_submit rule that holds them: both show as
``JobHeldUser``, measured on Slurm 22.05 as root). The adapter publishes Slurm's nodes on
``cluster.inventory`` so the placement manager knows the machine, publishes a node again whenever
its state turns it usable or unusable (DOWN, DRAIN, ...: ``usable`` false, no job is placed there),
then follows ``decisions.placement``:

* ``place`` / ``pair``: the held job is pinned to the decided node(s) (``scontrol update JobId=..
  NodeList=.. NumNodes=.. [MinCPUsNode=..]``, with the cores per node the placement booked) and
  released; both jobs of a pair are pinned to the same node and run side by side (node sharing:
  each holds its own cores, as the placement booked them);
* ``delay`` / ``serialize``: the job stays held;
* a decision for a job Slurm no longer has, or no longer holds (released already, running,
  finished), is logged and skipped: Slurm's own state is the record of what was applied, so a
  decision applied twice (the adapter died before it committed its offset) places nothing twice;
* only nodeshare's own hold (``JobHeldUser``) is released: a job an operator held
  (``scontrol hold``: ``JobHeldAdmin``) stays held whatever the decision;
* a command Slurm refuses (a node it does not know, a configuration it cannot run) becomes a dead
  letter with Slurm's message, and the adapter goes on with the next decision; only a Slurm it
  cannot reach stops the batch (nothing committed, the batch comes again).

It also follows ``decisions.power`` for the power-gated start (Seed 004 under a budget the busy
processors' min power can exceed):

* ``suspend``: the job runs on processors whose min power the budget cannot cover: it is suspended
  (``scontrol suspend``), so its processors draw no job power and hold no cap;
* ``start`` with ``resumes``: the power manager found its power (a job ended, or limits changed) and
  its caps are on their way to the node agents: it is resumed (``scontrol resume``), only if Slurm
  shows it SUSPENDED (an operator's ``scontrol resume`` before it is left alone);
* every other power decision is the node agents' business and runs nothing here.

``plan`` and ``power_plan`` are pure: the commands a decision turns into, given the job as Slurm reports it. The
adapter commits its consumer offsets only after Slurm accepted the commands (the sinks' rule), so
while it is down jobs simply stay held and no decision is lost.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Message

from nodeshare import metrics
from nodeshare.config import Settings
from nodeshare.consumer import BatchSink, position
from nodeshare.logs import fields
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.schemas import DecodeError, NodeInventory, PlacementDecision, PowerDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_PLACEMENT, DECISIONS_POWER
from nodeshare.schemas.dead_letters import dead_letter
from nodeshare.schemas.events import PlacementAction, PowerAction

from .slurm import SlurmCommands

log = logging.getLogger("nodeshare.slurm.scheduler")

SOURCE = "nodeshare.slurm.scheduler"
#: squeue's reasons for a job held by its user (sbatch --hold, scontrol hold) or by an admin
HELD = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: The holds nodeshare releases: the one ``sbatch --hold`` and a job_submit rule's ``priority = 0``
#: set (both JobHeldUser on Slurm 22.05, even for root). JobHeldAdmin is an operator's
#: ``scontrol hold``: never undone by a placement.
OWN_HOLDS = frozenset({"JobHeldUser"})
#: Node state flags (``scontrol show node``: ``State=IDLE+DRAIN``) under which Slurm starts no new
#: job there, or not for nodeshare's jobs (RESERVED: an advance reservation they do not carry).
#: POWERED_DOWN / POWER_DOWN are usable: Slurm resumes a powered-down node for a job.
UNUSABLE = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "MAINT",
                      "RESERVED", "FUTURE", "UNKNOWN", "ERROR", "INVALID_REG", "REBOOT_ISSUED", "POWERING_DOWN"})
#: What scontrol prints when it did not reach the controller: the command was not refused, the
#: batch is tried again (anything else Slurm says is a refusal, dead-lettered).
UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted",
               "Connection refused", "temporarily unable", "standby mode")


@dataclass(frozen=True)
class SlurmJob:
    """A job as ``squeue`` reports it."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, ...
    reason: str  # JobHeldUser, Resources, None, ...

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and self.reason in HELD

    @property
    def held_by_nodeshare(self) -> bool:
        return self.state == "PENDING" and self.reason in OWN_HOLDS


@dataclass(frozen=True)
class Plan:
    """What one decision does to Slurm: commands to run (none when it does nothing) and why."""

    commands: tuple[tuple[str, ...], ...]
    outcome: str  # applied, kept_held, skipped, refused (Slurm refused a command: dead-lettered)
    why: str


#: told of each decision the adapter acted on, and how
OnPlan = Callable[[PlacementDecision | PowerDecision, Plan], None]


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
    if not job.held_by_nodeshare:
        return Plan((), "kept_held", f"job {jid}: held by an operator ({job.reason}), not by nodeshare: "
                    f"{decision.action} not applied, the hold stays")
    if not decision.nodes:
        return Plan((), "kept_held", f"job {jid}: {decision.action} names no node, stays held")
    nodes = ",".join(decision.nodes)
    update = ("scontrol", "update", f"JobId={jid}", f"NodeList={nodes}", f"NumNodes={len(decision.nodes)}",
              # the cores the placement booked on each node, so Slurm starts the job on that many and
              # its co-runner keeps the rest
              *((f"MinCPUsNode={decision.cores_per_node}",) if decision.cores_per_node else ()))
    partner = f" next to {decision.paired_with}" if decision.paired_with else ""
    return Plan((update, ("scontrol", "release", jid)), "applied",
                f"job {jid}: {decision.action} on {nodes}{partner}, released")


def gates(decision: PowerDecision) -> bool:
    """Whether a power decision is the scheduler's business (a suspend, or the start that ends one)."""
    return decision.action is PowerAction.SUSPEND or (decision.action is PowerAction.START and decision.resumes)


def power_plan(decision: PowerDecision, job: SlurmJob | None) -> Plan:
    """The scontrol command a gating power decision (``gates``) turns into."""
    jid = decision.job_id
    if decision.action is PowerAction.SUSPEND:
        command, state, did = ("scontrol", "suspend", jid), "RUNNING", "power-gated, suspended"
    else:
        command, state, did = ("scontrol", "resume", jid), "SUSPENDED", "power found, resumed"
    if job is None:
        return Plan((), "skipped", f"job {jid}: Slurm no longer has it ({decision.action} not applied)")
    if job.state != state:
        return Plan((), "skipped", f"job {jid} is {job.state}, not {state}: {decision.action} skipped")
    return Plan((command,), "applied", f"job {jid}: {did} ({decision.reason})")


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
    """Follows ``decisions.placement`` (and the gating decisions of ``decisions.power``) and applies
    each decision to Slurm; offsets are committed after Slurm accepted the batch's commands."""

    def __init__(self, settings: Settings, commands: SchedulerCommands, on_plan: OnPlan | None = None,
                 dead_letters: Any = None) -> None:
        super().__init__(settings, [DECISIONS_PLACEMENT.name, DECISIONS_POWER.name], "slurm-scheduler",
                         max_batch=100, max_delay_s=0.1)
        self.power_topic = settings.topic(DECISIONS_POWER.name)
        self.commands = commands
        self.on_plan = on_plan
        self.dead_letters = dead_letters  # an EventProducer; None: a refusal is only logged and counted
        self._letters = 0  # dead letters sent since the last flush
        self.outcomes: dict[str, int] = {"applied": 0, "kept_held": 0, "skipped": 0, "refused": 0, "undecodable": 0}

    def write(self, messages: list[Message]) -> None:
        for m in messages:
            power = m.topic() == self.power_topic
            model: type[PlacementDecision] | type[PowerDecision] = PowerDecision if power else PlacementDecision
            try:
                decision = decode_model(model, m.value())
            except DecodeError as exc:  # the worker wrote it; a record that does not decode is not ours to act on
                self.outcomes["undecodable"] += 1
                metrics.SLURM_PLACEMENTS.labels("undecodable").inc()
                log.error("%s: skipped a record that does not decode: %s", m.topic(), exc.reason)
                continue
            if isinstance(decision, PowerDecision):
                if not gates(decision):
                    continue  # caps: the node agents' business
                p = power_plan(decision, self.commands.job(decision.job_id))
            else:
                p = plan(decision, self.commands.job(decision.job_id))
            for command in p.commands:
                try:
                    self.commands.run(command)
                except RuntimeError as exc:
                    if any(s in str(exc) for s in UNREACHABLE):
                        raise  # Slurm not reached: nothing is committed, the batch comes again
                    p = Plan(p.commands, "refused", f"job {decision.job_id}: Slurm refused {' '.join(command[:2])} "
                             f"({exc}); {decision.action} not applied, dead-lettered")
                    self._refused(m, p.why)
                    break
            self.outcomes[p.outcome] += 1
            metrics.SLURM_PLACEMENTS.labels(p.outcome).inc()
            level = {"skipped": log.warning, "refused": log.error}.get(p.outcome, log.info)
            level(p.why, extra=fields(job_id=decision.job_id))
            if self.on_plan is not None:
                self.on_plan(decision, p)
        if self.dead_letters is not None and self._letters:
            self.dead_letters.flush(30)  # a broker round trip only when this batch refused something
            self._letters = 0

    def _refused(self, m: Message, why: str) -> None:
        metrics.DEAD_LETTERS.labels(metrics.REJECTED).inc()
        if self.dead_letters is None:
            return
        topic, partition, offset = position(m)
        _, ts = m.timestamp()
        self.dead_letters.send(dead_letter(topic, partition, offset, m.key(), m.value(), ts / 1000, why,
                                           field="nodes", source=SOURCE))
        self._letters += 1


def publish_inventory(producer: EventProducer, commands: SchedulerCommands, watch: NodeWatch, *, cluster: str,
                      llc_ways: int, mem_bandwidth_gbps: float) -> list[NodeInventory]:
    """Slurm's nodes that changed since ``watch`` last published them, on ``cluster.inventory``
    (acknowledged before this returns)."""
    at = datetime.now(UTC)
    records = watch.changes(inventory(commands.nodes(), cluster, llc_ways, mem_bandwidth_gbps, at), at)
    if records:
        producer.send_all(records)
        producer.flush(30)
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


def run_scheduler(settings: Settings, commands: SchedulerCommands, stop: threading.Event, *, llc_ways: int,
                  mem_bandwidth_gbps: float, on_plan: OnPlan | None = None,
                  nodes_every_s: float = 30.0) -> SlurmScheduler:
    """Publish the inventory, then apply decisions until ``stop`` is set, publishing node state
    changes every ``nodes_every_s``."""
    watch = NodeWatch()
    shape: dict[str, Any] = {"cluster": commands.cluster_name(), "llc_ways": llc_ways,
                             "mem_bandwidth_gbps": mem_bandwidth_gbps}
    with EventProducer(settings, client_id="nodeshare-slurm-scheduler") as producer:
        nodes = publish_inventory(producer, commands, watch, **shape)
        log.info("published %d Slurm nodes on cluster.inventory: %s", len(nodes), ", ".join(n.node for n in nodes))
        done = threading.Event()
        watcher = threading.Thread(target=watch_nodes, args=(producer, commands, watch, done),
                                   kwargs={"every_s": nodes_every_s, **shape}, name="slurm-nodes", daemon=True)
        watcher.start()
        scheduler = SlurmScheduler(settings, commands, on_plan, dead_letters=producer)
        try:
            scheduler.run(stop)
        finally:
            done.set()
            watcher.join(35)
    return scheduler
