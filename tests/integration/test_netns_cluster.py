"""Issue 39, item 1 (a start): three nodes on this machine, each a network namespace with its own
address and host name, each running its own `nodeshare agent` on a real job; the broker, the worker
and the sinks on the host. Every job is charged on the node that ran it, and the audit agrees. A
node's link cut and joined again takes it off the broker and back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_nodes import netns_cluster, netns_missing, reaches, reaches_within

from nodeshare.demo import running_pipeline
from nodeshare.deploy.broker import BundledBroker
from nodeshare.deploy.netns import NetnsCluster
from nodeshare.runtime.config import Settings
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def cluster() -> Iterator[NetnsCluster]:
    if (why := netns_missing()) is not None:
        pytest.skip(why)
    with netns_cluster(3) as c:
        yield c


def test_three_nodes_each_with_its_agent_and_address_are_charged(cluster: NetnsCluster, tmp_path: Path) -> None:
    nodes = cluster.node_names()
    for node in nodes:
        named = subprocess.run(cluster.command(node, ["hostname"]), capture_output=True, text=True, timeout=30)
        assert named.stdout.strip() == node
        shown = subprocess.run(["ip", "netns", "exec", cluster.namespace(node), "ip", "-4", "-o", "addr"],
                               capture_output=True, text=True, timeout=30).stdout
        assert f"{cluster.address(node)}/24" in shown
    with BundledBroker(host=cluster.host_address, log_path=tmp_path / "tansu.log") as broker:
        settings = Settings(bootstrap=broker.bootstrap, topic_prefix="netns.", partitions=2)
        cluster.cut(nodes[0])
        assert not reaches(cluster, nodes[0], cluster.host_address, broker.port)
        cluster.join(nodes[0])
        # the node's first connection may wait on address resolution, which failed while it was cut
        # (the kernel solicits again every second; 1 in 6 first probes here took 1.05 s): within seconds
        assert reaches_within(cluster, nodes[0], cluster.host_address, broker.port, 15.0)

        job = [sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds", "3"]
        env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env(), "NODESHARE_PERIOD_MS": "100",
               "NODESHARE_SHUTTER_SCHEDULE": "fixed"}
        agents = []
        with running_pipeline(settings, tmp_path / "run") as pipeline:
            for node in nodes:
                home = tmp_path / node
                home.mkdir()
                (home / "jobs.toml").write_text(f'[[jobs]]\nid = "job-{node}"\ncommand = {job!r}\n'.replace("'", '"'))
                # no --node: the agent names its node by its host name, as on a real node
                agents.append(subprocess.Popen(cluster.command(node, [
                    sys.executable, "-m", "nodeshare", "agent", "--jobs", str(home / "jobs.toml"),
                    "--spool", str(home / "spool.db"), "--progress-dir", str(home / "progress"), "--until-idle",
                    "--drain-timeout", "30"]), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            try:
                for agent in agents:
                    _, errors = agent.communicate(timeout=120)
                    assert agent.returncode == 0, errors
            finally:
                for agent in agents:
                    if agent.poll() is None:
                        agent.kill()
                        agent.wait()
            pipeline.wait(charges=len(nodes), archived=0, timeout_s=90, report=lambda *_: None)
        with Ledger(pipeline.ledger_path, read_only=True) as ledger:
            charges = {c.job_id: c for c in ledger.charges()}
        assert {j: [n.node for n in c.nodes] for j, c in charges.items()} == {f"job-{n}": [n] for n in nodes}
        report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
        assert report.ok and report.matches == len(nodes), report.as_dict()


#: how long the node is cut off (issue 39, item 4: 60 s)
PARTITION_S = 60.0


def test_a_node_cut_from_the_broker_for_60_s_mid_job_loses_nothing_and_doubles_nothing(
        cluster: NetnsCluster, tmp_path: Path) -> None:
    """Issue 39, item 4. Two real jobs share a node; 4 s into them the node's link goes down for
    60 s, and both jobs end while it is down. The agent's spool holds their blocks and markers,
    and once the link is back it delivers them: each job charged once, every block the agent sent
    counted once (``blocks`` == ``blocks_sent``), the audit recomputes both charges. The same two
    programs run at the same time on a second node that is never cut: each cut job's degradation
    lies within the estimator's own noise of its uncut twin's (see the check's comment)."""
    import time

    cut_node, ref_node = cluster.node_names()[:2]
    with BundledBroker(host=cluster.host_address, log_path=tmp_path / "tansu.log") as broker:
        settings = Settings(bootstrap=broker.bootstrap, topic_prefix="cut.", partitions=2)
        job = [sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds", "20"]
        # 20 ms windows, as the real-Slurm tests use: an application counter's time is the job's CPU
        # time, which 3.2 ms windows on this 2-core machine cut too fine (tests/slurm_cluster.py)
        env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env(), "NODESHARE_PERIOD_MS": "100",
               "NODESHARE_SAMPLE_US": "20000", "NODESHARE_SHUTTER_SCHEDULE": "fixed"}
        agents = {}
        with running_pipeline(settings, tmp_path / "run") as pipeline:
            for node, prefix in ((cut_node, "cut"), (ref_node, "ref")):
                home = tmp_path / node
                home.mkdir()
                (home / "jobs.toml").write_text("".join(f'[[jobs]]\nid = "{prefix}-{j}"\ncommand = {job!r}\n'
                                                        .replace("'", '"') for j in ("a", "b")))
                agents[node] = subprocess.Popen(cluster.command(node, [
                    sys.executable, "-m", "nodeshare", "agent", "--jobs", str(home / "jobs.toml"),
                    "--spool", str(home / "spool.db"), "--progress-dir", str(home / "progress"), "--until-idle",
                    "--drain-timeout", str(PARTITION_S + 60)]), env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
            try:
                time.sleep(4)
                cluster.cut(cut_node)
                cut_at = time.monotonic()
                assert not reaches(cluster, cut_node, cluster.host_address, broker.port)
                time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))
                assert agents[cut_node].poll() is None, "the agent gave up while its node was cut off"
                cluster.join(cut_node)
                for agent in agents.values():
                    _, errors = agent.communicate(timeout=180)
                    assert agent.returncode == 0, errors
            finally:
                cluster.join(cut_node)
                for agent in agents.values():
                    if agent.poll() is None:
                        agent.kill()
                        agent.wait()
            pipeline.wait(charges=4, archived=0, timeout_s=90, report=lambda *_: None)
        with Ledger(pipeline.ledger_path, read_only=True) as ledger:
            rows = {c.job_id: c for c in ledger.charges()}
        assert sorted(rows) == ["cut-a", "cut-b", "ref-a", "ref-b"]  # one row each
        for j, c in rows.items():
            [n] = c.nodes
            assert n.node == (cut_node if j.startswith("cut") else ref_node), (j, n)
            assert n.blocks == n.blocks_sent > 0, (j, n)
            assert c.blocks_ignored == 0 and c.estimate_status.value != "node_lost", c
        print("cut off", PARTITION_S, "s:", [(j, c.nodes[0].blocks, c.blocks_used, c.estimate_status.value,
                                              round(c.degradation, 4), round(c.degradation_low, 4),
                                              round(c.degradation_high, 4), c.interval_method)
                                             for j, c in sorted(rows.items())])
        # The same program next to the same co-runner, cut and not: the two degradations differ by no
        # more than the two intervals' widths together (each interval widened to twice its half-width
        # around its point, so about 4 standard errors of the difference). All four jobs share this
        # machine's two cores, so the twins' true degradations differ too: the intervals themselves
        # met in 6 of 6 pairs in 3 runs here, and missed by 0.0005 in one CI run (D 0.0 in [0, 0.052]
        # against 0.158 in [0.052, 0.263]). A cut that distorted the measurement (blocks re-timed at
        # delivery, markers lost) moves D by far more.
        for twin in ("a", "b"):
            cut, ref = rows[f"cut-{twin}"], rows[f"ref-{twin}"]
            widths = (cut.degradation_high - cut.degradation_low) + (ref.degradation_high - ref.degradation_low)
            assert abs(cut.degradation - ref.degradation) <= widths, \
                (cut.degradation, cut.degradation_low, cut.degradation_high, ref.degradation, ref.degradation_low,
                 ref.degradation_high)
        report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
        assert report.ok and report.matches == 4, report.as_dict()
