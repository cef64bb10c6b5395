"""Nodes made of network namespaces for the multi-node tests (``nodeshare.deploy.netns``): whether
this machine can make them, a cluster of its own per test, and what runs on a node."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nodeshare.deploy.netns import NetnsCluster


def netns_missing() -> str | None:
    """Why this machine cannot make nodes of network namespaces (None when it can)."""
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in ("ip", "unshare", "nsenter")):
        return "needs root, ip (iproute2), unshare and nsenter (util-linux)"
    probe = f"nsp{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if ok else "ip netns add failed: no network namespaces here"


@contextmanager
def netns_cluster(nodes: int = 3) -> Iterator[NetnsCluster]:
    """A cluster with interface names and a subnet of its own (tests may run beside each other)."""
    name = f"t{uuid.uuid4().hex[:6]}"
    # 10.100-238.0.0/24: never 239, the default of ``python -m nodeshare.deploy.netns up``
    with NetnsCluster(nodes=nodes, name=name, net=100 + zlib.crc32(name.encode()) % 139) as c:
        yield c


def reaches(cluster: NetnsCluster, node: str, host: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    return subprocess.run(cluster.command(node, [sys.executable, "-c", probe]), capture_output=True,
                          timeout=30).returncode == 0


def reaches_within(cluster: NetnsCluster, node: str, host: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not reaches(cluster, node, host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def processes_on(cluster: NetnsCluster, node: str) -> list[int]:
    """Every process in the node's network namespace: what a crash of that node takes."""
    inode = os.stat(f"/run/netns/{cluster.namespace(node)}").st_ino
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == f"net:[{inode}]":
                    found.append(int(entry.name))
    return found


def crash(cluster: NetnsCluster, node: str) -> list[int]:
    """The node dies: its link down for good and every process on it SIGKILLed, again until none is
    left (one forked between a scan and the kills, an agent's ``scontrol`` say, is found by the
    next scan). Returns the PIDs killed."""
    cluster.cut(node)
    killed: list[int] = []
    deadline = time.monotonic() + 10
    while pids := processes_on(cluster, node):
        assert time.monotonic() < deadline, f"processes on {node} outlive SIGKILL: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)
    return killed
