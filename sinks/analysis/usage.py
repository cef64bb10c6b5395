"""Operator queries over the ledger, in the conventions of Slurm's sacct and sreport.

`charges` lists jobs like ``sacct``: jobs that ran at any moment of [starttime, endtime),
chosen columns, '|'-separated output without a trailing delimiter for ``--parsable2``.
`usage_by_account` rolls charges up like ``sreport cluster AccountUtilizationByUser``: a row
per account followed by its users. A job counts in the period in which it ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

#: Column name (as sacct users type them, case-insensitive) -> SQL over charges_current.
CHARGE_COLUMNS: dict[str, str] = {
    "JobID": "job_id",
    "Revision": "revision",
    "User": '"user"',
    "Account": "account",
    "Program": "program",
    "State": "upper(final_state)",
    "NCPUS": "cores",
    # schema 8: the partition, and what the standard price multiplied (Slurm's billing TRES, a
    # partition's weights, or the cores)
    "Partition": "json_extract_string(record, '$.partition')",
    "BillingUnits": "coalesce(CAST(json_extract(record, '$.billing_units') AS DOUBLE), cores)",
    "Start": "start_time",
    "End": "end_time",
    "Elapsed": "run_time_s",
    "Paused": "pause_credit_s",  # seconds
    "Degradation": "degradation",  # what the price applies (the estimate, with the short-sample margin if any)
    "DegradationEstimate": "coalesce(degradation_point, degradation)",
    "DegradationLow": "degradation_low",
    "DegradationHigh": "degradation_high",
    "Confidence": "confidence",
    "PricedAt": "priced_at",
    "EstimateStatus": "estimate_status",
    "BlocksUsed": "blocks_used",
    "BlocksRejected": "blocks_rejected",
    "RateFunction": "rate_function",
    "SOP": "standard_price",
    "Charged": "price",
    "Dividend": "dividend",
    # an operator's adjustment (schema 8): void or adjust, and what it took off the computed price
    "Adjustment": "json_extract_string(record, '$.adjustment.action')",
    "Credit": "coalesce(CAST(json_extract(record, '$.adjustment_credit') AS DOUBLE), 0.0)",
    "RevisionReason": "json_extract_string(record, '$.revision_reason')",  # why it superseded the last one
    "CodeVersion": "code_version",
}
DEFAULT_FORMAT = ("JobID,User,Account,Program,NCPUS,Start,End,Elapsed,DegradationEstimate,DegradationLow,"
                  "DegradationHigh,Degradation,SOP,Charged,Dividend,Credit")
USAGE_COLUMNS = ("Account", "Login", "Jobs", "CoreHours", "SOP", "Charged", "Dividend", "Credit")


class QueryError(ValueError):
    pass


def parse_time(text: str) -> datetime:
    """sacct's time forms: YYYY-MM-DD[THH:MM[:SS]], taken as UTC; also 'now'."""
    if text.lower() == "now":
        return datetime.now(UTC)
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise QueryError(f"invalid time {text!r}: use YYYY-MM-DD[THH:MM[:SS]] or 'now'")


def columns(fmt: str) -> list[str]:
    by_lower = {c.lower(): c for c in CHARGE_COLUMNS}
    out = []
    for name in (f.strip() for f in fmt.split(",") if f.strip()):
        if name.lower() not in by_lower:
            raise QueryError(f"unknown column {name!r}; known: {', '.join(CHARGE_COLUMNS)}")
        out.append(by_lower[name.lower()])
    return out


def _connect(ledger: Path) -> duckdb.DuckDBPyConnection:
    if not Path(ledger).exists():
        raise FileNotFoundError(f"no ledger at {ledger}")
    return duckdb.connect(str(ledger), read_only=True)


def charges(ledger: Path, *, users: Sequence[str] = (), accounts: Sequence[str] = (),
            start: datetime | None = None, end: datetime | None = None, fmt: str = DEFAULT_FORMAT,
            all_revisions: bool = False, jobs: Sequence[str] = (), incomplete: bool = False,
            ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(column names, rows) of the jobs that ran at any moment of [start, end) (of ``jobs``, when given);
    with ``incomplete``, only charges priced without a lost node's marker (estimate status ``node_lost``)."""
    cols = columns(fmt)
    where: list[str] = ["TRUE"]
    params: list[Any] = []
    if jobs:
        where.append("job_id IN (SELECT unnest(?))")
        params.append(list(jobs))
    if incomplete:
        where.append("estimate_status = 'node_lost'")
    if users:
        where.append('"user" IN (SELECT unnest(?))')
        params.append(list(users))
    if accounts:
        where.append("account IN (SELECT unnest(?))")
        params.append(list(accounts))
    if start is not None:
        where.append("end_time >= ?")
        params.append(start)
    if end is not None:
        where.append("start_time < ?")
        params.append(end)
    table = "charges" if all_revisions else "charges_current"
    sql = (f"SELECT {', '.join(CHARGE_COLUMNS[c] for c in cols)} FROM {table} "
           f"WHERE {' AND '.join(where)} ORDER BY start_time, job_id, revision")
    with _connect(ledger) as con:
        return cols, con.execute(sql, params).fetchall()


def usage_by_account(ledger: Path, start: datetime | None = None,
                     end: datetime | None = None) -> list[tuple[Any, ...]]:
    """Rows of USAGE_COLUMNS: per account a total (Login empty) followed by its users."""
    where: list[str] = ["TRUE"]
    params: list[Any] = []
    if start is not None:
        where.append("end_time >= ?")
        params.append(start)
    if end is not None:
        where.append("end_time < ?")
        params.append(end)
    sql = f"""
        SELECT account, coalesce("user", '') AS login, count(*), sum(cores * run_time_s) / 3600,
               sum(standard_price), sum(price), sum(dividend), sum({CHARGE_COLUMNS["Credit"]})
        FROM charges_current WHERE {' AND '.join(where)}
        GROUP BY GROUPING SETS ((account), (account, "user"))
        ORDER BY account, "user" NULLS FIRST"""
    with _connect(ledger) as con:
        return con.execute(sql, params).fetchall()


def render_value(column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if column == "Elapsed":
        return elapsed(float(value))
    if column == "Paused":  # shutter pauses are sub-second: seconds with decimals
        return f"{float(value):.3f}"
    if isinstance(value, float):
        return f"{value:.6f}" if column.startswith("Degradation") else f"{value:.4f}"
    return str(value)


def elapsed(seconds: float) -> str:
    """sacct's [D-]HH:MM:SS."""
    td = timedelta(seconds=round(seconds))
    hours, rest = divmod(td.seconds, 3600)
    text = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{td.days}-{text}" if td.days else text


def parsable2(header: Sequence[str], rows: Sequence[Sequence[Any]], *, noheader: bool = False) -> str:
    """'|'-separated lines without a trailing delimiter, like ``sacct --parsable2``."""
    lines = [] if noheader else ["|".join(header)]
    lines += ["|".join(render_value(c, v) for c, v in zip(header, row, strict=True)) for row in rows]
    return "\n".join(lines)


def slurm_comment(charge: Any) -> str:
    """What ``nodeshare charges export --to slurm`` writes into a job's AdminComment (one line, no
    quotes or spaces in a value, so ``sacct -o AdminComment`` and scripts read it as key=value pairs):
    the current revision's price and what it is made of, in service units."""
    parts = [f"nodeshare:rev={charge.revision}", f"charged={charge.price:.4f}", f"sop={charge.standard_price:.4f}",
             f"dividend={charge.dividend:.4f}", f"degradation={charge.degradation:.4f}",
             f"status={charge.estimate_status.value}"]
    if charge.billing_units is not None:
        parts.append(f"billing_units={charge.billing_units:g}")
    if charge.adjustment is not None:
        parts.append(f"{charge.adjustment.action}={charge.adjustment_credit:.4f}")
    return " ".join(parts)
