"""The node agent on real processes, no broker (events stay in its spool): SIGKILL in the middle
of a shutter leaves nothing stopped, and nothing outside the managed jobs is ever signalled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeshare.producers.agent.processes import Proc, identity, state
from nodeshare.producers.agent.spool import Spool

pytestmark = pytest.mark.slow

NOBODY_LISTENS = "127.0.0.1:9"  # the discard port: the broker is unreachable, so everything is spooled


def agent_env(sample_us: int, period_ms: int) -> dict[str, str]:
    return {**os.environ, "NODESHARE_BOOTSTRAP": NOBODY_LISTENS, "NODESHARE_SAMPLE_US": str(sample_us),
            "NODESHARE_PERIOD_MS": str(period_ms), "NODESHARE_CONFIG": "",
            "NODESHARE_SHUTTER_SCHEDULE": "fixed"}  # these shutters are the fixed loop's, S and P as given


def start_agent(tmp_path: Path, job_file: Path, sample_us: int, period_ms: int,
                *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(job_file), "--node", "n1",
         "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"),
         "--drain-timeout", "0", *extra],
        env=agent_env(sample_us, period_ms), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def two_jobs(tmp_path: Path) -> Iterator[tuple[Path, list[Proc]]]:
    """Two real workloads counting progress, and a job file that names them by PID."""
    procs, lines = [], []
    for name in ("a", "b"):
        progress = tmp_path / "progress" / name
        p = subprocess.Popen([sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds", "60",
                              "--progress", str(progress)], stdout=subprocess.DEVNULL)
        procs.append(p)
        lines.append(f'[[jobs]]\nid = "{name}"\npids = [{p.pid}]\nprogress = "{progress}"\n')
    deadline = time.monotonic() + 20
    while not all((tmp_path / "progress" / n).exists() for n in "ab") and time.monotonic() < deadline:
        time.sleep(0.05)
    job_file = tmp_path / "jobs.toml"
    job_file.write_text("".join(lines))
    ids = [identity(p.pid) for p in procs]
    assert all(ids)
    yield job_file, [p for p in ids if p is not None]
    for p in procs:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


def stopped(procs: list[Proc]) -> list[int]:
    return [p.pid for p in procs if state(p) == "T"]


def test_sigkill_in_the_middle_of_a_shutter_leaves_no_job_stopped(
        tmp_path: Path, two_jobs: tuple[Path, list[Proc]]) -> None:
    job_file, procs = two_jobs
    delays = []
    for _ in range(3):  # the agent restarts on the same spool each time
        agent = start_agent(tmp_path, job_file, sample_us=300_000, period_ms=50)
        deadline = time.monotonic() + 30
        for want in (True, False, True):  # in the second shutter: one job runs alone, the other is stopped
            while bool(stopped(procs)) != want:
                assert agent.poll() is None, agent.communicate()
                assert time.monotonic() < deadline, "no second shutter within 30 s"
                time.sleep(0.002)
        agent.kill()
        killed = time.monotonic()
        while stopped(procs) and time.monotonic() - killed < 5:
            time.sleep(0.001)
        delays.append(time.monotonic() - killed)
        agent.wait()
        assert not stopped(procs), f"still stopped {time.monotonic() - killed:.2f} s after SIGKILL"
    print(f"resumed {', '.join(f'{d * 1000:.1f}' for d in delays)} ms after SIGKILL")
    assert max(delays) < 1.0
    spool = Spool(tmp_path / "spool.db")
    # the counters survive the kills: a cycle number is never reused, so no event id repeats
    rows = spool.after(0, 10_000)
    ids = [json.loads(r[3])["event_id"] for r in rows]
    assert len(set(ids)) == len(ids) and spool.meta("next_cycle") >= 3
    # one block per completed cycle: sent in a batch, or still in an open batch the meta keeps
    events = [json.loads(r[3]) for r in rows]
    spooled = [c for e in events if e["kind"] == "shutter_batch" for c in e["cycle"]]
    kept = [c for b in spool.meta("batches", {}).get("open", []) for c in b["cycle"]]
    assert sorted(spooled + kept) == list(range(spool.meta("next_cycle")))


def test_the_agent_never_signals_a_decoy_and_refuses_its_own_parent(
        tmp_path: Path, two_jobs: tuple[Path, list[Proc]]) -> None:
    job_file, procs = two_jobs
    decoy_proc = subprocess.Popen(["sleep", "60"])
    decoy = identity(decoy_proc.pid)
    assert decoy is not None
    try:
        agent = start_agent(tmp_path, job_file, 20_000, 10, "--duration", "3")
        seen_job_stopped = decoy_stopped = 0
        while agent.poll() is None:
            decoy_stopped += state(decoy) == "T"
            seen_job_stopped += bool(stopped(procs))
            time.sleep(0.001)
        out, errors = agent.communicate()
        assert agent.returncode == 0, errors
        assert seen_job_stopped > 0 and decoy_stopped == 0, (seen_job_stopped, out)
        assert "shutter cycles" in out and not out.startswith("0 ")
    finally:
        decoy_proc.kill()
        decoy_proc.wait()

    # a job file that names the agent's parent (this test) is refused before anything is paused
    evil = tmp_path / "evil.toml"
    evil.write_text(job_file.read_text() + f'[[jobs]]\nid = "parent"\npids = [{os.getpid()}]\n')
    agent = start_agent(tmp_path, evil, 20_000, 10, "--duration", "5")
    out, errors = agent.communicate(timeout=60)
    assert agent.returncode == 3 and "refusing to signal" in errors and "agent itself" in errors
    assert not stopped(procs)


def test_the_watchdog_stays_light():
    """The watchdog starts with every agent and its start-up CPU counts against the agent's 1%
    budget: importing the schemas through resctrl's pure module once cost 70 ms of it (bench agent
    1.12% instead of 0.75%). It imports neither pydantic nor numpy nor a Kafka client."""
    import subprocess
    import sys

    code = ("import sys, nodeshare.producers.agent.watchdog; "
            "print(sorted(m for m in ('pydantic', 'numpy', 'duckdb', 'confluent_kafka') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
