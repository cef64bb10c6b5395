"""Issue 41, Slurm as sites run it: cgroup v2 freezing (``cgroup.freeze`` on the job's cgroup,
done when ``cgroup.events`` says ``frozen 1``), on a fake v2 tree whose kernel is the test and, where
this machine has a writable cgroup2 mount, on a real one with a real process; and one clear log line
when the agent pauses by SIGSTOP because a job has no cgroup."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit.test_agent import FakeSource, agent_on

from nodeshare.producers.agent import pausing
from nodeshare.producers.agent.jobs import LocalJob, SlurmJobs
from nodeshare.producers.agent.pausing import Pauser, Target, check_cgroup, freezer_state
from nodeshare.producers.agent.processes import Guard, Proc, Refused, identity


class FakeV2:
    """A cgroup v2 tree as Slurm's cgroup/v2 lays it out; the kernel's part is ``settle``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        (root / "cgroup.procs").write_text("")
        self.stuck = False

    def job(self, job_id: str, pids: list[int]) -> Path:
        job = self.root / "system.slice" / "slurmstepd.scope" / f"job_{job_id}"
        leaf = job / "step_batch" / "user" / "task_0"
        for cg in (job, job / "step_batch", job / "step_batch" / "user", leaf):
            cg.mkdir(parents=True, exist_ok=True)
            (cg / "cgroup.procs").write_text("")
            (cg / "cgroup.freeze").write_text("0\n")
            (cg / "cgroup.events").write_text("populated 1\nfrozen 0\n")
        (leaf / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        return job

    def settle(self, cgroup: Path) -> None:
        """What the kernel does after a write to cgroup.freeze (unless a task will not freeze)."""
        asked = (cgroup / "cgroup.freeze").read_text().strip() == "1"
        frozen = asked and not self.stuck
        for below, _dirs, files in os.walk(cgroup):
            if "cgroup.events" in files:
                Path(below, "cgroup.events").write_text(f"populated 1\nfrozen {int(frozen)}\n")


@pytest.fixture
def sleeper() -> Iterator[Proc]:
    proc = subprocess.Popen(["sleep", "60"])
    p = identity(proc.pid)
    assert p is not None
    yield p
    proc.kill()
    proc.wait()


@pytest.fixture
def v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeV2:
    tree = FakeV2(tmp_path / "cgroup")
    real_write = pausing._write_state

    def kernel(cgroup: Path, value: str) -> None:
        real_write(cgroup, value)
        tree.settle(cgroup)

    monkeypatch.setattr(pausing, "_write_state", kernel)
    return tree


def test_a_v2_job_is_frozen_by_cgroup_freeze_and_thawed(v2, sleeper):
    job = v2.job("7", [sleeper.pid])
    pauser = Pauser(Guard.here(), v2.root)
    target = pauser.running(pauser.checked(Target("7", frozenset({sleeper}), job)))
    assert target.cgroup is not None  # thawed, so the shutter may pause it
    pauser.pause(target)
    assert (job / "cgroup.freeze").read_text().strip() == "1" and freezer_state(job) == "FROZEN"
    assert pauser.held() == [Target("", frozenset(), job.resolve())]  # the watchdog would thaw it
    pauser.resume(target)
    assert (job / "cgroup.freeze").read_text().strip() == "0" and freezer_state(job) == "THAWED"
    assert not pauser.held()


def test_a_v2_job_frozen_by_someone_else_is_left_alone(v2, sleeper):
    """Frozen by a parent (Slurm's suspend, an admin): ``frozen 1`` with ``cgroup.freeze`` 0."""
    job = v2.job("8", [sleeper.pid])
    (job / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    pauser = Pauser(Guard.here(), v2.root)
    assert pauser.running(pauser.checked(Target("8", frozenset({sleeper}), job))).empty


def test_a_v2_freeze_that_never_completes_is_thawed(v2, sleeper, monkeypatch):
    monkeypatch.setattr(pausing, "FREEZE_DEADLINE_S", 0.02)
    v2.stuck = True
    job = v2.job("9", [sleeper.pid])
    pauser = Pauser(Guard.here(), v2.root)
    with pytest.raises(TimeoutError, match="FREEZING"):
        pauser.pause(Target("9", frozenset({sleeper}), job))
    assert freezer_state(job) == "FREEZING"
    pauser.resume_held(lambda what, e: pytest.fail(f"{what}: {e}"))
    assert (job / "cgroup.freeze").read_text().strip() == "0" and not pauser.held()


def test_a_v2_cgroup_holding_the_agent_below_it_is_refused(v2):
    job = v2.job("10", [os.getpid()])  # the agent's own process, in a leaf below the job's cgroup
    with pytest.raises(Refused, match="agent's own"):
        check_cgroup(job, Guard.here(), v2.root)


def test_the_slurm_source_finds_a_v2_job_cgroup(v2, tmp_path):
    job = v2.job("11", [])
    assert SlurmJobs(tmp_path / "progress", freezer_root=v2.root)._cgroup("11") == job
    assert SlurmJobs(tmp_path / "progress", freezer_root=v2.root)._cgroup("12") is None


def writable_cgroup2() -> Path | None:
    if os.geteuid() != 0:
        return None
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        probe = mount / f"nodeshare-probe-{os.getpid()}"
        if not (mount / "cgroup.controllers").exists():
            continue
        try:
            probe.mkdir()
        except OSError:
            continue
        ok = (probe / "cgroup.freeze").exists()
        probe.rmdir()
        if ok:
            return mount
    return None


REAL_V2 = writable_cgroup2()


@pytest.mark.skipif(REAL_V2 is None, reason="no writable cgroup v2 hierarchy with cgroup.freeze here (or not root)")
def test_a_real_process_in_a_real_v2_cgroup_is_frozen_and_thawed():
    assert REAL_V2 is not None
    cgroup = REAL_V2 / f"nodeshare-test-{os.getpid()}"
    cgroup.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        p = identity(proc.pid)
        assert p is not None
        pauser = Pauser(Guard.here(), REAL_V2)
        target = pauser.running(pauser.checked(Target("real", frozenset({p}), cgroup)))
        assert target.cgroup == cgroup.resolve()
        pauser.pause(target)  # returns once cgroup.events says frozen 1 (or raises at the deadline)
        assert "frozen 1" in (cgroup / "cgroup.events").read_text().splitlines()
        pauser.resume(target)
        assert (cgroup / "cgroup.freeze").read_text().strip() == "0" and not pauser.held()
    finally:
        (cgroup / "cgroup.freeze").write_text("0")
        proc.kill()
        proc.wait()
        cgroup.rmdir()


def test_the_fallback_to_sigstop_is_logged_once(tmp_path, sleeper, caplog):
    jobs = {j: LocalJob(j, frozenset({sleeper})) for j in ("a", "b")}
    agent = agent_on(tmp_path, FakeSource(jobs, {}))
    try:
        with caplog.at_level(logging.WARNING, logger="nodeshare.agent"):
            agent.rescan()
            agent.rescan()
    finally:
        agent.close()
    said = [r.getMessage() for r in caplog.records if "SIGSTOP" in r.getMessage()]
    assert len(said) == 1 and "no cgroup to freeze" in said[0], said
