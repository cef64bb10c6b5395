"""Issue 39 on a real Slurm 22.05: a node crashes under a running job (its slurmd SIGKILLed, so it
never registers again) and is set DOWN. Slurm ends the job with NODE_FAIL; the Slurm source reads
its real jobcomp hook file and, besides the failed terminal event, sends a NodeDown for the node
sinfo reports down, the record that lets the job be charged without the lost node's marker. No
broker needed: the source's ``step`` is what it would publish."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import local_slurm, missing, squeue_states

from nodeshare.producers.slurm import SlurmCommands, SlurmSource, install_hooks
from nodeshare.schemas import JobEvent, JobState, NodeDown

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _left_by(conf: str) -> list[int]:
    """Processes of this test's Slurm left when its slurmd died: its slurmstepd (daemonized, so found
    by the SLURM_CONF it inherited) and the job's own."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if f"SLURM_CONF={conf}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
    return out


def test_a_job_slurm_ends_with_node_fail_gets_a_node_down_record(tmp_path: Path) -> None:
    if not (_port_free(16817) and _port_free(16818)):
        pytest.skip("another local Slurm holds its ports")
    install_hooks(tmp_path / "hooks", tmp_path / "events")
    host = socket.gethostname().split(".")[0]
    conf = ""
    try:
        with local_slurm(tmp_path / "hooks") as env:
            conf = env["SLURM_CONF"]
            submit = subprocess.run(["sbatch", "--parsable", "--no-requeue", "-n", "1", "-J", "lost",
                                     "-o", str(tmp_path / "lost.out"), "--wrap", "sleep 97"],
                                    env=env, capture_output=True, text=True, check=True)
            job = submit.stdout.strip().split(";")[0]
            deadline = time.monotonic() + 30
            while squeue_states(env, [job]) != ["RUNNING"]:
                assert time.monotonic() < deadline, squeue_states(env, [job])
                time.sleep(0.1)
            # the node crashes: its slurmd dies (with ReturnToService=2 a live one would register and
            # bring the node back at once), and the controller is told it is down
            slurmd = Path(conf).parent.parent / "run" / f"slurmd-{host}.pid"
            os.kill(int(slurmd.read_text()), signal.SIGKILL)
            subprocess.run(["scontrol", "update", f"nodename={host}", "state=down", "reason=nodeshare test: lost"],
                           env=env, check=True, capture_output=True)
            source = SlurmSource(tmp_path / "events", SlurmCommands(env), "nodeshare-test")
            published: list = []
            deadline = time.monotonic() + 30
            while not any(isinstance(e, JobEvent) and e.state is JobState.FAILED for e in published):
                assert time.monotonic() < deadline, (published, squeue_states(env, [job]))
                events, files = source.step(poll_queue=False)
                published += events
                source.done(files)
                time.sleep(0.2)
    finally:
        for pid in _left_by(conf) if conf else []:  # no slurmd was left to end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    end = next(e for e in published if isinstance(e, JobEvent) and e.state is JobState.FAILED)
    downs = [e for e in published if isinstance(e, NodeDown)]
    assert end.job_id == job and end.nodes == (host,)
    assert [(d.job_id, d.node) for d in downs] == [(job, host)], published
    assert downs[0].reason.startswith("Slurm ended the job with NODE_FAIL; node state down")
    # named like the terminal event (jobcomp/script's CLUSTER is empty: slurm/slurm/<job>/failed)
    assert downs[0].event_id == f"{end.source}/{job}/node_down/{host}" and downs[0].event_time == end.end_time
