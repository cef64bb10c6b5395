"""A real node agent applies decisions.power and the cache shares of decisions.placement from a
real broker to powercap and resctrl trees with the kernel's layout, undoes all of it when it
exits, and its watchdog does when it is SIGKILLed (issue 27: nothing changed without its restore)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from factories import limit, placement, powercap_tree, resctrl_tree
from factories import power_decision as decision
from factories import power_plan as plan

from nodeshare.config import Settings
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.schemas.events import PowerAction

pytestmark = pytest.mark.integration


def _wait(what: str, ok, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def write_jobs(tmp_path: Path, *ids: str) -> None:
    """Jobs the agent launches; their command lines name tmp_path, so the test can end them."""
    text = ""
    for j in ids:
        progress = tmp_path / f"{j}.progress"
        job = [sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds", "30",
               "--progress", str(progress)]
        text += f'[[jobs]]\nid = "{j}"\ncommand = {json.dumps(job)}\nprogress = "{progress}"\n'
    (tmp_path / "jobs.toml").write_text(text)


@pytest.mark.parametrize("ending", ["sigterm", "sigkill"])
def test_the_agent_caps_its_processors_and_every_ending_restores_them(kafka_bootstrap: str, tmp_path: Path,
                                                                      ending: str) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"pc{tag}.", app_id=f"nodeshare-pc{tag}")
    create_topics(settings)
    root = powercap_tree(tmp_path / "powercap", packages=2)
    with EventProducer(settings) as producer:  # history: a's caps came and went; b holds processor 1
        for d in (decision("a", PowerAction.START, plan("a", ("n1", 0, 40.0), ("n1", 1, 40.0))),
                  decision("a", PowerAction.RELEASE),
                  decision("b", PowerAction.START, plan("b", ("n1", 1, 95.5), ("n2", 0, 70.0)))):
            producer.send(d)
    write_jobs(tmp_path, "j1")
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
         "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"),
         "--power-caps", "--powercap-root", str(root), "--drain-timeout", "5"],
        env={**os.environ, "NODESHARE_CONFIG": "", **settings.as_env()},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait("b's cap on processor 1", lambda: limit(root, 1) == 95_500_000)
        assert limit(root, 0) == 125_000_000  # a's cap was superseded before the agent started: never written
        with EventProducer(settings) as producer:  # live: c starts on processor 0
            producer.send(decision("c", PowerAction.START, plan("c", ("n1", 0, 60.0))))
        _wait("c's cap on processor 0", lambda: limit(root, 0) == 60_000_000)
        os.kill(agent.pid, signal.SIGTERM if ending == "sigterm" else signal.SIGKILL)
        agent.wait(timeout=30)
        # SIGTERM: the agent restores them; SIGKILL: its watchdog does, as soon as the pipe closes
        _wait("every limit restored", lambda: (limit(root, 0), limit(root, 1)) == (125_000_000, 125_000_000), 15)
    finally:
        if agent.poll() is None:
            agent.kill()
        output = agent.communicate(timeout=30)[0]
        subprocess.run(["pkill", "-f", f"{tmp_path}"], check=False)  # the workloads, which outlive a killed agent
    if ending == "sigterm":  # the agent unwinds through its exit paths and says what it restored
        assert agent.returncode == 128 + signal.SIGTERM, output
        assert "restored 2 power limits" in output, output
        assert not (tmp_path / "spool.db.caps.json").exists()


@pytest.mark.parametrize("ending", ["sigterm", "sigkill"])
def test_the_agent_gives_each_job_its_booked_ways_and_every_ending_takes_them_back(
        kafka_bootstrap: str, tmp_path: Path, ending: str) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"rc{tag}.", app_id=f"nodeshare-rc{tag}")
    create_topics(settings)
    root = resctrl_tree(tmp_path / "resctrl")
    with EventProducer(settings) as producer:  # j1 and j2 placed on n1 with cache shares; j3 elsewhere
        for d in (placement("j1", ("n1",), ways=4, gbps=10.0), placement("j2", ("n1",), ways=3),
                  placement("j3", ("n2",), ways=5)):
            producer.send(d)
    write_jobs(tmp_path, "j1", "j2")
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
         "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"),
         "--resctrl", "--resctrl-root", str(root), "--mem-bandwidth-gbps", "50", "--drain-timeout", "5"],
        env={**os.environ, "NODESHARE_CONFIG": "", **settings.as_env()},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    groups = (root / "nodeshare-j1", root / "nodeshare-j2")
    try:
        _wait("both jobs in their groups", lambda: all(
            (g / "tasks").exists() and (g / "tasks").read_text().strip() for g in groups))
        assert (groups[0] / "schemata").read_text() == "L3:0=f;1=f\nMB:0=20;1=20\n"
        assert (groups[1] / "schemata").read_text() == "L3:0=70;1=70\n"  # its own ways, next to j1's
        assert sorted(p.name for p in root.glob("nodeshare-*")) == ["nodeshare-j1", "nodeshare-j2"]
        os.kill(agent.pid, signal.SIGTERM if ending == "sigterm" else signal.SIGKILL)
        agent.wait(timeout=30)
        _wait("every group removed", lambda: not list(root.glob("nodeshare-*")), 15)
    finally:
        if agent.poll() is None:
            agent.kill()
        output = agent.communicate(timeout=30)[0]
        subprocess.run(["pkill", "-f", f"{tmp_path}"], check=False)  # the workloads, which outlive a killed agent
    if ending == "sigterm":
        assert agent.returncode == 128 + signal.SIGTERM, output
        assert "removed 2 resctrl groups" in output, output
