"""The node agent closes the block stream of every job the resource manager says ran on its node.

A job is charged once its terminal event has arrived and every node it lists has closed its block
stream with a ``JobLeftNode`` marker (``streams.core.accounting``). The agent's rescan sends a
marker for each job it saw run; a job shorter than the rescan, or a node of a multi-node job where
nothing of the job ever ran, is never seen, and would hold its charge for ever. So the agent also
follows ``jobs.lifecycle`` (``LifecycleFollower``, committed offsets) and, for each terminal event
of a run that lists its node, closes the stream of a job it never saw: a marker with no block, at
the run's end time, spooled like every other record.

One marker per run and node, whatever the order of events (``ClosedJobs``):

* a job open in the agent's books is left to the rescan, which closes it when it leaves;
* a run a marker was already sent for (one whose time is at or after the run's start) is skipped:
  the fold takes a second marker with another time on a closed stream for a new run of a requeued job;
* a job closed from its terminal event is not taken up by the rescan again (processes Slurm has not
  reaped yet) until a later run of it starts on this node (a requeued job: its ``started`` event).

What was sent is kept in the spool's meta, in the transaction that spools the marker, so a
restarted agent sends no marker twice. Each record is kept for ``KEEP``; a terminal event that ended
earlier than that is not acted on, since its record may be gone (a job that waited so long for its
marker is a matter for an operator).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from nodeshare.schemas import DecodeError, JobEvent, JobState, decode
from nodeshare.schemas.catalog import JOBS_LIFECYCLE

from .follower import Follower
from .spool import SpoolFull

log = logging.getLogger(__name__)

#: How long the agent remembers a marker it sent, and how old a terminal event it still acts on.
#: Longer than a Slurm source's outage or an agent's downtime is expected to last.
KEEP = timedelta(days=7)
#: The spool meta rows that hold the records, one per job: ``closed/<job id>``.
META_PREFIX = "closed/"


@dataclass
class Closed:
    """The last marker this node sent for one job."""

    at: datetime  # the marker's event time
    unseen: bool  # sent from a terminal event, for a run the agent never saw

    def dump(self) -> dict[str, Any]:
        return {"at": self.at.isoformat(), "unseen": self.unseen}

    @classmethod
    def load(cls, row: dict[str, Any]) -> Closed:
        return cls(datetime.fromisoformat(row["at"]), bool(row["unseen"]))


class ClosedJobs:
    """The markers a node sent, and what follows for the next lifecycle event or rescan. No I/O."""

    def __init__(self, node: str, rows: dict[str, dict[str, Any]]) -> None:
        self.node = node
        self.jobs = {job_id: Closed.load(row) for job_id, row in rows.items()}

    def to_close(self, event: JobEvent, open_jobs: Container[str], now: datetime) -> bool:
        """A terminal event of a run on this node that no marker closed, of a job not open here."""
        if not event.ran or self.node not in event.nodes or event.job_id in open_jobs:
            return False
        assert event.start_time is not None and event.end_time is not None  # event.ran
        if event.end_time < now - KEEP:
            return False
        last = self.jobs.get(event.job_id)
        return last is None or last.at < event.start_time

    def reopens(self, event: JobEvent) -> bool:
        """A later run of a job closed from its terminal event started here: the rescan may take it up."""
        last = self.jobs.get(event.job_id)
        return (event.state is JobState.STARTED and self.node in event.nodes and last is not None and last.unseen
                and event.start_time is not None and event.start_time > last.at)

    def shut(self, job_id: str) -> bool:
        """The rescan does not take this job up: its run was closed from its terminal event."""
        last = self.jobs.get(job_id)
        return last is not None and last.unseen

    def record(self, job_id: str, closed: Closed, now: datetime) -> tuple[dict[str, Any], list[str]]:
        """Note a marker: the meta to write with it, and the names of the records too old to keep."""
        self.jobs[job_id] = closed
        stale = [j for j, c in self.jobs.items() if c.at < now - KEEP and j != job_id]
        for j in stale:
            del self.jobs[j]
        return {META_PREFIX + job_id: closed.dump()}, [META_PREFIX + j for j in stale]


class LifecycleFollower(Follower):
    """Hands each lifecycle event naming ``node`` to ``on_event`` (the agent's ``job_event``),
    which must be idempotent: offsets are committed after each batch (``Follower.commits``)."""

    topic_name = JOBS_LIFECYCLE.name
    purpose = "lifecycle"
    commits = True

    def __init__(self, settings: Any, node: str, on_event: Callable[[JobEvent], None]) -> None:
        super().__init__(settings, node)
        self.on_event = on_event

    def handle(self, value: bytes | None, write: bool, topic: str | None = None) -> None:
        try:
            event = decode(JOBS_LIFECYCLE, value)
        except DecodeError as exc:  # the worker dead-letters it; here it is skipped
            log.warning("jobs.lifecycle: skipped a record that does not decode: %s", exc.reason)
            return
        if not isinstance(event, JobEvent) or self.node not in event.nodes:  # a charge adjustment: not a node's
            return
        while True:
            try:
                self.on_event(event)
                return
            except SpoolFull as exc:  # the marker waits for room; the offset is not committed before it
                log.error("job %s: its marker waits for room in the spool: %s", event.job_id, exc)
                if self._stop.wait(1.0):
                    raise

    def settle(self) -> None:
        """Nothing to settle: every event is acted on as it is read."""
