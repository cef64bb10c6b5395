"""A restarted agent's static jobs (issue 39): a job of its books is never launched again; its
processes are the ones recorded at its first start that still run (an agent that alone crashed),
or none (a reboot took them), and then the first rescan closes its stream."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from nodeshare.producers.agent.jobs import JobFileError, JobSpec, StaticJobs

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def launched(jobs: StaticJobs) -> list[int]:
    return sorted(p.pid for roots in jobs._roots.values() for p in roots)


def test_a_launched_job_of_the_books_is_taken_up_while_it_runs_and_never_launched_again(tmp_path: Path) -> None:
    specs = [JobSpec(id="a", command=SLEEP)]
    first = StaticJobs(specs, tmp_path)
    first.start()
    [pid] = launched(first)
    try:
        again = StaticJobs(specs, tmp_path)  # the agent alone crashed: the job still runs
        again.start(known={"a"})
        assert launched(again) == [pid] and set(again.poll()) == {"a"}
    finally:
        first._launched["a"].send_signal(signal.SIGKILL)  # the reboot takes it
        first._launched["a"].wait()
    rebooted = StaticJobs(specs, tmp_path)
    rebooted.start(known={"a"})
    assert launched(rebooted) == [] and rebooted.poll() == {} and not rebooted._launched


def test_a_listed_pid_of_the_books_that_is_gone_is_no_error_after_a_restart(tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.Popen(SLEEP)
    specs = [JobSpec(id="p", pids=[proc.pid])]
    StaticJobs(specs, tmp_path).start()
    proc.kill()
    proc.wait()
    with pytest.raises(JobFileError, match="no process with PID"):  # a job the agent never knew: a typo
        StaticJobs(specs, tmp_path).start()
    restarted = StaticJobs(specs, tmp_path)
    restarted.start(known={"p"})
    assert restarted.poll() == {}
