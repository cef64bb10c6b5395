"""A region's mean IPC, without numpy: what the node agent needs of the core on a compute node's
slim install (deploy/requirements-agent.txt), shared with ``degradation``."""

from __future__ import annotations

import math
from collections.abc import Iterable

from nodeshare.schemas.events import IpcSample


def mean_ipc(samples: Iterable[IpcSample]) -> float:
    ipcs = [s.instructions / s.cycles for s in samples]
    return math.fsum(ipcs) / len(ipcs)
