"""The Slurm source's started map: each running job's start time, read from its prolog's file, kept
on disk in the events directory (``.nodeshare-started.json``) so that an epilog read after the
source restarted still has the start its terminal event needs (``producers.slurm``)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

log = logging.getLogger("nodeshare.slurm")


def load_started(path: Path) -> dict[str, datetime]:
    """The started map a previous source saved (none: empty). An unreadable file is moved aside
    with an error: the jobs it named then end in ``bad/``, as before the map was kept."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        return {job: datetime.fromisoformat(at) for job, at in json.loads(text).items()}
    except (ValueError, AttributeError, TypeError) as exc:
        aside = path.with_name(path.name + ".unreadable")
        os.replace(path, aside)
        log.error("%s is not a started map (%s): moved to %s; epilogs of jobs started before this "
                  "source will go to bad/", path, exc, aside)
        return {}


def save_started(path: Path, started: Mapping[str, datetime]) -> None:
    """Write the started map whole or not at all, durably (a temporary, fsynced, renamed over the
    file, the directory fsynced): the archive's one way of doing it."""
    from nodeshare.runtime.files import atomic_write_bytes

    atomic_write_bytes(json.dumps({job: at.isoformat() for job, at in sorted(started.items())}).encode(), path)
