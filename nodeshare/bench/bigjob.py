"""Capability jobs in the charge fold (issue 44, item 4): how long one job's end event and closing
markers take to fold, and how many bytes its charge encodes to, for jobs of 1,000 and 10,000
nodes. Reported by ``nodeshare bench ledger`` (the charge is what the ledger sink receives).

The job sends no blocks (a block costs the same whatever the job's size); what grew with its size
was each marker's work, so the markers are what is timed. Folded as the worker and the audit fold
(``fold_states``: no running estimate per message).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from nodeshare.schemas import JobEvent, JobLeftNode, JobState, encode
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_states

_T0 = datetime(2026, 1, 1, tzinfo=UTC)
SIZES = (1_000, 10_000)


def job_messages(nodes: int, job: str = "capability") -> list[tuple[Origin, bytes, bytes, float]]:
    """A job on ``nodes`` nodes that ran an hour: its end event, then every node's marker."""
    names = tuple(f"nid{i:06d}" for i in range(nodes))
    end = JobEvent(event_id=f"{job}-end", source="bench", event_time=_T0 + timedelta(hours=1), job_id=job,
                   state=JobState.ENDED, user="u", account="a", program="p", cores=64 * nodes, nodes=names,
                   submit_time=_T0, start_time=_T0, end_time=_T0 + timedelta(hours=1))
    ts = (_T0 + timedelta(hours=1)).timestamp()
    out = [(Origin(JOBS_LIFECYCLE.name, 0, 0), job.encode(), encode(end), ts)]
    for i, n in enumerate(names):
        left = JobLeftNode(event_id=f"{job}-left-{n}", source="bench", event_time=_T0 + timedelta(hours=1), job_id=job,
                           node=n, blocks_sent=0, last_cycle=-1)
        out.append((Origin(NODE_IPC.name, 0, i), job.encode(), encode(left), ts))
    return out


def run_bigjob_bench(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """``bigjob_<n>_fold_s`` and ``bigjob_<n>_charge_bytes`` per job size n."""
    figures: dict[str, Any] = {}
    for n in sizes:
        messages = job_messages(n)
        t = time.perf_counter()
        _, charges = fold_states(messages, PricingPolicy())
        figures[f"bigjob_{n}_fold_s"] = round(time.perf_counter() - t, 3)
        [charge] = charges
        figures[f"bigjob_{n}_charge_bytes"] = len(charge.value)
    return figures
