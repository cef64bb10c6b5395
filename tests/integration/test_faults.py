"""Fault tests: what the pipeline survives, with the figures printed (pytest -s shows them)."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import pytest
from topic_reading import read_until

from nodeshare.config import Settings
from nodeshare.demo import publish, running_pipeline
from nodeshare.deploy.processes import start_worker
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.schemas import TOPIC_OF_RECORD, JobEvent, JobLeftNode, ShutterBlock, encode
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.accounting import Origin, fold_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _reference_charges(sim, policy):
    """The uninterrupted answer: the reducer over the simulated events (offsets as published)."""
    offsets: dict[str, int] = {}
    msgs = []
    for rec in sim.events:
        if not isinstance(rec, ShutterBlock | JobLeftNode | JobEvent):
            continue
        topic = TOPIC_OF_RECORD[type(rec)].name
        offsets[topic] = offsets.get(topic, -1) + 1
        msgs.append((Origin(topic, 0, offsets[topic]), rec.job_id.encode(), encode(rec), 0.0))
    return {(c.job_id, c.revision): c for c in fold_messages(msgs, policy)}


def test_worker_killed_five_times_loses_and_duplicates_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    # One partition per topic, so the reference fold above sees the same offsets as the broker.
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"k{tag}.", app_id=f"nodeshare-k{tag}", partitions=1)
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    rng = random.Random(5)
    kills = 0
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        for _ in range(5):
            # Kill mid-processing: once the (re)started worker has produced a new charge, at a random
            # moment within the next half second.
            before = pipeline.ledger_sink.rows_inserted
            deadline = time.monotonic() + 30
            while pipeline.ledger_sink.rows_inserted == before and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.5))
            pipeline.worker.kill()  # SIGKILL: no cleanup, no commit, no changelog flush
            pipeline.worker.wait()
            kills += 1
            print(f"kill {kills}: {pipeline.ledger_sink.rows_inserted}/{len(sim.truth)} charges in the ledger")
            pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 180, lambda *_: None)
        time.sleep(2)  # let any late duplicate charge reach the sink before we count
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        rows = ledger.charges()
    expected = _reference_charges(sim, settings.policy())
    got = {(c.job_id, c.revision): c for c in rows}
    lost = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    wrong = [k for k in expected.keys() & got.keys() if got[k] != expected[k]]
    print(f"{kills} SIGKILLs; {len(rows)} ledger rows for {len(expected)} expected charges; "
          f"lost {len(lost)}, unexpected {len(extra)}, different {len(wrong)}")
    assert kills == 5
    assert not lost and not extra and len(rows) == len(expected)
    assert not wrong, [(k, [f for f in got[k].model_fields if getattr(got[k], f) != getattr(expected[k], f)])
                       for k in wrong[:3]]
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok, report.as_dict()
    published = read_until(settings, "ledger.charges", lambda m: len(m) >= len(expected), deadline_s=30)
    print(f"ledger.charges carried {len(published)} charge messages for {len(expected)} charges: "
          f"{len(published) - len(expected)} redelivered duplicates absorbed by the ledger's key")
