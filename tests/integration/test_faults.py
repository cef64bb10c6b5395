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

# Crash tests of the faust worker on the bundled broker (README, Reliability). Left out of the
# default run while their timing-dependent results are observed:
#   crash_recovery - pass since the worker rebuilds its state from the input (2 of 2 runs each);
#   known_defect   - still fails (five kills: wrong charges that the audit flags).
# Run them with `./deploy/local.sh test -m "crash_recovery or known_defect"` (about 4 minutes).


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


def _settings(kafka_bootstrap: str, letter: str) -> Settings:
    tag = uuid.uuid4().hex[:8]
    # One partition per topic, so the reference fold sees the same offsets as the broker.
    return Settings(bootstrap=kafka_bootstrap, topic_prefix=f"{letter}{tag}.", app_id=f"nodeshare-{letter}{tag}",
                    partitions=1)


def _check(pipeline, sim, settings, kills: int) -> None:
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        rows = ledger.charges()
    expected = _reference_charges(sim, settings.policy())
    got = {(c.job_id, c.revision): c for c in rows}
    lost, extra = expected.keys() - got.keys(), got.keys() - expected.keys()
    wrong = [k for k in expected.keys() & got.keys() if got[k] != expected[k]]
    print(f"{kills} SIGKILLs; {len(rows)} ledger rows for {len(expected)} expected charges; "
          f"lost {len(lost)}, unexpected {len(extra)}, different {len(wrong)}")
    assert not lost and not extra and not wrong and len(rows) == len(expected)
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok, report.as_dict()
    published = read_until(settings, "ledger.charges", lambda m: len(m) >= len(expected), deadline_s=30)
    print(f"ledger.charges carried {len(published)} messages for {len(expected)} charges: "
          f"{len(published) - len(expected)} redelivered copies absorbed by the ledger's key")


@pytest.mark.crash_recovery  # passes since the rebuild (2 of 2 runs); flaky before it
def test_worker_killed_once_while_processing_loses_and_duplicates_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    """One SIGKILL at a random moment while the worker is producing charges, then a restart."""
    settings = _settings(kafka_bootstrap, "o")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        while pipeline.ledger_sink.rows_inserted < 5:
            time.sleep(0.05)
        time.sleep(random.Random(7).uniform(0.0, 0.5))
        pipeline.worker.kill()
        pipeline.worker.wait()
        print(f"kill 1: {pipeline.ledger_sink.rows_inserted}/{len(sim.truth)} charges in the ledger")
        pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 120, lambda *_: None)
        time.sleep(2)
    _check(pipeline, sim, settings, 1)


@pytest.mark.known_defect
def test_worker_killed_five_times_while_processing_loses_and_duplicates_nothing(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """Each kill lands while the restarted worker is producing charges, at a random moment."""
    settings = _settings(kafka_bootstrap, "k")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    rng = random.Random(5)
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        for kill in range(1, 6):
            time.sleep(1.5)  # let the killed worker's last charges drain into the ledger first
            before = pipeline.ledger_sink.rows_inserted
            deadline = time.monotonic() + 60
            while pipeline.ledger_sink.rows_inserted == before and time.monotonic() < deadline:
                time.sleep(0.05)  # the (re)started worker is processing once new charges appear
            time.sleep(rng.uniform(0.0, 0.5))
            pipeline.worker.kill()  # SIGKILL: no cleanup, no commit, no changelog flush
            pipeline.worker.wait()
            print(f"kill {kill}: {pipeline.ledger_sink.rows_inserted}/{len(sim.truth)} charges in the ledger")
            pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 180, lambda *_: None)
        time.sleep(2)  # late redelivered copies reach the sink before counting
    _check(pipeline, sim, settings, 5)


@pytest.mark.crash_recovery  # passes since the rebuild bound fix (2 of 2 runs); lost most charges before
def test_worker_killed_while_starting_up_loses_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap, "s")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        while pipeline.ledger_sink.rows_inserted < 5:
            time.sleep(0.05)
        pipeline.worker.kill()
        pipeline.worker.wait()
        for delay in (2.0, 5.0, 9.0):  # during join, during recovery, just after
            pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
            time.sleep(delay)
            pipeline.worker.kill()
            pipeline.worker.wait()
        pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 60, lambda *_: None)
    _check(pipeline, sim, settings, 4)
