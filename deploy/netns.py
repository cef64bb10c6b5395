"""A cluster of several nodes on one Linux machine: one network namespace per node, each with its
own address on a bridge and its own host name, for trying nodeshare's multi-node behaviour (a node
lost, cut off, rebooted) on a laptop or in tests. Needs root and ``ip`` (iproute2); ``unshare``
(util-linux) gives each node's processes their host name.

    bridge <name>br  10.<net>.0.1/24   (the host: broker, worker, sinks, Slurm controller)
      |-- veth <name>h1 <-> <name>p1 in netns <name>1, 10.<net>.0.11, host name <node prefix>1
      |-- veth <name>h2 <-> <name>p2 in netns <name>2, 10.<net>.0.12, ...

A node's processes run with ``command(node, argv)``; ``cut(node)`` takes its link down (the node
is cut from the broker for good, or until ``join(node)``). Run ``python -m nodeshare.deploy.netns
up|down [--nodes N]`` to keep a cluster between commands (see docs/deployment.md).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class NetnsCluster:
    """``nodes`` network namespaces on a bridge. Interface names are ``name`` plus a suffix, so
    ``name`` is at most 10 characters (Linux allows 15); ``net`` picks the 10.<net>.0.0/24 subnet."""

    nodes: int = 3
    name: str = "nsh"
    net: int = 239
    node_prefix: str = "node"

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200 or len(self.name) > 10 or not self.name.isalnum():
            raise ValueError("1..200 nodes and an alphanumeric name of at most 10 characters")

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def host_address(self) -> str:
        """The host's address on the bridge: where the nodes reach the broker and the controller."""
        return f"10.{self.net}.0.1"

    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1)]

    def namespace(self, node: str) -> str:
        return f"{self.name}{self._index(node)}"

    def address(self, node: str) -> str:
        return f"10.{self.net}.0.{10 + self._index(node)}"

    def _index(self, node: str) -> int:
        names = self.node_names()
        if node not in names:
            raise KeyError(f"{node} is not a node of this cluster ({', '.join(names)})")
        return names.index(node) + 1

    def up(self) -> NetnsCluster:
        """Create the bridge and each node's namespace, link, address and loopback (any left over
        from an earlier run first removed)."""
        self.down()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.node_names():
            i, ns = self._index(node), self.namespace(node)
            _ip("netns", "add", ns)
            _ip("link", "add", f"{self.name}h{i}", "type", "veth", "peer", "name", f"{self.name}p{i}")
            _ip("link", "set", f"{self.name}p{i}", "netns", ns)
            _ip("link", "set", f"{self.name}h{i}", "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", f"{self.name}p{i}")
            _ip("-n", ns, "link", "set", f"{self.name}p{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        """Remove every namespace and link this cluster made (what is not there is skipped). Processes
        still running in a namespace keep it alive until they end: stop them first."""
        for i in range(1, self.nodes + 1):
            _ip("netns", "del", f"{self.name}{i}", check=False)
            _ip("link", "del", f"{self.name}h{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def command(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``node``: in its network namespace, with its host name (a UTS namespace
        of its own), on the host's file systems. ``nsenter``, not ``ip netns exec``: the latter mounts
        a sysfs of its own, which hides ``/sys/fs/cgroup`` (slurmd will not start without it, and an
        agent could not find its jobs' cgroups) and ``/sys/class/powercap``."""
        script = f'hostname {shlex.quote(node)} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--uts", "sh", "-c", script, "sh",
                *argv]

    def cut(self, node: str) -> None:
        """Take the node's link down: nothing goes in or out of it (a cable pulled, a switch port dead)."""
        _ip("link", "set", f"{self.name}h{self._index(node)}", "down")

    def join(self, node: str) -> None:
        """Bring the node's link back up (it forwards at once; the node's first connection may still
        wait about a second on address resolution, which failed while it was cut)."""
        _ip("link", "set", f"{self.name}h{self._index(node)}", "up")

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nodeshare.deploy.netns", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--name", default="nsh")
    parser.add_argument("--net", type=int, default=239)
    args = parser.parse_args(argv)
    cluster = NetnsCluster(args.nodes, args.name, args.net)
    if args.action == "down":
        cluster.down()
        return
    cluster.up()
    for node in cluster.node_names():
        print(f"{node}: {cluster.address(node)} (netns {cluster.namespace(node)}); run on it: "
              f"{shlex.join(cluster.command(node, ['nodeshare', 'agent', '--help']))}")
    print(f"host (broker, worker, sinks): {cluster.host_address}")


if __name__ == "__main__":
    main()
