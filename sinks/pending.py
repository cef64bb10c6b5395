"""Ended jobs without a charge: what the archive says ended that the ledger has not charged, and why.

A job is charged once its terminal event has arrived and every node that event names has closed the
job's block stream with a ``JobLeftNode`` marker (docs/charges.md). A node that never sends its
marker (an agent lost with its spool, a marker refused) holds the charge back for ever, and nothing
else would show it: the audit recomputes charges, and a job that yields none is no mismatch. This
module reads the archive's ``jobs.lifecycle`` records (every terminal event of a job that ran), keeps
the jobs the ledger has no row of, folds their archived ``node.ipc`` records with the worker's own
reducer and names, per job, each node whose stream is still open or was never seen.

Its source is the archive and the ledger, never the broker: what the archive sink has not flushed
yet (at most its batch interval) is not seen. ``nodeshare audit`` counts these jobs as missing
charges; ``nodeshare charges --pending`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from nodeshare.schemas import JobEvent
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.schemas.serde import DecodeError, decode_model
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_states

from .archive import ParquetArchive


@dataclass(frozen=True)
class PendingJob:
    """An ended job the ledger has no charge of, and why it has none."""

    job_id: str
    state: str
    end_time: datetime
    nodes: int  # nodes its terminal event names
    #: each node whose stream holds the charge back: (node, blocks counted there; None: never seen)
    waiting: tuple[tuple[str, int | None], ...]
    #: the archive yields a charge for it (so the ledger lost it: a sink, not a node, is at fault)
    charge_in_archive: bool = False

    @property
    def reason(self) -> str:
        if self.charge_in_archive:
            return "the archive yields its charge, the ledger lacks it (the ledger sink lost or has not written it)"
        if not self.waiting:
            return "no node holds it back, yet the fold produced no charge"
        return "; ".join(f"node {n}: never seen (no block, no JobLeftNode marker)" if b is None
                         else f"node {n}: block stream open ({b} blocks, no JobLeftNode marker)"
                         for n, b in self.waiting)

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "state": self.state, "end_time": self.end_time.isoformat(),
                "nodes": self.nodes, "waiting": [{"node": n, "blocks": b} for n, b in self.waiting],
                "reason": self.reason}


def ended_jobs(archive: ParquetArchive) -> dict[str, JobEvent]:
    """Each job's latest terminal event of a run (ended, failed, or cancelled after it started) in the
    archive's ``jobs.lifecycle``, by job id; records that do not decode are left out (the worker
    dead-lettered them)."""
    out: dict[str, JobEvent] = {}
    for _, ev in archive.events([JOBS_LIFECYCLE.name]):
        if ev.value is None:
            continue
        try:
            e = decode_model(JobEvent, ev.value)
        except DecodeError:
            continue
        if e.ran:
            out[e.job_id] = e
    return out


def pending_jobs(archive: ParquetArchive, charged: set[str], policy: PricingPolicy,
                 ended_from: datetime | None = None, ended_to: datetime | None = None) -> list[PendingJob]:
    """Every job the archive says ended (end time within [``ended_from``, ``ended_to``) when given)
    whose id is not in ``charged`` (the ledger's jobs), with the nodes holding its charge back, by
    job id. Folds only those jobs' archived records."""
    ended = {j: e for j, e in ended_jobs(archive).items() if j not in charged
             and (ended_from is None or (e.end_time is not None and e.end_time >= ended_from))
             and (ended_to is None or (e.end_time is not None and e.end_time < ended_to))}
    if not ended:
        return []
    messages = [(Origin(topic, ev.partition, ev.offset), ev.key, ev.value, ev.timestamp_ms / 1000)
                for topic, ev in archive.events([NODE_IPC.name, JOBS_LIFECYCLE.name], {j.encode() for j in ended})]
    accounts, produced = fold_states(messages, policy)
    yielded = {(o.key or b"").decode(errors="replace") for o in produced}
    out = []
    for job, event in sorted(ended.items()):
        account = accounts.get(job.encode())
        waiting = tuple(account.waiting_for()) if account is not None else tuple((n, None) for n in event.nodes)
        assert event.end_time is not None  # JobEvent.ran
        out.append(PendingJob(job, event.state.value, event.end_time, len(event.nodes), waiting,
                              charge_in_archive=job in yielded))
    return out
