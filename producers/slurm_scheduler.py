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
  shows it SUSPENDED **and the adapter suspended it**: its ``SuspendBook`` (a JSON file,
  ``--state-file``) names every job it suspended with the time it began and the suspend time Slurm
  recorded (``squeue --json``: ``suspend_time``, whole seconds, updated at every suspend and
  resume). A job an operator suspended is not in the book, one an operator resumed and suspended
  again has another time, one Slurm cannot date is not resumed on a guess: each stays suspended,
  and the log says why. The book is written before the ``suspend`` runs and after it, so an adapter
  killed in between completes the entry when the decision comes again (a suspend dated within
  ``ADOPT_WITHIN_S`` of the attempt is its own);
* every other power decision is the node agents' business and runs nothing here (a ``release``
  drops the job from the book: it ended).

Placement fails open: a job held by nodeshare (``JobHeldUser``) that the placement manager never
answered (no decision of any kind for it) and that the adapter has seen held for
``placement_release_after_s`` (default 600 s) is released to Slurm's own scheduling
(``scontrol release``, outcome ``released_unplaced``, a warning naming the job). The manager
answers every job it learns of once (``place``, ``pair``, or ``delay``/``serialize`` while it
waits), so no answer within that time means the worker, the broker or the decision is lost: the
job is delayed by a stated time instead of held for good. A job the manager answered (a delayed
one waits for its placement, the manager's own age limit) or that the sweep released is noted in
the adapter's decided book (``decided.json`` next to ``--state-file``: a restarted adapter keeps
it; pruned to the jobs Slurm still lists) and never released by the sweep (a placement Slurm
refused is no answer). Array and heterogeneous jobs are
left alone (their ids differ between decisions and ``squeue --json``). The sweep runs every
``SWEEP_EVERY_S`` (``release_unplaced``; the rule is ``unplaced_due``, pure), also while the broker
is unreachable; while the adapter itself is down nothing is released: systemd restarts it, and
the bypass QOS (deploy/slurm/job_submit.lua) lets urgent work run unheld.

``plan``, ``power_plan`` and ``unplaced_due`` are pure: the commands a decision turns into, given
the job as Slurm reports it. The adapter commits its consumer offsets only after Slurm accepted the
commands (the sinks' rule), so while it is down no decision is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Message

from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import BatchSink, position
from nodeshare.runtime.logs import fields
from nodeshare.schemas import DecodeError, PlacementDecision, PowerDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_PLACEMENT, DECISIONS_POWER
from nodeshare.schemas.dead_letters import dead_letter
from nodeshare.schemas.events import PlacementAction, PowerAction

from .slurm import SlurmCommands
from .slurm_books import ADOPT_WITHIN_S, DecidedBook, SuspendBook, Suspended  # noqa: F401  (re-exported)
from .slurm_fail_open import HELD, OWN_HOLDS, SWEEP_EVERY_S, Waiting, unplaced_due
from .slurm_nodes import SOURCE, UNUSABLE, NodeWatch, inventory, parse_nodes, publish_inventory, usable, watch_nodes  # noqa: F401  (the adapter's names before the split)

log = logging.getLogger("nodeshare.slurm.scheduler")

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
    #: when Slurm last suspended it (``squeue --json``'s ``suspend_time``, epoch seconds); None:
    #: never, or not read (only gating power decisions read it)
    suspended_at: int | None = None

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


def power_plan(decision: PowerDecision, job: SlurmJob | None, booked: Suspended | None = None) -> Plan:
    """The scontrol command a gating power decision (``gates``) turns into. ``booked`` is the job's
    entry in the adapter's suspend book (None: the adapter did not suspend it): a job is resumed only
    if the adapter suspended it and nobody suspended or resumed it since (Slurm's suspend time is
    the one booked), so an operator's suspend is never undone, nor one Slurm cannot date."""
    jid = decision.job_id
    if job is None:
        return Plan((), "skipped", f"job {jid}: Slurm no longer has it ({decision.action} not applied)")
    if decision.action is PowerAction.SUSPEND:
        if job.state == "SUSPENDED" and booked is not None and booked.suspended_at is None \
                and booked.ours(job.suspended_at):  # the adapter's, which restarted before it read the time
            return Plan((), "applied", f"job {jid}: power-gated, suspended (before a restart) ({decision.reason})")
        if job.state != "RUNNING":
            return Plan((), "skipped", f"job {jid} is {job.state}, not RUNNING: {decision.action} skipped")
        return Plan((("scontrol", "suspend", jid),), "applied",
                    f"job {jid}: power-gated, suspended ({decision.reason})")
    if job.state != "SUSPENDED":
        return Plan((), "skipped", f"job {jid} is {job.state}, not SUSPENDED: {decision.action} skipped")
    if booked is None:
        return Plan((), "kept_suspended", f"job {jid}: suspended by an operator, not by nodeshare: "
                    "not resumed, the suspend stays")
    if job.suspended_at is None:
        return Plan((), "kept_suspended", f"job {jid}: Slurm does not say when it was suspended (squeue --json): "
                    "not resumed on a guess, an operator resumes it")
    if not booked.ours(job.suspended_at):
        return Plan((), "kept_suspended", f"job {jid}: suspended or resumed at {job.suspended_at}, not when "
                    f"nodeshare suspended it ({booked.suspended_at or booked.tried_at}): an operator's; not resumed")
    return Plan((("scontrol", "resume", jid),), "applied", f"job {jid}: power found, resumed ({decision.reason})")


def _epoch(value: object) -> int | None:
    """A time field of ``squeue --json``: an integer (Slurm 22.05 to 23.02) or ``{"set", "infinite",
    "number"}`` (23.11 and later); 0 or unset: never."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set") and not value.get("infinite") else None
    return value if type(value) is int and value > 0 else None


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

    def suspended_at(self, job_id: str) -> int | None:
        """When Slurm last suspended or resumed the job (epoch seconds; None: never, or Slurm cannot
        say). ``squeue --json``: ``scontrol show job -o`` prints ``SuspendTime=`` after the job's
        name, which a user can make look like one (measured on 22.05); squeue's formats have no such
        field. A Slurm not reached raises (the batch is tried again)."""
        try:
            jobs = json.loads(self._run("squeue", "--json", "-t", "all", "-j", job_id)).get("jobs", [])
        except RuntimeError as exc:
            if any(s in str(exc) for s in UNREACHABLE):
                raise
            if "Invalid job id" in str(exc):
                return None
            log.error("squeue --json failed (%s): job %s is not resumed (its suspend cannot be dated)", exc, job_id)
            return None
        except (ValueError, AttributeError) as exc:
            log.error("squeue --json printed no job list (%s): job %s is not resumed", exc, job_id)
            return None
        for j in jobs if isinstance(jobs, list) else ():
            if isinstance(j, dict) and str(j.get("job_id")) == job_id:
                return _epoch(j.get("suspend_time"))
        return None

    def waiting(self) -> list[Waiting]:
        """Every job Slurm lists, with its reason and whether it is pending (``squeue --json``; Slurm
        22.05 ignores ``-t`` with ``--json``, so the state is read here: a string up to 23.02, a
        list of the state and its flags from 23.11). A Slurm not reached, an answer that is not a
        job list, or one that reports errors raises RuntimeError: a failed listing must not read as
        "no job is pending"."""
        try:
            answer = json.loads(self._run("squeue", "--json", "-t", "PENDING"))
        except ValueError as exc:
            raise RuntimeError(f"squeue --json printed no JSON ({exc})") from None
        jobs = answer.get("jobs") if isinstance(answer, dict) else None
        if not isinstance(jobs, list) or answer.get("errors"):
            said = answer.get("errors") if isinstance(answer, dict) else answer
            raise RuntimeError(f"squeue --json gave no job list: {str(said)[:200]}")
        out = []
        for j in jobs:
            if not isinstance(j, dict):
                continue
            state = j.get("job_state")
            single = not _epoch(j.get("array_job_id")) and not _epoch(j.get("het_job_id"))
            out.append(Waiting(str(j.get("job_id")), str(j.get("state_reason", "")), single,
                               "PENDING" in (state if isinstance(state, list) else [state])))
        return out

    def nodes(self) -> list[dict[str, str]]:
        return parse_nodes(self._run("scontrol", "show", "node", "-o"))

    def run(self, command: Sequence[str]) -> None:
        self._run(*command)


class SlurmScheduler(BatchSink):
    """Follows ``decisions.placement`` (and the gating decisions of ``decisions.power``) and applies
    each decision to Slurm; offsets are committed after Slurm accepted the batch's commands."""

    def __init__(self, settings: Settings, commands: SchedulerCommands, on_plan: OnPlan | None = None,
                 dead_letters: Any = None, book: SuspendBook | None = None,
                 clock: Callable[[], float] = time.time, decided: DecidedBook | None = None) -> None:
        super().__init__(settings, [DECISIONS_PLACEMENT.name, DECISIONS_POWER.name], "slurm-scheduler",
                         max_batch=100, max_delay_s=0.1)
        self.power_topic = settings.topic(DECISIONS_POWER.name)
        self.commands = commands
        self.on_plan = on_plan
        self.dead_letters = dead_letters  # an EventProducer; None: a refusal is only logged and counted
        self._letters = 0  # dead letters sent since the last flush
        self.book = book if book is not None else SuspendBook()  # the jobs this adapter suspended
        self.clock = clock  # epoch seconds, the controller's (Slurm's suspend times are its)
        self.outcomes: dict[str, int] = {"applied": 0, "kept_held": 0, "kept_suspended": 0, "skipped": 0,
                                         "refused": 0, "undecodable": 0, "released_unplaced": 0}
        self.release_after_s = settings.placement_release_after_s
        self.decided = decided if decided is not None else DecidedBook()  # jobs answered (or swept)
        self.held_since: dict[str, float] = {}  # job -> the first sweep that saw it held, not answered
        #: one thread applies decisions, another sweeps: a job is released by one of them at a time
        self.acting = threading.Lock()
        metrics.SLURM_PLACEMENTS.labels("released_unplaced")  # a series from the start: the alert sees the first

    def write(self, messages: list[Message]) -> None:
        with self.acting:
            self._write(messages)
            self._save_book()

    def _write(self, messages: list[Message]) -> None:
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
                    if decision.action is PowerAction.RELEASE:
                        self.book.drop(decision.job_id)  # it ended: nothing of it to resume
                    continue  # caps: the node agents' business
                p = self._power(m, decision)
            else:
                p = self._apply(m, decision, plan(decision, self.commands.job(decision.job_id)))
                if p.outcome != "refused" and self.release_after_s > 0:  # answered: never released by the sweep
                    self.decided.note(decision.job_id, self.clock())  # (a refused one fails open later)
            self.outcomes[p.outcome] += 1
            metrics.SLURM_PLACEMENTS.labels(p.outcome).inc()
            level = {"skipped": log.warning, "kept_suspended": log.warning,
                     "refused": log.error}.get(p.outcome, log.info)
            level(p.why, extra=fields(job_id=decision.job_id))
            if self.on_plan is not None:
                self.on_plan(decision, p)
        if self.dead_letters is not None and self._letters:
            self.dead_letters.flush(30)  # a broker round trip only when this batch refused something
            self._letters = 0

    def _apply(self, m: Message, decision: PlacementDecision | PowerDecision, p: Plan) -> Plan:
        """Run the plan's commands; a command Slurm refuses is a dead letter (the plan's outcome
        ``refused``) and the later ones are not run. A Slurm not reached raises."""
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
        return p

    def _power(self, m: Message, decision: PowerDecision) -> Plan:
        """A gating decision applied, with the book kept: the job entered (with the time the attempt
        began) before its suspend runs and completed with Slurm's suspend time after; dropped once
        resumed, or resumed or suspended by someone else, or gone."""
        jid = decision.job_id
        job = self.commands.job(jid)
        if job is not None and job.state == "SUSPENDED":
            job = dataclasses.replace(job, suspended_at=self.commands.suspended_at(jid))
        booked = self.book.jobs.get(jid)
        p = power_plan(decision, job, booked)
        if decision.action is PowerAction.SUSPEND:
            if p.outcome == "applied" and p.commands:
                booked = Suspended(int(self.clock()))
                self.book.put(jid, booked)  # before it runs: a restart in between can still tell it is ours
                p = self._apply(m, decision, p)
            if p.outcome == "applied" and booked is not None:
                # a suspend completed after a restart: its time was read with the job; one just run: read it now
                at = self.commands.suspended_at(jid) if p.commands or job is None else job.suspended_at
                if booked.ours(at):
                    self.book.put(jid, Suspended(booked.tried_at, at))
                else:  # kept as the attempt: the resume then waits for Slurm to date it, or an operator
                    log.error("job %s: suspended, but Slurm dates its suspend %s (the attempt began at %d): "
                              "it will not be resumed on a guess", jid, at, booked.tried_at)
            elif p.outcome == "refused" or (booked is not None and booked.suspended_at is None
                                            and job is not None and job.state == "SUSPENDED"):
                self.book.drop(jid)  # refused, or an attempt that did not make the suspend Slurm shows
            return p
        p = self._apply(m, decision, p)
        if p.outcome != "refused":
            self.book.drop(jid)  # resumed, by the adapter or by someone else, suspended again by someone else, gone
        return p

    def release_unplaced(self, done: Callable[[], bool] = lambda: False) -> list[str]:
        """Fail open (see the module's docstring): release the held jobs ``unplaced_due`` names, until
        ``done``. Returns the released jobs. A job Slurm no longer holds when its release runs is
        skipped with a warning; a Slurm not reached, or a listing that failed, raises."""
        if self.release_after_s <= 0:
            return []
        listed_at = self.clock()
        waiting = self.commands.waiting()
        now = self.clock()
        with self.acting:  # forget the jobs Slurm no longer lists, not an answer noted since the listing
            self.decided.keep({w.job_id for w in waiting}, before=listed_at)
            self._save_book()
        held = {w.job_id for w in waiting if w.pending and w.reason in OWN_HOLDS}
        self.held_since = {j: self.held_since.get(j, now) for j in held}
        released = []
        for jid in unplaced_due(waiting, now, self.held_since, self.decided.jobs, self.release_after_s):
            if done():
                break
            with self.acting:
                if jid in self.decided.jobs:
                    continue  # answered while the list was read
                self.decided.note(jid, now)  # first: a crash after the release must not undo a later hold
                self._save_book()
                try:
                    self.commands.run(("scontrol", "release", jid))
                except RuntimeError as exc:
                    if any(u in str(exc) for u in UNREACHABLE):
                        raise
                    log.warning("job %s: not released to Slurm's scheduling (%s)", jid, exc, extra=fields(job_id=jid))
                    continue
            released.append(jid)
            self.outcomes["released_unplaced"] += 1
            metrics.SLURM_PLACEMENTS.labels("released_unplaced").inc()
            log.warning("job %s: held %.0f s with no placement decision: released to Slurm's own scheduling "
                        "(placement fails open; is the stream worker running, and can it reach the broker?)", jid,
                        now - self.held_since[jid], extra=fields(job_id=jid))
        return released

    def _save_book(self) -> None:
        """The decided book to its file; a file that cannot be written is logged and tried again at
        the next change (kept in memory: placement goes on; a restart before it is written may
        release a delayed job, which fails open)."""
        try:
            self.decided.save()
        except OSError as exc:
            log.error("the decided book could not be written (%s): kept in memory, tried again", exc)

    def _refused(self, m: Message, why: str) -> None:
        metrics.DEAD_LETTERS.labels(metrics.REJECTED).inc()
        if self.dead_letters is None:
            return
        topic, partition, offset = position(m)
        _, ts = m.timestamp()
        self.dead_letters.send(dead_letter(topic, partition, offset, m.key(), m.value(), ts / 1000, why,
                                           field="nodes", source=SOURCE))
        self._letters += 1


def run_scheduler(settings: Settings, commands: SchedulerCommands, stop: threading.Event, *, llc_ways: int,
                  mem_bandwidth_gbps: float, on_plan: OnPlan | None = None,
                  nodes_every_s: float = 30.0, state_file: Path | None = None,
                  sweep_every_s: float = SWEEP_EVERY_S) -> SlurmScheduler:
    """Publish the inventory, then apply decisions until ``stop`` is set, publishing node state
    changes every ``nodes_every_s``. ``state_file``: the suspend book (None: kept in memory, so a
    restarted adapter resumes no job it suspended before)."""
    watch = NodeWatch()
    shape: dict[str, Any] = {"cluster": commands.cluster_name(), "llc_ways": llc_ways,
                             "mem_bandwidth_gbps": mem_bandwidth_gbps}
    with EventProducer(settings, client_id="nodeshare-slurm-scheduler") as producer:
        scheduler = SlurmScheduler(settings, commands, on_plan, dead_letters=producer,
                                   book=SuspendBook.load(state_file),
                                   decided=DecidedBook.load(None if state_file is None
                                                            else state_file.with_name("decided.json")))
        done = threading.Event()
        # first, so that held jobs fail open even while the broker cannot be reached
        sweeper = threading.Thread(target=_sweep, args=(scheduler, done, sweep_every_s), name="slurm-fail-open",
                                   daemon=True)
        sweeper.start()
        try:
            nodes = publish_inventory(producer, commands, watch, **shape)
            log.info("published %d Slurm nodes on cluster.inventory: %s", len(nodes), ", ".join(n.node for n in nodes))
        except Exception as exc:  # the broker not reached: the watcher publishes them when it is
            log.error("Slurm's nodes not published yet (%s): tried again every %.0f s", exc, nodes_every_s)
        watcher = threading.Thread(target=watch_nodes, args=(producer, commands, watch, done),
                                   kwargs={"every_s": nodes_every_s, **shape}, name="slurm-nodes", daemon=True)
        watcher.start()
        try:
            scheduler.run(stop)
        finally:
            done.set()
            watcher.join(35)
            sweeper.join(35)
    return scheduler


def _sweep(scheduler: SlurmScheduler, done: threading.Event, every_s: float) -> None:
    """``release_unplaced`` every ``every_s`` until ``done``; a failed sweep is logged and tried again."""
    while not done.wait(every_s):
        try:
            scheduler.release_unplaced(done.is_set)
        except Exception as exc:  # Slurm or the book's file: the next sweep tries again, the adapter goes on
            log.error("placement fail-open sweep failed (%s): tried again in %.0f s", exc, every_s)
