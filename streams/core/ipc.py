"""A region's mean IPC and a ratio estimate's standard error, without numpy: what the node agent
(its shutter policy) needs of the core on a compute node's slim install
(deploy/requirements-agent.txt), shared with ``degradation``."""

from __future__ import annotations

import math
from collections.abc import Iterable

from nodeshare.schemas.events import IpcSample


def mean_ipc(samples: Iterable[IpcSample]) -> float:
    ipcs = [s.instructions / s.cycles for s in samples]
    return math.fsum(ipcs) / len(ipcs)


def ratio_standard_error(n: int, sx: float, sy: float, sxx: float, sxy: float, syy: float) -> float | None:
    """The standard error of the ratio R = sy / sx of n blocks' sums (the linearized, or delta-method,
    variance of a ratio estimator, as in survey sampling):

        Var(R) = n / (n - 1) * sum((y - R x)^2) / sx^2,   sum((y - R x)^2) = syy - 2 R sxy + R^2 sxx

    D = 1 - R has the same error. The blocks are taken as independent samples of the job's run:
    a phase that lasts many blocks raises the spread of y - R x and so widens the interval. None
    with fewer than two blocks or no progress alone (sx = 0)."""
    if n < 2 or not sx > 0.0:
        return None
    r = sy / sx
    residual = max(0.0, syy - 2.0 * r * sxy + r * r * sxx)
    return math.sqrt(n / (n - 1) * residual) / sx
