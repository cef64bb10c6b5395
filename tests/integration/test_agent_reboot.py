"""Issue 39, a node that reboots: the real agent shutters two real jobs, is SIGKILLed, the jobs'
processes are killed too (the reboot took them), and the agent starts again on its spool. Every
job it had open gets its JobLeftNode, no job is launched again, nothing is counted twice, and the
real worker charges each job once from every block the agent measured; the audit agrees."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from topic_reading import read_until

from nodeshare.demo import running_pipeline
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOBS = ("a", "b")
TAIL = b'{"kind": "test-tail"}'


def spooled_blocks(spool: Path) -> dict[str, int]:
    """Blocks per job the agent's books say it measured (its spool's meta; WAL lets a reader in)."""
    try:
        with sqlite3.connect(f"file:{spool}?mode=ro", uri=True, timeout=5) as db:
            row = db.execute("SELECT value FROM meta WHERE name = 'jobs'").fetchone()
    except sqlite3.OperationalError:
        return {}
    return {} if row is None else {j: s["blocks"] for j, s in json.loads(row[0]).items()}


def wait_for(what: str, ok, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.2)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_rebooted_node_closes_every_job_it_had_open_once(settings: Settings, tmp_path: Path) -> None:
    create_topics(settings)
    pids = tmp_path / "launched"  # one line per launch of a job: a relaunch would add one
    job = f"echo $$ >> {pids}/%s; exec {sys.executable} -m nodeshare workload --kind compute --seconds 120"
    pids.mkdir()
    (tmp_path / "jobs.toml").write_text("".join(
        f'[[jobs]]\nid = "{j}"\ncommand = {json.dumps(["sh", "-c", job % j])}\n' for j in JOBS))
    spool = tmp_path / "spool.db"
    cmd = [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
           "--spool", str(spool), "--progress-dir", str(tmp_path / "progress"), "--until-idle",
           "--drain-timeout", "30"]
    env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env(), "NODESHARE_PERIOD_MS": "100",
           "NODESHARE_SHUTTER_SCHEDULE": "fixed"}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("both jobs shuttered", lambda: all(spooled_blocks(spool).get(j, 0) >= 3 for j in JOBS))
    finally:
        first.kill()  # SIGKILL: no exit path of the agent runs
        first.communicate(timeout=30)
    measured = spooled_blocks(spool)
    launched = {j: [int(p) for p in (pids / j).read_text().split()] for j in JOBS}
    for j, [pid] in launched.items():  # the reboot takes the jobs' processes too
        os.killpg(pid, signal.SIGKILL)
        wait_for(f"job {j} gone", lambda pid=pid: gone(pid), 30)

    started = time.monotonic()
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert time.monotonic() - started < 60, "the restarted agent waited for jobs it should have closed"
    assert {j: (pids / j).read_text().split() for j in JOBS} == {j: [str(p)] for j, [p] in launched.items()}, \
        "a job the agent had launched before the reboot was launched again"

    # Tansu's high watermark stops at the first record of a partition's last batch (docs/broker.md):
    # one more record per partition makes the agent's last batch readable
    with EventProducer(settings, client_id="test-tail") as producer:
        for partition in range(settings.partitions):
            producer.send_raw(settings.topic("node.ipc"), b"tail", TAIL, partition=partition)
    ipc = [json.loads(m.value()) for m in read_until(
        settings, "node.ipc", lambda ms: sum(b'"job_left_node"' in m.value() for m in ms) >= len(JOBS))
        if m.value() != TAIL]
    markers = {(m["job_id"], m["event_id"], m["event_time"], m["blocks_sent"]) for m in ipc
               if m["kind"] == "job_left_node"}
    assert sorted(m[0] for m in markers) == sorted(JOBS), markers  # one marker per job (copies: one event id)
    sent = {m[0]: m[3] for m in markers}
    blocks = {(b["job_id"], c) for b in ipc if b["kind"] == "shutter_batch" for c in b["cycle"]}
    assert {j: sum(1 for job_id, _ in blocks if job_id == j) for j in JOBS} == sent
    assert all(sent[j] >= measured[j] for j in JOBS)  # every block measured before the kill was kept

    with running_pipeline(settings, tmp_path / "run") as pipeline:
        pipeline.wait(charges=len(JOBS), archived=0, timeout_s=90, report=lambda *_: None)
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = ledger.charges()
    assert sorted(c.job_id for c in charges) == sorted(JOBS) and all(c.revision == 0 for c in charges)
    for c in charges:
        [node] = c.nodes
        assert node.blocks == node.blocks_sent == sent[c.job_id] and not c.evidence_problems, c
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == len(JOBS), report.as_dict()
