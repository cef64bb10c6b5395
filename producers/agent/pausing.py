"""Pausing and resuming a job: its cgroup's freezer when it has one, else SIGSTOP/SIGCONT to each process.

Every signal passes the ``Guard`` first; every cgroup must sit strictly below the freezer
hierarchy's root and hold none of the agent's own processes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .processes import Guard, Proc, Refused, send

FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")  # cgroup v1 (docs/slurm.md: the test machine)
FREEZE_DEADLINE_S = 0.5  # FREEZING that lasts longer is an error: the shutter is abandoned and all is thawed


@dataclass(frozen=True)
class Target:
    """What to pause for one job: its cgroup if it has one, else its processes."""

    job_id: str
    procs: frozenset[Proc]
    cgroup: Path | None = None


def check_cgroup(cgroup: Path, guard: Guard, root: Path = FREEZER_ROOT) -> Path:
    path = cgroup.resolve()
    base = root.resolve()
    if path == base or base not in path.parents:
        raise Refused(f"refusing cgroup {cgroup}: not below the freezer hierarchy {root}")
    try:
        members = {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except FileNotFoundError as e:
        raise Refused(f"refusing cgroup {cgroup}: not a cgroup ({e})") from None
    if members & guard.own_pids:
        raise Refused(f"refusing cgroup {cgroup}: it holds the agent's own processes")
    return path


def _write_state(cgroup: Path, value: str) -> None:
    (cgroup / "freezer.state").write_text(value)


def freeze(cgroup: Path) -> None:
    _write_state(cgroup, "FROZEN")
    deadline = time.monotonic() + FREEZE_DEADLINE_S
    while (cgroup / "freezer.state").read_text().strip() != "FROZEN":
        if time.monotonic() > deadline:
            raise TimeoutError(f"cgroup {cgroup} still FREEZING after {FREEZE_DEADLINE_S} s")
        time.sleep(0.0002)


def thaw(cgroup: Path) -> None:
    _write_state(cgroup, "THAWED")


class Pauser:
    """Pauses and resumes jobs, refusing anything the guard forbids."""

    def __init__(self, guard: Guard, freezer_root: Path = FREEZER_ROOT) -> None:
        self.guard = guard
        self.freezer_root = freezer_root

    def checked(self, target: Target) -> Target:
        """The target, after every check that pausing it would need (raises Refused)."""
        if target.cgroup is not None:
            return Target(target.job_id, target.procs, check_cgroup(target.cgroup, self.guard, self.freezer_root))
        for p in target.procs:
            self.guard.check(p, target.procs)
        return target

    def pause(self, target: Target) -> None:
        self._apply(target, freeze, signal.SIGSTOP)

    def resume(self, target: Target) -> None:
        self._apply(target, thaw, signal.SIGCONT)

    def _apply(self, target: Target, on_cgroup: Callable[[Path], None], sig: signal.Signals) -> None:
        if target.cgroup is not None:
            on_cgroup(target.cgroup)
            return
        for p in sorted(target.procs):
            self.guard.check(p, target.procs)
            send(p, sig)


def resume_all(procs: Iterable[Proc], cgroups: Iterable[Path], guard: Guard,
               freezer_root: Path = FREEZER_ROOT) -> int:
    """Best-effort resume of everything named (the watchdog's and the agent's last resort):
    SIGCONT to each still-existing process, THAWED to each cgroup. Returns how many were touched."""
    touched = 0
    for cg in cgroups:
        try:
            thaw(check_cgroup(Path(cg), guard, freezer_root))
            touched += 1
        except (Refused, OSError):
            pass
    for p in procs:
        if p.pid > 1 and p.pid not in guard.own_pids and send(p, signal.SIGCONT):
            touched += 1
    return touched

