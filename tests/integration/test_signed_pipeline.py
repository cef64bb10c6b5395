"""Signed input on a real broker (issue 41, item 1): the simulator signs as each node and the Slurm
source would, the worker and the audit hold the site secret, and records one node wrote about
another, or that no one signed, end in the dead-letter topic without touching a charge."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
from topic_reading import read_until
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.demo import DemoResult, from_events, run_demo
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime.config import Settings
from nodeshare.runtime.identity import new_secret, read_secret
from nodeshare.schemas import (
    DeadLetter,
    JobEvent,
    NodeDown,
    PowerReading,
    ShutterBatch,
    ShutterWindow,
    decode_model,
    encode,
    key_of,
)
from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.signing import derive_key, sign
from nodeshare.sinks.archive import ParquetArchive

pytestmark = pytest.mark.integration

CFG = SimConfig(nodes=4, jobs=6, seed=33)


def _forgeries(secret: bytes) -> tuple[str, list[tuple[str, bytes, bytes, bytes, str]]]:
    """Records about a job of the simulation that its node did not send: (topic, key, value, auth,
    the dead letter's reason), and the job."""
    sim = simulate(CFG)
    real = next(e for e in sim.events if isinstance(e, ShutterBatch))
    end = next(e for e in sim.events
               if isinstance(e, JobEvent) and e.job_id == real.job_id and e.state.value == "ended")
    node = real.node
    other = next(n for e in sim.events if isinstance(e, JobEvent) for n in e.nodes if n != node)
    window = next(e for e in sim.events if isinstance(e, ShutterWindow) and e.node == node)
    as_other = derive_key(secret, f"node/{other}")
    records = [
        (real.model_copy(update={"event_id": "forged-batch"}), f"node/{other}",
         f"shutter_batch names node '{node}' but is signed by node/{other}"),
        (NodeDown(event_id="forged-down", source="x", event_time=end.event_time, job_id=end.job_id, node=node,
                  reason="forged"), f"node/{other}", f"node_down must be written by a service, not node/{other}"),
        (end.model_copy(update={"event_id": "forged-end", "cores": end.cores * 4}), "",
         "job_event is not signed by a known identity"),
        (PowerReading(event_id="forged-power", source="x", event_time=end.event_time, node=node, processor=0,
                      available=True, watts=10.0, interval_s=1.0), f"node/{other}",
         f"power_reading names node '{node}' but is signed by node/{other}"),
        # the ledger sink's co-runner counts (analysts' table) take no window another node wrote either
        (window.model_copy(update={"event_id": "forged-window", "cycle": window.cycle + 10**6}), f"node/{other}",
         f"shutter_window names node '{node}' but is signed by node/{other}"),
    ]
    out = []
    for rec, identity, reason in records:
        topic, key, value = TOPIC_OF_RECORD[type(rec)].name, key_of(rec), encode(rec)
        out.append((topic, key, value, sign(as_other, identity, topic, key, value) if identity else b"", reason))
    return end.job_id, out


@pytest.fixture(scope="module")
def signed(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[DemoResult, str, list[tuple[str, bytes, bytes, bytes, str]]]:
    tmp: Path = tmp_path_factory.mktemp("signed")
    new_secret(tmp / "site.secret")
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"s{tag}.", app_id=f"nodeshare-s{tag}",
                        site_secret_file=tmp / "site.secret")
    job, forged = _forgeries(read_secret(tmp / "site.secret"))
    result = run_demo(settings, from_events(simulate(CFG)), tmp / "out", timeout_s=120,
                      extra_inputs=[(t, k, v, a) for t, k, v, a, _ in forged])
    return result, job, forged


def test_every_job_is_charged_and_the_audit_checks_every_signature(signed) -> None:
    run, job, _ = signed
    assert run.jobs_ended == len({c.job_id for c in run.charges}) == CFG.jobs
    assert run.audit.ok and run.audit.identities_checked, run.audit.as_dict()
    assert run.audit.refused_jobs == [job]
    assert run.audit.reference_path_jobs == 1  # the attacked job; every other one on the fast path


def test_forged_and_unsigned_records_are_dead_letters_with_their_reason(signed) -> None:
    run, _, forged = signed
    wanted = {v: (t, reason) for t, _, v, _, reason in forged}

    def all_there(msgs: list) -> bool:
        return set(wanted) <= {base64.b64decode(decode_model(DeadLetter, m.value()).value_b64) for m in msgs}

    letters = [decode_model(DeadLetter, m.value()) for m in read_until(run.settings, "dlq", all_there)]
    assert len(letters) == len(forged)  # once each (the routers drop what the fold dead-letters), nothing else
    for dl in letters:
        topic, reason = wanted[base64.b64decode(dl.value_b64)]
        assert dl.origin_topic == run.settings.topic(topic) and dl.reason.startswith(reason) and dl.field == "auth"


def test_the_archive_keeps_each_records_signature(signed) -> None:
    run, _, forged = signed
    unsigned = {v for _, _, v, a, _ in forged if not a}
    events = [ev for _, ev in ParquetArchive(run.archive).events(["node.ipc", "jobs.lifecycle", "node.shutter"])]
    assert len(events) > 100
    assert [ev.value for ev in events if not ev.auth] == list(unsigned)


def test_the_audit_command_with_and_without_the_secret(signed, monkeypatch) -> None:
    run, job, _ = signed
    monkeypatch.setenv("NODESHARE_SITE_SECRET_FILE", str(run.settings.site_secret_file))
    r = CliRunner().invoke(app, ["audit", "--archive", str(run.archive), "--ledger", str(run.ledger)])
    assert r.exit_code == 0, r.output
    assert f"signatures checked (site secret): 1 jobs had records refused for their signer: {job}" in r.output
    monkeypatch.delenv("NODESHARE_SITE_SECRET_FILE")
    r = CliRunner().invoke(app, ["audit", "--archive", str(run.archive), "--ledger", str(run.ledger)])
    assert r.exit_code == 1 and "signatures not checked" in r.output  # the forgeries fold into another charge
    assert f"{job}#0" in r.output


def test_a_forged_window_moves_no_co_runner_count(signed) -> None:
    import duckdb

    run, _, forged = signed
    [window] = [decode_model(ShutterWindow, v) for t, _, v, _, _ in forged if t == "node.shutter"]
    with duckdb.connect(str(run.ledger), read_only=True) as con:
        [(last,)] = con.execute("SELECT last_cycle FROM shutter_watermarks WHERE node = ?", [window.node]).fetchall()
    assert last < window.cycle  # accepted, it would have moved the node's watermark to its cycle


def test_a_replay_resends_each_signature_as_archived_and_rebuilds_the_same_ledger(signed, tmp_path: Path) -> None:
    """The replaying producer holds the site secret too, yet vouches for nothing: the unsigned
    forged end event stays unsigned (signed anew, it would re-bill its job at four times the cores)."""
    from replaying import replayed_ledger

    run, _, _ = signed
    assert replayed_ledger(run, tmp_path, "sr") == {(c.job_id, c.revision): c for c in run.charges}
