"""Issue 39 on a real Slurm over several nodes: three nodes made of network namespaces, each with its
own address, host name, slurmd and `nodeshare agent --slurm`; slurmctld, the broker, the stream
worker, the sinks, the Slurm source and `nodeshare slurm scheduler` on the host. Jobs of one and of
two nodes, real processes (a two-node job's tasks started by srun on both nodes).

- Every job is placed by the placement manager, run by Slurm where the decision said, shuttered by
  the agents of its nodes and charged once, per node; the audit recomputes every charge.
- A node that dies under a two-node job (every process on it killed, its link down for good):
  Slurm ends the jobs it ran with NODE_FAIL once the node stops answering, the Slurm source sends a
  ``NodeDown`` per job, and each job is charged from what its nodes sent before, marked
  ``node_lost``; the audit recomputes those charges too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from netns_nodes import crash, netns_cluster, netns_missing
from slurm_cluster import SHUTTER, lifecycle_source, local_slurm, missing, squeue_states

from nodeshare.demo import Pipeline, running_pipeline
from nodeshare.deploy.broker import BundledBroker
from nodeshare.deploy.netns import NetnsCluster
from nodeshare.producers.slurm import SlurmCommands
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.producers.slurm_scheduler import SchedulerCommands, run_scheduler
from nodeshare.runtime.config import Settings
from nodeshare.schemas import Charge, JobState
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

_WHY_NOT = missing() or netns_missing()  # asked once: the probe makes and removes a namespace
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))]


@contextmanager
def site(tmp_path: Path, slurm_conf: str = "",
         **settings: float) -> Iterator[tuple[NetnsCluster, Settings, dict[str, str], Pipeline]]:
    """Three namespace nodes under a real Slurm, the broker on the host's bridge address (where the
    nodes reach it), the Slurm hooks installed and the pipeline running; ``slurm_conf``: lines added
    to slurm.conf; ``settings``: the site's own."""
    install_hooks(tmp_path / "hooks", tmp_path / "events")

    def more_conf(t: Path) -> None:
        with (t / "etc" / "slurm.conf").open("a") as f:
            f.write(slurm_conf)
    with netns_cluster(3) as cluster, BundledBroker(host=cluster.host_address, log_path=tmp_path / "tansu.log") as b:
        site_settings = Settings(bootstrap=b.bootstrap, topic_prefix="sn.", partitions=2, **settings)
        with local_slurm(tmp_path / "hooks", more_conf, cluster=cluster) as env, \
                running_pipeline(site_settings, tmp_path / "run") as pipeline:
            yield cluster, site_settings, env, pipeline


@contextmanager
def agents(cluster: NetnsCluster, settings: Settings, env: dict[str, str],
           home: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """`nodeshare agent --slurm` on every node, named by its host name, until the block ends (SIGTERM:
    each drains its spool first); fails if one stopped on its own."""
    agent_env = {**env, "NODESHARE_CONFIG": "", **settings.as_env(), **SHUTTER}
    running = {}
    for node in cluster.node_names():
        (home / node).mkdir(parents=True)
        (home / "progress" / node).mkdir(parents=True)  # a node's own directory (see ``workload``)
        running[node] = subprocess.Popen(cluster.command(node, [
            sys.executable, "-m", "nodeshare", "agent", "--slurm", "--spool", str(home / node / "spool.db"),
            "--progress-dir", str(home / "progress" / node), "--drain-timeout", "30"]),
            env=agent_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield running
    finally:
        for p in running.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in running.values():
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def submit(env: dict[str, str], out: Path, name: str, command: str, *args: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", "--no-requeue", "-J", name, "-o", str(out / f"{name}.out"),
                           *args, "--wrap", command], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


def workload(progress: Path, kind: str, seconds: float, srun: bool = False) -> str:
    """The job's command: a task per node (srun) or the batch script's own, counting its progress in
    the node's own directory under ``progress``, as in a node-local one on a real cluster (a counter
    file is per job: these nodes share one file system, where a two-node job's tasks would write
    the same file)."""
    task = (f"NODESHARE_PROGRESS_DIR={progress}/$(hostname) exec {sys.executable} -m nodeshare workload "
            f"--kind {kind} --seconds {seconds:g}")
    return f"{'srun ' if srun else ''}sh -c '{task}'"


def where(env: dict[str, str], job: str) -> list[str]:
    """The nodes Slurm ran ``job`` on."""
    listed = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%N"], env=env, capture_output=True,
                            text=True, check=True).stdout.strip()
    return list(SlurmCommands(env).hostnames(listed))


def charged(pipeline: Pipeline, ids: list[str]) -> dict[str, Charge]:
    """Each job's charge, one per job and every job charged; printed with its streams (blocks kept,
    blocks the node said it sent)."""
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.job_id: c for c in ledger.charges()}
    assert charges.keys() == set(ids)
    for j, c in sorted(charges.items()):
        print(f"job {j} ({c.program}): {[(n.node, n.blocks, n.blocks_sent) for n in c.nodes]}, degradation "
              f"{c.degradation:.3f}, {c.estimate_status.value}, {c.final_state.value}")
    return charges


def until(done: object, seconds: float, what: object) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


def test_jobs_of_one_and_two_nodes_are_placed_shuttered_and_charged_per_node(tmp_path: Path) -> None:
    with site(tmp_path) as (cluster, settings, env, pipeline), agents(cluster, settings, env, tmp_path) as running:
        progress = tmp_path / "progress"
        ids = [submit(env, tmp_path, "stream", workload(progress, "stream", 10), "--hold", "-n", "1"),
               submit(env, tmp_path, "compute", workload(progress, "compute", 10), "--hold", "-n", "1"),
               submit(env, tmp_path, "wide", workload(progress, "compute", 10, srun=True), "--hold", "-N", "2",
                      "-n", "2")]
        stop = threading.Event()
        plans: list = []
        with lifecycle_source(settings, tmp_path / "events", env):
            adapter = threading.Thread(target=run_scheduler, args=(settings, SchedulerCommands(env), stop), kwargs={
                "llc_ways": 11, "mem_bandwidth_gbps": 20.0, "on_plan": lambda d, p: plans.append((d, p))})
            adapter.start()
            try:
                until(lambda: set(squeue_states(env, ids)) == {"COMPLETED"}, 180,
                      lambda: (squeue_states(env, ids), plans))
                pipeline.wait(charges=3, archived=0, timeout_s=120, report=lambda *_: None)
            finally:
                stop.set()
                adapter.join(60)
        for node, p in running.items():
            assert p.poll() is None, (node, p.communicate())  # no agent stopped on its own
        ran_on = {j: where(env, j) for j in ids}
    applied = {d.job_id: d for d, p in plans if p.outcome == "applied"}
    assert applied.keys() == set(ids), plans  # each job placed by a decision the adapter applied
    assert {j: sorted(d.nodes) for j, d in applied.items()} == ran_on  # Slurm ran each where it was placed
    assert len(ran_on[ids[2]]) == 2 and all(len(ran_on[j]) == 1 for j in ids[:2])
    charges = charged(pipeline, ids)
    for j, c in charges.items():
        assert sorted(n.node for n in c.nodes) == ran_on[j]  # a stream per node it ran on, each closed
        assert c.final_state is JobState.ENDED and c.estimate_status.value != "node_lost"
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == 3, report.as_dict()


#: slurmctld marks a node that stops answering DOWN after this many seconds (its default is 300)
SLURMD_TIMEOUT_S = 6
#: An agent sends a job's blocks at the latest this long after the first of a batch (``batch_age_s``,
#: 30 s by default): a node that dies loses what it had not sent. Shorter here, so the test's node
#: has sent some before it dies.
BATCH_AGE_S = 4.0


def test_a_node_that_dies_under_a_two_node_job_leaves_its_jobs_charged_as_node_lost(tmp_path: Path) -> None:
    conf = f"SlurmdTimeout={SLURMD_TIMEOUT_S}\n"
    with site(tmp_path, conf, batch_age_s=BATCH_AGE_S) as (cluster, settings, env, pipeline), \
            agents(cluster, settings, env, tmp_path) as running:
        _, second, third = cluster.node_names()
        progress = tmp_path / "progress"
        wide = submit(env, tmp_path, "wide", workload(progress, "compute", 300, srun=True), "-N", "2", "-n", "2",
                      "-w", f"{second},{third}")
        # a co-runner on each of its nodes, so both nodes shutter it
        beside = [submit(env, tmp_path, f"beside-{n}", workload(progress, "stream", 300), "-n", "1", "-w", n)
                  for n in (second, third)]
        ids = [wide, *beside]
        with lifecycle_source(settings, tmp_path / "events", env) as published:
            until(lambda: set(squeue_states(env, ids)) == {"RUNNING"}, 60, lambda: squeue_states(env, ids))
            time.sleep(5 * BATCH_AGE_S)  # blocks sent from both nodes
            killed = crash(cluster, third)
            assert killed and running[third].wait(10) is not None  # its agent went with it
            down_at = time.monotonic()
            # Slurm ends the jobs on the dead node with NODE_FAIL once it stops answering, and kills the
            # two-node job's half on the live node; the live node's own job runs on
            after = ["NODE_FAIL", "RUNNING", "NODE_FAIL"]  # the two-node job, the live node's, the dead node's
            until(lambda: squeue_states(env, ids) == after, 60, lambda: squeue_states(env, ids))
            failed_after = time.monotonic() - down_at
            pipeline.wait(charges=2, archived=0, timeout_s=120, report=lambda *_: None)
            subprocess.run(["scancel", beside[0]], env=env, check=True)  # the live node's own job ends
            pipeline.wait(charges=3, archived=0, timeout_s=120, report=lambda *_: None)
        assert published and published[0] > 0
        for node in cluster.node_names()[:2]:
            assert running[node].poll() is None, (node, running[node].communicate())
    print(f"node {third} dead; Slurm ended its jobs with NODE_FAIL {failed_after:.1f} s later "
          f"({len(killed)} processes killed)")
    charges = charged(pipeline, ids)
    lost = {j for j, c in charges.items() if c.estimate_status.value == "node_lost"}
    assert lost == {wide, beside[1]}
    assert sorted(n.node for n in charges[wide].nodes) == [second, third]
    assert all(n.blocks > 0 for n in charges[wide].nodes)  # priced from both nodes' blocks, the lost one's too
    assert charges[wide].final_state is JobState.FAILED
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == 3, report.as_dict()
    listed = subprocess.run([sys.executable, "-m", "nodeshare", "charges", "--ledger", str(pipeline.ledger_path),
                             "--incomplete", "-P", "-n", "-o", "JobID"], env={**os.environ, "NODESHARE_CONFIG": ""},
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.split()) == sorted(lost), listed.stdout  # what an operator lists
