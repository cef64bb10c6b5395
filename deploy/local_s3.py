"""A local S3 server for the bundled broker's durable storage (``nodeshare broker --data DIR``).

Tansu keeps topics, offsets and consumer groups in memory unless it is given a storage engine: an
S3 bucket or PostgreSQL. On one machine without a cloud, the S3 engine is pointed at s3rver, a
small S3 server from the npm registry that writes each object to a file under DIR. It survives
the broker's SIGKILL and restart with every acknowledged record (docs/broker.md).

s3rver is installed on first use with the machine's npm into ``~/.cache/nodeshare/s3rver``
(``NODESHARE_S3RVER_DIR`` for another place); nodeshare pins its version.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO

from .broker import BrokerError, _wait_alive, close_child, free_port
from .processes import die_with_parent

S3RVER_VERSION = "3.7.1"
BUCKET = "tansu"
#: s3rver's documented credentials: it listens on 127.0.0.1 only, and anyone on the machine who
#: knows them can rewrite what it stores (a broker for one user's machine, docs/broker.md)
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}


def s3rver_dir() -> Path:
    return Path(os.environ.get("NODESHARE_S3RVER_DIR") or Path.home() / ".cache" / "nodeshare" / "s3rver")


def _installed(prefix: Path) -> bool:
    try:
        meta = json.loads((prefix / "node_modules" / "s3rver" / "package.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("version") == S3RVER_VERSION and (prefix / "node_modules" / ".bin" / "s3rver").exists()


def s3rver_binary(install: bool = True) -> Path:
    """The s3rver command, installed with npm first if this version is not there (a few seconds;
    one process at a time, under a lock, without the packages' install scripts)."""
    prefix = s3rver_dir()
    binary = prefix / "node_modules" / ".bin" / "s3rver"
    if not install or _installed(prefix):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise BrokerError("a durable broker needs s3rver from the npm registry, and npm is not installed "
                          "(Debian: apt-get install npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f".{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it: wait, then look again
        if _installed(prefix):
            return binary
        try:
            done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-fund", "--no-audit",
                                   "--ignore-scripts", "--loglevel=error", f"s3rver@{S3RVER_VERSION}"],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"npm did not install s3rver@{S3RVER_VERSION} into {prefix} within 300 s") from exc
        if done.returncode != 0 or not _installed(prefix):
            raise BrokerError(f"npm could not install s3rver@{S3RVER_VERSION} into {prefix}: "
                              f"{(done.stderr or done.stdout).strip()[-500:]}")
    return binary


class LocalS3:
    """s3rver on 127.0.0.1 serving ``directory``, with the bucket Tansu writes to. A context manager;
    ``env`` is what Tansu needs to reach it."""

    def __init__(self, directory: Path, *, port: int | None = None, log_path: Path | None = None) -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"nodeshare-s3rver-{self.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**_CREDENTIALS, "AWS_ENDPOINT": f"http://127.0.0.1:{self.port}", "AWS_ALLOW_HTTP": "true"}

    def start(self, timeout_s: float = 20.0) -> LocalS3:
        binary = s3rver_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [str(binary), "--directory", str(self.directory), "--address", "127.0.0.1", "--port", str(self.port),
             "--silent", "--configure-bucket", BUCKET],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            _wait_alive(self._proc, self.port, timeout_s, "s3rver", self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._proc, self._log = close_child(self._proc, self._log, timeout_s)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
