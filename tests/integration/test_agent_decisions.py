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
from factories import limit, node_shares, placement, powercap_tree, resctrl_tree
from factories import power_decision as decision
from factories import power_plan as plan

from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas.events import HeldCap, NodeCapState, PowerAction, PowerDecision
from nodeshare.streams.core.power.caps import node_states

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


def capping_agent(tmp_path: Path, settings: Settings, root: Path) -> subprocess.Popen:
    """An agent of node n1 running job j1, capping the powercap tree at ``root``."""
    write_jobs(tmp_path, "j1")
    return subprocess.Popen(
        [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
         "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"),
         "--power-caps", "--powercap-root", str(root), "--drain-timeout", "5"],
        env={**os.environ, "NODESHARE_CONFIG": "", **settings.as_env()},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def stated(d: PowerDecision, *nodes: tuple[str, int, tuple[tuple[int, str, float], ...]]) -> PowerDecision:
    """``d`` with the node states a schema-6 power manager puts in it: (node, sequence, caps)."""
    return d.model_copy(update={"node_caps": tuple(
        NodeCapState(node=n, sequence=seq, caps=tuple(HeldCap(processor=p, job_id=j, cap_watts=w) for p, j, w in caps))
        for n, seq, caps in nodes)})


def publish_as_the_worker(producer: EventProducer, d: PowerDecision) -> None:
    """The decision, then each node state it states on decisions.power.nodes (streams/worker/app.py)."""
    producer.send(d)
    for state in node_states(d):
        producer.send(state)


@pytest.mark.parametrize("ending", ["sigterm", "sigkill"])
def test_the_agent_caps_its_processors_and_every_ending_restores_them(kafka_bootstrap: str, tmp_path: Path,
                                                                      ending: str) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"pc{tag}.", app_id=f"nodeshare-pc{tag}")
    create_topics(settings)
    root = powercap_tree(tmp_path / "powercap", packages=2)
    history = [  # a's caps came and went; b holds processor 1 (as the worker publishes: node states)
        stated(decision("a", PowerAction.START, plan("a", ("n1", 0, 40.0), ("n1", 1, 40.0))),
               ("n1", 1, ((0, "a", 40.0), (1, "a", 40.0)))),
        stated(decision("a", PowerAction.RELEASE), ("n1", 2, ())),
        stated(decision("b", PowerAction.START, plan("b", ("n1", 1, 95.5), ("n2", 0, 70.0))),
               ("n1", 3, ((1, "b", 95.5),)), ("n2", 1, ((0, "b", 70.0),)))]
    with EventProducer(settings) as producer:
        for d in history:
            publish_as_the_worker(producer, d)
        # a probe the worker never sends: a decision whose node state is not on decisions.power.nodes.
        # decisions.power's history is not read at start, the compacted node states are (issue 42:
        # a start reads one record per node, not every decision retention keeps)
        producer.send(stated(decision("z", PowerAction.START, plan("z", ("n1", 0, 10.0))),
                             ("n1", 9, ((0, "z", 10.0),))))
    agent = capping_agent(tmp_path, settings, root)
    try:
        _wait("b's cap on processor 1", lambda: limit(root, 1) == 95_500_000)
        assert limit(root, 0) == 125_000_000  # a's cap was superseded before the agent started: never written
        with EventProducer(settings) as producer:  # live: c starts on processor 0
            publish_as_the_worker(producer, stated(decision("c", PowerAction.START, plan("c", ("n1", 0, 60.0))),
                                                   ("n1", 4, ((0, "c", 60.0), (1, "b", 95.5)))))
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


def test_an_agent_holds_caps_whose_decision_retention_deleted(kafka_bootstrap: str, tmp_path: Path) -> None:
    """decisions.power is deleted after 30 days; a node whose caps did not change since keeps its
    state on the compacted decisions.power.nodes, which the agent folds too (issue 43: before, an
    agent restarted without them while the manager counted them)."""
    from datetime import UTC, datetime

    from nodeshare.schemas.events import HeldCap, NodeCapState, NodePowerState

    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"pn{tag}.", app_id=f"nodeshare-pn{tag}")
    create_topics(settings)
    root = powercap_tree(tmp_path / "powercap", packages=2)
    state = NodeCapState(node="n1", sequence=7, caps=(HeldCap(processor=1, job_id="old", cap_watts=85.0),))
    with EventProducer(settings) as producer:  # decisions.power itself is empty: its records expired
        producer.send(NodePowerState(event_id="s7", source="test", event_time=datetime.now(UTC), node="n1",
                                     state=state, decided_by="expired"))
        producer.send(NodePowerState(event_id="s7b", source="test", event_time=datetime.now(UTC), node="n2",
                                     state=state.model_copy(update={"node": "n2"}), decided_by="expired"))
    agent = capping_agent(tmp_path, settings, root)
    try:
        _wait("the expired decision's cap on processor 1", lambda: limit(root, 1) == 85_000_000)
        assert limit(root, 0) == 125_000_000  # n2's state is not n1's
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
        output = agent.communicate(timeout=30)[0]
        subprocess.run(["pkill", "-f", f"{tmp_path}"], check=False)
    assert (limit(root, 0), limit(root, 1)) == (125_000_000, 125_000_000), output


@pytest.mark.parametrize("ending", ["sigterm", "sigkill"])
def test_the_agent_gives_each_job_its_booked_ways_and_every_ending_takes_them_back(
        kafka_bootstrap: str, tmp_path: Path, ending: str) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"rc{tag}.", app_id=f"nodeshare-rc{tag}")
    create_topics(settings)
    root = resctrl_tree(tmp_path / "resctrl")
    with EventProducer(settings) as producer:  # j1 and j2 placed on n1 with cache shares; j3 elsewhere
        # as the placement manager states them on decisions.placement.nodes, the one topic the agent reads
        for state in (node_shares("n1", ("old", 6, None), by="1"), node_shares("n2", ("j3", 5, None)),
                      node_shares("n1", ("j1", 4, 10.0), ("j2", 3, None), by="2")):
            producer.send(state)
        producer.send(placement("j1", ("n1",), ways=2))  # a decision alone is not read: its node's state is
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
