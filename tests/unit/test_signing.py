"""Who wrote an input record (issue 41, item 1): per-identity HMAC signatures, checked by the fold,
the power and placement routers and both audits; keys on disk; the ``nodeshare keys`` commands."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import POLICY, T0, archive_records, batch, block, job_event, left
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.producers.agent.agent import check_signing_identity
from nodeshare.runtime.config import Settings
from nodeshare.runtime.identity import new_secret, read_key, read_secret, write_key
from nodeshare.schemas import JobState, NodeDown, PowerReading, encode, key_of
from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.events import Charge, DeadLetter
from nodeshare.schemas.serde import decode_model
from nodeshare.schemas.signing import (
    AUTH_HEADER,
    IDENTITY_RULES,
    Signer,
    SigningError,
    Verifier,
    derive_key,
    header_value,
    identity_problem,
    sign,
)
from nodeshare.sinks.archive import ARCHIVE_SCHEMA, ArchivedEvent, ParquetArchive
from nodeshare.sinks.audit import audit
from nodeshare.streams.core.accounting import FORGED, Origin, fold_states
from nodeshare.streams.core.power.stream import screen

SECRET = bytes(range(32))


def _hmac(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256 from its definition (RFC 2104), independent of the ``hmac`` module."""
    k = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in k) + msg).digest()
    return hashlib.sha256(bytes(b ^ 0x5C for b in k) + inner).digest()


def _prefixed(*parts: bytes | None) -> bytes:
    return b"".join(struct.pack(">q", -1) if p is None else struct.pack(">q", len(p)) + p for p in parts)


def test_the_reference_hmac_is_rfc_4231s():
    # RFC 4231, test case 2
    assert _hmac(b"Jefe", b"what do ya want for nothing?").hex() == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")


def test_a_signature_is_the_derived_keys_hmac_of_identity_topic_key_and_value():
    key = _hmac(SECRET, b"nodeshare identity key v1\x00node/n1")
    assert derive_key(SECRET, "node/n1") == key
    mac = _hmac(key, b"node/n1\x00nodeshare-auth v1\x00" + _prefixed(b"node.ipc", b"j1", b'{"a":1}'))
    assert sign(key, "node/n1", "node.ipc", b"j1", b'{"a":1}') == b"node/n1 " + mac.hex().encode()
    # the length prefixes keep (key, value) boundaries: moving a byte across them is another message
    assert sign(key, "node/n1", "node.ipc", b"j1x", b"y") != sign(key, "node/n1", "node.ipc", b"j1", b"xy")
    assert sign(key, "node/n1", "node.ipc", None, b"") != sign(key, "node/n1", "node.ipc", b"", b"")


def test_the_verifier_names_the_signer_only_for_the_bytes_it_signed():
    v = Verifier(SECRET)
    auth = sign(derive_key(SECRET, "node/n1"), "node/n1", "node.ipc", b"j1", b"value")
    assert v.signer("node.ipc", b"j1", b"value", auth) == "node/n1"
    assert v.signer("node.ipc", b"j1", b"valuE", auth) == ""  # another value
    assert v.signer("node.ipc", b"j2", b"value", auth) == ""  # another key
    assert v.signer("node.power", b"j1", b"value", auth) == ""  # another topic
    assert v.signer("node.ipc", b"j1", b"value", b"node/n2" + auth[7:]) == ""  # n1's MAC claimed as n2's
    assert v.signer("node.ipc", b"j1", b"value", None) == ""
    for garbage in (b"", b"node/n1", b"node/n1 zz", b"\xff\xfe abc", b"root/x " + auth[8:]):
        assert v.signer("node.ipc", b"j1", b"value", garbage) == ""
    assert Verifier(bytes(32)).signer("node.ipc", b"j1", b"value", auth) == ""  # another site's secret
    for n in range(100):  # made-up identities cost a derivation each, and are never remembered
        assert v.signer("node.ipc", b"j1", b"value", f"node/x{n} {'0' * 64}".encode()) == ""
    assert set(v._keys) == {"node/n1"}
    assert v.signer("node.ipc", b"j1", b"value", b"node/n1\n" + auth[7:]) == ""  # no trailing newline
    with pytest.raises(SigningError, match="at least 32"):
        Verifier(b"short")


@pytest.mark.parametrize(("kind", "node", "signer", "allowed"), [
    ("shutter_batch", "n1", "node/n1", True),
    ("shutter_batch", "n1", "node/n2", False),  # a node speaking for another
    ("shutter_batch", "n1", "service/slurm", False),  # a service cannot measure a node
    ("shutter_block", "n1", "node/n1", True),
    ("job_left_node", "n1", "node/n2", False),
    ("power_reading", "n1", "node/n1", True),
    ("power_reading", "n1", "node/n2", False),
    ("shutter_window", "n1", "node/n1", True),
    ("llc_sample", "n1", "node/n3", False),
    ("node_down", "n1", "node/n1", False),  # a node cannot say it is down, nor another node for it
    ("node_down", "n1", "node/n2", False),
    ("node_down", "n1", "service/slurm", True),
    ("job_event", None, "service/slurm", True),
    ("job_event", None, "node/n1", False),  # a job on no node, or on several
    ("node_inventory", "n2", "node/n1", False),
    ("node_inventory", "n1", "service/adapter", True),
    ("shutter_batch", "n1", "", False),  # unsigned
    ("job_event", None, "", False),
    ("charge", None, "service/x", False),  # a kind with no rule: no one may write it as input
])
def test_who_may_write_what(kind, node, signer, allowed):
    from types import SimpleNamespace

    assert (identity_problem(SimpleNamespace(kind=kind, node=node), signer) is None) is allowed


def test_no_node_writes_a_jobs_lifecycle_and_a_node_describes_only_its_processors():
    """A job id names no node: a node's word on a job's end, cores or account would re-bill any
    job, even one listed on that node alone. A node's inventory record may only list its processors."""
    mine = job_event("j1", JobState.ENDED, nodes=("n1",))
    assert identity_problem(mine, "node/n1") == "job_event must be written by a service, not node/n1"
    assert identity_problem(mine, "service/slurm") is None
    from nodeshare.schemas import NodeInventory

    inv = NodeInventory(event_id="i", source="x", event_time=T0, node="n1", cores=8, llc_ways=11,
                        mem_bandwidth_gbps=10.0)
    assert "must be processors-only" in identity_problem(inv, "node/n1")
    assert identity_problem(inv, "service/adapter") is None
    assert identity_problem(inv.model_copy(update={"processors_only": True}), "node/n1") is None
    assert identity_problem(inv.model_copy(update={"processors_only": True}), "node/n2") is not None


def test_every_input_record_kind_has_a_rule():
    from nodeshare.schemas import INPUT_TOPICS

    kinds = {model.model_fields["kind"].default for model, spec in TOPIC_OF_RECORD.items() if spec in INPUT_TOPICS}
    assert kinds == set(IDENTITY_RULES)


def test_the_header_is_read_from_any_shape_confluent_or_faust_give():
    assert header_value([("x", b"1"), (AUTH_HEADER, b"node/n1 ab")]) == b"node/n1 ab"
    assert header_value({AUTH_HEADER: b"node/n1 ab"}) == b"node/n1 ab"
    assert header_value(None) is None and header_value([]) is None
    assert header_value([(AUTH_HEADER, b"a"), (AUTH_HEADER, b"b")]) is None  # twice proves nothing


def test_a_site_signer_signs_each_record_as_the_identity_that_may_write_it():
    s = Signer(secret=SECRET, service="service/simulator")
    v = Verifier(SECRET)
    b = batch(block(1.0, 1.0, 1.0, node="n3"))
    value = encode(b)
    assert v.signer("node.ipc", b"j1", value, s.header("node.ipc", b"j1", value)) == "node/n3"  # from the bytes
    assert s.identity_for("job_event", None) == "service/simulator"
    assert s.identity_for("node_down", "n3") == "service/simulator"
    one = Signer(identity="node/n1", key=derive_key(SECRET, "node/n1"))
    assert v.signer("node.ipc", b"j1", value, one.header("node.ipc", b"j1", value)) == "node/n1"  # its own only
    with pytest.raises(SigningError):
        Signer(identity="node/n1")
    with pytest.raises(SigningError, match="neither"):
        Signer(identity="root", key=b"k" * 32)


# ---------------------------------------------------------------------------- keys on disk and the CLI


def test_keys_are_written_private_and_never_replaced_silently(tmp_path):
    secret = tmp_path / "site.secret"
    new_secret(secret)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(read_secret(secret)) == 32
    with pytest.raises(SigningError, match="exists"):
        new_secret(secret)
    write_key(secret, "node/n1", tmp_path / "n1.key")
    identity, key = read_key(tmp_path / "n1.key")
    assert identity == "node/n1" and key == derive_key(read_secret(secret), "node/n1")
    os.chmod(tmp_path / "n1.key", 0o644)
    with pytest.raises(SigningError, match="readable by others"):
        read_key(tmp_path / "n1.key")



@pytest.mark.parametrize(("content", "read", "error"), [
    (b"not hex\n", read_secret, "not hex"),
    (b"\xff\xfe\x00", read_secret, "not text"),
    (b'{"identity": "node/n1", "key": ""}', read_key, "0 bytes"),  # an empty HMAC key would sign
])
def test_an_unusable_secret_or_key_file_is_one_clear_error(tmp_path, content, read, error):
    path = tmp_path / "f"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(SigningError, match=error):
        read(path)


def test_an_agent_starts_only_with_a_key_it_may_use(tmp_path):
    new_secret(tmp_path / "s")
    write_key(tmp_path / "s", "node/n1", tmp_path / "n1.key")
    check_signing_identity(Settings(signing_key_file=tmp_path / "n1.key"), "n1", static_jobs=False)
    with pytest.raises(ValueError, match="node/n1's, and this agent is node 'n2'"):
        check_signing_identity(Settings(signing_key_file=tmp_path / "n1.key"), "n2", static_jobs=False)
    with pytest.raises(ValueError, match="never the site secret"):  # root on a Slurm node could sign as anyone
        check_signing_identity(Settings(site_secret_file=tmp_path / "s"), "n1", static_jobs=False)
    with pytest.raises(ValueError, match="lifecycle, which a node key may not sign"):
        check_signing_identity(Settings(signing_key_file=tmp_path / "n1.key"), "n1", static_jobs=True)
    check_signing_identity(Settings(site_secret_file=tmp_path / "s"), "n1", static_jobs=True)  # a one-host trial


def test_the_keys_commands(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["keys", "secret", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["keys", "derive", "node/n7", "--secret", str(tmp_path / "s"), "--out", str(tmp_path / "k")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "k").read_text())["identity"] == "node/n7"
    r = runner.invoke(app, ["keys", "derive", "n7", "--secret", str(tmp_path / "s"), "--out", str(tmp_path / "k2")])
    assert r.exit_code == 2 and "neither node/<name> nor service/<name>" in r.output
    r = runner.invoke(app, ["keys", "secret", str(tmp_path / "s")])
    assert r.exit_code == 2 and "exists" in r.output


# ---------------------------------------------------------------------------- the fold and the audit

#: j1 ran alone-measured on n1, 20 blocks at D = 0.2 (IPC 1.0 around the shutter, 1.25 alone)
GOOD = [
    job_event("j1", JobState.STARTED),
    batch(*[block(1.0, 1.25, 1.0, cycle=c) for c in range(20)]),
    left("j1", "n1", blocks_sent=20, last_cycle=19),
    job_event("j1", JobState.ENDED),
]


def _forgeries() -> list[tuple[str, bytes, bytes, bytes]]:
    """Records about j1 on n1 that n1 did not send, each with the auth it carries."""
    n2 = derive_key(SECRET, "node/n2")
    wild = batch(*[block(1.0, 4.0, 1.0, cycle=c) for c in range(20, 30)], seq=1)  # "n1 measured D = 0.75"
    early = left("j1", "n1", blocks_sent=0, last_cycle=-1).model_copy(update={"event_id": "forged-left"})
    down = NodeDown(event_id="forged-down", source="x", event_time=T0 + timedelta(seconds=10), job_id="j1",
                    node="n1", reason="forged")
    out = []
    for rec, auth in ((wild, "node/n2"), (early, "node/n2"), (down, "node/n2"), (wild, "")):
        topic, key, value = TOPIC_OF_RECORD[type(rec)].name, key_of(rec), encode(rec)
        out.append((topic, key, value, sign(n2, auth, topic, key, value) if auth else b""))
    return out


def _signed(records: list) -> list[tuple[str, bytes, bytes, bytes]]:
    s = Signer(secret=SECRET, service="service/slurm")
    out = []
    for rec in records:
        topic, key, value = TOPIC_OF_RECORD[type(rec)].name, key_of(rec), encode(rec)
        out.append((topic, key, value, s.header(topic, key, value)))
    return out


def _fold(messages: list[tuple[str, bytes, bytes, bytes]], verifier: Verifier | None):
    origins = [(Origin(t, 0, i, None if verifier is None else verifier.signer(t, k, v, a)), k, v, 0.0)
               for i, (t, k, v, a) in enumerate(messages)]
    return fold_states(origins, POLICY)


def _priced(value: bytes) -> dict:
    return decode_model(Charge, value).model_dump(exclude={"event_id", "event_range"})


def test_the_fold_refuses_what_its_signer_may_not_write_and_charges_as_without_it():
    clean = _signed(GOOD)
    attacked = clean[:2] + _forgeries() + clean[2:]
    v = Verifier(SECRET)
    _, expected = _fold(clean, v)
    # the dead letters come from apply_message, so fold them with it directly
    from nodeshare.streams.core.accounting import apply_message

    accounts: dict = {}
    letters = []
    charges = []
    for i, (t, k, val, a) in enumerate(attacked):
        acc, out, _ = apply_message(accounts.get(k), Origin(t, 0, i, v.signer(t, k, val, a)), k, val, 0.0, POLICY)
        if acc is not None:
            accounts[k] = acc
        letters += [o for o in out if o.topic == "dlq"]
        charges += [o for o in out if o.topic == "ledger.charges"]
    assert [o.kind for o in letters] == [FORGED] * 4
    reasons = [decode_model(DeadLetter, o.value).reason for o in letters]
    assert reasons[0] == "shutter_batch names node 'n1' but is signed by node/n2"
    assert reasons[2] == "node_down must be written by a service, not node/n2"
    assert "not signed by a known identity" in reasons[3]
    assert [decode_model(DeadLetter, o.value).field for o in letters] == ["auth"] * 4
    # the same charge (its event range names other offsets: the forgeries sit between the records)
    assert [_priced(o.value) for o in charges] == [_priced(o.value) for o in expected]
    # the same records with no identity checked: the forged batch and markers change the charge
    _, unchecked = _fold(attacked, None)
    assert [_priced(o.value) for o in unchecked] != [_priced(o.value) for o in expected]
    assert decode_model(Charge, expected[0].value).degradation == pytest.approx(0.2)


def test_the_audit_checks_signatures_as_the_worker_did(tmp_path):
    v = Verifier(SECRET)
    records = _signed(GOOD)
    records = records[:2] + _forgeries() + records[2:]
    archive, ledger, n = archive_records(tmp_path, records, verifier=v)
    assert n == 1
    for fast in (True, False):
        report = audit(archive, ledger, POLICY, verifier=v, fast=fast)
        assert report.ok, report.as_dict()
        assert report.identities_checked and report.refused_jobs == ["j1"]
    # the auditor without the secret folds the forgeries in: the ledger no longer matches
    report = audit(archive, ledger, POLICY)
    assert not report.ok and {m.job_id for m in report.mismatches} == {"j1"}


def test_a_ledger_that_took_forged_records_fails_the_audit_on_both_paths(tmp_path):
    """A ledger priced with the forgeries in (a worker without the secret, or one written to match
    them): the fast path would reproduce it, so the jobs with refused records must leave it."""
    records = _signed(GOOD)
    wild = _forgeries()[0]  # a batch alone: markers would send the job to the reference path anyway
    archive, ledger, _ = archive_records(tmp_path, [*records[:2], wild, *records[2:]])
    for fast in (True, False):
        report = audit(archive, ledger, POLICY, verifier=Verifier(SECRET), fast=fast)
        assert not report.ok and {m.job_id for m in report.mismatches} == {"j1"}, fast


def test_a_clean_signed_run_audits_on_the_fast_path(tmp_path):
    from nodeshare.producers.simulator import SimConfig, simulate

    v = Verifier(SECRET)
    sim = simulate(SimConfig(nodes=3, jobs=5, seed=3))
    archive, ledger, n = archive_records(tmp_path, sim.events, signer=Signer(secret=SECRET), verifier=v)
    report = audit(archive, ledger, POLICY, verifier=v)
    assert report.ok and report.charges_checked == n and report.refused_jobs == []
    assert report.reference_path_jobs == 0 and report.fast_path_jobs == n


def test_the_archive_keeps_the_signature_and_reads_older_files_as_unsigned(tmp_path):
    archive = ParquetArchive(tmp_path / "a")
    archive.write("jobs.lifecycle", [ArchivedEvent("jobs.lifecycle", 0, 0, 1, b"j1", b"v", b"service/x ab")])
    old = tmp_path / "a" / "topic=jobs.lifecycle" / "date=1970-01-01" / "p0000-000000000001-000000000001.parquet"
    pq.write_table(pa.table({"kafka_topic": ["jobs.lifecycle"], "partition": pa.array([0], pa.int32()),
                             "offset": [1], "timestamp_ms": [2], "key": [b"j2"], "value": [b"w"]}), old)
    got = [ev for _, ev in archive.events(["jobs.lifecycle"])]
    assert [(e.offset, e.auth) for e in got] == [(0, b"service/x ab"), (1, None)]
    assert archive.row_at("jobs.lifecycle", 0, 0, 1).auth is None
    assert "auth" in ARCHIVE_SCHEMA.names
    only_old = tmp_path / "b" / "topic=jobs.lifecycle" / "date=1970-01-01"
    only_old.mkdir(parents=True)
    pq.write_table(pa.table({"kafka_topic": ["jobs.lifecycle"], "partition": pa.array([0], pa.int32()),
                             "offset": [1], "timestamp_ms": [2], "key": [b"j2"], "value": [b"w"]}),
                   only_old / "p0000-000000000001-000000000001.parquet")
    assert [ev.auth for _, ev in ParquetArchive(tmp_path / "b").events(["jobs.lifecycle"])] == [None]


def test_the_power_router_dead_letters_a_reading_for_another_node():
    reading = PowerReading(event_id="p1", source="x", event_time=T0, node="n1", processor=0, available=True,
                           watts=100.0, interval_s=1.0)
    value = encode(reading)
    ts = T0.timestamp()
    assert screen("node.power", 0, 0, b"n1", value, ts, signer="node/n1") is None
    dl = screen("node.power", 0, 0, b"n1", value, ts, signer="node/n2")
    assert dl is not None and dl.field == "auth" and "signed by node/n2" in dl.reason
    assert screen("node.power", 0, 0, b"n1", value, ts) is None  # the site checks no identities
    # an unscreened input topic gets its verdict too (the router drops it; its owner dead-letters it)
    end = job_event("j1", JobState.ENDED)
    assert screen("jobs.lifecycle", 0, 0, b"j1", encode(end), end.event_time.timestamp(), signer="node/n2") is not None
    assert screen("estimates.degradation", 0, 0, b"j1", b"{}", ts, signer="") is None  # derived: never signed


def test_a_node_key_written_twice_is_read_as_the_models_read_it(tmp_path):
    """DuckDB's typed column keeps the first of a key written twice, the models the last: node n2
    signs a batch that says node n2 first and n1 last. The worker reads n1 and refuses it; so must
    the audit, and it must not refuse n1's own such batch."""
    v = Verifier(SECRET)
    clean = _signed(GOOD)
    topic, key, value, _ = clean[1]
    # written twice, and written once plainly and once escaped (DuckDB reads "\u006eode" as node)
    for n, first in enumerate((b'{"node":"n2",', b'{"\\u006eode":"n2",')):
        twice = first + value[1:]
        assert decode_model(type(GOOD[1]), twice).node == "n1"
        forged = (topic, key, twice, sign(derive_key(SECRET, "node/n2"), "node/n2", topic, key, twice))
        honest = (topic, key, twice, sign(derive_key(SECRET, "node/n1"), "node/n1", topic, key, twice))
        for extra, refused in ((forged, ["j1"]), (honest, [])):
            archive, ledger, _ = archive_records(tmp_path / f"{n}{len(refused)}", [*clean, extra], verifier=v)
            for fast in (True, False):
                report = audit(archive, ledger, POLICY, verifier=v, fast=fast)
                assert report.ok and report.refused_jobs == refused, (first, refused, fast, report.as_dict())


def test_a_deeply_nested_value_does_not_stop_a_signed_audit(tmp_path):
    v = Verifier(SECRET)
    deep = b'{"node":"a","node":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    archive, ledger, _ = archive_records(tmp_path, [*_signed(GOOD), ("node.ipc", b"j1", deep, b"")], verifier=v)
    report = audit(archive, ledger, POLICY, verifier=v)
    assert report.ok and report.refused_jobs == []  # the models refuse it before any signature matters


def test_a_rotation_keeps_verifying_what_the_retired_secret_signed(tmp_path):
    new_secret(tmp_path / "old")
    old = read_secret(tmp_path / "old")
    new_secret(tmp_path / "new")
    new = read_secret(tmp_path / "new")
    both = tmp_path / "site.secret"
    both.write_text(f"{new.hex()}\n{old.hex()}\n")
    os.chmod(both, 0o600)
    v = Settings(site_secret_file=both).verifier()
    for secret in (old, new):
        auth = sign(derive_key(secret, "node/n1"), "node/n1", "node.ipc", b"j1", b"v")
        assert v.signer("node.ipc", b"j1", b"v", auth) == "node/n1"
    assert read_secret(both) == new  # signers derive from the first line
    assert Verifier(new).signer("node.ipc", b"j1", b"v",
                                sign(derive_key(old, "node/n1"), "node/n1", "node.ipc", b"j1", b"v")) == ""


def test_a_broker_command_with_an_unusable_secret_says_so_in_one_line(tmp_path, monkeypatch):
    new_secret(tmp_path / "s")
    os.chmod(tmp_path / "s", 0o644)
    monkeypatch.setenv("NODESHARE_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("NODESHARE_SITE_SECRET_FILE", str(tmp_path / "s"))
    for args in (["worker"], ["sink", "ledger", "--ledger", str(tmp_path / "l.duckdb")]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "readable by others" in r.output and "Traceback" not in r.output, r.output
    monkeypatch.setenv("NODESHARE_SITE_SECRET_FILE", str(tmp_path / "missing"))
    r = CliRunner().invoke(app, ["worker"])
    assert r.exit_code == 2 and "cannot read the site secret" in r.output


def test_a_managers_own_log_is_read_back_without_a_signature_check(tmp_path, monkeypatch):
    """The power and placement managers' logs (power.machine, placement.cluster) are the worker's
    own, not in the catalog: reading one back (faust skipped a message) must not look it up there."""
    import asyncio

    from nodeshare.streams.worker import cursor as cursor_module

    new_secret(tmp_path / "s")
    settings = Settings(bootstrap="127.0.0.1:1", topic_prefix="x.", site_secret_file=tmp_path / "s")
    asked: list[object] = []

    def read_range(settings, topic, partition, start, stop, timeout_s=60.0, verifier=None):
        asked.append((topic, verifier))
        return []

    monkeypatch.setattr(cursor_module, "read_range", read_range)

    async def handle(m):
        pass

    c = cursor_module.Cursor(settings, "power-manager", handle)
    asyncio.run(c._refetch("x.power.machine", 0, 0, 3))
    asyncio.run(c._refetch("x.node.power", 0, 0, 3))
    assert [(t, v is not None) for t, v in asked] == [("x.power.machine", False), ("x.node.power", True)]
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="could not re-read"):  # not a KeyError from the catalog
        cursor_module.read_range(settings, "x.power.machine", 0, 0, 3, timeout_s=0.5, verifier=settings.verifier())


def test_an_agent_on_a_slurm_node_refuses_the_site_secret_even_beside_its_key(tmp_path):
    new_secret(tmp_path / "s")
    write_key(tmp_path / "s", "node/n1", tmp_path / "n1.key")
    with pytest.raises(ValueError, match="never the site secret"):
        check_signing_identity(Settings(site_secret_file=tmp_path / "s", signing_key_file=tmp_path / "n1.key"),
                               "n1", static_jobs=False)
