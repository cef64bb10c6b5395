"""Ended jobs without a charge: what the archive says ended that the ledger has not charged, and why.

A job is charged once its terminal event has arrived and every node that event names has closed the
job's block stream with a ``JobLeftNode`` marker (docs/charges.md). A node that never sends its
marker (an agent lost with its spool, a marker refused) holds the charge back for ever, and nothing
else would show it: the audit recomputes charges, and a job that yields none is no mismatch. This
module folds the archive's ``jobs.lifecycle`` records with the worker's own reducer (every terminal
event of a job that ran, and the revision each makes: a correction makes the next), keeps the jobs
whose latest revision the ledger lacks, folds their archived ``node.ipc`` records too and names,
per job, each node whose stream is still open or was never seen.

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
from nodeshare.schemas.signing import Verifier
from nodeshare.streams.core.accounting import Message, Origin, PricingPolicy, as_read_live, fold_states

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


def archived_input(archive: ParquetArchive, topics: list[str], keys: set[bytes] | None = None,
                   verifier: Verifier | None = None) -> list[Message]:
    """The archived messages of catalog ``topics`` (of the given keys, default all) as the fold takes
    them: each partition in offset order, the partitions merged by broker time as the live worker
    read them (``as_read_live``); with ``verifier``, each origin names the identity whose signature
    the archived ``auth`` is, as the worker's fold saw it."""
    return as_read_live((Origin(topic, ev.partition, ev.offset,
                                None if verifier is None else verifier.signer(topic, ev.key, ev.value, ev.auth)),
                         ev.key, ev.value, ev.timestamp_ms / 1000)
                        for topic, ev in archive.events(topics, keys))


def ended_jobs(archive: ParquetArchive, policy: PricingPolicy,
               verifier: Verifier | None = None) -> dict[str, tuple[JobEvent, int]]:
    """Each job whose archived ``jobs.lifecycle`` has a terminal event of a run (ended, failed, or
    cancelled after it started): its latest such event and the charge revision that event makes
    (a correction that changes a billed field makes the next one). Folded by the worker's own
    reducer, lifecycle only, so what it refused (dead letters, duplicates) counts for nothing."""
    accounts, _ = fold_states(archived_input(archive, [JOBS_LIFECYCLE.name], verifier=verifier), policy)
    return {a.job_id: (a.ends[-1].event, len(a.ends) - 1) for a in accounts.values() if a.ends}


def pending_jobs(archive: ParquetArchive, charged: dict[str, int], policy: PricingPolicy,
                 ended_from: datetime | None = None, ended_to: datetime | None = None,
                 verifier: Verifier | None = None) -> list[PendingJob]:
    """Every job the archive says ended (end time within [``ended_from``, ``ended_to``) when given)
    whose latest terminal event has no charge in the ledger (``charged``: each job's highest revision
    there), with the nodes holding that charge back, by job id. Folds only those jobs' records (with
    ``verifier``, what their signers may not have written left out, as the worker does)."""
    ended = {j: e for j, (e, revision) in ended_jobs(archive, policy, verifier).items() if charged.get(j, -1) < revision
             and (ended_from is None or (e.end_time is not None and e.end_time >= ended_from))
             and (ended_to is None or (e.end_time is not None and e.end_time < ended_to))}
    if not ended:
        return []
    messages = archived_input(archive, [NODE_IPC.name, JOBS_LIFECYCLE.name], {j.encode() for j in ended}, verifier)
    accounts, _ = fold_states(messages, policy)
    out = []
    for job, event in sorted(ended.items()):
        account = accounts.get(job.encode())
        waiting = tuple(account.waiting_for()) if account is not None else tuple((n, None) for n in event.nodes)
        assert event.end_time is not None  # JobEvent.ran
        out.append(PendingJob(job, event.state.value, event.end_time, len(event.nodes), waiting,
                              charge_in_archive=account is not None and account.awaiting() is None))
    return out
