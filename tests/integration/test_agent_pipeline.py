"""The real node agent on real processes, through the real pipeline: two workloads share this
machine, the agent shutters them and publishes their lifecycle, and a charge comes out for each.
The agent's metrics are scraped while it runs and its JSON log lines are read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodeshare.demo import running_pipeline
from nodeshare.deploy.broker import free_port
from nodeshare.deploy.topics import create_topics
from nodeshare.runtime.config import Settings
from nodeshare.schemas.events import Charge, EstimateStatus
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

# This machine has 2 cores for everything. When the application counter's time was wall-clock
# time, a job descheduled for a window read as slowed by its co-runner (fresh-clone CI saw 0.99);
# its time is now the job's CPU time (each thread's task clock: the process CPU clock moved in
# 4 ms ticks, and read 0.96 for a 3.2 ms window). 20 ms windows span several scheduler slices,
# and the worker starts only once the jobs have ended. A node that gives each job its own cores
# needs neither.
SHUTTER = {"NODESHARE_SAMPLE_US": "20000", "NODESHARE_PERIOD_MS": "100", "NODESHARE_SHUTTER_SCHEDULE": "fixed"}
#: Even so, one run in three of this test once saw a job 90% slower next to its co-runner for a
#: whole run (unfiltered too), before application counters were timed by CPU time; later runs saw
#: 0.92-0.98 about one run in six: the workload wrote its count with struct.pack_into, which zeroes
#: the word first, and the agent read the zero (producers/agent/progress.py). A degradation out of
#: bounds fails, unless the hypervisor took the CPUs meanwhile (steal time, which a guest counts as
#: its processes' CPU time): then the test is an expected failure that says so, with the figures,
#: never a pass.
STEAL_LIMIT = 0.05  # of the machine's CPU time during the run


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of every CPU since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


pytestmark = [pytest.mark.integration, pytest.mark.slow]


def scrape_while_running(proc: subprocess.Popen[str], port: int) -> dict[str, float]:
    """The agent's metrics, scraped until a shutter has been counted (or the agent exits)."""
    wanted = ("nodeshare_agent_shutter_seconds_count", "nodeshare_agent_spool_events", "process_cpu_seconds_total")
    found: dict[str, float] = {}
    while proc.poll() is None and found.get(wanted[0], 0.0) == 0.0:
        time.sleep(0.5)
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            continue  # not serving yet
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name in wanted:
                    found[sample.name] = sample.value
    return found


def _f(v: float | None) -> str:
    return "none" if v is None else f"{v:.3f}"  # Alg. 4 accepted no block: no filtered estimate


def run_two_jobs(settings: Settings, tmp_path: Path) -> dict[str, Charge]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    # 10 s: Alg. 4 rejects 60-85% of the blocks on these two loaded cores (their before and after
    # differ by more than delta), and a 6 s job once had none accepted (fresh-clone CI, 2026-11-26)
    job = [sys.executable, "-m", "nodeshare", "workload", "--seconds", "10"]
    (tmp_path / "jobs.toml").write_text(
        f'[[jobs]]\nid = "stream-1"\ncommand = {[*job, "--kind", "stream"]!r}\nprogram = "stream"\nuser = "ana"\n'
        f'[[jobs]]\nid = "compute-2"\ncommand = {[*job, "--kind", "compute"]!r}\nprogram = "compute"\n'
        'user = "bo"\naccount = "physics"\n'.replace("'", '"'))
    port = free_port()
    env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env(), **SHUTTER,
           "NODESHARE_METRICS_PORT": str(port), "NODESHARE_LOG_FORMAT": "json"}
    create_topics(settings)
    with subprocess.Popen(
            [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
             "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"), "--until-idle"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as agent:
        scraped = scrape_while_running(agent, port)
        stdout, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 0, stderr
    # the agent's metrics moved while it ran, and its logs are JSON lines naming the node and the jobs
    print(f"agent metrics mid-run: {scraped}")
    assert scraped["nodeshare_agent_shutter_seconds_count"] > 0 and scraped["process_cpu_seconds_total"] > 0
    assert "nodeshare_agent_spool_events" in scraped
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert {r["job_id"] for r in lines if r["msg"].startswith("job ") and "left" in r["msg"]} == {
        "stream-1", "compute-2"} and all(r["component"] == "agent" and r["node"] == "n1" for r in lines)
    # the stream worker starts once the jobs have ended (see SHUTTER): it then reads it all
    with running_pipeline(settings, tmp_path / "run") as pipeline:
        pipeline.wait(charges=2, archived=0, timeout_s=90, report=lambda *_: None)
    print(stdout.strip())
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.job_id: c for c in ledger.charges()}
    assert charges.keys() == {"stream-1", "compute-2"}
    for c in charges.values():
        print(f"{c.job_id}: {c.blocks_used} blocks used, {c.blocks_rejected} rejected, degradation "
              f"{c.degradation:.3f} ({c.estimate_status}; Alg. 4 {_f(c.degradation_filtered)}, "
              f"unfiltered {_f(c.degradation_unfiltered)}), "
              f"run {c.run_time_s:.2f} s, paused {c.pause_credit_s:.3f} s, price {c.price:.6f}")
        assert c.nodes[0].node == "n1" and 5.0 < c.run_time_s < 30.0
        assert c.blocks_used + c.blocks_rejected >= 10  # about one block per job per 0.2 s
        assert 0.0 < c.pause_credit_s < 0.1 * c.run_time_s  # Eq. 10: S / P = 3.2 % per co-runner
    assert charges["compute-2"].account == "physics" and charges["stream-1"].user == "ana"
    assert audit(pipeline.archive_path, pipeline.ledger_path, settings.policy()).ok
    return charges


def test_two_real_jobs_shuttered_by_the_agent_are_charged(settings: Settings, tmp_path: Path) -> None:
    steal0, total0 = cpu_ticks()
    charges = run_two_jobs(settings, tmp_path)
    steal1, total1 = cpu_ticks()
    steal = (steal1 - steal0) / max(1, total1 - total0)
    print(f"steal time during the run: {100 * steal:.1f}% of the CPUs")
    # two jobs on two cores next to the agent, the worker and the broker: slowed, not stopped
    # the measured estimate (the price applies its interval's upper end, wider on a loaded machine)
    # A job Alg. 4 accepted no block of (1.2% of runs at its 15% acceptance here) has no estimate and
    # is priced at the stated prior over the time it shared: that is checked instead; one of the two
    # jobs must be measured.
    unmeasured = [c for c in charges.values() if c.estimate_status is EstimateStatus.NO_ACCEPTED_BLOCKS]
    assert len(unmeasured) < 2, [(c.job_id, c.blocks_used, c.blocks_rejected) for c in unmeasured]
    for c in unmeasured:
        assert c.degradation_point is None and c.interval_method == "prior"
        assert 0.0 < c.degradation <= settings.prior_high
    out = {c.job_id: None if c.degradation_point is None else round(c.degradation_point, 3)
           for c in charges.values() if c not in unmeasured
           and (c.degradation_point is None or not 0.0 <= c.degradation_point < 0.6)}
    if out and steal >= STEAL_LIMIT:
        pytest.xfail(f"degradations {out} out of [0, 0.6) while the hypervisor stole {100 * steal:.1f}% of the CPUs")
    assert not out, f"degradations {out} out of [0, 0.6) (steal time {100 * steal:.1f}%)"
