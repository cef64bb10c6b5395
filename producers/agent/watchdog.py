"""The shutter watchdog: an independent process that resumes what the agent paused if the agent dies.

The agent holds the only write end of a pipe; the watchdog reads it. Before each pause the agent
writes the set it is about to pause (one JSON line), after resuming it writes an empty set. Bytes
written to a pipe outlive their writer, so however the agent ends (SIGKILL included) the watchdog
reads the last set and then end-of-file, at once, and resumes that set. It runs in its own session,
so a signal to the agent's process group does not take it down too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .pausing import FREEZER_ROOT, Target, resume_all
from .processes import Guard, Proc


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

    @property
    def pid(self) -> int:
        return self.process.pid

    def _say(self, procs: list[list[int]], cgroups: list[str]) -> None:
        if self.process.poll() is not None:
            raise WatchdogLost(f"the shutter watchdog (PID {self.pid}) exited with {self.process.returncode}")
        data = (json.dumps({"procs": procs, "cgroups": cgroups}) + "\n").encode()
        while data:
            data = data[os.write(self._write_end, data):]

    def arm(self, targets: list[Target]) -> None:
        """Record what is about to be paused; call before pausing anything."""
        self._say([p.encode() for t in targets for p in sorted(t.procs) if t.cgroup is None],
                  [str(t.cgroup) for t in targets if t.cgroup is not None])

    def disarm(self) -> None:
        """Nothing is paused any more."""
        self._say([], [])

    def close(self, timeout: float = 5.0) -> None:
        os.close(self._write_end)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def watch(read_fd: int, freezer_root: Path) -> int:
    """Read paused sets until end-of-file, then resume the last one. Returns how many were resumed."""
    guard = Guard(frozenset({os.getpid()}))
    last: dict[str, list] = {"procs": [], "cgroups": []}
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                last = json.loads(line)
    procs = [Proc(pid, start) for pid, start in last["procs"]]
    return resume_all(procs, [Path(c) for c in last["cgroups"]], guard, freezer_root)


def main() -> None:
    resumed = watch(int(sys.argv[1]), Path(sys.argv[2]))
    if resumed:
        print(f"nodeshare watchdog: the agent ended during a shutter; resumed {resumed} processes/cgroups",
              file=sys.stderr)


if __name__ == "__main__":
    main()
