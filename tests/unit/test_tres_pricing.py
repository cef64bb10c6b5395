"""A TRES-aware standard price (issue 42, item 7): a site that bills GPUs or memory through Slurm's
TRESBillingWeights gets the standard price ``sreport`` counts. Numbers are Slurm's documented
examples (slurm.conf(5), TRESBillingWeights) and worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from factories import POLICY, archive_records, block, job_event, left
from pydantic import ValidationError
from unit.test_charge_adjustments import IPC, LIFE, msgs

from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobState
from nodeshare.sinks.audit import audit
from nodeshare.streams.core.accounting import fold_messages
from nodeshare.streams.core.pricing import billed_units, billing_units, parse_billing_weights, standard_price


def test_weights_read_as_slurm_reads_them():
    w = parse_billing_weights("CPU=1.25, Mem=0.25G,GRES/gpu=2.0")
    assert w == {"cpu": 1.25, "mem": 0.25 / 1024, "gres/gpu": 2.0}
    # slurm.conf(5): a job of 1 CPU and 8 GB under "CPU=1.25,Mem=0.25G" weighs (1 * 1.25) + (8 * 0.25) =
    # 3.25, which Slurm stores as a whole count: it bills 3 (its tres docs: 4.5 bills 4)
    assert billing_units({"cpu": 1, "mem": 8192}, parse_billing_weights("CPU=1.25,Mem=0.25G")) == 3.0
    assert billing_units({"cpu": 3, "mem": 6144}, parse_billing_weights("CPU=1.0,Mem=0.25G")) == 4.0  # 4.5
    # names without case: slurm.conf's "GRES/gpu:A100" is scontrol's "gres/gpu:A100"
    assert billing_units({"gres/gpu:A100": 2.0}, parse_billing_weights("GRES/gpu:A100=8")) == 16.0
    # and a memory weight without a suffix is per MB: "mem=.25" on 8 GB bills 8192 * .25 = 2048
    assert billing_units({"mem": 8192}, parse_billing_weights("mem=.25")) == 2048.0
    assert parse_billing_weights("Mem=1T") == {"mem": 1 / 1024**2}
    for bad, why in (("CPU", "expected NAME=WEIGHT"), ("CPU=x", "is not a number"), ("CPU=-1", ">= 0"),
                     ("GRES/gpu=2G", "for Mem only"), ("CPU=1,cpu=2", "weighted twice")):
        with pytest.raises(ValueError, match=why):
            parse_billing_weights(bad)


def test_what_the_standard_price_multiplies():
    gpu = {"cpu": 8.0, "mem": 32768.0, "gres/gpu": 2.0}
    # the default configuration (standard_units = "cores"): POPPA's C, whatever the event carries
    assert billed_units(8, {**gpu, "billing": 18.0}, "CPU=1", by_tres=False) == (8.0, None)
    assert billed_units(8, {**gpu, "billing": 18.0}, "CPU=1") == (18.0, "slurm")  # Slurm's own count wins
    assert billed_units(8, gpu, "CPU=1.0,Mem=0.25G,GRES/gpu=2.0") == (8 + 8 + 4, "CPU=1.0,Mem=0.25G,GRES/gpu=2.0")
    assert billed_units(8, gpu, None) == (8.0, None)  # no weights for the partition: its cores, as POPPA
    assert billed_units(8, {}, "CPU=2") == (0.0, "CPU=2")  # weights but no TRES: nothing allocated to bill


TRES = POLICY.__class__(**{**POLICY.__dict__, "standard_units": "tres"})


def run_on(partition: str | None, tres: dict[str, float], job: str = "g1") -> tuple[list, list]:
    ipc = [block(1.0, 2.0, 1.0, job=job, cycle=0), block(0.8, 1.0, 0.82, job=job, cycle=1), left(job, "n1", 2, 1)]
    end = job_event(job, JobState.ENDED, cores=8).model_copy(update={"partition": partition, "tres": tres})
    return ipc, [job_event(job, JobState.STARTED, cores=8), end]


def test_a_gpu_jobs_standard_price_is_its_billable_tres_and_the_audit_recomputes_it(tmp_path: Path):
    weights = "CPU=1.0,Mem=0.25G,GRES/gpu=2.0"
    policy = POLICY.__class__(**{**POLICY.__dict__, "standard_units": "tres", "billing_weights": (("gpu", weights),)})
    ipc, life = run_on("gpu", {"cpu": 8.0, "mem": 32768.0, "gres/gpu": 2.0})
    [weighted] = fold_messages(msgs(ipc, IPC) + msgs(life, LIFE), policy)
    [plain] = fold_messages(msgs(ipc, IPC) + msgs(life, LIFE), POLICY)  # the default: cores
    assert (weighted.partition, weighted.billing_units, weighted.billing_weights) == ("gpu", 20.0, weights)
    assert plain.billing_units is None and plain.billing_weights is None
    # one hour at L = 1.5: SOP = 1.5 * 20 units, against 1.5 * 8 cores; the discount scales with it
    assert math.isclose(weighted.standard_price, standard_price(1.5, 20, 3600)) and weighted.standard_price == 30.0
    assert math.isclose(weighted.price / weighted.standard_price, plain.price / plain.standard_price)
    other_ipc, other_life = run_on("cpu", {"cpu": 8.0, "billing": 12.0}, job="s1")  # Slurm's own count
    both = fold_messages(msgs([*ipc, *other_ipc], IPC) + msgs([*life, *other_life], LIFE), policy)
    assert both[0] == weighted
    slurm = both[1]
    assert (slurm.billing_units, slurm.billing_weights, slurm.standard_price) == (12.0, "slurm", 18.0)
    # the audit reprices each row by the rule it records, whatever today's configuration says
    archive, _, _ = archive_records(tmp_path, [*ipc, *life, *other_ipc, *other_life])
    from nodeshare.schemas import encode
    from nodeshare.sinks.ledger import Ledger

    ledger = tmp_path / "weighted.duckdb"
    with Ledger(ledger) as led:
        led.append([(c, encode(c), 0, i) for i, c in enumerate((weighted, slurm))])
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == 2, report.as_dict()


def test_the_configuration_refuses_weights_slurm_would_not_read():
    policy = Settings(standard_units="tres", billing_weights={"gpu": "CPU=1,GRES/gpu=4"}).policy()
    assert (policy.standard_units, policy.billing_weights) == ("tres", (("gpu", "CPU=1,GRES/gpu=4"),))
    assert Settings().policy().standard_units == "cores"  # switched on by the site, never by an upgrade
    with pytest.raises(ValidationError, match="partition gpu: TRESBillingWeights part 'GPU=x'"):
        Settings(billing_weights={"gpu": "GPU=x"})


def test_a_lifecycle_event_carries_tres_by_slurms_names():
    event = job_event("g1", JobState.ENDED)
    # validated as a producer's record is (model_copy would check nothing)
    assert type(event).model_validate({**event.model_dump(), "tres": {"gres/gpu:a100": 2.0}}).tres == {
        "gres/gpu:a100": 2.0}
    with pytest.raises(ValidationError):
        type(event).model_validate({**event.model_dump(), "tres": {"GPU count": 2.0}})
    with pytest.raises(ValidationError):
        type(event).model_validate({**event.model_dump(), "tres": {"cpu": -1.0}})


def test_the_slurm_source_reads_the_allocation_as_scontrol_writes_it():
    from datetime import UTC, datetime

    from nodeshare.producers.slurm import HookEvent, event_from_hook
    from nodeshare.streams.core.pricing import parse_tres

    assert parse_tres("cpu=4,mem=8G,node=1,billing=6,gres/gpu=1,gres/gpu:a100=1") == {
        "cpu": 4.0, "mem": 8192.0, "node": 1.0, "billing": 6.0, "gres/gpu": 1.0, "gres/gpu:a100": 1.0}
    assert parse_tres("cpu=1,mem=500M,energy=n/a,Weird=2") == {"cpu": 1.0, "mem": 500.0}  # what it cannot read: out
    env = {"JOBID": "7", "JOBSTATE": "COMPLETED", "USERNAME": "u", "ACCOUNT": "a", "JOBNAME": "lmp", "PROCS": "4",
           "NODES": "n1", "PARTITION": "gpu", "START": "1764230400", "END": "1764234000", "CLUSTER": "c"}
    asked: list[str] = []
    event = event_from_hook(HookEvent("jobcomp", datetime(2025, 11, 27, tzinfo=UTC), env), lambda e: (e,),
                            tres=lambda job: asked.append(job) or {"cpu": 4.0, "billing": 10.0})
    assert event is not None and asked == ["7"]
    assert (event.partition, event.tres) == ("gpu", {"cpu": 4.0, "billing": 10.0})
    bare = event_from_hook(HookEvent("jobcomp", datetime(2025, 11, 27, tzinfo=UTC), env), lambda e: (e,))
    assert bare is not None and bare.tres == {}  # no controller to ask: priced by its cores


def test_a_terminal_event_sent_again_without_its_tres_is_a_copy_not_a_correction():
    """The Slurm source re-reads a hook file it had sent (it died before deleting it) after the
    controller forgot the job: the copy has no TRES. It changes nothing: no revision priced by cores."""
    ipc, life = run_on(None, {"cpu": 8.0, "billing": 12.0})
    copy = life[1].model_copy(update={"tres": {}})
    charges = fold_messages(msgs(ipc, IPC) + msgs([*life, copy], LIFE), TRES)
    assert [(c.revision, c.billing_units) for c in charges] == [(0, 12.0)]


def test_charges_lists_the_partition_and_the_billed_units(tmp_path: Path):
    from nodeshare.schemas import encode
    from nodeshare.sinks.analysis.usage import charges as query
    from nodeshare.sinks.ledger import Ledger

    ipc, life = run_on("gpu", {"cpu": 8.0, "billing": 20.0})
    [charge] = fold_messages(msgs(ipc, IPC) + msgs(life, LIFE), TRES)
    with Ledger(tmp_path / "l.duckdb") as led:
        led.append([(charge, encode(charge), 0, 0)])
    _, rows = query(tmp_path / "l.duckdb", fmt="JobID,NCPUS,Partition,BillingUnits,SOP")
    assert rows == [("g1", 8, "gpu", 20.0, 30.0)]


def test_a_saved_state_without_an_allocation_or_adjustment_reads_as_before_schema_8():
    """A worker rolled back across schema 8 reads the accounts this build saves (snapshots, settled
    accounts) of every job whose events carry no TRES and that no operator adjusted: none of schema
    8's fields is written when it says nothing (an older build refuses fields it does not know)."""
    from nodeshare.streams.core.accounting import apply_message

    ipc, life = run_on(None, {})
    account = None
    for origin, key, value, ts in msgs(ipc, IPC) + msgs(life, LIFE):
        account = apply_message(account, origin, key, value, ts, POLICY)[0] or account
    assert account is not None and account.revision == 0
    import json

    saved = account.dumps()
    doc = json.loads(saved)
    assert "adjustment" not in doc and "adjustment" not in doc["ends"][0]
    assert not {"tres", "partition"} & set(doc["ends"][0]["event"])
    assert type(account).loads(saved, "g1") == account
    ipc, life = run_on("gpu", {"cpu": 8.0})
    assert b'"tres":{"cpu":8.0}' in msgs(life, LIFE)[1][2]  # an allocation is written when there is one


def test_a_terminal_event_without_tres_is_priced_with_the_allocation_its_start_stated(tmp_path: Path):
    """The Slurm source asked after the controller forgot the job (MinJobAge): its end carries no
    TRES, but its start did. The same price as with them, in the worker and the audit."""
    ipc, life = run_on("gpu", {"cpu": 8.0, "billing": 24.0})
    started = life[0].model_copy(update={"partition": "gpu", "tres": {"cpu": 8.0, "billing": 24.0}})
    bare = life[1].model_copy(update={"partition": None, "tres": {}})
    [told] = fold_messages(msgs(ipc, IPC) + msgs(life, LIFE), TRES)
    [recalled] = fold_messages(msgs(ipc, IPC) + msgs([started, bare], LIFE), TRES)
    assert (recalled.billing_units, recalled.partition, recalled.standard_price) == (24.0, "gpu", told.standard_price)
    from nodeshare.schemas import encode
    from nodeshare.sinks.ledger import Ledger

    archive, _, _ = archive_records(tmp_path, [*ipc, started, bare])
    ledger = tmp_path / "tres.duckdb"
    with Ledger(ledger) as led:
        led.append([(recalled, encode(recalled), 0, 0)])
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == 1 and report.fast_path_jobs == 0, report.as_dict()


def test_a_controller_that_does_not_answer_leaves_the_hook_file_for_the_next_poll(tmp_path: Path, monkeypatch):
    """Publishing the event without its TRES would bill the job by its cores for good: the file waits.
    A job the controller no longer knows (MinJobAge) is published without TRES (the worker then takes
    its started event's)."""
    from nodeshare.producers.slurm import ControllerAway, SlurmCommands, SlurmSource

    commands = SlurmCommands()
    answers = {"5": RuntimeError("scontrol show job -o 5 did not answer within 30 s (Socket timed out)"),
               "6": RuntimeError("scontrol show job -o 6 failed (1): slurm_load_jobs error: Invalid job id specified"),
               "7": "JobId=7 JobName=x Partition=gpu TRES=cpu=8,mem=32G,node=1,billing=20,gres/gpu=2 Socks/Node=*"}

    def run(*args: str) -> str:
        answer = answers[args[-1]]
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(commands, "_run", run)
    with pytest.raises(ControllerAway, match="job 5: no TRES from the controller"):
        commands.job_tres("5")
    assert commands.job_tres("6") == {}
    assert commands.job_tres("7") == {"cpu": 8.0, "mem": 32768.0, "node": 1.0, "billing": 20.0, "gres/gpu": 2.0}

    events = tmp_path / "events"
    events.mkdir()
    env = {"JOBID": "5", "JOBSTATE": "COMPLETED", "USERNAME": "u", "ACCOUNT": "a", "JOBNAME": "x", "PROCS": "8",
           "NODES": "n1", "PARTITION": "gpu", "START": "1764230400", "END": "1764234000"}
    (events / "1764234000000000000-jobcomp-1").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()))

    class Away:
        def hostnames(self, expr: str) -> tuple[str, ...]:
            return (expr,)

        def job_tres(self, job_id: str) -> dict[str, float]:
            raise ControllerAway(f"job {job_id}: no TRES from the controller: Socket timed out")

        def queue(self) -> list[dict[str, str]]:
            return []

    published, files = SlurmSource(events, Away()).step()  # type: ignore[arg-type]
    assert published == [] and files == [] and (events / "1764234000000000000-jobcomp-1").exists()
    assert not (events / "bad").exists()


def test_charges_export_writes_what_slurm_and_an_allocation_bank_take(tmp_path: Path):
    from typer.testing import CliRunner

    from nodeshare.cli import app
    from nodeshare.producers.slurm import annotate_command
    from nodeshare.schemas import encode
    from nodeshare.sinks.analysis.usage import slurm_comment
    from nodeshare.sinks.ledger import Ledger

    ipc, life = run_on("gpu", {"cpu": 8.0, "billing": 20.0})
    [charge] = fold_messages(msgs(ipc, IPC) + msgs(life, LIFE), TRES)
    assert slurm_comment(charge) == (f"nodeshare:rev=0 charged={charge.price:.4f} sop=30.0000 "
                                     f"dividend={charge.dividend:.4f} degradation={charge.degradation:.4f} "
                                     "status=ok billing_units=20")
    # the one field of a finished job's accounting record sacctmgr may set (sacctmgr(1))
    assert annotate_command("g1", "x=1")[:6] == ("sacctmgr", "-i", "modify", "job", "where", "JobID=g1")
    ledger = tmp_path / "l.duckdb"
    with Ledger(ledger) as led:
        led.append([(charge, encode(charge), 0, 0)])
    runner = CliRunner()
    csv_out = runner.invoke(app, ["charges", "export", "--to", "csv", "--ledger", str(ledger)])
    assert csv_out.exit_code == 0
    header, row = csv_out.output.splitlines()
    assert header.startswith("job_id,revision,user,account,partition") and row.startswith("g1,0,alice,physics,gpu,")
    printed = runner.invoke(app, ["charges", "export", "--print", "--ledger", str(ledger)])
    assert printed.exit_code == 0 and printed.output.startswith(
        "sacctmgr -i modify job where JobID=g1 set 'AdminComment=nodeshare:rev=0 ")
    none = runner.invoke(app, ["charges", "export", "--to", "csv", "--ledger", str(ledger), "-S", "2030-01-01"])
    assert none.output.splitlines()[1:] == []  # nothing ended in the window
