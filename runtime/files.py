"""Files written whole or not at all, durably: the archive's Parquet files and every small state
file a service keeps (the Slurm source's started map and lost-node watch, the Slurm adapter's
books). Only the standard library: a producer needs no store to write its state."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(data: bytes, path: Path) -> None:
    """``data`` into ``path`` whole or not at all, durably."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    publish_file(tmp, path)


def publish_file(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it to ``path`` and fsync the directory: ``path`` is whole or absent."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
