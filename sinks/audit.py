"""The audit: recompute every charge from the archive with the stream's own functions and diff.

Each job is folded separately, through ``streams.core.accounting.process_message``, with the
pricing policy its ledger row states (so a later change of L or delta does not make old
charges look wrong), or the configured policy for a job the ledger lacks.
"""

from __future__ import annotations

import hashlib
import logging
import math
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nodeshare.schemas import Charge
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC, spec_for_topic
from nodeshare.schemas.serde import DecodeError, decode, decode_model
from nodeshare.schemas.signing import Verifier, identity_problem
from nodeshare.streams.core.accounting import Message, PricingPolicy, fold_states
from nodeshare.streams.core.confidence import DEFAULT_CONFIDENCE, DEFAULT_PRIOR_HIGH, DEFAULT_SHORT_SAMPLE_US

from .archive import ParquetArchive
from .fast_audit import Progress, Runner, fast_recompute, in_process
from .ledger import Ledger, charge_differences
from .pending import PendingJob, archived_input, pending_jobs

log = logging.getLogger(__name__)


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
    #: ended jobs (a terminal event in the archive) with no charge in the ledger and none the archive
    #: yields: a node's block stream is still open or was never seen (sinks/pending.py)
    missing_charges: list[PendingJob] = field(default_factory=list)
    outside_window: int = 0  # ledger rows of jobs that ended outside --from/--to: not compared
    #: records archived more than once with different contents: "topic[partition]@offset"
    conflicting_copies: list[str] = field(default_factory=list)
    identities_checked: bool = False  # the site secret was given: records were taken from allowed signers only
    #: jobs with an archived record refused for its signer (unsigned, forged, or a node writing for
    #: another): the worker refused it too, so it is no failure of the ledger, but someone tried
    refused_jobs: list[str] = field(default_factory=list)

    @property
    def conservation_ok(self) -> bool:
        return not self.conservation_violations

    @property
    def ok(self) -> bool:
        return (not self.mismatches and not self.missing_in_ledger and not self.missing_charges and self.chain_ok
                and self.conservation_ok and not self.conflicting_copies)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "charges_checked": self.charges_checked,
            "matches": self.matches,
            "mismatches": len(self.mismatches),
            "missing_in_ledger": len(self.missing_in_ledger),
            "beyond_retention": self.beyond_retention,
            "outside_window": self.outside_window,
            "chain_ok": self.chain_ok,
            "chain_error": self.chain_error,
            "conservation_ok": self.conservation_ok,
            "conservation_violations": self.conservation_violations[:50],
            "events_read": self.events_read,
            "fast_path_jobs": self.fast_path_jobs,
            "reference_path_jobs": self.reference_path_jobs,
            "mismatch_details": [m.__dict__ for m in self.mismatches[:50]],
            "missing_details": self.missing_in_ledger[:50],
            "conflicting_copies": len(self.conflicting_copies),
            "conflicting_copy_details": self.conflicting_copies[:50],
            "missing_charges": len(self.missing_charges),
            "missing_charge_details": [p.as_dict() for p in self.missing_charges[:50]],
            "identities_checked": self.identities_checked,
            "refused_jobs": len(self.refused_jobs),
            "refused_job_details": self.refused_jobs[:50],
        }


#: An archived row, as the signature check names a refused one: (catalog topic, partition, offset,
#: a digest of its value); the digest tells apart the rows of one offset in two epochs of a topic.
RowId = tuple[str, int, int, bytes]


def row_id(topic: str, partition: int, offset: int, value: bytes | None) -> RowId:
    return topic, partition, offset, hashlib.blake2b(value or b"", digest_size=16).digest()


def archived_messages(archive: ParquetArchive, keys: set[bytes] | None = None,
                      refused: Collection[RowId] = ()) -> dict[bytes | None, list[Message]]:
    """The archived input messages of job accounting (of the given keys, default all), per message
    key, as the live worker read them (``as_read_live``), without the ``refused`` rows (``unsigned_rows``: a record the
    worker refused for its signer changed no account, exactly as if it were absent)."""
    per_key: dict[bytes | None, list[Message]] = defaultdict(list)
    # The catalog names (the archive's topic= partition), so no topic prefix needs configuring.
    for m in archived_input(archive, [NODE_IPC.name, JOBS_LIFECYCLE.name], keys):
        if refused and row_id(m[0].topic, m[0].partition, m[0].offset, m[2]) in refused:
            continue
        per_key[m[1]].append(m)
    return per_key


def recompute(messages: dict[bytes | None, list[Message]], policies: dict[str, PricingPolicy],
              default: PricingPolicy, superseded: dict[tuple[str, int], Charge] | None = None,
              revision_policies: dict[tuple[str, int], PricingPolicy] | None = None,
              ) -> dict[tuple[str, int], Charge]:
    """Every charge the archived messages yield, per (job, revision), priced under the job's policy
    in ``policies`` (its newest ledger row's). A revision in ``revision_policies`` whose row was
    priced under another policy (an upgrade or a policy change between two revisions of one job)
    is recomputed under its own: the job is folded once more per such policy. ``superseded``, when
    given, receives the revisions a correction superseded before their nodes closed: a ledger row
    of one is checked against it, and its absence is no finding."""
    out: dict[tuple[str, int], Charge] = {}
    by_job: dict[str, dict[int, PricingPolicy]] = defaultdict(dict)
    for (j, r), p in (revision_policies or {}).items():
        by_job[j][r] = p
    for key, msgs in messages.items():
        job = key.decode(errors="replace") if key is not None else ""
        policy = policies.get(job, default)
        own = {r: p for r, p in by_job.get(job, {}).items() if p != policy}
        for fold_policy in [policy, *dict.fromkeys(own.values())]:  # each revision under the policy it was priced by
            accounts, produced = fold_states(msgs, fold_policy)
            for o in produced:
                c = decode_model(Charge, o.value)
                if own.get(c.revision, policy) == fold_policy:
                    out.setdefault((c.job_id, c.revision), c)
            if superseded is not None:
                for account in accounts.values():
                    superseded.update(((c.job_id, c.revision), c) for c in account.superseded_charges(fold_policy)
                                      if own.get(c.revision, policy) == fold_policy)
    return out


@dataclass(frozen=True)
class Window:
    """Jobs that ended in [start, end) (UTC; None: unbounded): what ``audit --from/--to`` compares."""

    start: datetime | None = None
    end: datetime | None = None

    def holds(self, t: datetime) -> bool:
        return (self.start is None or t >= self.start) and (self.end is None or t < self.end)


EVERY_JOB = Window()


def policy_of(charge: Charge) -> PricingPolicy:
    """The policy a charge was priced under, from what it records (a charge before version 6 was
    priced at its point estimate; one before version 7 had no interval margin; one before version 8
    by its cores; one of version 8 by the weights it names, if any; one before version 10 had no
    short-sample margin, and its interval's lower end never reached the trusted level's)."""
    bound = charge.priced_at == "upper_bound"
    return PricingPolicy(rate_per_core_hour=charge.rate_per_core_hour, delta=charge.delta,
                         rate_function=charge.rate_function, estimator=charge.estimator,
                         confidence=charge.confidence or DEFAULT_CONFIDENCE, price_at_bound=bound,
                         prior_high=DEFAULT_PRIOR_HIGH if charge.prior_degradation_high is None
                         else charge.prior_degradation_high,
                         prior_without_evidence=charge.confidence is not None,
                         margin_abs=charge.interval_margin_abs or 0.0, margin_rel=charge.interval_margin_rel or 0.0,
                         short_margin=charge.short_margin or 0.0,
                         short_sample_us=charge.short_sample_us or DEFAULT_SHORT_SAMPLE_US,
                         trusted_level_low=charge.short_sample_us is not None,
                         standard_units="cores" if charge.billing_weights is None else "tres",
                         billing_weights=((charge.partition or "", charge.billing_weights),)
                         if charge.billing_weights not in (None, "slurm") else ())


@dataclass
class JobsAudit:
    """The ledger rows recomputed and compared. ``checked`` holds each row's key and its
    differences (none: a match), in no particular order."""

    checked: list[tuple[tuple[str, int], list[Mismatch]]] = field(default_factory=list)
    missing: list[tuple[str, int]] = field(default_factory=list)  # recomputed, not in the ledger
    fast_path_jobs: int = 0
    reference_path_jobs: int = 0
    samples: int = 0  # shutter samples the fast path checked
    #: records archived more than once (ParquetArchive.duplicates): (topic, partition, epoch, offset, differ)
    duplicates: list[tuple[str, int, int, int, bool]] = field(default_factory=list)
    #: with identities checked: jobs with an archived record its signer may not have written
    refused_jobs: list[str] = field(default_factory=list)


def reference_task(location: Path | str, keys: list[bytes] | None, policies: dict[str, PricingPolicy],
                   default: PricingPolicy, revision_policies: dict[tuple[str, int], PricingPolicy] | None = None,
                   refused: Collection[RowId] = (),
                   ) -> tuple[dict[tuple[str, int], Charge], dict[tuple[str, int], Charge], int]:
    """One task of the reference path: these jobs' archived messages (None: every message), but the
    ``refused`` rows, folded by the stream's own functions. Returns their charges, the revisions a
    correction superseded, and the jobs (message keys) folded. It never sees the site secret: a
    task may run on a Dask worker on a compute node."""
    messages = archived_messages(ParquetArchive(location), None if keys is None else set(keys), refused)
    superseded: dict[tuple[str, int], Charge] = {}
    return recompute(messages, policies, default, superseded, revision_policies), superseded, len(messages)


#: The columns the signature check reads, per topic: where the row is, what the signature covers,
#: and what says who may have written it (node.ipc's typed ``kind`` and ``node``; a lifecycle
#: event is a service's).
_SIGNED_COLUMNS = {NODE_IPC.name: ["partition", "offset", "key", "value", "auth", "kind", "node"],
                   JOBS_LIFECYCLE.name: ["partition", "offset", "key", "value", "auth"]}


def _as_the_models_read(topic: str, value: bytes, kind: str | None, node: str | None) -> Any:
    """What a record is and which node it is about, as the worker's models read it, or None when
    they refuse it (the worker dead-letters it before any signature matters). The typed columns are
    DuckDB's reading, which keeps the first of a key written twice where the models keep the last,
    and reads an escaped key as the plain one: a value that names "kind" or "node" more than once,
    or holds any escape, is decoded by the models themselves (normal records do neither)."""
    if b"\\" not in value and value.count(b'"kind"') <= 1 and value.count(b'"node"') <= 1:
        return None if kind is None else SimpleNamespace(kind=kind, node=node)
    try:
        return decode(spec_for_topic(topic), value)
    except (DecodeError, RecursionError):
        return None


def unsigned_task(location: Path | str, topic: str, files: list[str], verifier: Verifier
                  ) -> dict[str, set[RowId]]:
    """One task of the signature check: per job (message key), the rows of these archive files of
    ``topic`` whose signer may not have written them (``schemas.signing.identity_problem``)."""
    import pyarrow.parquet as pq

    from nodeshare.sinks.archive import ARCHIVE_SCHEMA, IPC_SCHEMA

    archive = ParquetArchive(location)
    schema = IPC_SCHEMA if topic == NODE_IPC.name else ARCHIVE_SCHEMA
    out: dict[str, set[RowId]] = defaultdict(set)
    for f in files:
        table = pq.read_table(f, columns=_SIGNED_COLUMNS[topic], schema=schema, filesystem=archive.fs)
        rows = table.to_pydict()
        kinds = rows.get("kind") or ["job_event"] * table.num_rows
        nodes = rows.get("node") or [None] * table.num_rows
        for partition, offset, key, value, auth, typed_kind, typed_node in zip(
                rows["partition"], rows["offset"], rows["key"], rows["value"], rows["auth"], kinds, nodes, strict=True):
            record = _as_the_models_read(topic, value or b"", typed_kind, typed_node)
            if record is None:  # not a record the fold decodes: refused before any signature matters
                continue
            signer = verifier.signer(topic, key, value, auth)
            if identity_problem(record, signer):
                out[(key or b"").decode(errors="replace")].add(row_id(topic, partition, offset, value))
    return out


def unsigned_rows(archive: ParquetArchive, verifier: Verifier, threads: int | None = None) -> dict[str, set[RowId]]:
    """Per job, every archived row of the fold's topics that its signer may not have written,
    checked file by file on threads of this process, never on a Dask cluster: the check needs the
    site secret, which must not leave the audit's host."""
    runner = in_process(threads)
    calls = [(archive.location, topic, [archive.uri(f) for f in archive.files(topic)[i::runner.slots]], verifier)
             for topic in _SIGNED_COLUMNS for i in range(runner.slots)]
    found: dict[str, set[RowId]] = defaultdict(set)
    for part in runner.map(unsigned_task, [c for c in calls if c[2]]):
        for job, rows in part.items():
            found[job] |= rows
    return found


def audit_jobs(archive: ParquetArchive, ledger_rows: dict[tuple[str, int], Charge], beyond: set[str],
               default: PricingPolicy, fast: bool, window: Window = EVERY_JOB, runner: Runner | None = None,
               progress: AuditProgress | None = None, verifier: Verifier | None = None) -> JobsAudit:
    """Recompute the charges ``archive`` yields and compare them with ``ledger_rows`` (those beyond
    retention left out). With ``fast``, the vectorized path recomputes the clean jobs and the
    reference fold the rest, including every job where the two disagree with the ledger; without
    it, the reference fold recomputes everything. Both run as tasks on ``runner`` (default:
    threads of this process): the vectorized fold in chunks of the archive's row groups, the
    reference fold (pure Python) in groups of jobs on a runner of processes, in one task here.
    With ``verifier``, a record its signer may not have written counts for nothing, as in the
    worker: the jobs that have one go to the reference fold, which leaves those rows out."""
    runner = runner if runner is not None else in_process(archive.threads)
    policies = {job: policy_of(c) for (job, _), c in sorted(ledger_rows.items())}  # the newest revision's
    # a revision priced under another policy than its job's newest (an upgrade, a changed margin or
    # rate): the reference fold recomputes it under its own
    mixed = {key: p for key, c in ledger_rows.items() if (p := policy_of(c)) != policies[key[0]]}
    recomputed: dict[tuple[str, int], Charge] = {}
    reference_jobs: set[str] | None = None  # None: every job
    samples = 0
    duplicates = None
    refused_rows = unsigned_rows(archive, verifier, archive.threads) if verifier is not None else {}
    refused = set(refused_rows)
    if fast:
        result = fast_recompute(archive.location, policies, default, archive.partitions, archive.threads,
                                runner=runner, progress=progress)
        samples, duplicates = result.samples, result.duplicates
        reference_jobs = set(result.ineligible) | refused
        for key, charge in result.charges.items():
            row = ledger_rows.get(key)
            if row is not None and not diff_charges(row, charge):
                recomputed[key] = charge
            else:
                reference_jobs.add(key[0])
        reference_jobs |= {job for (job, revision) in ledger_rows if (job, revision) not in recomputed}
        recomputed = {k: c for k, c in recomputed.items() if k[0] not in reference_jobs}
        reference_jobs -= beyond  # their partial events would only re-fold to a charge that is not compared
    every_refused = frozenset(r for rows in refused_rows.values() for r in rows)
    calls: list[tuple[Any, ...]] = [(archive.location, None, policies, default, mixed, every_refused)]  # all
    if reference_jobs is not None:
        keys = sorted(reference_jobs)
        groups = runner.slots if runner.processes else 1
        calls = [(archive.location, [k.encode() for k in group], {k: policies[k] for k in group if k in policies},
                  default, {key: p for key, p in mixed.items() if key[0] in members},
                  frozenset(r for k in group for r in refused_rows.get(k, ())))
                 for group in (keys[i::groups] for i in range(groups)) if group for members in [set(group)]]
    fast_jobs = {k[0] for k in recomputed}
    superseded: dict[tuple[str, int], Charge] = {}
    folded = 0
    for charges, replaced, jobs in runner.map(reference_task, calls):
        for key, charge in charges.items():
            recomputed.setdefault(key, charge)
        superseded.update(replaced)
        folded += jobs
    part = JobsAudit(fast_path_jobs=len(fast_jobs), reference_path_jobs=folded, samples=samples,
                     refused_jobs=sorted(refused),
                     duplicates=duplicates if duplicates is not None
                     else archive.duplicates([NODE_IPC.name, JOBS_LIFECYCLE.name]))
    for key, row in ledger_rows.items():
        again = recomputed.get(key, superseded.get(key))
        part.checked.append((key, [Mismatch(key[0], key[1], "*", "charged", "no charge from the archive")]
                             if again is None else diff_charges(row, again)))
    part.missing = [k for k, c in recomputed.items()
                    if k not in ledger_rows and k[0] not in beyond and window.holds(c.end_time)]
    return part


@contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None) -> Iterator[Any]:
    """A dask.distributed Client: of the scheduler at ``scheduler`` (a cluster the site runs, e.g.
    dask-jobqueue's SLURMCluster), or of a LocalCluster of ``workers`` processes; None for neither."""
    if scheduler is None and workers is None:
        yield None
        return
    from distributed import Client, LocalCluster

    if scheduler is not None:
        with Client(scheduler, timeout=10) as client:
            yield client
        return
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        yield client


def on_dask(client: Any) -> Runner:
    """The audit's tasks on a Dask cluster: as many at once as its workers have threads (each task's
    DuckDB runs on one)."""
    from distributed import as_completed

    def run(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> Iterator[Any]:
        futures = [client.submit(fn, *args, key=f"nodeshare-audit-{fn.__name__}-{uuid.uuid4().hex[:12]}", pure=False)
                   for args in calls]
        for future in as_completed(futures):
            yield future.result()

    return Runner(max(1, sum(client.nthreads().values())), run, processes=True)


#: Reports progress: (tasks done, tasks, shutter samples folded so far).
AuditProgress = Progress


def audit(archive_root: Path | str, ledger_path: Path, default: PricingPolicy, *, fast: bool = True,
          client: Any = None, progress: AuditProgress | None = None, window: Window = EVERY_JOB,
          threads: int | None = None, verifier: Verifier | None = None) -> AuditReport:
    """Verify the ledger against the archive. The hash chain, the ledger's columns and
    conservation are checked here, globally; the recomputation runs as tasks, on ``threads``
    threads of this process (default: one per core) or with ``client`` (a dask.distributed Client)
    on its cluster: one code path, the same report. With a ``window``, only jobs that ended in it
    (their current revision's end; for a job the ledger lacks, the end its archive yields) are
    compared and looked for. With ``verifier`` (the site secret's), records are taken only from
    identities allowed to write them, as the worker's fold takes them; a ledger folded under
    signatures and audited without the secret fails on every job that had a refused record."""
    with Ledger(ledger_path, read_only=True) as ledger:
        ledger_rows = {(c.job_id, c.revision): c for c in ledger.charges()}
        drift = ledger.column_drift()
        chain = ledger.verify_chain()
    archive = ParquetArchive(archive_root, threads=threads)
    pruned = archive.retention()
    beyond = {job for (job, _), c in ledger_rows.items()
              if any(r.first_offset <= pruned.get((r.topic, r.partition), -1) for r in c.event_range)}
    outside = {c.job_id for c in current_revisions(list(ledger_rows.values())) if not window.holds(c.end_time)}
    pruned_rows = sum(k[0] in beyond for k in ledger_rows)
    beyond = beyond | outside  # neither compared nor looked for, as the rows beyond retention
    all_rows, ledger_rows = ledger_rows, {k: c for k, c in ledger_rows.items() if k[0] not in beyond}
    runner = on_dask(client) if client is not None else in_process(threads)
    part = audit_jobs(archive, ledger_rows, beyond, default, fast, window, runner, progress, verifier)
    report = AuditReport(events_read=archive.count(), chain_ok=chain.ok,
                         fast_path_jobs=part.fast_path_jobs, reference_path_jobs=part.reference_path_jobs,
                         chain_error=chain.error,
                         conservation_violations=conservation_violations(list(all_rows.values())),
                         beyond_retention=pruned_rows,
                         outside_window=len(all_rows) - len(ledger_rows) - pruned_rows,
                         identities_checked=verifier is not None, refused_jobs=part.refused_jobs)
    # A SQL column edited behind the record's back is tampering too: analysts read the columns.
    report.mismatches += [Mismatch(j, r, f"column {c}", v, want) for j, r, c, v, want in drift]
    for _, diffs in sorted(part.checked, key=lambda c: c[0]):
        report.charges_checked += 1
        report.mismatches += diffs
        report.matches += not diffs
    report.missing_in_ledger = [f"{j}#{r}" for (j, r) in sorted(part.missing)]
    report.conflicting_copies = [f"{t}[{p}]@{o}" + (f" (epoch {e})" if e else "")
                                 for t, p, e, o, differ in part.duplicates if differ]
    # ended jobs with no charge anywhere: the fold above yields none, so no comparison can miss them
    latest: dict[str, int] = {}
    for job, revision in all_rows:
        latest[job] = max(revision, latest.get(job, -1))
    report.missing_charges = [p for p in pending_jobs(archive, latest, default, window.start, window.end, verifier)
                              if not p.charge_in_archive]
    return report


def current_revisions(charges: list[Charge]) -> list[Charge]:
    latest: dict[str, Charge] = {}
    for c in charges:
        if c.job_id not in latest or c.revision > latest[c.job_id].revision:
            latest[c.job_id] = c
    return [latest[j] for j in sorted(latest)]


def conservation_violations(charges: list[Charge], rel_tol: float = 1e-9) -> list[str]:
    """For every day (of job end, UTC): total standard price = total charged + total dividend + total
    adjustment credit (operators' adjustments, schema 8); and every job's charge lies within [0, its
    standard price]. Only current revisions count."""
    out: list[str] = []
    by_day: dict[str, list[Charge]] = defaultdict(list)
    for c in current_revisions(charges):
        by_day[c.end_time.astimezone(UTC).date().isoformat()].append(c)
        if not 0.0 <= c.price <= c.standard_price * (1 + rel_tol):
            out.append(f"{c.job_id}#{c.revision}: price {c.price} outside [0, standard price {c.standard_price}]")
        if c.adjustment is None and c.adjustment_credit != 0.0:
            out.append(f"{c.job_id}#{c.revision}: an adjustment credit of {c.adjustment_credit} without an adjustment")
    for day, rows in sorted(by_day.items()):
        sop = math.fsum(c.standard_price for c in rows)
        charged = math.fsum(c.price for c in rows)
        dividend = math.fsum(c.dividend for c in rows)
        credit = math.fsum(c.adjustment_credit for c in rows)
        if not math.isclose(sop, charged + dividend + credit, rel_tol=rel_tol, abs_tol=1e-12):
            out.append(f"{day}: standard price {sop} != charged {charged} + dividend {dividend}"
                       + (f" + adjustment credit {credit}" if credit else ""))
    return out


def diff_charges(ledger: Charge, recomputed: Charge) -> list[Mismatch]:
    """Differences in every field the ledger row's schema version has (a row written by an older
    version is compared on what it carries). Which build and schema wrote it (``code_version``,
    ``schema_version``, ``source``) is provenance, as in the ledger's redelivery check: an upgraded
    build recomputes an old row to the same charge, stamped with its own version."""
    return [Mismatch(ledger.job_id, ledger.revision, f, a, b) for f, a, b in charge_differences(ledger, recomputed)]
