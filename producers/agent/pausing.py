"""Pausing and resuming a job: its cgroup's freezer when it has one, else SIGSTOP/SIGCONT to each process.

Both cgroup versions: v1's freezer controller (``freezer.state``: THAWED, FREEZING, FROZEN) and
v2's ``cgroup.freeze`` (write 1 or 0; ``cgroup.events`` says ``frozen 1`` once every task of the
cgroup and below is frozen), the default of current distributions and Slurm releases. The v2 state
reads in v1's words (``freezer_state``), so the rest is one code path. Under Slurm's cgroup/v2 the
job's cgroup (``.../slurmstepd.scope/job_<id>``) holds its steps' slurmstepd too, frozen with the
job for the few milliseconds of a shutter.

Every signal passes the ``Guard`` first; every cgroup must sit strictly below the freezer
hierarchy's root and hold none of the agent's own processes.

The agent resumes only what it stopped itself. A job someone else stopped (Slurm's suspend or gang
scheduling, its user's Ctrl-Z or ``kill -STOP``, a debugger) is not paused by a shutter, so it is
not continued after it either: ``Pauser.running`` leaves it out before the shutter, and the pause
itself skips a process or cgroup that stopped in the moment between. And the ``Pauser`` records
each process and cgroup it is about to stop *before* the signal or the write, so a pause that
raises halfway (a FREEZING that never ends, a signal, a refused process) is undone all the same.
What SIGSTOP and the freezer cannot tell apart, the agent cannot either: a job suspended by
someone else *while* the agent has it paused is continued by the agent's resume.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from .processes import NOT_RUNNING, Guard, Proc, Refused, send, state

CGROUP_V1_FREEZER = Path("/sys/fs/cgroup/freezer")


def default_freezer_root() -> Path:
    """Where the jobs' cgroups live: v1's freezer hierarchy when it is mounted, else the v2 tree."""
    return CGROUP_V1_FREEZER if CGROUP_V1_FREEZER.is_dir() else Path("/sys/fs/cgroup")


FREEZER_ROOT = default_freezer_root()
FREEZE_DEADLINE_S = 0.5  # FREEZING that lasts longer is an error: the shutter is abandoned and all is thawed


@dataclass(frozen=True)
class Target:
    """What to pause for one job: its cgroup if it has one, else its processes."""

    job_id: str
    procs: frozenset[Proc]
    cgroup: Path | None = None

    @property
    def empty(self) -> bool:
        """Nothing to pause: the job does not run (stopped by someone else, or gone)."""
        return self.cgroup is None and not self.procs


def check_cgroup(cgroup: Path, guard: Guard, root: Path = FREEZER_ROOT) -> Path:
    path = cgroup.resolve()
    base = root.resolve()
    if path == base or base not in path.parents:
        raise Refused(f"refusing cgroup {cgroup}: not below the freezer hierarchy {root}")
    if not (path / "cgroup.procs").is_file():
        raise Refused(f"refusing cgroup {cgroup}: not a cgroup (no cgroup.procs)")
    # a freeze reaches every cgroup below (Slurm's steps; v2 keeps processes only in leaves)
    for below, _dirs, files in os.walk(path):
        if "cgroup.procs" in files:
            with suppress(FileNotFoundError):  # a step that ended meanwhile
                if {int(x) for x in Path(below, "cgroup.procs").read_text().split()} & guard.own_pids:
                    raise Refused(f"refusing cgroup {cgroup}: it holds the agent's own processes")
    return path


def is_v2(cgroup: Path) -> bool:
    """A cgroup v2 directory (``cgroup.freeze``), as opposed to v1's freezer (``freezer.state``)."""
    return (cgroup / "cgroup.freeze").exists()


def _write_state(cgroup: Path, value: str) -> None:
    """Ask for FROZEN or THAWED (v1's words; v2 takes 1 or 0)."""
    if is_v2(cgroup):
        (cgroup / "cgroup.freeze").write_text("1" if value == "FROZEN" else "0")
    else:
        (cgroup / "freezer.state").write_text(value)


def freezer_state(cgroup: Path) -> str:
    """THAWED, FREEZING or FROZEN. v2: FROZEN once ``cgroup.events`` says so (asked here, or by a
    parent: someone else's freeze), FREEZING while asked and not all frozen, else THAWED."""
    try:
        return (cgroup / "freezer.state").read_text().strip()
    except FileNotFoundError:
        asked = (cgroup / "cgroup.freeze").read_text().strip() == "1"  # FileNotFoundError: the cgroup has gone
    events = (cgroup / "cgroup.events").read_text()
    if "frozen 1" in events.splitlines():
        return "FROZEN"
    return "FREEZING" if asked else "THAWED"


def freeze(cgroup: Path) -> None:
    _write_state(cgroup, "FROZEN")
    deadline = time.monotonic() + FREEZE_DEADLINE_S
    while freezer_state(cgroup) != "FROZEN":
        if time.monotonic() > deadline:
            raise TimeoutError(f"cgroup {cgroup} still FREEZING after {FREEZE_DEADLINE_S} s")
        time.sleep(0.0002)


def thaw(cgroup: Path) -> None:
    _write_state(cgroup, "THAWED")


class Pauser:
    """Pauses and resumes jobs, refusing anything the guard forbids, and resuming only what it stopped."""

    def __init__(self, guard: Guard, freezer_root: Path = FREEZER_ROOT) -> None:
        self.guard = guard
        self.freezer_root = freezer_root
        # What this pauser stopped and has not resumed yet, each entry made before its SIGSTOP or
        # FROZEN write: a process (with its job's processes, which the guard checks it against)
        # and a cgroup
        self.stopped: dict[Proc, frozenset[Proc]] = {}
        self.frozen: set[Path] = set()

    def checked(self, target: Target) -> Target:
        """The target, after every check that pausing it would need (raises Refused)."""
        if target.cgroup is not None:
            return Target(target.job_id, target.procs, check_cgroup(target.cgroup, self.guard, self.freezer_root))
        for p in target.procs:
            self.guard.check(p, target.procs)
        return target

    def running(self, target: Target) -> Target:
        """What of a checked ``target`` runs now: the only part a shutter may pause, and so resume.
        Processes stopped by someone else (T, t) or gone are left out; a cgroup frozen or freezing by
        someone else, or whose processes are all stopped, leaves nothing. Empty: the job does not run."""
        procs = frozenset(p for p in target.procs if state(p) not in NOT_RUNNING)
        if target.cgroup is None or not procs:
            return Target(target.job_id, procs)
        try:
            thawed = freezer_state(target.cgroup) == "THAWED"
        except FileNotFoundError:  # the cgroup went with its job
            thawed = False
        return Target(target.job_id, procs, target.cgroup) if thawed else Target(target.job_id, frozenset())

    def pause(self, target: Target) -> None:
        if target.cgroup is not None:
            cgroup = target.cgroup.resolve()
            if freezer_state(cgroup) != "THAWED":  # frozen by someone else since running(): theirs to thaw
                return
            self.frozen.add(cgroup)  # before the write: a FREEZING that times out is thawed too
            freeze(cgroup)
            return
        for p in sorted(target.procs):
            self.guard.check(p, target.procs)
            self.stopped[p] = target.procs  # before the signal: a signal or error after it still resumes p
            if not send(p, signal.SIGSTOP):  # gone, or already stopped by someone else: not ours
                del self.stopped[p]

    def resume(self, target: Target) -> None:
        """Resume what this pauser stopped of ``target`` (nothing else)."""
        if target.cgroup is not None:
            cgroup = target.cgroup.resolve()
            if cgroup in self.frozen:
                self._thaw(cgroup)
            return
        for p in sorted(target.procs):
            if p in self.stopped:
                self._continue(p)

    def held(self) -> list[Target]:
        """Everything this pauser stopped and has not resumed, as targets (for the watchdog)."""
        procs = [Target("", frozenset(self.stopped))] if self.stopped else []
        return procs + [Target("", frozenset(), cgroup) for cgroup in sorted(self.frozen)]

    def resume_held(self, on_error: Callable[[Proc | Path, Exception], None]) -> None:
        """Resume everything this pauser stopped; what fails stays recorded (for the next attempt
        and the watchdog) and goes to ``on_error``. Never raises an ``Exception``."""
        for cgroup in sorted(self.frozen):
            try:
                self._thaw(cgroup)
            except Exception as e:  # every other one must still be tried
                on_error(cgroup, e)
        for p in sorted(self.stopped):
            try:
                self._continue(p)
            except Exception as e:
                on_error(p, e)

    def _thaw(self, cgroup: Path) -> None:
        with suppress(FileNotFoundError):  # the cgroup went with its job: nothing is left frozen
            thaw(cgroup)
        self.frozen.discard(cgroup)

    def _continue(self, p: Proc) -> None:
        self.guard.check(p, self.stopped[p])
        send(p, signal.SIGCONT)
        del self.stopped[p]


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

