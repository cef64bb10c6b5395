"""The Slurm adapter's books (``nodeshare slurm scheduler``): small JSON files it keeps across
restarts, next to each other in its state directory (the unit's ``StateDirectory``).

* ``SuspendBook`` (``--state-file``): the jobs it suspended for the power-gated start, each with
  the time its attempt began and the suspend time Slurm recorded, so it resumes only those;
* ``DecidedBook`` (``decided.json``): the jobs the placement manager answered or the fail-open
  sweep released, so the sweep never releases a job held on purpose.

Each is written whole (temporary, fsync, rename); a file that is not a book is moved aside with an
error; one that cannot be read (permissions, I/O) raises OSError and stops the adapter.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Container
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("nodeshare.slurm.scheduler")


#: How long after the adapter began its ``scontrol suspend`` Slurm's suspend time may be for the
#: suspend to be taken as the adapter's (a restart that did not read the time in between)
ADOPT_WITHIN_S = 60


@dataclass(frozen=True)
class Suspended:
    """A job's entry in the suspend book: when the adapter began suspending it (epoch seconds, the
    controller's clock: the adapter runs there) and the suspend time Slurm recorded (None until read)."""

    tried_at: int
    suspended_at: int | None = None

    def ours(self, slurm_time: int | None) -> bool:
        """Whether Slurm's last suspend (or resume) time is the adapter's suspend: the one recorded, or,
        not recorded yet, one within ``ADOPT_WITHIN_S`` after the attempt began. Unknown: not ours."""
        if slurm_time is None:
            return False
        if self.suspended_at is not None:
            return slurm_time == self.suspended_at
        return self.tried_at - 1 <= slurm_time <= self.tried_at + ADOPT_WITHIN_S


@dataclass
class SuspendBook:
    """The jobs the adapter suspended (``Suspended``), kept in a JSON file (``None``: in memory only,
    for tests) written whole at every change (temporary, fsync, rename). A file that is not a book
    is moved aside with an error (the jobs it named stay suspended until an operator resumes them,
    never resumed on a guess); one that cannot be read (permissions, I/O) stops the adapter."""

    path: Path | None = None
    jobs: dict[str, Suspended] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> SuspendBook:
        after = "the jobs it names stay suspended until an operator resumes them"
        raw = _read_book(path, "suspend book", after)
        try:
            jobs = {job: Suspended(int(e["tried_at"]), None if e.get("suspended_at") is None
                                   else int(e["suspended_at"])) for job, e in (raw or {}).items()}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            _aside(path, exc, "suspend book", after)  # type: ignore[arg-type]
            return cls(path)
        return cls(path, jobs)

    def put(self, job_id: str, entry: Suspended) -> None:
        self.jobs[job_id] = entry
        self._save()

    def drop(self, job_id: str) -> None:
        if self.jobs.pop(job_id, None) is not None:
            self._save()

    def _save(self) -> None:
        if self.path is not None:
            from nodeshare.runtime.files import atomic_write_bytes

            atomic_write_bytes(json.dumps({j: {"tried_at": e.tried_at, "suspended_at": e.suspended_at}
                                           for j, e in sorted(self.jobs.items())}).encode(), self.path)


def _aside(path: Path, exc: Exception, what: str, after: str) -> None:
    aside = path.with_name(f"{path.name}.unreadable.{datetime.now(UTC):%Y%m%dT%H%M%S}")
    os.replace(path, aside)
    log.error("%s is not the adapter's %s (%s): moved to %s; %s", path, what, exc, aside, after)


def _read_book(path: Path | None, what: str, after: str) -> Any:
    """A book's JSON (None: no path, or no file yet); one that does not parse is moved aside
    (``_aside``); one that cannot be read (permissions, I/O) raises OSError: the adapter stops."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}, not an object")
        return raw
    except (ValueError, TypeError) as exc:
        _aside(path, exc, what, after)
        return None


@dataclass
class DecidedBook:
    """The jobs the placement manager answered, or the sweep released (job -> when), in a JSON file
    next to the suspend book (``None``: memory only), written whole after a batch that changed it
    and pruned to the jobs Slurm still lists. A file that is not a book is moved aside with an error:
    the jobs it named may then be released by the sweep (failing open)."""

    path: Path | None = None
    jobs: dict[str, float] = field(default_factory=dict)
    dirty: bool = False

    @classmethod
    def load(cls, path: Path | None) -> DecidedBook:
        raw = _read_book(path, "decided book", "the sweep may release jobs it named")
        try:
            return cls(path, {str(j): float(t) for j, t in (raw or {}).items()})
        except (TypeError, ValueError, AttributeError) as exc:
            _aside(path, exc, "decided book", "the sweep may release jobs it named")  # type: ignore[arg-type]
            return cls(path)

    def note(self, job_id: str, at: float) -> None:
        self.jobs[job_id] = at
        self.dirty = True

    def keep(self, listed: Container[str], before: float) -> None:
        """Forget the jobs Slurm no longer lists (ended and purged), noted before ``before`` (when the
        listing began: an answer noted since may be for a job submitted after it)."""
        gone = [j for j, at in self.jobs.items() if j not in listed and at < before]
        for j in gone:
            del self.jobs[j]
        self.dirty = self.dirty or bool(gone)

    def save(self) -> None:
        if self.dirty and self.path is not None:
            from nodeshare.runtime.files import atomic_write_bytes

            atomic_write_bytes(json.dumps(dict(sorted(self.jobs.items()))).encode(), self.path)  # OSError: stays dirty
        self.dirty = False
