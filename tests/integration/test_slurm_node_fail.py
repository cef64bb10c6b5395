"""Issue 39 on a real Slurm 22.05: a node crashes under a running job (its slurmd SIGKILLed, so it
never registers again) and is set DOWN. Slurm ends the job with NODE_FAIL; the Slurm source reads
its real jobcomp hook file and, besides the failed terminal event, sends a NodeDown for the node
sinfo reports down, the record that lets the job be charged without the lost node's marker; and
when the node reads fine at that moment (returned to service), once Slurm marks it not responding.
No broker needed: the source's ``step`` is what it would publish."""

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

from nodeshare.producers.slurm import SlurmCommands, SlurmSource
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.producers.slurm_lost_nodes import WATCH_FILE
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


def _script_runs(conf: str) -> bool:
    """Whether the job's script (its ``sleep``) runs: slurmd has launched the job."""
    for pid in _left_by(conf):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                return True
    return False


@pytest.mark.parametrize("returned", [False, True], ids=["down", "returned-to-service"])
def test_a_job_slurm_ends_with_node_fail_gets_a_node_down_record(tmp_path: Path, returned: bool) -> None:
    """``returned``: the node's slurmd lives on and registers again at once (ReturnToService=2), so
    the node reads idle when the job's end is read, as one returned to service by a launch reply in
    flight does; then it dies, and the source, still asking, sends the record once SlurmdTimeout
    (6 s here) marks it not responding."""
    if not (_port_free(16817) and _port_free(16818)):
        pytest.skip("another local Slurm holds its ports")
    install_hooks(tmp_path / "hooks", tmp_path / "events")
    host = socket.gethostname().split(".")[0]
    conf = ""

    def short_timeout(t: Path) -> None:
        with (t / "etc" / "slurm.conf").open("a") as f:
            f.write("SlurmdTimeout=6\n")

    def scontrol(*args: str) -> None:
        subprocess.run(["scontrol", "update", f"nodename={host}", *args], env=env, check=True, capture_output=True)

    try:
        with local_slurm(tmp_path / "hooks", short_timeout) as env:
            conf = env["SLURM_CONF"]
            submit = subprocess.run(["sbatch", "--parsable", "--no-requeue", "-n", "1", "-J", "lost",
                                     "-o", str(tmp_path / "lost.out"), "--wrap", "sleep 97"],
                                    env=env, capture_output=True, text=True, check=True)
            job = submit.stdout.strip().split(";")[0]
            deadline = time.monotonic() + 30
            while squeue_states(env, [job]) != ["RUNNING"] or not _script_runs(conf):
                assert time.monotonic() < deadline, squeue_states(env, [job])
                time.sleep(0.1)
            # slurmd's answer to the launch RPC must be processed first: one handled after the node is
            # set DOWN returns it to service (ReturnToService=2, "node_did_resp: node vm returned to
            # service"; a fresh-clone CI run killed slurmd 5 ms after the allocation and sinfo said idle)
            time.sleep(1.0)
            # the node crashes: its slurmd dies (with ReturnToService=2 a live one would register and
            # bring the node back at once), and the controller is told it is down
            slurmd = Path(conf).parent.parent / "run" / f"slurmd-{host}.pid"
            if not returned:  # the node crashes: its slurmd dies (a live one would register again)
                os.kill(int(slurmd.read_text()), signal.SIGKILL)
            scontrol("state=down", "reason=nodeshare test: lost")
            commands = SlurmCommands(env)
            source = SlurmSource(tmp_path / "events", commands, "nodeshare-test")
            source.watch.ask_every_s = 1.0  # (30 s in service)
            published: list = []

            def until(done: object, seconds: float) -> None:
                deadline = time.monotonic() + seconds
                while not done():  # type: ignore[operator]
                    assert time.monotonic() < deadline, (published, commands.node_states((host,)))
                    events, files = source.step(poll_queue=False)
                    published.extend(events)
                    source.done(files)
                    time.sleep(0.2)

            def ended() -> bool:
                return any(isinstance(e, JobEvent) and e.state is JobState.FAILED for e in published)

            if returned:  # registered again (ReturnToService=2): it reads idle when the end is read
                deadline = time.monotonic() + 30
                while commands.node_states((host,)) != {host: "idle"}:  # the source not asked yet
                    assert time.monotonic() < deadline, commands.node_states((host,))
                    time.sleep(0.2)
                until(ended, 30)
                assert not any(isinstance(e, NodeDown) for e in published) and source.watch.jobs
                os.kill(int(slurmd.read_text()), signal.SIGKILL)  # then it dies: not responding after 6 s
            until(lambda: any(isinstance(e, NodeDown) for e in published), 40)
    finally:
        for pid in _left_by(conf) if conf else []:  # no slurmd was left to end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    end = next(e for e in published if isinstance(e, JobEvent) and e.state is JobState.FAILED)
    downs = [e for e in published if isinstance(e, NodeDown)]
    assert end.job_id == job and end.nodes == (host,)
    assert [(d.job_id, d.node) for d in downs] == [(job, host)], published
    assert published.index(downs[0]) > published.index(end)
    assert downs[0].reason.startswith("Slurm ended the job with NODE_FAIL; node state ")
    assert downs[0].reason.endswith("*") if returned else downs[0].reason.endswith("down"), downs[0].reason
    assert source.watch.jobs == {} and not (tmp_path / "events" / WATCH_FILE).exists()
    # named like the terminal event (jobcomp/script's CLUSTER is empty: slurm/slurm/<job>/failed)
    assert downs[0].event_id == f"{end.source}/{job}/node_down/{host}" and downs[0].event_time == end.end_time
