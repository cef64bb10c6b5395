"""A small real workload that reports its progress through an application counter, for trying
the agent (and for its tests) where no instrumented application is at hand.

``stream`` sweeps a buffer larger than a typical LLC (memory-bandwidth bound); ``compute`` works
on a cache-resident array. One unit of work is one fixed-size chunk; the counter counts chunks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .jobs import PROGRESS_ENV
from .progress import ProgressFile

KINDS = ("stream", "compute")
_STREAM_BYTES = 64 * 2**20
_CHUNK = 32_768  # float64 elements per unit: 256 KiB


def progress_path(explicit: Path | None = None) -> Path:
    """Where to count: the explicit path, else $NODESHARE_PROGRESS_FILE, else
    $NODESHARE_PROGRESS_DIR/$SLURM_JOB_ID (a job under Slurm)."""
    if explicit is not None:
        return explicit
    if os.environ.get(PROGRESS_ENV):
        return Path(os.environ[PROGRESS_ENV])
    if os.environ.get("NODESHARE_PROGRESS_DIR") and os.environ.get("SLURM_JOB_ID"):
        return Path(os.environ["NODESHARE_PROGRESS_DIR"]) / os.environ["SLURM_JOB_ID"]
    raise ValueError(f"no progress counter: pass --progress, or set {PROGRESS_ENV} "
                     "(or NODESHARE_PROGRESS_DIR inside a Slurm job)")


def run(kind: str, seconds: float, progress: Path) -> int:
    """Work for ``seconds`` of wall time; returns the units done."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload kind {kind!r}; one of {', '.join(KINDS)}")
    data = np.ones(_STREAM_BYTES // 8 if kind == "stream" else _CHUNK)
    chunks = len(data) // _CHUNK
    counter = ProgressFile(progress)
    done = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for _ in range(64):
                i = (done % chunks) * _CHUNK
                view = data[i:i + _CHUNK]
                view *= 1.0000001
                counter.add(1)
                done += 1
    finally:
        counter.close()
    return done
