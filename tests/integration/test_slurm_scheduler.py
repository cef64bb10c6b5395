"""Placement decisions that act (issue 27): two jobs submitted held to a real Slurm 22.05, the
placement manager places both on the node (Spread-n-Share over the nodes the adapter published),
the adapter pins and releases them, they run side by side, the node agent shutters them and both
get charges with a clean audit. Skipped only where Slurm cannot run (see slurm_cluster.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import local_slurm, missing, run_agent_until_idle, squeue_states

from nodeshare.demo import running_pipeline
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.producers.slurm import SlurmCommands, SlurmSource, run_source
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.producers.slurm_scheduler import Plan, SchedulerCommands, SlurmJob, run_scheduler
from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobState, PlacementDecision
from nodeshare.schemas.events import PlacementAction
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def test_held_slurm_jobs_are_placed_by_the_placement_manager_then_shuttered_and_charged(
        settings: Settings, tmp_path: Path) -> None:
    install_hooks(tmp_path / "hooks", tmp_path / "events")
    progress = tmp_path / "progress"
    progress.mkdir()
    create_topics(settings)
    host = socket.gethostname().split(".")[0]
    plans: list[tuple[PlacementDecision, Plan]] = []
    stop = threading.Event()
    with local_slurm(tmp_path / "hooks") as env, running_pipeline(settings, tmp_path / "run") as pipeline:
        job_env = {**env, "NODESHARE_PROGRESS_DIR": str(progress)}
        ids = []
        for kind in ("stream", "compute"):
            submit = subprocess.run(
                ["sbatch", "--parsable", "--hold", "-n", "1", "-J", kind, "-o", str(tmp_path / f"{kind}.out"),
                 "--wrap", f"{sys.executable} -m nodeshare workload --kind {kind} --seconds 8"],
                env=job_env, capture_output=True, text=True, check=True)
            ids.append(submit.stdout.strip().split(";")[0])
        commands = SchedulerCommands(env)
        assert [commands.job(j) for j in ids] == [SlurmJob(j, "PENDING", "JobHeldUser") for j in ids]
        assert commands.job("999999") is None

        source = SlurmSource(tmp_path / "events", SlurmCommands(env), "nodeshare-test")
        with EventProducer(settings, client_id="nodeshare-slurm") as producer:
            def publish(events: list) -> None:
                producer.send_all(events)
                producer.flush(30)
            threads = [
                threading.Thread(target=run_source, args=(source, publish),
                                 kwargs={"poll_s": 0.5, "stop": stop.is_set}),
                threading.Thread(target=run_scheduler, args=(settings, commands, stop), kwargs={
                    "llc_ways": 11, "mem_bandwidth_gbps": 20.0, "on_plan": lambda d, p: plans.append((d, p))}),
            ]
            for t in threads:
                t.start()
            try:
                deadline = time.monotonic() + 90  # the worker's start, a decision each, then Slurm's start
                while squeue_states(env, ids) != ["RUNNING", "RUNNING"]:  # released by the adapter alone
                    assert time.monotonic() < deadline, (squeue_states(env, ids), plans)
                    time.sleep(0.2)
                where = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%N"], env=env,
                                       capture_output=True, text=True, check=True).stdout.split()
                assert where == [host, host]  # side by side on the node the decisions named
                run_agent_until_idle(env, settings.as_env(), tmp_path / "spool.db", progress)
                pipeline.wait(charges=2, archived=0, timeout_s=120, report=lambda *_: None)
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
    applied = [(d, p) for d, p in plans if p.outcome == "applied"]
    assert sorted(d.job_id for d, _ in applied) == sorted(ids)  # each job placed exactly once
    for d, p in applied:
        assert d.action in (PlacementAction.PLACE, PlacementAction.PAIR) and d.nodes == (host,), d
        assert p.commands[-1] == ("scontrol", "release", d.job_id)
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.job_id: c for c in ledger.charges()}
    assert charges.keys() == set(ids)
    for c in charges.values():
        print(f"job {c.job_id} ({c.program}): {c.blocks_used} blocks used, {c.blocks_rejected} rejected, "
              f"degradation {c.degradation:.3f}, run {c.run_time_s:.1f} s")
        assert c.final_state is JobState.ENDED and c.cores == 1
        assert c.blocks_used + c.blocks_rejected >= 10  # they shared the node: the agent shuttered both
    assert audit(pipeline.archive_path, pipeline.ledger_path, settings.policy()).ok


def test_with_no_stream_worker_a_held_job_is_released_to_slurm_after_the_stated_time(
        settings: Settings, tmp_path: Path) -> None:
    """Placement fails open: the broker is up but nothing decides (no worker). A job submitted held
    waits the stated time (4 s here) after the adapter first saw it held, then the adapter releases
    it and Slurm runs it; an operator's hold stays."""
    install_hooks(tmp_path / "hooks", tmp_path / "events")
    create_topics(settings)
    settings = settings.model_copy(update={"placement_release_after_s": 4.0})
    stop = threading.Event()
    with local_slurm(tmp_path / "hooks") as env:
        ids = [subprocess.run(["sbatch", "--parsable", "--hold", "-n", "1", "-o", str(tmp_path / f"{n}.out"),
                               "--wrap", "sleep 1"], env=env, capture_output=True, text=True,
                              check=True).stdout.strip().split(";")[0] for n in range(2)]
        subprocess.run(["scontrol", "hold", ids[1]], env=env, check=True, capture_output=True)  # JobHeldAdmin
        commands = SchedulerCommands(env)
        assert [(w.reason, w.single) for w in commands.waiting() if w.job_id in ids] == [
            ("JobHeldUser", True), ("JobHeldAdmin", True)]
        result: list = []
        adapter = threading.Thread(target=lambda: result.append(run_scheduler(
            settings, commands, stop, llc_ways=11, mem_bandwidth_gbps=20.0, sweep_every_s=0.5)))
        started = time.monotonic()
        adapter.start()
        try:
            deadline = started + 60
            while squeue_states(env, ids[:1]) != ["COMPLETED"]:
                assert time.monotonic() < deadline, squeue_states(env, ids)
                time.sleep(0.2)
            released_after = time.monotonic() - started
        finally:
            stop.set()
            adapter.join(60)
        assert squeue_states(env, ids[1:]) == ["PENDING"]  # the operator's hold is the operator's
    assert released_after >= 4.0
    assert result[0].outcomes["released_unplaced"] == 1 and result[0].outcomes["applied"] == 0
