"""An operator's adjustment of a charge (issue 42, item 5): ``ChargeAdjustment`` on jobs.lifecycle,
priced by the reducer as a new revision from the same evidence, so the archive, the ledger's chain
and the audit all see it. Prices are worked out by hand from the charge the job gets unadjusted."""

from __future__ import annotations

import itertools
import math
from datetime import timedelta
from pathlib import Path

import pytest
from factories import POLICY, T0, archive_records, block, job_event, left
from pydantic import ValidationError

from nodeshare.schemas import AdjustmentAction, ChargeAdjustment, JobState, Record, decode, encode
from nodeshare.schemas.catalog import DLQ, JOBS_LIFECYCLE
from nodeshare.schemas.signing import identity_problem
from nodeshare.sinks.audit import audit, conservation_violations
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import JobAccount, Origin, apply_message, fold_messages, process_message
from nodeshare.streams.core.pricing import adjusted_price

IPC, LIFE = "node.ipc", "jobs.lifecycle"


def adjustment(job: str, action: str, price: float | None = None, reason: str = "node fault, refunded",
               n: int = 0) -> ChargeAdjustment:
    return ChargeAdjustment(event_id=f"adj-{job}-{n}", source="operator/alice",
                            event_time=T0 + timedelta(seconds=7200 + n), job_id=job, action=AdjustmentAction(action),
                            price=price,
                            reason=reason, operator="alice")


def run(job: str = "j1") -> tuple[list[Record], list[Record]]:
    """One job on n1, two blocks with a slowdown, ended after an hour on 16 cores."""
    ipc = [block(1.0, 2.0, 1.0, job=job, cycle=0), block(0.8, 1.0, 0.82, job=job, cycle=1), left(job, "n1", 2, 1)]
    life = [job_event(job, JobState.STARTED), job_event(job, JobState.ENDED)]
    return ipc, life


def msgs(records: list[Record], topic: str, start: int = 0) -> list[tuple]:
    return [(Origin(topic, 0, start + i), r.job_id.encode(), encode(r), 0.0) for i, r in enumerate(records)]


def test_the_price_an_adjustment_sets():
    assert adjusted_price(None, None, 24.0, 20.0) == 20.0
    assert adjusted_price("void", None, 24.0, 20.0) == 0.0
    assert adjusted_price("adjust", 5.0, 24.0, 20.0) == 5.0
    assert adjusted_price("adjust", 30.0, 24.0, 20.0) == 24.0  # never above the standard price
    with pytest.raises(ValueError, match="price >= 0"):
        adjusted_price("adjust", None, 24.0, 20.0)
    with pytest.raises(ValueError, match="unknown adjustment"):
        adjusted_price("refund", None, 24.0, 20.0)


def test_an_adjustment_says_what_it_sets_and_why():
    with pytest.raises(ValidationError, match="required to adjust"):
        adjustment("j1", "adjust")
    with pytest.raises(ValidationError, match="a void carries no price"):
        adjustment("j1", "void", 3.0)
    with pytest.raises(ValidationError, match="says nothing"):
        adjustment("j1", "void", reason="   ")
    with pytest.raises(ValidationError):
        adjustment("j1", "adjust", -1.0)
    record = adjustment("j1", "adjust", 2.5)
    assert decode(JOBS_LIFECYCLE, encode(record)) == record
    # an operator's word, signed by the operator it names: neither a node nor another service, nor
    # another operator, may re-price a job
    assert identity_problem(record, "service/operator-alice") is None
    for signer in ("node/n1", "service/slurm", "service/operator-bob"):
        assert "must be signed by service/operator-alice" in (identity_problem(record, signer) or ""), signer
    assert adjustment("j1", "adjust", -0.0).price == 0.0 and str(adjustment("j1", "adjust", -0.0).price) == "0.0"


def test_void_adjust_and_restore_of_a_charged_job_are_revisions_priced_from_the_same_evidence():
    ipc, life = run()
    changes = [adjustment("j1", "void", n=1), adjustment("j1", "adjust", 4.0, "agreed with the user", n=2),
               adjustment("j1", "restore", reason="refund reversed", n=3)]
    charges = fold_messages(msgs(ipc, IPC) + msgs([*life, *changes], LIFE), POLICY)
    assert [c.revision for c in charges] == [0, 1, 2, 3]
    plain, void, adjusted, restored = charges
    assert plain.adjustment is None and plain.adjustment_credit == 0.0 and 0 < plain.price < plain.standard_price
    assert void.price == 0.0 and void.adjustment_credit == plain.price
    assert void.adjustment is not None
    assert (void.adjustment.action, void.adjustment.at) == ("void", "jobs.lifecycle:0:2")
    assert void.revision_reason == "voided by alice at jobs.lifecycle:0:2: node fault, refunded"
    assert adjusted.price == 4.0 and math.isclose(adjusted.adjustment_credit, plain.price - 4.0)
    assert adjusted.revision_reason == "adjusted to 4.0 SU by alice at jobs.lifecycle:0:3: agreed with the user"
    assert restored.model_dump(exclude={"revision", "revision_reason", "event_id"}) == plain.model_dump(
        exclude={"revision", "revision_reason", "event_id"})
    assert restored.revision_reason.startswith("adjustment withdrawn by alice")
    # the measurement is untouched: the dividend stays the co-location discount it earned
    for c in charges:
        assert (c.degradation, c.dividend, c.standard_price) == (plain.degradation, plain.dividend,
                                                                  plain.standard_price)
        assert math.isclose(c.standard_price, c.price + c.dividend + c.adjustment_credit)
    assert conservation_violations(charges) == []


def test_an_adjustment_never_raises_a_price_above_the_standard_price():
    ipc, life = run()
    [_, raised] = fold_messages(msgs(ipc, IPC) + msgs([*life, adjustment("j1", "adjust", 1e6)], LIFE), POLICY)
    assert raised.price == raised.standard_price and raised.adjustment_credit < 0
    assert raised.adjustment is not None and raised.adjustment.requested_price == 1e6
    assert conservation_violations([raised]) == []


def test_an_adjustment_before_the_end_prices_the_first_charge_and_holds_for_a_correction():
    ipc, life = run()
    fix = job_event("j1", JobState.ENDED, cores=32).model_copy(update={"event_id": "fix"})
    charges = fold_messages(msgs(ipc, IPC) + msgs([life[0], adjustment("j1", "void"), life[1], fix], LIFE), POLICY)
    assert [(c.revision, c.cores, c.price) for c in charges] == [(0, 16, 0.0), (1, 32, 0.0)]
    assert charges[0].revision_reason == ""  # the first charge, voided from the start
    assert all(c.adjustment is not None and c.adjustment.action == "void" for c in charges)


def test_the_same_revisions_in_every_interleaving_of_the_two_topics():
    """The adjustment's place among the job's lifecycle events is fixed; the node's marker may come
    before or after it: revision 0 unadjusted, revision 1 voided, whatever the order."""
    ipc, life = run()
    a, b = msgs(ipc, IPC), msgs([*life, adjustment("j1", "void")], LIFE)
    reference = fold_messages(a + b, POLICY)
    assert [c.price == 0.0 for c in reference] == [False, True]
    for order in set(itertools.permutations([0] * len(a) + [1] * len(b))):
        ia, ib = iter(a), iter(b)
        assert fold_messages([next(ia) if w == 0 else next(ib) for w in order], POLICY) == reference, order


def test_an_adjustment_that_changes_nothing_is_a_dead_letter_and_no_revision():
    ipc, life = run()
    again = [adjustment("j1", "void", n=1), adjustment("j1", "void", reason="same refund, said twice", n=2),
             adjustment("j1", "restore", reason="undo", n=3), adjustment("j1", "restore", reason="undo", n=4)]
    account, out = None, []
    for origin, key, value, ts in msgs(ipc, IPC) + msgs([*life, *again], LIFE):
        account, produced, _ = apply_message(account, origin, key, value, ts, POLICY)
        out += produced
    dead = [decode(DLQ, o.value) for o in out if o.topic == DLQ.name]
    assert [d.reason for d in dead] == ["void changes nothing: the job's charge is already voided",
                                        "restore changes nothing: no adjustment is in force"]
    assert sum(o.topic == "ledger.charges" for o in out) == 3  # revision 0, the void, the restore


def test_an_adjustment_survives_the_serialized_state_and_a_redelivery_sends_its_charge_again():
    ipc, life = run()
    state = None
    for origin, key, value, ts in msgs(ipc, IPC) + msgs([*life, adjustment("j1", "adjust", 1.25)], LIFE):
        state = process_message(state, origin, key, value, ts, POLICY).state or state
    account = JobAccount.model_validate_json(state)
    assert account.revision == 1 and account.adjustment is not None and account.adjustment.requested_price == 1.25
    again = process_message(state, Origin(LIFE, 0, 2), b"j1", encode(adjustment("j1", "adjust", 1.25)), 0.0, POLICY)
    assert again.state is None  # a redelivered offset changes nothing ...
    [charge] = [decode_charge(o.value) for o in again.out]  # ... but sends the charge it completed again
    assert (charge.revision, charge.price) == (1, 1.25)


def decode_charge(raw: bytes):
    from nodeshare.schemas import Charge, decode_model

    return decode_model(Charge, raw)


def test_the_audit_recomputes_adjusted_charges_and_finds_an_edited_price(tmp_path: Path):
    ipc, life = run()
    other_ipc, other_life = run("j2")
    archive, ledger, n = archive_records(tmp_path, [*ipc, *other_ipc, *life, *other_life,
                                                    adjustment("j1", "adjust", 2.0)])
    assert n == 3
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == 3, report.as_dict()
    assert report.fast_path_jobs == 1  # j2; j1's adjustment is the reference fold's to number

    import duckdb

    with duckdb.connect(str(ledger)) as con:  # an edited row (chain and columns aside): the audit says so
        row = con.execute("SELECT record FROM charges WHERE job_id = 'j1' AND revision = 1").fetchone()[0]
        con.execute("UPDATE charges SET record = ? WHERE job_id = 'j1' AND revision = 1",
                    [row.replace('"requested_price":2.0', '"requested_price":0.5')])
    report = audit(archive, ledger, POLICY)
    assert ("j1", 1, "adjustment") in {(m.job_id, m.revision, m.field) for m in report.mismatches}


def test_the_cli_refuses_what_the_worker_would_and_says_so_in_one_line(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from nodeshare.cli import app
    from nodeshare.producers import kafka_producer

    ipc, life = run()
    _, ledger, _ = archive_records(tmp_path, [*ipc, *life])
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(app, ["charges", *args, "--bootstrap", "127.0.0.1:1"])

    missing = cli("void", "j1", "--reason", "x", "--ledger", str(tmp_path / "none.duckdb"))
    assert missing.exit_code == 2 and "no ledger at" in missing.output and "--not-charged-yet" in missing.output
    typo = cli("void", "j9", "--reason", "x", "--ledger", str(ledger))
    assert typo.exit_code == 2 and "job j9 has no charge in" in typo.output
    blank = cli("void", "j1", "--reason", " ", "--ledger", str(ledger))
    assert blank.exit_code == 2 and "reason: says nothing" in blank.output
    negative = cli("adjust", "j1", "--price", "-1", "--reason", "x", "--ledger", str(ledger))
    assert negative.exit_code == 2

    class Unreachable(kafka_producer.EventProducer):
        def flush(self, timeout: float = 30.0) -> None:
            raise kafka_producer.DeliveryError("1 records still undelivered after 30 s")

    monkeypatch.setattr(kafka_producer, "EventProducer", Unreachable)
    down = cli("void", "j1", "--reason", "faulty node", "--ledger", str(ledger))
    assert down.exit_code == 1
    assert "charges void: the broker at 127.0.0.1:1 did not take the records: 1 records still undelivered" in (
        " ".join(down.output.split()))


def test_an_adjustment_is_of_a_run_and_a_requeued_jobs_next_run_starts_unadjusted():
    """Run 1 voided; the job is requeued under its id and runs again (after run 1 ended): run 2 is
    charged at its computed price, and a correction of run 1 keeps run 1's void."""
    ipc, life = run()
    again = [block(0.9, 1.5, 0.9, job="j1", cycle=9000), left("j1", "n1", 1, 9000, at_s=12000)]
    run2 = job_event("j1", JobState.ENDED, run_s=3600).model_copy(update={
        "event_id": "run2", "start_time": T0 + timedelta(seconds=9000), "end_time": T0 + timedelta(seconds=12600),
        "event_time": T0 + timedelta(seconds=12600)})
    charges = fold_messages(msgs([*ipc, *again], IPC) + msgs([*life, adjustment("j1", "void"), run2], LIFE), POLICY)
    assert [(c.revision, c.start_time, c.price == 0.0) for c in charges] == [
        (0, T0, False), (1, T0, True), (2, T0 + timedelta(seconds=9000), False)]
    assert charges[2].adjustment is None and charges[2].adjustment_credit == 0.0


def test_a_correction_keeps_the_adjustment_and_says_so():
    ipc, life = run()
    fix = job_event("j1", JobState.ENDED, cores=64).model_copy(update={"event_id": "fix"})
    *_, fixed = fold_messages(msgs(ipc, IPC) + msgs([*life, adjustment("j1", "adjust", 4.0), fix], LIFE), POLICY)
    assert (fixed.cores, fixed.price) == (64, 4.0)
    assert fixed.revision_reason.endswith("; the adjust by alice at jobs.lifecycle:0:2 still applies")


def test_a_copy_of_an_adjustment_sent_again_is_refused_and_undoes_no_restore():
    ipc, life = run()
    void = adjustment("j1", "void", n=1)
    sent = [void, adjustment("j1", "restore", reason="undo", n=2), void]
    account, out = None, []
    for origin, key, value, ts in msgs(ipc, IPC) + msgs([*life, *sent], LIFE):
        account, produced, _ = apply_message(account, origin, key, value, ts, POLICY)
        out += produced
    dead = [decode(DLQ, o.value).reason for o in out if o.topic == DLQ.name]
    assert dead == ["void adj-j1-1 was taken before (a copy, sent again)"]
    assert account is not None and account.adjustment is None  # the restore stands


def test_the_audit_numbers_late_data_and_a_later_void_as_the_worker_did(tmp_path: Path):
    """The case docs/charges.md gives: a node lost, charged node_lost; the node comes back and sends
    its late data; days later an operator voids the job. The worker read them in that order, and so
    do the audit and a rebuild (``as_read_live``): before, they read jobs.lifecycle first and found
    the void ahead of the late data, a mismatch on an honest ledger."""
    from unit.test_node_lost import lost_node_job

    ipc, life = lost_node_job(late=True)
    void = adjustment("j1", "void").model_copy(update={"event_time": T0 + timedelta(days=3)})
    ordered = [*ipc[:6], *life, *ipc[6:], void]  # as they were sent, in time
    archive, ledger, n = archive_records(tmp_path, ordered)
    assert n == 3
    with Ledger(ledger, read_only=True) as led:
        rows = sorted(led.charges(), key=lambda c: c.revision)
    assert [r.revision_reason.split(":")[0] for r in rows] == ["", "late data", "voided by alice at jobs.lifecycle"]
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == 3, report.as_dict()


def test_a_lifecycle_record_without_a_kind_is_still_a_job_event():
    """Before schema 8 every jobs.lifecycle record was a JobEvent and ``kind`` had a default (the
    published schema never required it): such a record from an outside producer still reads."""
    import json

    event = job_event("j1", JobState.ENDED)
    doc = json.loads(encode(event))
    del doc["kind"]
    assert decode(JOBS_LIFECYCLE, json.dumps(doc).encode()) == event


def test_the_cli_takes_the_groups_ledger_and_the_operator_from_its_key(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from nodeshare.cli import app, charges
    from nodeshare.runtime.identity import new_secret, write_key

    ipc, life = run()
    _, ledger, _ = archive_records(tmp_path, [*ipc, *life])
    runner = CliRunner()
    sent: list = []
    monkeypatch.setattr(charges, "publish", lambda settings, records, what: sent.extend(records) or [(3, 41)])

    def cli(*args: str, env: dict | None = None):
        return runner.invoke(app, ["charges", *args], env={"NODESHARE_BOOTSTRAP": "127.0.0.1:1", **(env or {})})

    group = cli("--ledger", str(ledger), "void", "j9", "--reason", "x")  # the group's --ledger is the one checked
    assert group.exit_code == 2 and f"job j9 has no charge in {ledger}" in group.output
    charged = cli("void", "j1", "--reason", "x", "--not-charged-yet", "--ledger", str(ledger))
    assert charged.exit_code == 2 and "is charged already (revision 0" in charged.output
    pending = cli("restore", "j9", "--reason", "sent by mistake", "--not-charged-yet", "--ledger", str(ledger))
    assert pending.exit_code == 0 and "jobs.lifecycle:3:41" in pending.output
    assert "sent unsigned" in pending.output  # no key: a verifying worker would refuse it, and it says so
    new_secret(tmp_path / "site.secret", False)
    write_key(tmp_path / "site.secret", "service/operator-carol", tmp_path / "carol.key", False)
    write_key(tmp_path / "site.secret", "service/slurm", tmp_path / "slurm.key", False)
    signed = cli("void", "j1", "--reason", "faulty node", "--ledger", str(ledger),
                 env={"NODESHARE_SIGNING_KEY_FILE": str(tmp_path / "carol.key")})
    assert signed.exit_code == 0, signed.output
    assert [(r.action.value, r.operator) for r in sent] == [("restore", sent[0].operator), ("void", "carol")]
    borrowed = cli("void", "j1", "--reason", "x", "--ledger", str(ledger),
                   env={"NODESHARE_SIGNING_KEY_FILE": str(tmp_path / "slurm.key")})
    assert borrowed.exit_code == 2 and "signed by an operator's key (service/operator-<name>" in " ".join(
        borrowed.output.split())
