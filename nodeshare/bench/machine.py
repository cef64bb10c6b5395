"""The machine a benchmark ran on, said the same way by every benchmark."""

from __future__ import annotations

import os
import platform


def available_cores() -> int:
    """CPUs this process may run on (the affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_stamp() -> str:
    """Architecture, usable cores and Python, e.g. 'x86_64, 2 cores, Python 3.11.7'."""
    return f"{platform.machine()}, {available_cores()} cores, Python {platform.python_version()}"
