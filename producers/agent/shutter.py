"""The pure parts of a shutter cycle (Seed 002, Alg. 1-3): who runs alone next, and the events
one cycle produces (its window; its block goes into its open batch, producers.batching). No
clock, no processes: the agent passes in what it measured."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from nodeshare.schemas import IpcSample, JobLeftNode, ShutterWindow


def next_lone(candidates: Sequence[str], previous: str | None) -> str:
    """Round robin over the sorted candidates: the first one after ``previous`` (Alg. 3 rotates
    the job that keeps running so every co-runner gets its turn)."""
    if not candidates:
        raise ValueError("no job to run alone")
    ordered = sorted(candidates)
    if previous is None:
        return ordered[0]
    later = [j for j in ordered if j > previous]
    return later[0] if later else ordered[0]


def shutter_window(*, node: str, source: str, cycle: int, lone: str, paused: Sequence[str], start: datetime,
                   end: datetime) -> ShutterWindow:
    """The node's shutter window for one cycle (the lone job's block goes into its open batch)."""
    return ShutterWindow(event_id=f"{node}/win/{cycle}", source=source, event_time=end, node=node, cycle=cycle,
                         lone_job=lone, paused_jobs=tuple(sorted(paused)), start=start, end=end)


def triples(samples: Sequence[IpcSample]) -> list[tuple[int, int, int]]:
    """A region's samples as the batcher takes them: (instructions, cycles, threads)."""
    return [(s.instructions, s.cycles, s.threads) for s in samples]


def left_node(*, node: str, source: str, job_id: str, blocks_sent: int, last_cycle: int, paused_us: int,
              alone_us: int, at: datetime) -> JobLeftNode:
    return JobLeftNode(event_id=f"{node}/left/{job_id}", source=source, event_time=at, job_id=job_id, node=node,
                       blocks_sent=blocks_sent, last_cycle=last_cycle, paused_us=paused_us, alone_us=alone_us)
