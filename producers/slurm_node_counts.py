"""The node count a Slurm job asked for (``-N min[-max]``), for placement (schema 9's
``JobEvent.nodes_requested`` and ``nodes_max``).

``scontrol show job -o`` prints ``NumNodes=2-2`` for ``-N 2``, ``1-2`` for ``-N 1-3`` of two tasks,
a bare minimum where Slurm worked one out (``-w n1,n2``: 2, no maximum), and a bare ``NumNodes=1``
for a job that gave no ``-N``, which bounds nothing and is left out. squeue's %D and MaxNodes read
the same for ``-N 1`` and for none (Slurm 22.05, measured), so they cannot say it. Array tasks
(squeue ``123_[1-10]``, scontrol ``JobId=123``) and 24.05's ``1,2,4`` sizes are left out."""

from __future__ import annotations

import re

#: a job's node count: (min, max); max None: no bound
NodeRange = tuple[int, int | None]

_JOB = re.compile(r"(?:^|\s)JobId=(\S+)")
_COUNT = re.compile(r"(?:^|\s)NumNodes=(\d+)(?:-(\d+))?(?:\s|$)")


def parse_node_ranges(listing: str) -> dict[str, NodeRange]:
    """Job id -> its node count, from ``scontrol show job -o`` (one line per job)."""
    out: dict[str, NodeRange] = {}
    for line in listing.splitlines():
        job, count = _JOB.search(line), _COUNT.search(line)
        if job and count and (count.group(2) or int(count.group(1)) > 1):
            out[job.group(1)] = (int(count.group(1)), int(count.group(2)) if count.group(2) else None)
    return out

