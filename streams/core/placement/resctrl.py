"""LLC ways and memory bandwidth one node must give its jobs, folded from ``decisions.placement``
(Seed 001: Spread-n-Share books w ways and b GB/s per job and node, as Intel RDT's CAT and MBA
isolate them), and the resctrl ``schemata`` that enforce them.

``NodeShares`` keeps, per job placed on the node, the ways and bandwidth its decision booked.
``layout`` turns the jobs running now into resctrl settings the kernel accepts: each job a
contiguous run of ways (CAT needs contiguous bits) of at least ``min_cbm_bits`` (the kernel's
``info/L3/min_cbm_bits``), within the node's ways, and no way in two jobs' masks. A job keeps its
ways while it runs, a newcomer takes the lowest free run; when the free ways are fragmented (their
sum fits, no run does) every job is laid out again, packed from way 0 (the kept ones move: a cold
cache for a moment, never a shared way); a job that still finds no room (more ways booked than the
node holds: a job started outside nodeshare's decisions) gets no setting and runs in the default
group, said. ``default_mask`` is what the default group (every process without a share) keeps:
the ways no job booked, so unmanaged processes stay out of the booked ways.
Memory bandwidth is MBA's percentage of the node's bandwidth, rounded up
to its granularity (10%: the throttle levels Intel's MBA offers). Pure: the agent's shell
(``producers.agent.resctrl``) writes the groups and removes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeshare.schemas.events import NodePlacementState, PlacementAction, PlacementDecision

MBA_GRANULARITY = 10  # percent


@dataclass(frozen=True)
class Share:
    ways: int
    bandwidth_gbps: float | None


@dataclass(frozen=True)
class Setting:
    """One job's resctrl group: its way mask and its MBA percentage (None: unthrottled)."""

    mask: int
    mb_percent: int | None

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

    def state(self, state: NodePlacementState) -> None:
        """The node's shares as the placement manager stated them (``decisions.placement.nodes``): the
        whole set, replacing what was held (a job that ended is gone from it)."""
        if state.node == self.node:
            self.shares = {s.job_id: Share(s.ways, s.bandwidth_gbps) for s in state.shares}


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


def _pack(order: list[str], ways: dict[str, int], total_ways: int, kept: dict[str, int]) -> dict[str, int]:
    """Masks for the jobs of ``order``: those in ``kept`` keep theirs, the others take the lowest free
    run in turn; a job with no free run is left out."""
    free = (1 << total_ways) - 1
    masks: dict[str, int] = {}
    for job, mask in kept.items():
        masks[job] = mask
        free &= ~mask
    for job in order:
        if job in masks:
            continue
        first = _first_fit(free, ways[job], total_ways)
        if first is not None:
            masks[job] = ((1 << ways[job]) - 1) << first
            free &= ~masks[job]
    return masks


def layout(shares: dict[str, Share], jobs: Iterable[str], total_ways: int, node_gbps: float,
           previous: dict[str, Setting] | None = None, min_bits: int = 1) -> dict[str, Setting]:
    """The resctrl setting of each running job that has a share and fits. A job keeps its ways
    from ``previous`` while its share is unchanged (its cache stays warm); the others, in job
    order, take the lowest free run of ways; if one finds none, all are packed again from way 0
    (those that ran before first). No two masks share a way; each is a run of at least
    ``min_bits`` ways within ``total_ways``."""
    if total_ways < 1:
        raise ValueError(f"a node has at least one LLC way, got {total_ways}")
    if not 1 <= min_bits <= total_ways:
        raise ValueError(f"min_cbm_bits must be within 1..{total_ways}, got {min_bits}")
    ways = {job: min(max(min_bits, shares[job].ways), total_ways) for job in sorted(set(jobs) & shares.keys())}
    mba = {job: mb_percent(shares[job].bandwidth_gbps, node_gbps) for job in ways}
    kept: dict[str, int] = {}
    taken = 0
    for job, n in ways.items():  # kept first, so a newcomer never moves them
        old = (previous or {}).get(job)
        if old is not None and old.mask.bit_count() == n and old.mask & taken == 0 \
                and old.mask >> total_ways == 0:
            kept[job] = old.mask
            taken |= old.mask
    masks = _pack(list(ways), ways, total_ways, kept)
    if len(masks) < len(ways):  # fragmented free ways: pack everyone again, the jobs that ran before first
        ran = sorted(ways, key=lambda j: (j not in (previous or {}), j))
        repacked = _pack(ran, ways, total_ways, {})
        if len(repacked) > len(masks):
            masks = repacked
    return {job: Setting(masks[job], mba[job]) for job in ways if job in masks}


def default_mask(settings: dict[str, Setting], total_ways: int, min_bits: int = 1) -> int:
    """The default group's ways: the longest run no job's mask holds (the highest such), or, when
    fewer than ``min_bits`` ways are free, the highest ``min_bits`` ways (the kernel takes no
    smaller mask; the jobs there share them with unmanaged processes)."""
    free = (1 << total_ways) - 1
    for s in settings.values():
        free &= ~s.mask
    best, first, length = 0, 0, 0
    for way in range(total_ways + 1):
        if way < total_ways and free >> way & 1:
            length += 1
            continue
        if length >= min_bits and length >= best.bit_count():
            best = ((1 << length) - 1) << first
        first, length = way + 1, 0
    return best or ((1 << min_bits) - 1) << (total_ways - min_bits)
