"""Power caps written through the Linux powercap interface, and always put back.

The kernel exposes each processor package as ``/sys/class/powercap/intel-rapl:N`` with its
long-term limit in ``constraint_0_power_limit_uw`` and the highest limit it accepts in
``constraint_0_max_power_uw``. ``Powercap.set`` writes a cap the power manager decided
(``streams.core.power.caps``); before the first write to a package it records the package's original
limit, in memory, in a state file next to the agent's spool and through the watchdog, so the
original comes back however the agent ends: ``restore_all`` on every exit path, the watchdog if the
agent is killed, and the next start if both died (it restores what the state file still holds).
As geopmd does: a cap is a lease, not a setting.

The original of a package stays recorded (memory, state file, watchdog) until it is written back:
a restore the kernel refuses (EBUSY, EIO) keeps it, so the next cap on the package never takes the
old job's cap for the original, and the restore is tried again (``retry_restores``, at exit, by the
watchdog, at the next start). If the original cannot be recorded (state file unwritable), the cap is
refused and nothing is written.

A cap is refused, with the reason, when the package has no powercap domain, when it is outside
0 < cap <= the package's maximum, or when the limit cannot be written (the agent needs root or
CAP_SYS_ADMIN and a writable /sys): it is logged and counted, and the package keeps its limit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from . import rapl
from .rapl import POWERCAP

log = logging.getLogger(__name__)

LIMIT = "constraint_0_power_limit_uw"
MAX = "constraint_0_max_power_uw"


class CapRefused(RuntimeError):
    """A cap was not written; the message says why."""


class Powercap:
    """Writes package power limits under ``root`` and remembers the originals in ``state_file``."""

    def __init__(self, state_file: Path, root: Path = POWERCAP,
                 on_originals: Callable[[dict[str, int]], None] | None = None) -> None:
        self.root = root
        self.state_file = state_file
        self.on_originals = on_originals  # the watchdog hears of every original before it is changed
        self.originals: dict[str, int] = {}  # limit file -> its original value (µW), until written back
        self.unrestored: set[str] = set()  # released packages whose write-back the kernel refused
        self._lock = threading.Lock()

    def _limit(self, processor: int) -> Path:
        path = self.root / f"intel-rapl:{processor}" / LIMIT
        if not path.exists():
            raise CapRefused(f"processor {processor} has no powercap domain ({path} does not exist)")
        return path

    def set(self, processor: int, watts: float | None) -> None:
        """Cap ``processor`` at ``watts``, or give it back its original limit (None)."""
        with self._lock:
            limit = self._limit(processor)
            key = str(limit)
            if watts is None:
                if key in self.originals:
                    self._write_back(key)
                return
            uw = round(watts * 1e6)
            top = limit.with_name(MAX)
            highest = int(top.read_text()) if top.exists() else None
            if uw <= 0 or (highest is not None and uw > highest):
                bound = f"{highest / 1e6:g} W" if highest is not None else "its maximum"
                raise CapRefused(f"cap {watts:g} W for processor {processor} is outside (0, {bound}]")
            if key not in self.originals:
                self.originals[key] = int(limit.read_text())
                try:
                    self._remember()  # recorded before the first write, never after
                except BaseException:
                    del self.originals[key]  # not written: nothing of this package to restore
                    self._remember(tell=False, quiet=True)
                    raise
            self.unrestored.discard(key)  # a job holds it again: its original is still the one recorded
            self._write(limit, uw)

    def _write_back(self, key: str) -> None:
        """Write one original back; it is forgotten only once written (a refused write keeps it)."""
        try:
            self._write(Path(key), self.originals[key])
        except CapRefused:
            self.unrestored.add(key)
            raise
        del self.originals[key]
        self.unrestored.discard(key)
        self._remember()

    def retry_restores(self) -> int:
        """Write back again the originals a refused restore left (no job holds those packages);
        how many were written. Costs nothing when none is left."""
        if not self.unrestored:
            return 0
        done = 0
        with self._lock:
            for key in sorted(self.unrestored):
                try:
                    self._write_back(key)
                    done += 1
                except CapRefused as exc:
                    log.debug("restore of %s refused again: %s", key, exc)
        if done:
            log.info("restored %d power limits a refused write had left capped", done)
        return done

    def _write(self, limit: Path, uw: int) -> None:
        try:
            limit.write_text(f"{uw}\n")
        except OSError as exc:
            raise CapRefused(f"cannot write {limit}: {exc.strerror or exc} (the agent needs root or "
                             f"CAP_SYS_ADMIN and /sys/class/powercap writable)") from exc

    def _remember(self, tell: bool = True, quiet: bool = False) -> None:
        """The originals into the state file (removed once empty), then to the watchdog. A state file
        that cannot be written refuses the cap (``CapRefused``); ``quiet``: logged only."""
        try:
            if self.originals:
                tmp = self.state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.originals))
                os.replace(tmp, self.state_file)
            else:
                self.state_file.unlink(missing_ok=True)
        except OSError as exc:
            if quiet:
                log.error("could not write the power-cap state file %s: %s", self.state_file, exc)
            else:
                raise CapRefused(f"cannot record the original limits in {self.state_file}: {exc}") from exc
        if tell and self.on_originals is not None:
            self.on_originals(dict(self.originals))

    def restore_all(self) -> int:
        """Every limit this agent changed back to its original; returns how many. A limit that
        cannot be written back stays in the state file for the next start. Works without a
        watchdog (one that is gone is logged, not raised: this is the last thing the agent does)."""
        with self._lock:
            if not self.originals:
                return 0
            restored = restore(self.originals)
            self.originals = {k: v for k, v in self.originals.items() if k not in restored}
            self.unrestored = set(self.originals)
            try:
                self._remember(quiet=True)
            except Exception as exc:  # the watchdog is gone: the state file holds what is left
                log.error("could not tell the watchdog the restored power limits: %s", exc)
            return len(restored)

    def recover(self) -> int:
        """At start: restore what a previous run's state file says it changed (it died before it could)."""
        if not self.state_file.exists():
            return 0
        left = {str(k): int(v) for k, v in json.loads(self.state_file.read_text() or "{}").items()}
        with self._lock:
            self.originals = left
        n = self.restore_all()
        if n:
            log.warning("restored %d power limits a previous run of the agent left changed", n)
        return n


def restore(originals: dict[str, int]) -> set[str]:
    """Write each limit file's original value back; the files written (also the watchdog's)."""
    done = set()
    for path, uw in originals.items():
        try:
            Path(path).write_text(f"{uw}\n")
            done.add(path)
        except OSError as exc:
            log.error("could not restore %s to %d µW: %s", path, uw, exc)
    return done


def processors(root: Path, min_watts: float) -> tuple[tuple[int, float, float], ...]:
    """The node's processor packages as powercap shows them: (package index, min watts, max watts)
    for each ``intel-rapl:N`` with a ``constraint_0_max_power_uw``, max from it (the highest cap the
    kernel accepts) and min the site's ``min_watts`` (RAPL says no floor), at most the max. A package
    without a readable max is left out (it could not be capped safely)."""
    out = []
    for d in rapl.package_domains(root, energy=False):
        try:
            max_w = int((d.path / "constraint_0_max_power_uw").read_text()) / 1e6
        except (OSError, ValueError):
            log.warning("package %d: no readable constraint_0_max_power_uw: not published", d.processor)
            continue
        if max_w > 0:
            out.append((d.processor, min(min_watts, max_w), max_w))
    return tuple(out)
