"""The audit: recompute every charge from the archive with the stream's own functions and diff.

Each job is folded separately, through ``streams.accounting.process_message``, with the
pricing policy its ledger row states (so a later change of L or delta does not make old
charges look wrong), or the configured policy for a job the ledger lacks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

from nodeshare.schemas import Charge
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.schemas.events import carried
from nodeshare.streams.accounting import Message, Origin, PricingPolicy, fold_messages

from .archive import ParquetArchive
from .fast_audit import fast_recompute
from .ledger import Ledger

#: Fields that describe where a charge was computed, not what it is.
_PROVENANCE = frozenset({"source", "schema_version"})

@dataclass(frozen=True)
class Mismatch:
    job_id: str
    revision: int
    field: str
    ledger: Any
    recomputed: Any


@dataclass
class AuditReport:
    charges_checked: int = 0
    matches: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    missing_in_ledger: list[str] = field(default_factory=list)  # the archive yields a charge the ledger lacks
    # rows whose events reach back to what archive retention removed: chain and conservation are
    # checked, the recomputation cannot be (the job's later revisions neither)
    beyond_retention: int = 0
    events_read: int = 0
    fast_path_jobs: int = 0  # jobs whose charges the vectorized path reproduced
    reference_path_jobs: int = 0  # jobs recomputed by the reference fold
    chain_ok: bool = True
    chain_error: str | None = None
    conservation_violations: list[str] = field(default_factory=list)

    @property
    def conservation_ok(self) -> bool:
        return not self.conservation_violations

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.missing_in_ledger and self.chain_ok and self.conservation_ok

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "charges_checked": self.charges_checked,
            "matches": self.matches,
            "mismatches": len(self.mismatches),
            "missing_in_ledger": len(self.missing_in_ledger),
            "beyond_retention": self.beyond_retention,
            "chain_ok": self.chain_ok,
            "chain_error": self.chain_error,
            "conservation_ok": self.conservation_ok,
            "conservation_violations": self.conservation_violations[:50],
            "events_read": self.events_read,
            "fast_path_jobs": self.fast_path_jobs,
            "reference_path_jobs": self.reference_path_jobs,
            "mismatch_details": [m.__dict__ for m in self.mismatches[:50]],
            "missing_details": self.missing_in_ledger[:50],
        }


def archived_messages(archive: ParquetArchive, keys: set[bytes] | None = None) -> dict[bytes | None, list[Message]]:
    """The archived input messages of job accounting (of the given keys, default all), per message
    key, each topic in offset order."""
    per_key: dict[bytes | None, list[Message]] = defaultdict(list)
    for topic, ev in archive.events([NODE_IPC.name, JOBS_LIFECYCLE.name], keys):
        # The catalog name (the archive's topic= partition), so no topic prefix needs configuring.
        per_key[ev.key].append((Origin(topic, ev.partition, ev.offset), ev.key, ev.value, ev.timestamp_ms / 1000))
    return per_key


def recompute(messages: dict[bytes | None, list[Message]], policies: dict[str, PricingPolicy],
              default: PricingPolicy) -> dict[tuple[str, int], Charge]:
    out: dict[tuple[str, int], Charge] = {}
    for key, msgs in messages.items():
        job = key.decode(errors="replace") if key is not None else ""
        for c in fold_messages(msgs, policies.get(job, default)):
            out[(c.job_id, c.revision)] = c
    return out


def policy_of(charge: Charge) -> PricingPolicy:
    return PricingPolicy(rate_per_core_hour=charge.rate_per_core_hour, delta=charge.delta,
                         rate_function=charge.rate_function, estimator=charge.estimator)


def audit(archive_root: Path, ledger_path: Path, default: PricingPolicy, *, fast: bool = True) -> AuditReport:
    """Verify the ledger against the archive. With ``fast``, the vectorized path recomputes the
    clean jobs and the reference fold the rest, including every job where the two disagree with
    the ledger; without it, the reference fold recomputes everything."""
    with Ledger(ledger_path, read_only=True) as ledger:
        ledger_rows = {(c.job_id, c.revision): c for c in ledger.charges()}
        drift = ledger.column_drift()
        chain = ledger.verify_chain()
    archive = ParquetArchive(archive_root)
    pruned = archive.retention()
    beyond = {job for (job, _), c in ledger_rows.items()
              if any(r.first_offset <= pruned.get((r.topic, r.partition), -1) for r in c.event_range)}
    all_rows, ledger_rows = ledger_rows, {k: c for k, c in ledger_rows.items() if k[0] not in beyond}
    policies = {job: policy_of(c) for (job, _), c in sorted(ledger_rows.items())}
    recomputed: dict[tuple[str, int], Charge] = {}
    reference_jobs: set[str] | None = None  # None: every job
    if fast:
        result = fast_recompute(archive_root, policies, default)
        reference_jobs = set(result.ineligible)
        for key, charge in result.charges.items():
            row = ledger_rows.get(key)
            if row is not None and not diff_charges(row, charge):
                recomputed[key] = charge
            else:
                reference_jobs.add(key[0])
        reference_jobs |= {job for (job, revision) in ledger_rows if (job, revision) not in recomputed}
        recomputed = {k: c for k, c in recomputed.items() if k[0] not in reference_jobs}
        reference_jobs -= beyond  # their partial events would only re-fold to a charge that is not compared
    messages = archived_messages(archive, None if reference_jobs is None else {j.encode() for j in reference_jobs})
    fast_jobs = {k[0] for k in recomputed}
    recomputed.update(recompute(messages, policies, default))
    report = AuditReport(events_read=archive.count(), chain_ok=chain.ok,
                         fast_path_jobs=len(fast_jobs), reference_path_jobs=len(messages),
                         chain_error=chain.error,
                         conservation_violations=conservation_violations(list(all_rows.values())),
                         beyond_retention=len(all_rows) - len(ledger_rows))
    # A SQL column edited behind the record's back is tampering too: analysts read the columns.
    report.mismatches += [Mismatch(j, r, f"column {c}", v, want) for j, r, c, v, want in drift]
    for key, row in sorted(ledger_rows.items()):
        report.charges_checked += 1
        again = recomputed.get(key)
        if again is None:
            report.mismatches.append(Mismatch(key[0], key[1], "*", "charged", "no charge from the archive"))
            continue
        diffs = diff_charges(row, again)
        report.mismatches += diffs
        report.matches += not diffs
    report.missing_in_ledger = [f"{j}#{r}" for (j, r) in sorted(recomputed)
                                if (j, r) not in ledger_rows and j not in beyond]
    return report


def current_revisions(charges: list[Charge]) -> list[Charge]:
    latest: dict[str, Charge] = {}
    for c in charges:
        if c.job_id not in latest or c.revision > latest[c.job_id].revision:
            latest[c.job_id] = c
    return [latest[j] for j in sorted(latest)]


def conservation_violations(charges: list[Charge], rel_tol: float = 1e-9) -> list[str]:
    """For every day (of job end, UTC): total standard price = total charged + total dividend;
    and every job's charge lies within [0, its standard price]. Only current revisions count."""
    out: list[str] = []
    by_day: dict[str, list[Charge]] = defaultdict(list)
    for c in current_revisions(charges):
        by_day[c.end_time.astimezone(UTC).date().isoformat()].append(c)
        if not 0.0 <= c.price <= c.standard_price * (1 + rel_tol):
            out.append(f"{c.job_id}#{c.revision}: price {c.price} outside [0, standard price {c.standard_price}]")
    for day, rows in sorted(by_day.items()):
        sop = math.fsum(c.standard_price for c in rows)
        charged = math.fsum(c.price for c in rows)
        dividend = math.fsum(c.dividend for c in rows)
        if not math.isclose(sop, charged + dividend, rel_tol=rel_tol, abs_tol=1e-12):
            out.append(f"{day}: standard price {sop} != charged {charged} + dividend {dividend}")
    return out


def diff_charges(ledger: Charge, recomputed: Charge) -> list[Mismatch]:
    """Differences in every field the ledger row's schema version has (a row written by an older
    version is compared on what it carries; which version wrote it is provenance)."""
    a, b = ledger.model_dump(), recomputed.model_dump()
    return [Mismatch(ledger.job_id, ledger.revision, f, a[f], b[f])
            for f in a if f not in _PROVENANCE and carried(ledger, f) and a[f] != b[f]]
