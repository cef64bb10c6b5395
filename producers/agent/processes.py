"""Process identities and the signalling guard.

A PID alone is not an identity: it is reused once its process is reaped. A ``Proc`` is a PID plus
the process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), which together
name one process for the life of the machine. Signals go through a pidfd opened *and then*
checked against the start time, so a signal can never reach a process that merely inherited the PID.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
STOPPED: frozenset[str | None] = frozenset("Tt")  # stopped by a signal (T) or at a tracer's stop (t)
NOT_RUNNING = STOPPED | {"Z", "X", None}  # ... or gone (a zombie, dead, no such process)


class Refused(RuntimeError):
    """The agent was asked to touch a process or cgroup it must not touch."""


@dataclass(frozen=True, order=True)
class Proc:
    pid: int
    start_ticks: int

    def encode(self) -> list[int]:
        return [self.pid, self.start_ticks]


def _stat_fields(pid: int, proc: Path = PROC) -> list[str] | None:
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'
    return [str(pid), raw[raw.index("(") + 1:raw.rindex(")")], *raw[raw.rindex(")") + 2:].split()]


def identity(pid: int, proc: Path = PROC) -> Proc | None:
    """The process now holding ``pid``, or None when there is none."""
    fields = _stat_fields(pid, proc)
    return None if fields is None else Proc(pid, int(fields[21]))


def state(p: Proc, proc: Path = PROC) -> str | None:
    """The process's state letter (R, S, D, T, Z, ...), or None when it has gone."""
    fields = _stat_fields(p.pid, proc)
    if fields is None or int(fields[21]) != p.start_ticks:
        return None
    return fields[2]


def owner(p: Proc, proc: Path = PROC) -> tuple[int, int] | None:
    """The real user and group ids of the process ``p`` names, or None when it has gone."""
    try:
        status = (proc / str(p.pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    ids = {line.split(":", 1)[0]: line.split()[1] for line in status.splitlines() if line[:4] in ("Uid:", "Gid:")}
    if state(p, proc) is None or "Uid" not in ids or "Gid" not in ids:  # the PID is another process's now
        return None
    return int(ids["Uid"]), int(ids["Gid"])


def alive(p: Proc) -> bool:
    s = state(p)
    return s is not None and s not in ("Z", "X")


def children(proc: Path = PROC) -> dict[int, list[int]]:
    """Every process's children, now: one scan of /proc."""
    tree: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name), proc)
            if fields is not None:
                tree.setdefault(int(fields[3]), []).append(int(entry.name))
    return tree


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> set[int]:
    """``root`` and every process below it in the parent tree (``tree`` from ``children()``, or scanned now)."""
    tree = children() if tree is None else tree
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(tree.get(pid, ()))
    return found


def identities(pids: Iterable[int]) -> frozenset[Proc]:
    return frozenset(p for p in map(identity, pids) if p is not None)


@dataclass(frozen=True)
class Guard:
    """What the agent may never signal: PID 1, itself, its watchdog, and anything not managed."""

    own_pids: frozenset[int]

    @classmethod
    def here(cls, *extra: int) -> Guard:
        return cls(frozenset({os.getpid(), os.getppid(), *extra}))

    def check(self, p: Proc, managed: frozenset[Proc]) -> None:
        if p.pid <= 1:
            raise Refused(f"refusing to signal PID {p.pid}")
        if p.pid in self.own_pids:
            raise Refused(f"refusing to signal PID {p.pid}: the agent itself or its watchdog")
        if p not in managed:
            raise Refused(f"refusing to signal PID {p.pid}: not a process of a managed job")


def send(p: Proc, sig: signal.Signals) -> bool:
    """Signal exactly the process ``p`` names; False when it has gone (nothing was signalled).

    SIGSTOP to a process already stopped (T, t) is not sent either, and False says so: that stop is
    someone else's (a suspend, Ctrl-Z, a debugger), so the caller must not count it as its own and
    continue the process later."""
    try:
        fd = os.pidfd_open(p.pid)
    except ProcessLookupError:
        return False
    try:
        # the pidfd pins the process; only now is comparing start times free of races
        fields = _stat_fields(p.pid)
        if fields is None or int(fields[21]) != p.start_ticks:
            return False
        if sig == signal.SIGSTOP and fields[2] in STOPPED:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)
