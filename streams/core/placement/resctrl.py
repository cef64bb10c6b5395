"""LLC ways and memory bandwidth one node must give its jobs, folded from ``decisions.placement``
(Seed 001: Spread-n-Share books w ways and b GB/s per job and node, as Intel RDT's CAT and MBA
isolate them), and the resctrl ``schemata`` that enforce them.

``NodeShares`` keeps, per job placed on the node, the ways and bandwidth its decision booked.
``layout`` turns the jobs running now into resctrl settings: each job a contiguous run of ways
(CAT needs contiguous bits); a job keeps its ways while it runs, a newcomer takes the lowest free
run, so no two jobs share a way while the booked ways fit; a job that finds no free run gets the
highest ways it asked for and is said to overlap (the scheduler books no more ways than a node
holds, so either a job started outside nodeshare's decisions or the free ways are fragmented).
Memory bandwidth is MBA's percentage of the node's bandwidth, rounded up
to its granularity (10%: the throttle levels Intel's MBA offers). Pure: the agent's shell
(``producers.agent.resctrl``) writes the groups and removes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeshare.schemas.events import PlacementAction, PlacementDecision

MBA_GRANULARITY = 10  # percent


@dataclass(frozen=True)
class Share:
    ways: int
    bandwidth_gbps: float | None


@dataclass(frozen=True)
class Setting:
    """One job's resctrl group: its way mask, its MBA percentage (None: unthrottled) and whether
    its ways overlap another job's."""

    mask: int
    mb_percent: int | None
    overlaps: bool = False

    def schemata(self, cache_ids: Iterable[int], mb_ids: Iterable[int]) -> str:
        lines = ["L3:" + ";".join(f"{i}={self.mask:x}" for i in cache_ids)]
        mb = list(mb_ids)
        if self.mb_percent is not None and mb:
            lines.append("MB:" + ";".join(f"{i}={self.mb_percent}" for i in mb))
        return "\n".join(lines) + "\n"


@dataclass
class NodeShares:
    """The ways and bandwidth booked for each job placed on ``node``."""

    node: str
    shares: dict[str, Share] = field(default_factory=dict)

    def apply(self, decision: PlacementDecision) -> None:
        placed = decision.action in (PlacementAction.PLACE, PlacementAction.PAIR)
        if placed and self.node in decision.nodes and decision.llc_ways is not None:
            self.shares[decision.job_id] = Share(decision.llc_ways, decision.bandwidth_gbps)
        elif placed:  # placed elsewhere, or without a cache share: nothing to isolate here
            self.shares.pop(decision.job_id, None)


def mb_percent(bandwidth_gbps: float | None, node_gbps: float) -> int | None:
    """MBA's percentage for ``bandwidth_gbps`` of a node's ``node_gbps``, rounded up to the granularity."""
    if bandwidth_gbps is None or node_gbps <= 0:
        return None
    steps = math.ceil(round(100.0 * bandwidth_gbps / node_gbps / MBA_GRANULARITY, 9))
    return min(100, max(MBA_GRANULARITY, steps * MBA_GRANULARITY))


def _first_fit(free: int, ways: int, total_ways: int) -> int | None:
    """The lowest first way of a run of ``ways`` free ways (bits of ``free``), or None."""
    run = (1 << ways) - 1
    for first in range(total_ways - ways + 1):
        if (free >> first) & run == run:
            return first
    return None


def layout(shares: dict[str, Share], jobs: Iterable[str], total_ways: int, node_gbps: float,
           previous: dict[str, Setting] | None = None) -> dict[str, Setting]:
    """The resctrl setting of each running job that has a share. A job keeps its ways from
    ``previous`` while its share is unchanged (its cache stays warm); the others, in job order,
    take the lowest free run of ways."""
    if total_ways < 1:
        raise ValueError(f"a node has at least one LLC way, got {total_ways}")
    ways = {job: min(max(1, shares[job].ways), total_ways) for job in sorted(set(jobs) & shares.keys())}
    mba = {job: mb_percent(shares[job].bandwidth_gbps, node_gbps) for job in ways}
    out: dict[str, Setting] = {}
    free = (1 << total_ways) - 1
    for job, n in ways.items():  # kept first, so a newcomer never moves them
        old = (previous or {}).get(job)
        if old is not None and not old.overlaps and old.mask.bit_count() == n and old.mask & free == old.mask:
            out[job] = Setting(old.mask, mba[job])
            free &= ~old.mask
    for job, n in ways.items():
        if job in out:
            continue
        first = _first_fit(free, n, total_ways)
        mask = ((1 << n) - 1) << (total_ways - n if first is None else first)
        if first is not None:
            free &= ~mask
        out[job] = Setting(mask, mba[job], overlaps=first is None)
    return out
