"""``nodeshare charges``: the ledger's charges like sacct, the ended jobs still without one, and an
operator's corrections (adjust, void, restore), each a ``ChargeAdjustment`` on jobs.lifecycle that
the worker prices as a new revision, so the archive, the ledger's chain and the audit all see it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .common import Bootstrap, app, check_signing, err, load_settings, out, progress_bar, publish, require_bootstrap
from .ledger import print_machine_readable, split_values

charges_app = typer.Typer(help="Charged jobs (like sacct), and an operator's corrections of a charge.")
app.add_typer(charges_app, name="charges")


@charges_app.callback(invoke_without_command=True)
def charges(
    ctx: typer.Context,
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    user: Annotated[list[str] | None, typer.Option("--user", "-u", help="user(s), comma-separated")] = None,
    account: Annotated[list[str] | None, typer.Option("--account", "-A", help="account(s), comma-separated")] = None,
    starttime: Annotated[str | None, typer.Option("--starttime", "-S", help="YYYY-MM-DD[THH:MM[:SS]] (UTC)")] = None,
    endtime: Annotated[str | None, typer.Option("--endtime", "-E", help="YYYY-MM-DD[THH:MM[:SS]] (UTC)")] = None,
    fmt: Annotated[str, typer.Option("--format", "-o", help="comma-separated columns")] = "",
    parsable: Annotated[bool, typer.Option("--parsable2", "-P", help="'|'-separated, no trailing delimiter")] = False,
    noheader: Annotated[bool, typer.Option("--noheader", "-n", help="no header line")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON list of objects")] = False,
    all_revisions: Annotated[bool, typer.Option(help="include superseded revisions")] = False,
    incomplete: Annotated[bool, typer.Option(
        help="only charges priced without a lost node's marker (estimate status node_lost)")] = False,
    jobs: Annotated[list[str] | None, typer.Option(
        "--jobs", "-j", help="job id(s), comma-separated: every revision of each (as --all-revisions), "
        "with RevisionReason")] = None,
    pending: Annotated[bool, typer.Option(
        "--pending", help="instead: ended jobs (a terminal event in the archive) without a charge in the ledger, "
        "and the nodes holding each back; reads --archive and --ledger, not the broker")] = False,
    archive: Annotated[str | None, typer.Option(help="archive root (for --pending)")] = None,
) -> None:
    """Charged jobs, like sacct: jobs that ran at any moment between --starttime and --endtime; or
    an operator's correction of one job's charge (adjust, void, restore)."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"ledger": ledger}  # `charges --ledger L void J` checks J against L
        return
    from nodeshare.sinks.analysis.usage import CHARGE_COLUMNS, DEFAULT_FORMAT, QueryError, parse_time, render_value
    from nodeshare.sinks.analysis.usage import charges as query

    if pending:
        pending_charges(ledger, archive, as_json)
        return
    job_ids = split_values(jobs)
    if job_ids and not fmt:  # a job's history: which revision, and why it superseded the one before
        fmt = DEFAULT_FORMAT.replace("JobID,", "JobID,Revision,", 1) + ",CodeVersion,RevisionReason"
    try:
        header, rows = query(
            ledger, users=split_values(user), accounts=split_values(account),
            start=parse_time(starttime) if starttime else None, end=parse_time(endtime) if endtime else None,
            fmt=fmt or DEFAULT_FORMAT, all_revisions=all_revisions or bool(job_ids), jobs=job_ids,
            incomplete=incomplete)
    except (QueryError, FileNotFoundError) as exc:
        err.print(f"[red]charges[/red]: {exc}  (columns: {', '.join(CHARGE_COLUMNS)})")
        raise typer.Exit(2) from None
    if not print_machine_readable(header, rows, as_json, parsable, noheader):
        table = Table(show_header=not noheader, box=None)
        for c in header:
            table.add_column(c, justify="left" if c in ("JobID", "User", "Account", "Program", "State") else "right")
        for r in rows:
            table.add_row(*(render_value(c, v) for c, v in zip(header, r, strict=True)))
        out.print(table)


def pending_charges(ledger: Path, archive: str | None, as_json: bool) -> None:
    """``charges --pending``: the archive's ended jobs the ledger has no charge of, and why."""
    from nodeshare.sinks.archive import ParquetArchive
    from nodeshare.sinks.ledger import Ledger
    from nodeshare.sinks.pending import pending_jobs

    if archive is None:
        err.print("[red]charges --pending[/red]: give --archive (ended jobs are read from its jobs.lifecycle)")
        raise typer.Exit(2)
    if not ledger.exists():
        err.print(f"[red]charges --pending[/red]: no ledger at {ledger}")
        raise typer.Exit(2)
    charged: dict[str, int] = {}
    with Ledger(ledger, read_only=True) as led:
        for c in led.charges():
            charged[c.job_id] = max(c.revision, charged.get(c.job_id, -1))
    root = archive if "://" in archive else Path(archive).resolve()
    settings = load_settings()
    check_signing(settings)
    rows = pending_jobs(ParquetArchive(root), charged, settings.policy(), verifier=settings.verifier())
    if as_json:
        print(json.dumps([p.as_dict() for p in rows], indent=2))
        return
    for p in rows:
        out.print(f"{p.job_id}  {p.state}  ended {p.end_time:%Y-%m-%dT%H:%M:%S}  {p.reason}")
    out.print(f"{len(rows)} ended jobs without a charge")


LedgerOption = Annotated[Path | None, typer.Option(
    help="DuckDB ledger (or a snapshot of it) to check the job's current charge against (default: the group's "
    "--ledger, ledger.duckdb)")]
Reason = Annotated[str, typer.Option(help="why (kept in the charge and its revision reason; required)")]
JobArg = Annotated[str, typer.Argument(help="job id")]
NotChargedYet = Annotated[bool, typer.Option(
    "--not-charged-yet", help="the job has no charge in the ledger yet: the worker prices its first charge "
    "with the adjustment when it comes")]


@charges_app.command("void")
def charges_void(
    ctx: typer.Context,
    job: JobArg,
    reason: Reason,
    ledger: LedgerOption = None,
    not_charged_yet: NotChargedYet = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Charge JOB nothing from now on: a new revision, the measurement kept, price 0."""
    adjust_charge(job, "void", None, reason, ledger_of(ctx, ledger), not_charged_yet, bootstrap)


@charges_app.command("adjust")
def charges_adjust(
    ctx: typer.Context,
    job: JobArg,
    price: Annotated[float, typer.Option(min=0.0, help="what the job is charged, in service units (at most its "
                                                       "standard price: a higher one is capped)")],
    reason: Reason,
    ledger: LedgerOption = None,
    not_charged_yet: NotChargedYet = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Charge JOB --price from now on: a new revision, the measurement kept."""
    adjust_charge(job, "adjust", price, reason, ledger_of(ctx, ledger), not_charged_yet, bootstrap)


@charges_app.command("restore")
def charges_restore(
    ctx: typer.Context,
    job: JobArg,
    reason: Reason,
    ledger: LedgerOption = None,
    not_charged_yet: NotChargedYet = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Withdraw JOB's adjustment: a new revision at the computed price."""
    adjust_charge(job, "restore", None, reason, ledger_of(ctx, ledger), not_charged_yet, bootstrap)


def ledger_of(ctx: typer.Context, ledger: Path | None) -> Path:
    """The subcommand's --ledger, else the group's (``charges --ledger L void J``)."""
    if ledger is not None:
        return ledger
    return Path((ctx.obj or {}).get("ledger") or "ledger.duckdb")


def adjust_charge(job: str, action: str, price: float | None, reason: str, ledger: Path, not_charged_yet: bool,
                  bootstrap: str | None) -> None:
    """Check the request against the job's current charge, publish it, say where it is in the log."""
    import getpass
    import uuid
    from datetime import UTC, datetime

    from pydantic import ValidationError

    from nodeshare.runtime.identity import read_key
    from nodeshare.schemas import AdjustmentAction, ChargeAdjustment
    from nodeshare.schemas.signing import OPERATOR

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    operator = getpass.getuser()
    if settings.signing_key_file is not None:  # the operator is who the key says, as a verifying worker checks
        identity, _ = read_key(settings.signing_key_file)
        if not identity.startswith(OPERATOR):
            err.print(f"[red]charges {action}[/red]: the signing key is {identity}'s; an adjustment is signed by an "
                      f"operator's key ({OPERATOR}<name>: `nodeshare keys derive {OPERATOR}{operator}`)")
            raise typer.Exit(2)
        operator = identity.removeprefix(OPERATOR)
    elif settings.site_secret_file is None:
        err.print(f"[yellow]charges {action}[/yellow]: sent unsigned (no signing_key_file): a worker that checks "
                  f"signatures refuses it as forged; give it a key of {OPERATOR}{operator}")
    try:
        record = ChargeAdjustment(
            event_id=f"operator/{uuid.uuid4()}", source=f"operator/{operator}", event_time=datetime.now(UTC),
            job_id=job, action=AdjustmentAction(action), price=price, reason=reason, operator=operator)
    except ValidationError as exc:
        first = exc.errors()[0]
        err.print(f"[red]charges {action}[/red]: {'.'.join(map(str, first['loc'])) or 'request'}: "
                  f"{first['msg'].removeprefix('Value error, ')}")
        raise typer.Exit(2) from None
    problem, note = adjustment_problem(record, ledger, not_charged_yet)
    if problem:
        err.print(f"[red]charges {action}[/red]: {problem}")
        raise typer.Exit(2)
    [(partition, offset)] = publish(settings, [record], f"charges {action}")
    out.print(f"{job}: {action} published at jobs.lifecycle:{partition}:{offset} by {operator}; the worker "
              f"prices it as the job's next revision" + (f" ({note})" if note else ""))


def adjustment_problem(record: Any, ledger: Path, not_charged_yet: bool) -> tuple[str | None, str]:
    """Why the request would be refused or misdirected (None: it may go), and a note on what it will
    do, from the job's current charge in ``ledger``: a typo would otherwise leave an adjustment
    waiting for a job that never comes, and one that changes nothing is a dead letter."""
    from nodeshare.sinks.ledger import Ledger

    if not_charged_yet and not ledger.exists():
        return None, "it applies to the job's first charge"
    if not ledger.exists():
        return (f"no ledger at {ledger} to check job {record.job_id}'s charge: give --ledger (or a snapshot), or "
                "--not-charged-yet for a job not charged yet"), ""
    try:
        with Ledger(ledger, read_only=True) as led:
            rows = led.charges([record.job_id])
    except Exception as exc:
        return f"cannot read {ledger}: {str(exc).splitlines()[0]} (give a snapshot of it with --ledger)", ""
    if not rows and not_charged_yet:
        return None, "it applies to the job's first charge"
    if not rows:
        return (f"job {record.job_id} has no charge in {ledger}: check the id, or give --not-charged-yet to have "
                "its first charge priced with the adjustment"), ""
    current = max(rows, key=lambda c: c.revision)
    if not_charged_yet:
        return (f"job {record.job_id} is charged already (revision {current.revision} in {ledger}): "
                "drop --not-charged-yet"), ""
    held = current.adjustment
    if record.action.value == "restore" and held is None:
        return f"job {record.job_id}'s charge (revision {current.revision}) has no adjustment to restore", ""
    if held is not None and (held.action, held.requested_price) == (record.action.value, record.price):
        return (f"job {record.job_id}'s charge (revision {current.revision}) is already {held.action}ed"
                + (f" to {held.requested_price} SU" if held.requested_price is not None else "")), ""
    note = f"revision {current.revision}, {current.price:.4f} SU now"
    if record.price is not None and record.price > current.standard_price:
        note += f"; capped at its standard price {current.standard_price:.4f} SU"
    return None, note


@charges_app.command("export")
def charges_export(
    ctx: typer.Context,
    to: Annotated[str, typer.Option("--to", help="slurm: each job's AdminComment in Slurm's accounting database "
                                                 "(sacctmgr modify job: needs slurmdbd, run as a Slurm "
                                                 "administrator); csv: one line per job on stdout, for an "
                                                 "allocation bank")] = "slurm",
    ledger: LedgerOption = None,
    starttime: Annotated[str | None, typer.Option("--starttime", "-S", help="jobs that ended at or after this "
                                                                            "(YYYY-MM-DD[THH:MM[:SS]], UTC)")] = None,
    endtime: Annotated[str | None, typer.Option("--endtime", "-E", help="... and before this")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="with --to slurm: print the sacctmgr commands, "
                                                             "run none")] = False,
) -> None:
    """Every current charge of the jobs that ended in [--starttime, --endtime) into Slurm's accounting
    records of them (sacct -o JobID,AdminComment shows the price), or out as CSV."""
    import csv
    import shlex
    import sys

    from nodeshare.producers.slurm import SlurmCommands, annotate_command
    from nodeshare.sinks.analysis.usage import QueryError, parse_time, slurm_comment
    from nodeshare.sinks.audit import current_revisions
    from nodeshare.sinks.ledger import Ledger

    if to not in ("slurm", "csv"):
        err.print(f"[red]charges export[/red]: --to {to}: slurm or csv")
        raise typer.Exit(2)
    path = ledger_of(ctx, ledger)
    try:
        start = parse_time(starttime) if starttime else None
        end = parse_time(endtime) if endtime else None
        with Ledger(path, read_only=True) as led:
            rows = current_revisions(led.charges())
    except (QueryError, FileNotFoundError) as exc:
        err.print(f"[red]charges export[/red]: {exc}")
        raise typer.Exit(2) from None
    rows = [c for c in rows if (start is None or c.end_time >= start) and (end is None or c.end_time < end)]
    if to == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(["job_id", "revision", "user", "account", "partition", "end_time", "standard_price",
                         "charged", "dividend", "adjustment_credit"])
        for c in rows:
            writer.writerow([c.job_id, c.revision, c.user, c.account, c.partition or "", c.end_time.isoformat(),
                             f"{c.standard_price:.6f}", f"{c.price:.6f}", f"{c.dividend:.6f}",
                             f"{c.adjustment_credit:.6f}"])
        return
    if print_only:
        for c in rows:
            print(shlex.join(annotate_command(c.job_id, slurm_comment(c))))
        return
    slurm, done, failed = SlurmCommands(), 0, []
    with progress_bar() as bar:
        task = bar.add_task("AdminComment", total=len(rows))
        for c in rows:
            try:
                slurm.annotate(c.job_id, slurm_comment(c))
                done += 1
            except RuntimeError as exc:
                failed.append(f"{c.job_id}: {exc}")
                if len(failed) == 3 and not done:  # nothing works (no slurmdbd, not an administrator): stop
                    break
            bar.advance(task)
    out.print(f"{done} of {len(rows)} jobs' charges written to Slurm's accounting")
    if failed:
        err.print(f"[red]charges export[/red]: {len(failed)} failed, first: {failed[0]}")
        raise typer.Exit(1)
