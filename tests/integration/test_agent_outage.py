"""The node agent keeps measuring through a 30 s broker outage (the broker process SIGSTOPped) and
loses nothing: every cycle's block (in its batch) and window reaches the broker once the broker is back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from topic_reading import read_until

from nodeshare.deploy.broker import BundledBroker
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTAGE_S = 30.0
TAIL = b'{"kind": "test-tail"}'


def test_the_agent_spools_through_a_broker_outage_and_loses_nothing(tmp_path: Path) -> None:
    # a broker of its own: stopping the shared one would stall every other test
    with BundledBroker(log_path=tmp_path / "tansu.log") as broker:
        settings = Settings(bootstrap=broker.bootstrap, topic_prefix="outage.", partitions=2)
        create_topics(settings)
        job = [sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds", str(OUTAGE_S + 12)]
        (tmp_path / "jobs.toml").write_text("".join(
            f'[[jobs]]\nid = "{name}"\ncommand = {json.dumps(job)}\n' for name in ("a", "b")))
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(tmp_path / "jobs.toml"), "--node", "n1",
             "--spool", str(tmp_path / "spool.db"), "--progress-dir", str(tmp_path / "progress"), "--until-idle",
             "--drain-timeout", "60"],
            env={**os.environ, "NODESHARE_CONFIG": "", **settings.as_env(), "NODESHARE_PERIOD_MS": "100",
                 "NODESHARE_SHUTTER_SCHEDULE": "fixed"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(5)
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                time.sleep(OUTAGE_S)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            out, errors = agent.communicate(timeout=180)
        finally:  # an agent that cannot drain would otherwise outlive the test (one did)
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        assert agent.returncode == 0, errors
        assert time.monotonic() - stopped_at > OUTAGE_S
        cycles = int(re.search(r"(\d+) shutter cycles", out).group(1))  # type: ignore[union-attr]
        assert cycles > 100, out  # it kept shuttering while the broker was stopped
        print("agent:", out.strip())

        # Tansu's high watermark stops at the first record of a partition's last batch (docs/broker.md):
        # one more record per partition makes the agent's last batch readable
        with EventProducer(settings, client_id="test-tail") as producer:
            for topic in ("node.shutter", "node.ipc"):
                for partition in range(settings.partitions):
                    producer.send_raw(settings.topic(topic), b"tail", TAIL, partition=partition)
        windows = read_until(settings, "node.shutter", lambda ms: len(
            {json.loads(m.value())["cycle"] for m in ms if m.value() != TAIL}) >= cycles)
        ipc = [json.loads(m.value()) for m in read_until(
            settings, "node.ipc", lambda ms: sum(b'"job_left_node"' in m.value() for m in ms) >= 2)
            if m.value() != TAIL]
        windows = [m for m in windows if m.value() != TAIL]
    assert {json.loads(m.value())["cycle"] for m in windows} == set(range(cycles))
    sent = [(b["job_id"], c) for b in ipc if b["kind"] == "shutter_batch" for c in b["cycle"]]
    blocks = set(sent)
    left = [b for b in ipc if b["kind"] == "job_left_node"]
    assert len(blocks) == cycles == sum(x["blocks_sent"] for x in {b["job_id"]: b for b in left}.values())
    assert {c for _, c in blocks} == set(range(cycles))
    duplicates = len(windows) - cycles + len(sent) - len(blocks)
    print(f"{cycles} cycles, all delivered after a {OUTAGE_S:.0f} s outage; {duplicates} re-sent copies "
          "(removed downstream by event id)")
