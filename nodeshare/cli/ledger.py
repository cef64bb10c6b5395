"""The ledger and the archive: audit, charges, usage reports, report, archive housekeeping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .common import (
    Bootstrap,
    app,
    err,
    load_settings,
    out,
    progress_bar,
)

archive_app = typer.Typer(no_args_is_help=True, help="Archive housekeeping.")
ledger_app = typer.Typer(no_args_is_help=True, help="Ledger file housekeeping: backup, chain head.")


def split_values(values: list[str] | None) -> list[str]:
    return [v for item in values or [] for v in item.split(",") if v]


def print_machine_readable(header: Any, rows: list[Any], as_json: bool, parsable: bool,
                            noheader: bool = False) -> bool:
    """--json (a list of objects) or --parsable2 ('|'-separated, like sacct); False when neither."""
    from nodeshare.sinks.analysis.usage import parsable2

    if as_json:
        print(json.dumps([dict(zip(header, r, strict=True)) for r in rows], indent=2, default=str))
    elif parsable:
        print(parsable2(header, rows, noheader=noheader))
    return as_json or parsable


@app.command()
def audit(
    archive: Annotated[str, typer.Option(
        help="archive root: a directory, or object storage (s3://bucket/prefix; credentials and endpoint from "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)")],
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    threads: Annotated[int | None, typer.Option(
        min=1, help="recompute on this many threads of this process (default: one per core); the archive's "
        "row groups are cut into tasks, whatever its partitions")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="recompute on a local Dask cluster of this many processes instead (the same tasks)")]
    = None,
    scheduler: Annotated[str | None, typer.Option(
        help="recompute on this Dask scheduler (tcp://host:8786), e.g. workers started as Slurm jobs by "
        "dask-jobqueue; the archive must be reachable from its workers (the ledger is read here)")] = None,
    ended_from: Annotated[str | None, typer.Option(
        "--from", help="only jobs that ended from this time (YYYY-MM-DD[THH:MM[:SS]], UTC)")] = None,
    ended_to: Annotated[str | None, typer.Option(
        "--to", help="only jobs that ended before this time (UTC)")] = None,
    metrics_file: Annotated[Path | None, typer.Option(
        help="also write the result as Prometheus gauges (nodeshare_audit_ok, ..._mismatches, "
        "..._missing_charges, ..._chain_ok, ..._charges_checked, ..._last_run_timestamp_seconds) to this file, "
        "e.g. in node_exporter's --collector.textfile.directory")] = None,
) -> None:
    """Verify the ledger's hash chain and conservation, recompute every charge from the archive and
    compare, and report ended jobs without a charge. Exit 1 on any failure."""
    from nodeshare.schemas.signing import SigningError
    from nodeshare.sinks.analysis.usage import QueryError, parse_time
    from nodeshare.sinks.audit import Window, dask_client
    from nodeshare.sinks.audit import audit as run_audit

    settings = load_settings()
    try:
        window = Window(parse_time(ended_from) if ended_from else None, parse_time(ended_to) if ended_to else None)
        verifier = settings.verifier()
    except (QueryError, SigningError) as exc:
        err.print(f"[red]audit[/red]: {exc}")
        raise typer.Exit(2) from None
    if workers is not None and scheduler is not None:
        err.print("[red]audit[/red]: --workers starts a local cluster, --scheduler uses one: give one of them")
        raise typer.Exit(2)
    if threads is not None and (workers is not None or scheduler is not None):
        err.print("[red]audit[/red]: --threads is this process's; a Dask cluster (--workers, --scheduler) runs "
                  "the tasks on its own workers: give one of them")
        raise typer.Exit(2)
    try:
        with dask_client(workers, scheduler) as client, progress_bar() as bar:
            task = bar.add_task("archive chunks folded", total=None, visible=err.is_terminal)

            def progress(done: int, total: int, samples: int) -> None:
                bar.update(task, completed=done, total=total,
                           description=f"archive chunks folded ({samples / 1e6:.1f} M samples)")
            root = archive if "://" in archive else Path(archive).resolve()
            report = run_audit(root, ledger.resolve(), settings.policy(), client=client,
                               progress=progress, window=window, threads=threads, verifier=verifier)
    except FileNotFoundError as exc:
        err.print(f"[red]audit failed[/red]: {exc}")
        raise typer.Exit(2) from None
    except (OSError, TimeoutError) as exc:  # connecting to the Dask scheduler
        err.print(f"[red]audit failed[/red]: the Dask cluster is not reachable ({scheduler or 'local'}): {exc}")
        raise typer.Exit(2) from None
    if metrics_file is not None:
        import time

        from nodeshare.runtime.metrics import write_audit_metrics

        write_audit_metrics(str(metrics_file), {
            "nodeshare_audit_ok": float(report.ok), "nodeshare_audit_mismatches": len(report.mismatches),
            "nodeshare_audit_missing_charges": len(report.missing_charges) + len(report.missing_in_ledger),
            "nodeshare_audit_chain_ok": float(report.chain_ok),
            "nodeshare_audit_charges_checked": report.charges_checked,
            "nodeshare_audit_last_run_timestamp_seconds": time.time()})
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        if report.outside_window:
            out.print(f"{report.outside_window} ledger rows of jobs that ended outside --from/--to not compared")
        out.print(f"{report.charges_checked} charges checked against {report.events_read} archived events: "
                  f"{report.matches} match, {len(report.mismatches)} mismatches, "
                  f"{len(report.missing_in_ledger)} missing from the ledger, "
                  f"{len(report.missing_charges)} ended jobs without a charge")
        for p in report.missing_charges[:20]:
            out.print(f"  {p.job_id} ({p.state} {p.end_time:%Y-%m-%d %H:%M:%S}): {p.reason}")
        for m in report.mismatches[:20]:
            out.print(f"  {m.job_id}#{m.revision} {m.field}: ledger {m.ledger!r} != recomputed {m.recomputed!r}")
        if report.identities_checked:
            out.print(f"signatures checked (site secret): {len(report.refused_jobs)} jobs had records refused "
                      "for their signer" + (f": {', '.join(report.refused_jobs[:20])}" if report.refused_jobs else ""))
        else:
            out.print("signatures not checked (no site_secret_file configured)")
        if report.conflicting_copies:
            out.print(f"[red]{len(report.conflicting_copies)} archived records have copies that differ[/red] "
                      f"(overlapping files): {', '.join(report.conflicting_copies[:20])}")
        out.print("hash chain: " + ("intact" if report.chain_ok else f"[red]broken[/red]: {report.chain_error}"))
        out.print("conservation (SOP = charged + dividend + adjustment credit, 0 <= price <= SOP): "
                  + ("holds" if report.conservation_ok else "[red]violated[/red]"))
        for v in report.conservation_violations[:20]:
            out.print(f"  {v}")
    if not report.ok:
        raise typer.Exit(1)


@app.command("report-usage")
def report_usage(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    starttime: Annotated[str | None, typer.Option("--starttime", "-S", help="jobs that ended from (UTC)")] = None,
    endtime: Annotated[str | None, typer.Option("--endtime", "-E", help="jobs that ended before (UTC)")] = None,
    parsable: Annotated[bool, typer.Option("--parsable2", "-P", help="'|'-separated, no trailing delimiter")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON list of objects")] = False,
) -> None:
    """Standard price, charged, dividend and operators' credit by account and user, like
    `sreport cluster AccountUtilizationByUser` (an account's total first, then its users)."""
    from nodeshare.sinks.analysis.usage import USAGE_COLUMNS, QueryError, parse_time, usage_by_account

    try:
        rows = usage_by_account(ledger, parse_time(starttime) if starttime else None,
                                parse_time(endtime) if endtime else None)
    except (QueryError, FileNotFoundError) as exc:
        err.print(f"[red]report-usage[/red]: {exc}")
        raise typer.Exit(2) from None
    if not print_machine_readable(USAGE_COLUMNS, rows, as_json, parsable):
        table = Table(title="Usage by account and user (SU)", box=None)
        for c in USAGE_COLUMNS:
            table.add_column(c, justify="left" if c in ("Account", "Login") else "right")
        for r in rows:
            table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r))
        out.print(table)


@app.command()
def report(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory for the PNG files and index.html")],
    archive: Annotated[Path | None, typer.Option(help="archive root (for the program-pair heatmap)")] = None,
    truth: Annotated[Path | None, typer.Option(help="ground-truth parquet of a simulation (oracle prices)")] = None,
) -> None:
    """PNG plots and one HTML page: prices per program (with the oracle when truth exists),
    degradation by program pair, dividend per account over time, estimator confidence."""
    from nodeshare.sinks.analysis.report import build_report

    try:
        files = build_report(ledger, archive, out_dir, truth)
    except (FileNotFoundError, ValueError) as exc:
        err.print(f"[red]report failed[/red]: {exc}")
        raise typer.Exit(2) from None
    for p in (files.html, *files.pngs):
        out.print(f"wrote {p}")


@archive_app.command("compact")
def archive_compact(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    min_rows: Annotated[int, typer.Option(min=1, help="merge until a file holds this many rows")] = 100_000,
) -> None:
    """Merge small archive files into large ones with scan-sized row groups (safe while the sink runs)."""
    from nodeshare.sinks.archive import ParquetArchive

    before, after = ParquetArchive(archive).compact(min_rows=min_rows)
    out.print(f"{before} files -> {after} files")


@archive_app.command("prune")
def archive_prune(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    before: Annotated[str, typer.Option(help="remove the events of every date before this one (YYYY-MM-DD, UTC)")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go, remove nothing")] = False,
) -> None:
    """Retention: remove archived events of whole dates. Charges computed from removed events stay
    in the ledger; the audit then checks their hash chain and conservation, and counts them as
    beyond retention instead of recomputing them."""
    from datetime import date

    from nodeshare.sinks.archive import ParquetArchive

    try:
        cutoff = date.fromisoformat(before)
    except ValueError:
        err.print(f"[red]--before[/red]: {before!r} is not a date (YYYY-MM-DD)")
        raise typer.Exit(2) from None
    if not archive.is_dir():
        err.print(f"[red]no archive at[/red] {archive}")
        raise typer.Exit(2)
    pruned = ParquetArchive(archive).prune(cutoff, dry_run=dry_run)
    span = f"{pruned.dates[0]} .. {pruned.dates[-1]}" if pruned.dates else "none"
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {pruned.events:,} events in {pruned.files} files (dates {span})")


@archive_app.command("check")
def archive_check(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    bootstrap: Bootstrap = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Gaps in each topic partition's archived offsets, and, with a broker (--bootstrap or
    NODESHARE_BOOTSTRAP), offsets it still has that the archive lacks. Exit 1 on a gap, 2 when
    the broker cannot be reached."""
    from confluent_kafka import KafkaException

    from nodeshare.schemas import INPUT_TOPICS
    from nodeshare.sinks.archive import ParquetArchive, archive_gaps, broker_watermarks

    if not archive.is_dir():
        err.print(f"[red]no archive at[/red] {archive}")
        raise typer.Exit(2)
    settings = load_settings(bootstrap=bootstrap)
    watermarks = None
    if settings.bootstrap:
        try:
            watermarks = broker_watermarks(settings, [t.name for t in INPUT_TOPICS])
        except KafkaException as exc:
            err.print(f"[red]archive check[/red]: the broker at {settings.bootstrap} cannot be reached: "
                      f"{exc.args[0].str() if exc.args and hasattr(exc.args[0], 'str') else exc}")
            raise typer.Exit(2) from None
    gaps, logs = archive_gaps(ParquetArchive(archive), watermarks)
    against = f"the broker at {settings.bootstrap}" if watermarks is not None else "no broker (none configured)"
    if as_json:
        print(json.dumps({"logs_checked": logs, "broker": settings.bootstrap if watermarks is not None else None,
                          "gaps": [{**g.__dict__, "count": g.count} for g in gaps]}, indent=2))
    else:
        for g in gaps:
            out.print(f"{g.topic}[{g.partition}] epoch {g.epoch}: offsets {g.first}..{g.last} missing "
                      f"({g.count:,}, {g.kind})")
        out.print(f"{logs} topic partition logs checked against {against}: "
                  + (f"{len(gaps)} gaps, {sum(g.count for g in gaps):,} offsets missing" if gaps else "no gap"))
    if gaps:
        raise typer.Exit(1)


@ledger_app.command("backup")
def ledger_backup(
    dest: Annotated[Path, typer.Argument(help="the backup file to write (must not exist)")],
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    wait: Annotated[float, typer.Option(min=0.0, help="seconds to wait while the sink writes a batch")] = 30.0,
) -> None:
    """A consistent copy of the ledger, safe while the ledger sink writes: taken while no write can
    land (the file held read-only), its hash chain checked before it is put in place. Prints the
    copy's chain head."""
    from nodeshare.sinks.ledger_tools import backup

    try:
        head = backup(ledger, dest, wait_s=wait)
    except (FileNotFoundError, FileExistsError, RuntimeError) as exc:
        err.print(f"[red]ledger backup[/red]: {exc}", highlight=False)
        raise typer.Exit(1) from None
    out.print(f"{dest}: {head.rows} rows, chain intact, head {head.head}", highlight=False)


@ledger_app.command("verify")
def ledger_verify(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    head: Annotated[str | None, typer.Option(
        help="a chain head recorded earlier (e.g. printed by a previous verify and kept elsewhere): fail unless "
        "the intact chain passes through it")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Walk the ledger's hash chain and print its head (record it off the ledger's host: a ledger
    rewritten with a recomputed chain no longer leads to it). Exit 1 on a broken chain, or when it
    does not lead to --head."""
    from nodeshare.sinks.ledger_tools import chain_head, verify_head

    try:
        result = chain_head(ledger) if head is None else verify_head(ledger, head)
    except FileNotFoundError as exc:
        err.print(f"[red]ledger verify[/red]: {exc}", highlight=False)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(result.__dict__, indent=2))
    elif result.ok:
        at = f"; {head} is row {result.at_row}" if head is not None else ""
        out.print(f"chain intact: {result.rows} rows, head {result.head}{at}", highlight=False)
    else:
        err.print(f"[red]ledger verify[/red]: {result.error}", highlight=False)
    if not result.ok:
        raise typer.Exit(1)
