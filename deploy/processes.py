"""Starting and stopping nodeshare's own child processes (stream workers) without orphans."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from nodeshare.runtime.config import Settings

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child between fork and exec: the kernel sends it SIGTERM when its parent dies,
    even by SIGKILL, so no child of nodeshare is ever orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_nodeshare(settings: Settings, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``nodeshare ARGS`` with these settings (and no other NODESHARE_* variable), its
    output appended to ``log_path``; it dies with its parent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODESHARE_")}
    env.update(settings.as_env())
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "nodeshare", *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()


def start_worker(settings: Settings, datadir: Path, log_path: Path, loglevel: str = "info",
                 extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a faust stream worker (``nodeshare worker [EXTRA]``) that dies with its parent."""
    datadir.mkdir(parents=True, exist_ok=True)
    return start_nodeshare(settings, ["worker", "--datadir", str(datadir), "--loglevel", loglevel, *extra], log_path)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> int:
    """SIGTERM, wait, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
