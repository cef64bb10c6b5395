"""The node agent applies the cache shares of ``decisions.placement`` through resctrl.

Placement decisions book LLC ways and memory bandwidth per job and node (Seed 001); the placement
manager states each node's whole set of shares on the compacted ``decisions.placement.nodes`` when
it changes (a decision, a job's start elsewhere, its end) and for every node after a rebuild. The
agent reads that topic alone (``streams.core.placement.resctrl.NodeShares.state``), from its start
as ``follower.Follower`` reads: a start reads one record per node, not every decision retention
keeps (issue 42; before, it folded 30 days of ``decisions.placement`` and kept the shares of jobs
long ended). At each rescan ``sync`` gives every running job with a share its
resctrl group (``layout``: a contiguous run of ways of its own, at least ``min_cbm_bits``, MBA's
percentage) holding its processes, removes the groups of jobs that left, and narrows the default
group (every other process) to the ways no job holds (``default_mask``). A write the kernel refuses
(no permission, a schemata it rejects) is logged and counted; the job runs on in the default group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from nodeshare.runtime import metrics
from nodeshare.schemas import DecodeError, NodePlacementState, decode_model
from nodeshare.schemas.catalog import DECISIONS_PLACEMENT_NODES
from nodeshare.streams.core.placement.resctrl import NodeShares, default_mask, layout

from .follower import Follower
from .jobs import LocalJob
from .resctrl import Resctrl

log = logging.getLogger(__name__)


class LlcFollower(Follower):
    """Holds ``node``'s shares from ``decisions.placement.nodes``; ``sync`` applies them to running jobs."""

    topic_name = DECISIONS_PLACEMENT_NODES.name
    purpose = "llc"

    def __init__(self, settings: Any, node: str, resctrl: Resctrl, node_gbps: float) -> None:
        super().__init__(settings, node)
        self.resctrl = resctrl
        self.node_gbps = node_gbps
        self.shares = NodeShares(node)
        self._lock = threading.Lock()
        #: jobs whose group the kernel refused: they keep the whole cache and are not tried again
        #: at every rescan while they run (one log line each, not one a second)
        self.refused: set[str] = set()
        self.unplaced: set[str] = set()  # jobs with a share that found no room (said once each)

    def handle(self, value: bytes | None, write: bool, topic: str | None = None) -> None:
        if value is None:
            return  # a tombstone: compaction's, nothing to fold
        try:
            state = decode_model(NodePlacementState, value)
        except DecodeError as exc:
            log.warning("decisions.placement.nodes: skipped a record that does not decode: %s", exc.reason)
            return
        with self._lock:
            self.shares.state(state)

    def settle(self) -> None:
        """Nothing to write yet: ``sync`` does, on the agent's loop, where the jobs' processes are known."""

    def sync(self, jobs: Mapping[str, LocalJob]) -> None:
        """Give each running job its share, and take back the groups of jobs that left."""
        if not self.caught_up.is_set():
            return
        with self._lock:
            shares = dict(self.shares.shares)
        self.refused &= jobs.keys()  # a job that left may come back as a new one
        wanted = layout(shares, [j for j in jobs if j not in self.refused], self.resctrl.total_ways, self.node_gbps,
                        self.resctrl.settings, self.resctrl.min_bits)
        for job_id in self.resctrl.jobs():
            if job_id not in wanted:
                self.resctrl.remove(job_id)
                metrics.RESCTRL.labels("removed").inc()
        unplaced = {j for j in jobs if j in shares and j not in self.refused and j not in wanted}
        for job_id in sorted(unplaced - self.unplaced):
            log.warning("job %s: its %d LLC ways do not fit beside the other jobs' (more booked than the node "
                        "holds): it runs in the default group", job_id, shares[job_id].ways)
        self.unplaced = unplaced
        for job_id, setting in wanted.items():
            new = self.resctrl.settings.get(job_id) != setting
            try:
                self.resctrl.apply(job_id, setting, [p.pid for p in jobs[job_id].procs])
            except OSError as exc:
                self.refused.add(job_id)
                metrics.RESCTRL.labels("refused").inc()
                log.warning("job %s: resctrl refused (%s): it runs in the default group", job_id, exc)
                self.resctrl.remove(job_id)
                continue
            if new:
                metrics.RESCTRL.labels("applied").inc()
                log.info("job %s: LLC ways %s, memory bandwidth %s", job_id, f"{setting.mask:#x}",
                         f"{setting.mb_percent}%" if setting.mb_percent is not None else "unthrottled")
        self._default()

    def _default(self) -> None:
        """The default group out of the ways the jobs hold; given back its ways once no job holds any."""
        r = self.resctrl
        try:
            if r.settings:
                r.set_default(default_mask(r.settings, r.total_ways, r.min_bits))
            elif r.default_narrowed:
                r.restore_default()
        except OSError as exc:
            metrics.RESCTRL.labels("refused").inc()
            log.warning("the default resctrl group keeps its ways (%s): unmanaged processes share the jobs' ways",
                        exc)
