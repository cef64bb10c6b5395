"""The shutter watchdog: an independent process that resumes what the agent paused, restores the
power limits it changed and removes the resctrl groups it made, if the agent dies.

The agent holds the only write end of a pipe; the watchdog reads it. Before each pause the agent
writes the set it is about to pause (one JSON line: only what runs, so never a job someone else
stopped), after resuming it writes what stays paused (nothing, unless a resume failed); before
it first changes a power limit it writes the limit's original value, and an empty map once it has
restored them; before it makes a resctrl group, the groups it has. Each line states everything, so
the last one read is what needs undoing. Bytes written to a pipe outlive their writer, so however
the agent ends (SIGKILL included) the watchdog reads the last line and then end-of-file, at once,
resumes that set, writes those limits back and removes those groups. It runs in its own session,
so a signal to the agent's process group does not take it down too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from .pausing import FREEZER_ROOT, Target, resume_all
from .powercap import restore
from .processes import Guard, Proc
from .resctrl import remove_group


class WatchdogLost(RuntimeError):
    """The watchdog is gone: shutters must stop (nothing would resume a job if the agent died)."""


class Watchdog:
    """The agent's side: start the watchdog, tell it what is paused, stop it."""

    def __init__(self, freezer_root: Path = FREEZER_ROOT) -> None:
        read_end, self._write_end = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nodeshare.producers.agent.watchdog", str(read_end), str(freezer_root)],
                pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(read_end)
        self._lock = threading.Lock()  # the shutter loop and the power-cap follower both speak
        self._paused: tuple[list[list[int]], list[str]] = ([], [])
        self._caps: dict[str, int] = {}
        self._groups: list[str] = []

    @property
    def pid(self) -> int:
        return self.process.pid

    def _say(self, paused: tuple[list[list[int]], list[str]] | None = None,
             caps: dict[str, int] | None = None, groups: list[str] | None = None) -> None:
        with self._lock:
            if self.process.poll() is not None:
                raise WatchdogLost(f"the shutter watchdog (PID {self.pid}) exited with {self.process.returncode}")
            self._paused = paused if paused is not None else self._paused
            self._caps = caps if caps is not None else self._caps
            self._groups = groups if groups is not None else self._groups
            data = (json.dumps({"procs": self._paused[0], "cgroups": self._paused[1], "caps": self._caps,
                                "resctrl": self._groups}) + "\n").encode()
            while data:
                data = data[os.write(self._write_end, data):]

    def arm(self, targets: list[Target]) -> None:
        """Record what is about to be paused; call before pausing anything."""
        self._say(([p.encode() for t in targets for p in sorted(t.procs) if t.cgroup is None],
                   [str(t.cgroup) for t in targets if t.cgroup is not None]))

    def disarm(self) -> None:
        """Nothing is paused any more."""
        self._say(([], []))

    def hold_caps(self, originals: dict[str, int]) -> None:
        """The power limits changed so far and their original values (limit file -> µW)."""
        self._say(caps=originals)

    def hold_groups(self, groups: list[str]) -> None:
        """The resctrl groups made so far (removed if the agent dies)."""
        self._say(groups=groups)

    def close(self, timeout: float = 5.0) -> None:
        os.close(self._write_end)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def watch(read_fd: int, freezer_root: Path) -> int:
    """Read the agent's lines until end-of-file, then resume the last paused set and write back the
    last power limits. Returns how many processes, cgroups and limits were put back."""
    guard = Guard(frozenset({os.getpid()}))
    last: dict = {"procs": [], "cgroups": [], "caps": {}}
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                last = json.loads(line)
    procs = [Proc(pid, start) for pid, start in last["procs"]]
    resumed = resume_all(procs, [Path(c) for c in last["cgroups"]], guard, freezer_root)
    groups = sum(remove_group(Path(g)) for g in last.get("resctrl", []))
    return resumed + len(restore(last.get("caps", {}))) + groups


def main() -> None:
    resumed = watch(int(sys.argv[1]), Path(sys.argv[2]))
    if resumed:
        print(f"nodeshare watchdog: the agent ended with work to undo; resumed or restored {resumed} "
              "processes, cgroups, power limits and resctrl groups",
              file=sys.stderr)


if __name__ == "__main__":
    main()
