"""The node agent under an adaptive shutter schedule (issue 36): the lone job's policy picks each
shutter's S, the block carries it, and a turn that would exceed a co-runner's pause budget passes."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Container, Iterator
from pathlib import Path

import pytest

from nodeshare.producers.agent.agent import Agent, AgentOptions
from nodeshare.producers.agent.jobs import JobSpec, LocalJob
from nodeshare.producers.agent.processes import identity
from nodeshare.producers.agent.progress import ProgressFile
from nodeshare.producers.agent.spool import Spool
from nodeshare.producers.batching import FlushPolicy
from nodeshare.streams.core.shutter_policy import LevelStats, ShutterPolicy


class FakeSource:  # as in test_agent: the jobs the test says are running
    def __init__(self, jobs: dict[str, LocalJob]) -> None:
        self.jobs = jobs

    def start(self, known: Container[str] = frozenset()) -> None: ...

    def poll(self) -> dict[str, LocalJob]:
        return dict(self.jobs)

    def exit_code(self, job_id: str) -> int | None:
        return None

    def spec(self, job_id: str) -> JobSpec | None:
        return None

    def close(self) -> None: ...


class NoBroker:  # what the agent publishes stays in its spool
    def __init__(self, spool: Spool) -> None: ...

    def pump(self, timeout: float = 0.0) -> None: ...

    def drain(self, timeout: float) -> bool:
        return False

    def close(self, timeout: float) -> None: ...


def spooled(tmp_path: Path) -> list[dict]:
    spool = Spool(tmp_path / "spool.db")
    events = [json.loads(r[3]) for r in spool.after(0, 1000)]
    spool.close()
    return events


@pytest.fixture
def two_jobs(tmp_path: Path) -> Iterator[dict[str, LocalJob]]:
    """Two sleeping processes with application progress counters (so the agent can shutter them)."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        jobs = {}
        for name, proc in zip("ab", procs, strict=True):
            ProgressFile(tmp_path / name).close()
            p = identity(proc.pid)
            assert p is not None
            jobs[name] = LocalJob(name, frozenset({p}), progress=tmp_path / name)
        yield jobs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def agent_with(tmp_path: Path, jobs: dict[str, LocalJob], pol: ShutterPolicy) -> Agent:
    options = AgentOptions(node="n1", spool=tmp_path / "spool.db", sample_us=1000, hardware_counters=False,
                           flush=FlushPolicy(max_blocks=100, max_age_s=3600), schedule=pol)
    return Agent(options, FakeSource(jobs), NoBroker, lambda name: name)  # type: ignore[arg-type]


def test_each_shutter_takes_the_s_the_lone_jobs_policy_chose(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    pol = ShutterPolicy(ladder_us=(1000, 4000), period_ms=0, n_start=2, n_level=1, budget_share=0.5)
    agent = agent_with(tmp_path, two_jobs, pol)
    agent.rescan()
    time.sleep(0.05)  # 0.5 x 50 ms of run: room for a 4 ms pause of each co-runner
    assert agent.shutter() and agent.shutter()  # a then b: the dense start, 1 ms
    # the sleeping jobs retire no instructions, so Alg. 4 rejects their blocks: a is still starting
    assert agent.levels["a"][1000].n == 0 and agent.levels["a"][1000].rejected == 1
    # as if a had two accepted 1 ms blocks: its next shutter probes the longest S
    st = LevelStats()
    st.add(1.0, 1.2, 1.0)
    st.add(1.0, 1.2, 1.0)
    agent.levels["a"][1000] = st
    assert agent.shutter()
    assert agent.levels["a"][4000].rejected == 1
    agent.close(0)
    batches = [e for e in spooled(tmp_path) if e["kind"] == "shutter_batch"]
    # a's batch is cut where S changes (producers.batching): [0] at 1 ms, [2] at 4 ms; b's [1] at 1 ms
    assert sorted((e["job_id"], e["cycle"], e["sample_us"]) for e in batches) == [
        ("a", [0], 1000), ("a", [2], 4000), ("b", [1], 1000)]


def test_a_turn_over_a_co_runners_pause_budget_passes(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    # a budget of one 1 ms sample (the allowance) and almost nothing per second of run
    pol = ShutterPolicy(ladder_us=(1000,), period_ms=0, budget_share=1e-9)
    agent = agent_with(tmp_path, two_jobs, pol)
    agent.rescan()
    assert agent.shutter()  # a alone: b paused for its one allowed sample (and the freezer's time)
    assert agent.shutter()  # b alone: a not paused yet
    assert agent.state["b"].paused_us >= 1000
    assert not agent.shutter()  # a's turn again: b has no budget left, the turn passes...
    assert agent.stats.skipped_schedule == 1 and agent.lone == "a"
    assert not agent.shutter()  # ...and b's, a being paused as much now
    assert agent.stats.skipped_schedule == 2
    agent.close(0)
