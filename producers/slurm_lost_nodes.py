"""Which nodes a job Slurm ended with NODE_FAIL lost, and the watch that keeps asking.

Slurm ends a job with NODE_FAIL when one of its nodes fails, but ``sinfo`` does not always say so
when the job's end is read: a node that dies while slurmd's answer to a job's launch is in flight
is returned to service by that answer (ReturnToService=2, slurmctld logs ``node_did_resp: node ...
returned to service``) and reads ``idle`` until SlurmdTimeout (300 s by default) marks it not
responding; and of a job on many nodes, one can read lost before another. Without a record that
closes a lost node's stream, the job would wait for a marker its agent never sends.

So each node of a NODE_FAIL job that does not read lost when the job's end is read is watched:
``sinfo`` is asked again (every ``ask_every_s``), and each watched node that reads lost before
``wait_s`` has passed since the job's end (Slurm's END, on this machine's clock) gets its
``NodeDown``. A node still fine after that was not lost (a rebooted node's agent closes its jobs
itself from its spool). If none of the job's nodes was ever found lost, the job is named once in
an error for an operator (``nodeshare nodes down``). An extra record for a node whose marker came
changes nothing (the fold skips a closed stream); a marker after it is a new revision.

Entries are keyed by job and end time, so a requeued job's runs are watched apart. The watch is
kept in a file of the events directory (``.nodeshare-lost-nodes.json``), written when it changes
and before the hook file that started it is deleted, so a restarted source keeps watching.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from nodeshare.runtime.logs import fields
from nodeshare.schemas import JobEvent, NodeDown

log = logging.getLogger("nodeshare.slurm")

#: sinfo states of a node that is gone: Slurm took it down or failed it, or it stopped answering
#: (the trailing ``*``). A job Slurm ended with NODE_FAIL lost these of its nodes.
_LOST_NODE_STATES = frozenset({"down", "fail", "failing"})

#: The watch's file in the events directory: a dot name, which the source's scan skips.
WATCH_FILE = ".nodeshare-lost-nodes.json"

#: How long a NODE_FAIL job's nodes that read fine are watched: twice Slurm's default
#: SlurmdTimeout, after which a dead node reads not responding.
DEFAULT_WAIT_S = 600.0
#: The longest wait accepted (a day): a watch must end.
MAX_WAIT_S = 86_400.0
#: How often ``sinfo`` is asked for watched nodes (each ask makes slurmctld send its node table).
DEFAULT_ASK_EVERY_S = 30.0


def node_lost(state: str) -> bool:
    """Whether a node in this sinfo state (%T) is down, failed or not responding."""
    return state.endswith("*") or state.rstrip("*~#!%$@^-").split("+")[0] in _LOST_NODE_STATES


def nodes_down(event: JobEvent, states: Mapping[str, str], nodes: tuple[str, ...] | None = None) -> list[NodeDown]:
    """For a job Slurm ended with NODE_FAIL, a ``NodeDown`` per node of it (of ``nodes``, default
    all) in a lost state (sorted). Its id names the job and node, so a hook file processed twice
    sends a copy that changes nothing."""
    assert event.end_time is not None  # a terminal event of a job that ran
    cluster = event.source.removeprefix("slurm/")
    return [NodeDown(event_id=f"slurm/{cluster}/{event.job_id}/node_down/{node}", source=event.source,
                     event_time=event.end_time, job_id=event.job_id, node=node,
                     reason=f"Slurm ended the job with NODE_FAIL; node state {states[node]}")
            for node in sorted(event.nodes if nodes is None else nodes) if node_lost(states.get(node, ""))]


def describe(nodes: tuple[str, ...] | list[str], states: Mapping[str, str]) -> str:
    return ", ".join(f"{n} {states.get(n, 'not listed')}" for n in nodes)


def watch_key(event: JobEvent) -> str:
    """A run of a job: its id and end time (a requeued job ends more than once)."""
    assert event.end_time is not None
    return f"{event.job_id}@{event.end_time.isoformat()}"


@dataclass
class Watched:
    event: JobEvent  #: the job's terminal event (its nodes, end time, the id's cluster)
    pending: set[str]  #: its nodes not seen lost yet
    #: its nodes seen lost whose record the broker has not acknowledged yet, with the state read
    lost: dict[str, str] = field(default_factory=dict)
    found: bool = False  #: whether a record of one of its nodes was sent and acknowledged

    def past(self, now: datetime, wait_s: float) -> bool:
        return now - self.event.end_time > timedelta(seconds=wait_s)  # type: ignore[operator]


@dataclass
class LostNodeWatch:
    """The nodes of NODE_FAIL jobs that ``sinfo`` has not named lost yet (see the module's docstring).

    ``poll`` returns the records to publish: those of nodes seen lost and not acknowledged yet
    (every step, until they are) and of nodes that read lost now (``sinfo`` asked at most every
    ``ask_every_s``). ``settle``, once the broker acknowledged what the last ``poll`` returned,
    forgets the nodes they close and the runs that are done (every node sent, or the wait over
    with nothing left to send), and writes the file if anything changed."""

    path: Path | None
    wait_s: float = DEFAULT_WAIT_S
    ask_every_s: float = DEFAULT_ASK_EVERY_S
    jobs: dict[str, Watched] = field(default_factory=dict)
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC), repr=False)
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    _closing: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)
    _told: set[str] = field(default_factory=set, init=False, repr=False)
    _asked_at: float | None = field(default=None, init=False, repr=False)
    _sinfo_failing: bool = field(default=False, init=False, repr=False)
    _dirty: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.wait_s) and 0 <= self.wait_s <= MAX_WAIT_S):
            raise ValueError(f"the lost-node wait must be 0-{MAX_WAIT_S:.0f} s, not {self.wait_s}")
        if self.path is not None:
            self.jobs = {**load_watch(self.path), **self.jobs}

    def add(self, event: JobEvent, states: Mapping[str, str], found: bool) -> None:
        """Watch the nodes of this NODE_FAIL run that do not read lost in ``states``; ``found``:
        whether any of its nodes did (their records go out with its terminal event)."""
        key = watch_key(event)
        pending = {n for n in event.nodes if not node_lost(states.get(n, ""))}
        if key in self.jobs:  # its file read again (a publish failed): what reads lost now is kept
            w = self.jobs[key]
            for node in w.pending - pending:
                w.pending.discard(node)
                w.lost[node] = states[node]
                self._dirty = True
            return
        if not pending:
            return
        if self.wait_s == 0 or Watched(event, pending).past(self.clock(), self.wait_s):
            if not found and key not in self._told:  # once, though the file is read again until acknowledged
                self._told.add(key)
                self._give_up(event, states, "" if self.wait_s == 0 else
                              f"; it ended more than {self.wait_s:.0f} s ago, so it is not watched")
            return
        self.jobs[key] = Watched(event, pending, found=found)
        self._dirty = True
        log.warning("job %s ended with NODE_FAIL; nodes not reading lost yet (%s): asking sinfo again until "
                    "%.0f s after its end", event.job_id, describe(sorted(pending), states), self.wait_s,
                    extra=fields(job_id=event.job_id))

    def poll(self, node_states: Callable[[tuple[str, ...]], dict[str, str]],
             skip: set[str] | frozenset[str] = frozenset()) -> list[NodeDown]:
        """The records to publish (runs in ``skip``, whose files the same step read, are left to
        the next). A failing ``sinfo`` is logged once per outage; the records of nodes seen lost
        before are returned all the same."""
        self._closing.clear()  # only what this poll returns is settled by the next ``settle``
        now, at = self.monotonic(), self.clock()
        runs = {k: w for k, w in self.jobs.items() if k not in skip}
        asked = {k: w for k, w in runs.items() if w.pending and not w.past(at, self.wait_s)}
        if asked and (self._asked_at is None or now - self._asked_at >= self.ask_every_s):
            self._asked_at = now  # a failing sinfo is not asked more often either
            try:
                states = node_states(tuple(sorted({n for w in asked.values() for n in w.pending})))
            except RuntimeError as exc:
                if not self._sinfo_failing:
                    log.error("NODE_FAIL jobs watched for a lost node: sinfo failed (%s): asked again every "
                              "%.0f s until it answers", exc, self.ask_every_s)
                self._sinfo_failing = True
            else:
                self._sinfo_failing = False
                for w in asked.values():
                    for node in sorted(n for n in w.pending if node_lost(states.get(n, ""))):
                        w.pending.discard(node)
                        w.lost[node] = states[node]
                        self._dirty = True
        out: list[NodeDown] = []
        for key, w in sorted(runs.items()):
            if w.lost:
                sent = nodes_down(w.event, w.lost, tuple(w.lost))
                out += sent
                self._closing.update((key, d.node) for d in sent)
        return out

    def settle(self) -> None:
        """Forget what the last ``poll`` returned (the broker acknowledged it) and the runs that are
        done, and write the watch if it changed (removed once empty)."""
        for key, node in self._closing:
            if key in self.jobs and node in self.jobs[key].lost:
                del self.jobs[key].lost[node]
                self.jobs[key].found = True
                self._dirty = True
        self._closing.clear()
        at = self.clock()
        for key, w in list(self.jobs.items()):
            if not w.lost and (not w.pending or w.past(at, self.wait_s)):
                del self.jobs[key]
                self._dirty = True
                if not w.found:
                    self._give_up(w.event, {n: "fine" for n in w.pending}, f" within {self.wait_s:.0f} s of its end")
        self._told.clear()  # the files of runs given up at once are acknowledged, so gone: never read again
        if self._dirty and self.path is not None:
            save_watch(self.path, self.jobs)
        self._dirty = False

    def _give_up(self, event: JobEvent, states: Mapping[str, str], why: str) -> None:
        log.error("job %s ended with NODE_FAIL but Slurm reports none of its nodes down (%s)%s: its charge "
                  "waits for their markers, or for `nodeshare nodes down`", event.job_id,
                  describe(event.nodes, states), why, extra=fields(job_id=event.job_id))


def load_watch(path: Path) -> dict[str, Watched]:
    """The watch a previous source saved (none: empty; unreadable: moved aside, with an error)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        return {key: Watched(JobEvent.model_validate_json(entry["event"]), set(entry["pending"]),
                             {str(n): str(st) for n, st in entry["lost"].items()}, bool(entry["found"]))
                for key, entry in json.loads(text).items()}
    except (ValueError, AttributeError, TypeError, KeyError) as exc:
        aside = path.with_name(f"{path.name}.unreadable-{time.time_ns()}")
        path.replace(aside)
        log.error("%s is not a lost-node watch (%s): moved to %s; the NODE_FAIL jobs it watched need "
                  "`nodeshare nodes down` if a node of theirs was lost", path, exc, aside)
        return {}


def save_watch(path: Path, jobs: Mapping[str, Watched]) -> None:
    """Write the watch whole or not at all (the archive's atomic write); an empty one is removed."""
    from nodeshare.runtime.files import atomic_write_bytes

    if not jobs:
        path.unlink(missing_ok=True)
        return
    atomic_write_bytes(json.dumps({key: {"event": w.event.model_dump_json(), "pending": sorted(w.pending),
                                         "lost": dict(sorted(w.lost.items())), "found": w.found}
                                   for key, w in sorted(jobs.items())}).encode(), path)
