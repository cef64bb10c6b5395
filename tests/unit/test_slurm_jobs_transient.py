"""A job step's slurmstepd that exits while `scontrol listpids` goes through the steps makes it fail
with "Unable to connect to slurmstepd" (seen on a real Slurm 22.05 as two jobs ended): the agent
keeps the jobs it knows and asks again at the next rescan, instead of exiting (it did) or taking
every job for gone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from unit.test_agent import FakeSource, agent_on

from nodeshare.producers.agent import agent as agent_module
from nodeshare.producers.agent.jobs import JobsUnavailable, LocalJob, SlurmJobs
from nodeshare.producers.agent.processes import identity


def fake_scontrol(tmp_path: Path, stderr: str, code: int = 1) -> str:
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\necho 'PID JOBID STEPID LOCALID GLOBALID'\necho '{stderr}' >&2\nexit {code}\n")
    script.chmod(0o755)
    return str(script)


def test_a_step_ending_mid_listing_is_a_passing_failure(tmp_path):
    jobs = SlurmJobs(tmp_path, scontrol=fake_scontrol(tmp_path, "Unable to connect to slurmstepd: Connection refused"))
    with pytest.raises(JobsUnavailable):
        jobs.poll()
    broken = SlurmJobs(tmp_path, scontrol=fake_scontrol(tmp_path, "slurm_load_jobs error: something else"))
    with pytest.raises(RuntimeError, match="listpids failed") as raised:
        broken.poll()
    assert not isinstance(raised.value, JobsUnavailable)


class Flaky(FakeSource):
    def __init__(self, jobs: dict[str, LocalJob], failing: int) -> None:
        super().__init__(jobs, {})
        self.failing = failing

    def poll(self) -> dict[str, LocalJob]:
        if self.failing:
            self.failing -= 1
            raise JobsUnavailable("scontrol listpids: Unable to connect to slurmstepd")
        return super().poll()


def test_the_agent_keeps_its_jobs_through_a_passing_failure_and_gives_up_after_many(tmp_path, monkeypatch):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        p = identity(proc.pid)
        assert p is not None
        source = Flaky({"a": LocalJob("a", frozenset({p}))}, failing=0)
        agent = agent_on(tmp_path, source)
        try:
            agent.rescan()
            source.failing = 2
            agent.rescan()
            agent.rescan()
            assert set(agent.jobs) == {"a"} and set(agent.state) == {"a"}  # not taken for gone
            agent.rescan()
            monkeypatch.setattr(agent_module, "MAX_UNAVAILABLE_RESCANS", 2)
            source.failing = 3
            agent.rescan()
            agent.rescan()
            with pytest.raises(JobsUnavailable):
                agent.rescan()
        finally:
            agent.close()
    finally:
        proc.kill()
        proc.wait()
