"""Issue 39, item 6: slurmctld restarted while jobs run and end. A real Slurm 22.05 (single node),
two real jobs sharing the node; the controller is stopped (SIGTERM: it saves its state) while they run, kept down
for a few seconds, and started again on its saved state while the jobs end. The Slurm source's
lifecycle events are complete (submitted, started and ended for each job, once), the node agent
closes every stream, and each job is charged exactly once; the audit recomputes the charges."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import (
    lifecycle_source,
    local_slurm,
    missing,
    restart_controller,
    run_agent_until_idle,
    squeue_states,
    wait_running,
)
from topic_reading import read_until

from nodeshare.demo import running_pipeline
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobEvent, JobState
from nodeshare.schemas.catalog import JOBS_LIFECYCLE
from nodeshare.schemas.serde import decode
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def test_a_controller_restarted_while_jobs_run_and_end_leaves_each_job_charged_once(
        settings: Settings, tmp_path: Path) -> None:
    install_hooks(tmp_path / "hooks", tmp_path / "events")
    progress = tmp_path / "progress"
    progress.mkdir()
    create_topics(settings)
    with local_slurm(tmp_path / "hooks") as env:
        job_env = {**env, "NODESHARE_PROGRESS_DIR": str(progress)}
        ids = []
        for n, seconds in enumerate((12, 12)):
            submit = subprocess.run(
                ["sbatch", "--parsable", "-n", "1", "-J", f"r{n}", "-o", str(tmp_path / f"{n}.out"),
                 "--wrap", f"{sys.executable} -m nodeshare workload --kind compute --seconds {seconds}"],
                env=job_env, capture_output=True, text=True, check=True)
            ids.append(submit.stdout.strip().split(";")[0])
        wait_running(env, ids)  # the agent runs until no job is left
        with lifecycle_source(settings, tmp_path / "events", env):
            restarted: list[list[str]] = []

            def restart() -> None:
                time.sleep(4)  # mid-run
                restarted.append(squeue_states(env, ids))
                restart_controller(env, down_s=3.0)
                restarted.append(squeue_states(env, ids))

            controller = threading.Thread(target=restart)
            controller.start()
            agent = run_agent_until_idle(env, settings.as_env(), tmp_path / "spool.db", progress)
            controller.join(60)
            deadline = time.monotonic() + 60
            while set(squeue_states(env, ids)) - {"COMPLETED"} and time.monotonic() < deadline:
                time.sleep(0.5)
            with running_pipeline(settings, tmp_path / "run") as pipeline:
                pipeline.wait(charges=len(ids), archived=0, timeout_s=90, report=lambda *_: None)
    print("states before and after the restart:", restarted, "agent:", agent.stdout.strip()[-300:])
    assert len(restarted) == 2 and restarted[0] == ["RUNNING", "RUNNING"], restarted  # restarted while they ran
    events = [decode(JOBS_LIFECYCLE, m.value()) for m in read_until(
        settings, JOBS_LIFECYCLE.name, lambda msgs: len(msgs) >= 3 * len(ids), 30)]
    states = sorted((e.job_id, e.state.value) for e in events if isinstance(e, JobEvent))
    assert states == sorted((j, s) for j in ids for s in ("submitted", "started", "ended")), states
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        rows = ledger.charges()
    assert sorted(c.job_id for c in rows) == sorted(ids)  # once each
    assert all(c.final_state is JobState.ENDED and c.blocks_used + c.blocks_rejected > 0 for c in rows), rows
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == len(ids), report.as_dict()
