"""Job lifecycle from a real Slurm.

Three controller-side hooks (``producers.slurm_hooks``, installed by ``nodeshare slurm
install-hooks``) each drop one file per event, the hook's whole environment NUL-separated, into an
events directory: no Python, no network, always exit 0 (a failing PrologSlurmctld would hold the
job). The source turns files into ``JobEvent`` records and deletes a file only after the broker acknowledged its event:

* ``prolog_ctld`` (PrologSlurmctld) -> started; the file name carries the time in nanoseconds;
* ``jobcomp`` (JobCompType=jobcomp/script) -> ended / failed / cancelled, with Slurm's own
  SUBMIT, START and END;
* ``epilog_ctld`` (EpilogSlurmctld) -> terminal only when jobcomp/script is not configured; its
  start time is the prolog's, kept in a state file in the events directory
  (``.nodeshare-started.json``) that is durable before the prolog's file is deleted, so a job
  that started before the source restarted still ends;
* submissions: no hook sees them, so ``squeue`` is polled;
* a job Slurm ended with NODE_FAIL: besides its terminal event, a ``NodeDown`` on node.ipc for each
  of its nodes that ``sinfo`` reports down, failed or not responding, so the job is charged from
  what that node sent before it went (``streams.core.accounting``) rather than never; its nodes
  that do not read lost yet are asked about again for a while (``slurm_lost_nodes``).

Slurm versions with jobcomp/kafka (23.02+) send one JSON record per finished job;
``from_jobcomp_json`` parses one, but no command consumes that topic: jobcomp/script is the path.
Event ids are ``slurm/<cluster>/<job id>/<state>``, so a file processed twice (the source died
between the ack and the delete) is de-duplicated downstream.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nodeshare.producers.slurm_lost_nodes import DEFAULT_WAIT_S, WATCH_FILE, LostNodeWatch, nodes_down, watch_key
from nodeshare.producers.slurm_node_counts import NodeRange, parse_node_ranges
from nodeshare.producers.slurm_started import load_started, save_started
from nodeshare.runtime import metrics
from nodeshare.runtime.logs import fields
from nodeshare.schemas import TERMINAL_STATES, JobEvent, JobState, NodeDown
from nodeshare.streams.core.pricing import parse_tres

log = logging.getLogger("nodeshare.slurm")

_FILE = re.compile(r"^(\d+)-(prolog_ctld|epilog_ctld|jobcomp)-\d+$")

# Slurm job states (squeue/jobcomp) -> lifecycle states
_TERMINAL = {
    "COMPLETED": JobState.ENDED, "CANCELLED": JobState.CANCELLED, "PREEMPTED": JobState.CANCELLED,
    "DEADLINE": JobState.CANCELLED, "FAILED": JobState.FAILED, "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED, "OUT_OF_MEMORY": JobState.FAILED, "BOOT_FAIL": JobState.FAILED,
}

#: squeue states of a job that has run and is over (or on its way out): no submission to publish
#: for it. A restarted source finds them in ``squeue -t all`` (kept MinJobAge after the end).
_OVER = frozenset(_TERMINAL) | {"COMPLETING", "REVOKED", "SPECIAL_EXIT", "STAGE_OUT"}

class HookFileError(ValueError):
    """A hook file that cannot become an event (moved aside to ``bad/`` with this reason)."""



def total_cpus(cpus_per_node: str) -> int:
    """SLURM_JOB_CPUS_PER_NODE ('4(x2),2') -> total CPUs (10)."""
    total = 0
    for part in cpus_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise HookFileError(f"unreadable SLURM_JOB_CPUS_PER_NODE {cpus_per_node!r}")
        total += int(m.group(1)) * int(m.group(2) or 1)
    return total


def _name(value: str | None, default: str) -> str:
    return default if not value or value == "(null)" else value


def _epoch(value: str | None) -> datetime | None:
    return None if not value or not value.isdigit() or value == "0" else datetime.fromtimestamp(int(value), UTC)


def _exit_failed(code: str | None) -> bool:
    """'0:0' or '0' -> False; '1:0' (exit 1) or '0:9' (killed by signal 9) -> True."""
    return any(p.strip() not in ("", "0") for p in (code or "0").split(":"))


@dataclass(frozen=True)
class HookEvent:
    hook: str
    at: datetime
    env: Mapping[str, str]


def read_hook_file(path: Path) -> HookEvent:
    m = _FILE.match(path.name)
    if not m:
        raise HookFileError(f"{path.name}: not a hook file name (<ns>-<hook>-<pid>)")
    env = {}
    for item in path.read_bytes().split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            env[key] = value
    return HookEvent(m.group(2), datetime.fromtimestamp(int(m.group(1)) / 1e9, UTC), env)


Hostnames = Callable[[str], tuple[str, ...]]


class ControllerAway(Exception):
    """slurmctld did not answer a question an event needs (a job's TRES): ask again later."""

#: A job's allocated TRES as the controller holds it (job id -> Slurm's names and counts; {}: unknown)
JobTres = Callable[[str], dict[str, float]]

def event_from_hook(h: HookEvent, hostnames: Hostnames, *, terminal_from_epilog: bool = False,
                    started: Mapping[str, datetime] | None = None, tres: JobTres | None = None) -> JobEvent | None:
    """The lifecycle event a hook file stands for (None for one that carries none). An epilog's
    terminal event takes its start time from ``started`` (job id -> the prolog's time). ``tres``
    gives the job's allocated TRES (``billing`` among them: what the partition's TRESBillingWeights
    make of it, the count ``sreport`` bills), carried by a started or terminal event with the job's
    partition (schema 8); without it, or where the controller no longer knows the job, none."""
    e = h.env

    def allocated(job_id: str) -> dict[str, float]:
        return tres(job_id) if tres is not None else {}

    if h.hook == "jobcomp":
        job_id, state_name = e.get("JOBID"), e.get("JOBSTATE", "")
        if not job_id:
            raise HookFileError("jobcomp record without JOBID")
        state = _TERMINAL.get(state_name.split()[0] if state_name else "")
        if state is None:
            raise HookFileError(f"job {job_id}: jobcomp state {state_name!r} is not a final state")
        if state is JobState.ENDED and _exit_failed(e.get("EXITCODE")):
            state = JobState.FAILED
        end = _epoch(e.get("END")) or h.at
        return _event(e.get("CLUSTER"), job_id, state, end, user=e.get("USERNAME"), account=e.get("ACCOUNT"),
                      program=e.get("JOBNAME"), cores=e.get("PROCS"), nodes=hostnames(e.get("NODES", "")),
                      submit=_epoch(e.get("SUBMIT")), start=_epoch(e.get("START")), end=end,
                      partition=e.get("PARTITION"), tres=allocated(job_id))
    job_id = e.get("SLURM_JOB_ID")
    if not job_id:
        raise HookFileError(f"{h.hook} hook without SLURM_JOB_ID")
    try:
        cores = total_cpus(e.get("SLURM_JOB_CPUS_PER_NODE", "1"))
    except HookFileError as exc:
        raise HookFileError(f"job {job_id}: {exc}") from None
    nodes = hostnames(e.get("SLURM_JOB_NODELIST", ""))

    def event(state: JobState, start: datetime | None = None, end: datetime | None = None) -> JobEvent:
        return _event(e.get("SLURM_CLUSTER_NAME"), job_id, state, h.at, user=e.get("SLURM_JOB_USER"),
                      account=e.get("SLURM_JOB_ACCOUNT"), program=e.get("SLURM_JOB_NAME"), cores=str(cores),
                      nodes=nodes, partition=e.get("SLURM_JOB_PARTITION"), tres=allocated(job_id), start=start,
                      end=end)

    if h.hook == "prolog_ctld":
        return event(JobState.STARTED, start=h.at)
    if not terminal_from_epilog:
        return None
    start = (started or {}).get(job_id)
    if start is None:
        raise HookFileError(f"job {job_id}: epilog without a known start (its prolog event was not seen)")
    failed = _exit_failed(e.get("SLURM_JOB_EXIT_CODE2", e.get("SLURM_JOB_EXIT_CODE")))
    return event(JobState.FAILED if failed else JobState.ENDED, start=start, end=h.at)


def _event(cluster: str | None, job_id: str, state: JobState, at: datetime, *, user: str | None,
           account: str | None, program: str | None, cores: str | None, nodes: tuple[str, ...],
           submit: datetime | None = None, start: datetime | None = None, end: datetime | None = None,
           partition: str | None = None, tres: dict[str, float] | None = None,
           nodes_requested: int | None = None, nodes_max: int | None = None) -> JobEvent:
    cluster = _name(cluster, "slurm")
    if not cores or not cores.isdigit() or int(cores) < 1:
        raise HookFileError(f"job {job_id}: no CPU count ({cores!r})")
    return JobEvent(
        event_id=f"slurm/{cluster}/{job_id}/{state.value}", source=f"slurm/{cluster}", event_time=at,
        job_id=job_id, state=state, user=_name(user, "unknown"), account=_name(account, "default"),
        program=_name(program, "unknown"), cores=int(cores), nodes=nodes, submit_time=submit, start_time=start,
        end_time=end, partition=partition or None, tres=tres or {}, nodes_requested=nodes_requested,
        nodes_max=nodes_max,
    )


def from_jobcomp_json(record: Mapping[str, Any], cluster: str = "slurm") -> JobEvent:
    """A jobcomp/kafka (Slurm >= 23.02) JSON job record -> its terminal event. Fields used: jobid,
    username, account, job_name, total_cpus, nodes (one node list string), state, exit_code,
    @submit/@start/@end (ISO 8601; taken as UTC when they carry no zone)."""
    def when(key: str) -> datetime | None:
        v = record.get(key)
        if not v:
            return None
        t = datetime.fromisoformat(str(v))
        return t if t.tzinfo else t.replace(tzinfo=UTC)

    try:
        job_id = str(record["jobid"])
        state = _TERMINAL[str(record["state"]).split()[0]]
    except KeyError as exc:
        raise HookFileError(f"jobcomp record: missing or unknown {exc}") from None
    if state is JobState.ENDED and _exit_failed(str(record.get("exit_code", "0"))):
        state = JobState.FAILED
    end = when("@end") or datetime.now(UTC)
    nodes = record.get("nodes") or ""
    return _event(str(record.get("cluster") or cluster), job_id, state, end, user=record.get("username"),
                  account=record.get("account"), program=record.get("job_name"),
                  cores=str(record.get("total_cpus", "")), nodes=tuple(n for n in str(nodes).split(",") if n),
                  submit=when("@submit"), start=when("@start"), end=end)


@dataclass
class SlurmCommands:
    """The Slurm client commands the source uses (environment: SLURM_CONF and friends)."""

    env: dict[str, str] | None = None

    def _run(self, *args: str) -> str:
        try:
            # errors="replace": a job's name, path or comment need not be UTF-8, and one that is not
            # must not stop the source (it reads every job's record in one listing)
            out = subprocess.run(list(args), capture_output=True, text=True, errors="replace", timeout=30,
                                 env=self.env)
        except subprocess.TimeoutExpired:  # a controller that does not answer: not reached, tried again
            raise RuntimeError(f"{' '.join(args)} did not answer within 30 s (Socket timed out)") from None
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def hostnames(self, expression: str) -> tuple[str, ...]:
        if not expression or expression == "(null)":
            return ()
        if re.fullmatch(r"[\w.-]+", expression):  # a single node: no need to ask
            return (expression,)
        return tuple(self._run("scontrol", "show", "hostnames", expression).split())

    def job_tres(self, job_id: str) -> dict[str, float]:
        """The job's allocated TRES from the controller (``scontrol show job``: TRES, or AllocTRES in
        later releases); {} when it no longer knows the job (MinJobAge after its end: the worker then
        takes the TRES of the run's started event). Raises ControllerAway when the controller does
        not answer: the hook file is read again at the next poll, not published without its TRES."""
        try:
            line = self._run("scontrol", "show", "job", "-o", job_id)
        except RuntimeError as exc:
            if "Invalid job id" not in str(exc):
                raise ControllerAway(f"job {job_id}: no TRES from the controller: {exc}") from None
            log.warning("job %s: the controller no longer knows the job: its event carries no TRES", job_id)
            return {}
        m = re.search(r"(?:^|\s)(?:Alloc)?TRES=(\S+)", line)
        return parse_tres(m.group(1)) if m else {}

    def annotate(self, job_id: str, comment: str) -> None:
        """Write ``comment`` into the finished job's AdminComment in Slurm's accounting database
        (``annotate_command``; ``sacct -o AdminComment`` shows it). Needs slurmdbd and a Slurm
        administrator; raises RuntimeError with sacctmgr's own words when it fails."""
        self._run(*annotate_command(job_id, comment))

    def cluster_name(self) -> str:
        for line in self._run("scontrol", "show", "config").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "ClusterName":
                return _name(value.strip(), "slurm")
        return "slurm"

    def node_states(self, nodes: tuple[str, ...]) -> dict[str, str]:
        """Slurm's state of each of these nodes (sinfo's %T, lower case: ``idle``, ``down*``, ...)."""
        if not nodes:
            return {}
        text = self._run("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T")
        return dict(line.split("|", 1) for line in text.splitlines() if line.count("|") == 1)

    def queue(self) -> list[dict[str, str]]:
        """Every job the controller still knows, with submit details. The job name is last: it may
        hold a ``|``."""
        keys = ("job_id", "user", "account", "cores", "submit", "state", "program")
        text = self._run("squeue", "-h", "-t", "all", "-o", "%i|%u|%a|%C|%V|%T|%j")
        return [dict(zip(keys, line.split("|", 6), strict=True)) for line in text.splitlines() if line.count("|") >= 6]

    def node_ranges(self) -> dict[str, NodeRange]:
        """Each job's node count from one ``scontrol show job -o`` (``slurm_node_counts``); raises
        ControllerAway when the controller does not answer."""
        try:
            return parse_node_ranges(self._run("scontrol", "show", "job", "-o"))
        except RuntimeError as exc:
            raise ControllerAway(f"no node counts from the controller: {exc}") from None


def annotate_command(job_id: str, comment: str) -> tuple[str, ...]:
    """The sacctmgr command that sets a finished job's AdminComment, one of the fields of a job record
    sacctmgr may change after completion (sacctmgr(1), "SPECIFICATIONS FOR JOB"); ``scontrol update``
    refuses a finished job ("Job has already finished", measured on the test Slurm)."""
    return ("sacctmgr", "-i", "modify", "job", "where", f"JobID={job_id}", "set", f"AdminComment={comment}")


def submitted_event(row: Mapping[str, str], cluster: str, node_range: NodeRange | None = None) -> JobEvent:
    """A squeue row's submission, with the node count it asked for if known. A count the event's own
    rules refuse (more nodes than CPUs, say) is logged and left out: the job is still placed."""
    submit = datetime.fromisoformat(row["submit"]).astimezone(UTC)  # squeue prints local time

    def event(asked: NodeRange | None) -> JobEvent:
        return _event(cluster, row["job_id"], JobState.SUBMITTED, submit, user=row["user"], account=row["account"],
                      program=row["program"], cores=row["cores"], nodes=(), submit=submit,
                      nodes_requested=asked[0] if asked else None, nodes_max=asked[1] if asked else None)
    if node_range is None:
        return event(None)
    try:
        return event(node_range)
    except HookFileError:
        raise
    except ValueError as exc:
        log.warning("job %s: node count %s left out of its submission: %s", row["job_id"], node_range, exc,
                    extra=fields(job_id=row["job_id"]))
        return event(None)


#: The started map's file in the events directory: a dot name, which the source's scan skips and no
#: hook writes (their temporaries are ``.<ns>-<hook>-<pid>``).
STARTED_FILE = ".nodeshare-started.json"


@dataclass
class SlurmSource:
    """Turns hook files and squeue into lifecycle events; ``step()`` returns what to publish and
    ``done()`` forgets it after the broker acknowledged it.

    With ``terminal_from_epilog`` an epilog's event needs its job's start, which only the prolog's
    file carried, and that file is gone once its event was published. The started map is therefore
    kept in ``state_file`` (default: ``STARTED_FILE`` in the events directory), written atomically
    before a prolog's file is deleted, and loaded on start: a restarted source still ends every job
    that started before it. Asking ``sacct``/``scontrol`` instead was not chosen: their start time
    is not the prolog's (the started event already published carries the prolog's), the controller
    forgets a job MinJobAge after it ends, and sacct needs slurmdbd, which a site with only
    EpilogSlurmctld may lack."""

    events_dir: Path
    commands: SlurmCommands
    cluster: str = "slurm"
    terminal_from_epilog: bool = False
    seen_submitted: set[str] = field(default_factory=set)
    #: the node count each waiting job asked for (``SlurmCommands.node_ranges``; None: not known)
    node_counts: dict[str, NodeRange | None] = field(default_factory=dict)
    started: dict[str, datetime] = field(default_factory=dict)
    state_file: Path | None = None
    #: how long the nodes of a NODE_FAIL job that do not read lost yet are watched (``slurm_lost_nodes``)
    lost_wait_s: float = DEFAULT_WAIT_S
    watch: LostNodeWatch = field(init=False, repr=False)
    #: jobs whose terminal event is not yet acknowledged: they leave ``started`` in ``done()``
    _ended: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.state_file is None:
            self.state_file = self.events_dir / STARTED_FILE
        self.started = {**load_started(self.state_file), **self.started}
        self.watch = LostNodeWatch(self.events_dir / WATCH_FILE, self.lost_wait_s)

    def step(self, poll_queue: bool = True) -> tuple[list[JobEvent | NodeDown], list[Path]]:
        events: list[JobEvent | NodeDown] = []
        files: list[Path] = []
        if poll_queue:
            rows = self.commands.queue()
            waiting = {r["job_id"] for r in rows if r.get("state") == "PENDING"}
            new = [r for r in rows if r["job_id"] not in self.seen_submitted]
            # a waiting job's count, asked once in one call for all new ones, kept while it waits
            self.node_counts = {j: c for j, c in self.node_counts.items() if j in waiting}
            publish = True
            if any(r["job_id"] in waiting and r["job_id"] not in self.node_counts for r in new):
                try:
                    counts = self.commands.node_ranges()
                except ControllerAway as exc:  # published at the next poll, not without the counts
                    log.warning("submissions wait for the next poll: %s", exc)
                    publish = False
                else:
                    self.node_counts.update({r["job_id"]: counts.get(r["job_id"]) for r in new
                                             if r["job_id"] in waiting})
            for row in new:
                if row.get("state") in _OVER:
                    self.seen_submitted.add(row["job_id"])
                    continue  # ended already (a restarted source sees it again): its submission is history
                if publish:
                    self.seen_submitted.add(row["job_id"])
                    try:
                        events.append(submitted_event(row, self.cluster, self.node_counts.get(row["job_id"])))
                    except (HookFileError, ValueError) as exc:
                        log.error("job %s: submission not published: %s", row["job_id"], exc,
                                  extra=fields(job_id=str(row["job_id"])))
        for path in sorted(p for p in self.events_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
            try:
                hook = read_hook_file(path)
                event = event_from_hook(hook, self.commands.hostnames,
                                        terminal_from_epilog=self.terminal_from_epilog, started=self.started,
                                        tres=self.commands.job_tres)
            except ControllerAway as exc:  # the file stays, and is read again next time
                log.error("%s: %s: read again at the next poll", path.name, exc)
                continue
            except (HookFileError, ValueError, RuntimeError) as exc:
                bad = self.events_dir / "bad"
                bad.mkdir(exist_ok=True)
                path.rename(bad / path.name)
                (bad / f"{path.name}.reason").write_text(f"{exc}\n")
                log.error("%s: moved to %s: %s", path.name, bad, exc)
                metrics.SLURM_HOOK_EVENTS.labels("refused").inc()
                continue
            try:
                lost = self._lost(hook, event)
            except RuntimeError as exc:  # sinfo failed: the file stays, and is read again next time
                log.error("%s: which nodes failed is not known yet (%s): read again at the next poll", path.name, exc)
                continue
            if event is not None:
                events.append(event)
                events += lost
                if event.state is JobState.STARTED and event.start_time is not None:
                    self.started[event.job_id] = event.start_time
                elif event.state in TERMINAL_STATES:
                    self._ended.add(event.job_id)
            files.append(path)
        # nodes of NODE_FAIL jobs that did not read lost when their end was read (not those read now)
        if self.watch.jobs:
            events += self.watch.poll(self.commands.node_states,
                                      skip={watch_key(e) for e in events if isinstance(e, JobEvent) and e.end_time})
        return events, files

    def _lost(self, hook: HookEvent, event: JobEvent | None) -> list[NodeDown]:
        """The node-down records of a job Slurm ended with NODE_FAIL (none for any other)."""
        if event is None or hook.hook != "jobcomp" or not hook.env.get("JOBSTATE", "").startswith("NODE_FAIL"):
            return []
        states = self.commands.node_states(event.nodes)
        lost = nodes_down(event, states)
        self.watch.add(event, states, found=bool(lost))
        return lost

    def done(self, files: list[Path]) -> None:
        """Delete the files whose events the broker acknowledged. The started map is durable first
        (a crash after it re-reads a prolog, whose event is de-duplicated downstream); the ended
        jobs leave it after the files are gone (a crash in between leaves a stale entry, never an
        epilog without its start)."""
        if self.terminal_from_epilog and self.state_file is not None:
            save_started(self.state_file, self.started)
        self.watch.settle()  # durable before the NODE_FAIL files that started it are gone
        for path in files:
            path.unlink(missing_ok=True)
        metrics.SLURM_HOOK_EVENTS.labels("published").inc(len(files))
        if self._ended:
            for job in self._ended:
                self.started.pop(job, None)
            self._ended.clear()
            if self.terminal_from_epilog and self.state_file is not None:
                save_started(self.state_file, self.started)


def run_source(source: SlurmSource, publish: Callable[[list[JobEvent | NodeDown]], None], *, poll_s: float = 2.0,
               stop: Callable[[], bool] = lambda: False, sleep: Callable[[float], None] | None = None) -> int:
    """Publish lifecycle events until ``stop()``; ``publish`` must raise unless the broker acknowledged
    every event. Returns how many were published. Files stay until their events are acknowledged."""
    pause = sleep or time.sleep
    published = 0
    away = False
    while not stop():
        try:
            events, files = source.step()
        except RuntimeError as exc:
            # squeue failed (a loaded or restarting controller: "Socket timed out", "Unable to
            # contact"): ``step`` asks it first, before it changes anything, and every later question
            # is handled inside it. Nothing was read, so nothing is settled: the hook files stay
            # and the same poll is made again. Before, the source stopped on it for good, and every
            # job that ended after was never charged.
            if not away:
                log.error("squeue failed: lifecycle events wait until it answers (asked every %.0f s): %s",
                          poll_s, exc)
            away = True
            pause(poll_s)
            continue
        if away:
            log.warning("squeue answers again: lifecycle events resume")
            away = False
        if events:
            try:
                publish(events)
            except Exception as exc:  # broker unreachable: keep the files, ask squeue again next time
                source.seen_submitted -= {e.job_id for e in events
                                          if isinstance(e, JobEvent) and e.state is JobState.SUBMITTED}
                log.error("lifecycle events not delivered, retrying: %s", exc)
                pause(poll_s)
                continue
            published += len(events)
        source.done(files)
        pause(poll_s)
    return published
