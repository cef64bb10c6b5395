"""The charge fold's state of one input partition as of its offsets: what lets retention be short.

The stream worker's charge fold (``streams.worker.fold_consumer``) keeps the job accounts of each
input partition (``node.ipc`` and ``jobs.lifecycle``, co-partitioned). Without snapshots, a
partition assigned to a worker is rebuilt from offset 0 of both topics, so neither may ever delete
a record. With them, the worker writes each partition's accounts, with the offset of each topic
they are after, to the compacted ``accounting.snapshots``, and a rebuild folds only the records
after the newest complete snapshot of the partition: retention may delete everything before it.

A snapshot is JSON (each account as its persisted model: no code runs on load, unlike a pickle),
compressed, and cut into chunks of at most ``CHUNK_BYTES`` (a partition of many large jobs passes
Kafka's 1 MB message limit), each a message of its own keyed ``<partition>/<snapshot id>/<index>``.
Every chunk's header names the snapshot, the chunk count, the digest of the whole and the offsets,
so a reader assembles only complete, undamaged snapshots: a worker killed while it wrote one leaves
chunks that are never used. Keys are unique per snapshot (compaction never mixes two), and once a
snapshot is durable the worker deletes the one it replaced (tombstones of its chunks).

Any complete snapshot is a correct state: the fold is a deterministic function of the records
before the offsets (which member took it, a zombie included, changes nothing), and what those
records produced (charges, dead letters) was made durable before the snapshot was written. So a
rebuild takes the complete snapshot with the most records and, per topic, folds from its offset up
to the group's committed one, or, where the snapshot is ahead of the commit (a commit that failed
after the snapshot), consumes from the snapshot's offset. A snapshot taken under another pricing
policy or partition count is not used (the partition is folded from offset 0, as without snapshots).
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC

from .accounting import JobAccount, PricingPolicy

FORMAT = 1
#: The persisted shape of a partition's state: bumped by a release that changes it. A snapshot of a
#: state version this build does not read is neither used (its accounts may not decode) nor deleted
#: (a member still on the other release, or a rollback, may need it). Version 2 added the index of
#: settled accounts (``FoldSnapshot.settled``): a release that reads only version 1 would take an
#: evicted job's late record for a new job's, so it must not read version 2.
STATE_VERSION = 2
#: The state versions this build reads: version 1 is version 2 with no settled account.
READABLE_STATES = frozenset({1, 2})
#: The shape of a settled account's message (``encode_settled``) and of the account in it: its own
#: number, so that a change of the snapshots alone leaves every settled account readable.
SETTLED_VERSION = 1
#: The largest chunk's compressed bytes: well under Kafka's default 1 MB message limit
CHUNK_BYTES = 512 * 1024

Accounts = dict[bytes | None, JobAccount]
#: Where a settled account is: its offset on ``accounting.settled``, and how far its job's records
#: of ``node.ipc`` and ``jobs.lifecycle`` had been applied (``progress``) when it left memory
Mark = tuple[int, int, int]
#: A partition's settled accounts, out of memory: message key -> its mark, packed (``pack``)
SettledIndex = dict[bytes | None, int]
#: Bits of each part of a packed mark: offsets up to 2**48 (a partition of 281 trillion messages)
_MARK_BITS = 48


def pack(mark: Mark) -> int:
    """A mark as one integer: the worker holds one per job ever charged, and a tuple of three
    costs about 100 bytes more than one integer (``bench sizing``)."""
    offset, ipc, life = mark
    if min(offset, ipc + 1, life + 1) < 0 or max(offset, ipc + 1, life + 1) >> _MARK_BITS:
        raise ValueError(f"a mark out of range: {mark}")
    return offset | (ipc + 1) << _MARK_BITS | (life + 1) << 2 * _MARK_BITS


def unpack(packed: int) -> Mark:
    low = (1 << _MARK_BITS) - 1
    return packed & low, (packed >> _MARK_BITS & low) - 1, (packed >> 2 * _MARK_BITS) - 1


class SnapshotProblem(ValueError):
    """A chunk or snapshot that cannot be used (the reason is logged; the partition folds from an
    older snapshot, or from offset 0)."""


def config_of(policy: PricingPolicy) -> str:
    """What in the pricing policy the accounts depend on: only ``delta`` (which blocks a fold keeps);
    the rate, estimator and confidence price charges from the accounts, so changing them keeps every
    snapshot usable. A snapshot under another ``delta`` is not used: its partition folds from offset 0."""
    return f"delta={policy.delta!r}"


@dataclass(frozen=True)
class FoldSnapshot:
    """One input partition's accounts after every record before ``offsets`` (topic -> offset)."""

    partition: int
    partitions: int  # the input topics' partition count it was taken under
    offsets: dict[str, int]
    config: str  # ``config_of`` the policy it was folded under
    accounts: Accounts
    snapshot_id: str = ""
    chunks: int = 0
    settled: SettledIndex = field(default_factory=dict)

    @property
    def records(self) -> int:
        """How many input offsets it covers: the newest complete snapshot is the one with most."""
        return sum(self.offsets.values())


def chunk_key(partition: int, snapshot_id: str, index: int) -> bytes:
    return f"{partition}/{snapshot_id}/{index}".encode()


def _digest(head: Mapping[str, object], body: bytes) -> str:
    """sha256 of what every chunk's header says of the whole (all but its index and the digest) and
    of the body: a header changed after the fact fails it as the body would."""
    said = json.dumps({k: v for k, v in head.items() if k not in ("index", "digest")}, sort_keys=True).encode()
    return hashlib.sha256(said + b"\n" + body).hexdigest()


def _b64(key: bytes | None) -> str | None:
    return None if key is None else base64.b64encode(key).decode()


def encode_snapshot(partition: int, partitions: int, offsets: Mapping[str, int], config: str, accounts: Accounts,
                    snapshot_id: str | None = None, chunk_bytes: int | None = None,
                    settled: SettledIndex | None = None) -> list[tuple[bytes, bytes]]:
    """The (key, value) messages of a snapshot: one per chunk, in order. Its body holds the accounts
    in memory and the index of the settled ones (``settled``)."""
    sid = snapshot_id or uuid.uuid4().hex
    body = zlib.compress(json.dumps({
        "accounts": [[_b64(k), a.model_dump_json()] for k, a in sorted(accounts.items(), key=lambda kv: kv[0] or b"")],
        "settled": [[_b64(k), *unpack(m)] for k, m in sorted((settled or {}).items(), key=lambda kv: kv[0] or b"")],
    }).encode(), 6)
    size = chunk_bytes or CHUNK_BYTES
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    whole = {"format": FORMAT, "state": STATE_VERSION, "partition": partition, "partitions": partitions, "id": sid,
             "count": len(parts), "offsets": dict(sorted(offsets.items())), "config": config}
    digest = _digest(whole, body)
    return [(chunk_key(partition, sid, i), json.dumps({**whole, "index": i, "digest": digest}, sort_keys=True).encode()
             + b"\n" + part) for i, part in enumerate(parts)]


def tombstones(partition: int, snapshot_id: str, chunks: int) -> list[tuple[bytes, None]]:
    """The messages that delete a replaced snapshot from the compacted topic."""
    return [(chunk_key(partition, snapshot_id, i), None) for i in range(chunks)]


#: The most chunks a snapshot may have (512 KB each: 50 GB); a header claiming more is refused
MAX_CHUNKS = 100_000

_HEAD_TYPES = {"format": int, "state": int, "partition": int, "partitions": int, "id": str, "index": int, "count": int,
               "offsets": dict, "config": str, "digest": str}


def _head(value: bytes) -> tuple[dict, bytes]:
    """A chunk's header, every field of the type it must have, and its part of the body."""
    head, sep, part = value.partition(b"\n")
    if not sep:
        raise SnapshotProblem("not a fold snapshot chunk")
    try:
        h = json.loads(head)
    except (ValueError, RecursionError) as exc:
        raise SnapshotProblem(f"a chunk header that is not JSON: {str(exc)[:200]}") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise SnapshotProblem(f"snapshot format {h.get('format') if isinstance(h, dict) else '?'}; "
                              f"this build reads {FORMAT}")
    wrong = [k for k, t in _HEAD_TYPES.items() if type(h.get(k)) is not t]
    if wrong or not all(type(k) is str and type(o) is int and o >= 0 for k, o in h["offsets"].items()) \
            or not 0 <= h["index"] < h["count"] <= MAX_CHUNKS:
        raise SnapshotProblem(f"a chunk header with fields of the wrong type or range: {sorted(wrong) or 'offsets'}")
    return h, part


def live_keys(messages: Iterable[tuple[bytes | None, bytes | None]], partition: int) -> dict[bytes, bytes]:
    """The keys of ``partition``'s chunks a compacted topic holds (the last value of a key wins, None
    deletes it), with their values."""
    latest: dict[bytes, bytes] = {}
    for key, value in messages:
        if key is None or not key.startswith(f"{partition}/".encode()):
            continue
        if value is None:
            latest.pop(key, None)
        else:
            latest[key] = value
    return latest


def replaceable(messages: Iterable[tuple[bytes | None, bytes | None]], partition: int) -> list[bytes]:
    """The chunk keys of ``partition`` a newer snapshot of this build replaces: those whose header
    says this format and state version (older, incomplete or damaged snapshots of this release,
    ones under another ``delta`` or partition count) and those with no readable header at all. A
    chunk of another format or state version is kept: a member on another release may need it."""
    out = []
    for key, value in live_keys(messages, partition).items():
        head = value.partition(b"\n")[0]
        try:
            h = json.loads(head)
        except (ValueError, RecursionError):
            h = None  # no snapshot of anyone's
        if not isinstance(h, dict) or (h.get("format"), h.get("state")) == (FORMAT, STATE_VERSION):
            out.append(key)
    return out


def _chunks(messages: Iterable[tuple[bytes | None, bytes | None]], partition: int, partitions: int, config: str,
            ) -> tuple[list[FoldSnapshot], dict[str, dict[int, tuple[dict, bytes]]], list[str]]:
    """The complete snapshots of ``partition`` (without their accounts), most records first; their
    chunks by id and index; and why any other one is not used."""
    problems: list[str] = []
    found: dict[str, dict[int, tuple[dict, bytes]]] = defaultdict(dict)
    for key, value in live_keys(messages, partition).items():
        try:
            h, part = _head(value)
            if key != chunk_key(partition, h["id"], h["index"]) or h["partition"] != partition:
                raise SnapshotProblem("a chunk whose header names another place")
        except SnapshotProblem as exc:
            problems.append(f"{key!r}: {exc}")
            continue
        found[h["id"]][h["index"]] = (h, part)
    complete: list[FoldSnapshot] = []
    for sid, chunks in found.items():
        first = next(iter(chunks.values()))[0]
        count = first["count"]
        # indexes are distinct and below count (headers checked): all there when there are count of them
        if len(chunks) != count or any(h != first | {"index": i} for i, (h, _) in chunks.items()):
            problems.append(f"snapshot {sid}: {len(chunks)} of {count} chunks, or chunks that disagree (a writer "
                            "stopped while it wrote it)")
        elif first["state"] not in READABLE_STATES:
            problems.append(f"snapshot {sid}: state version {first['state']} (another release's); this build "
                            f"reads {', '.join(map(str, sorted(READABLE_STATES)))}")
        elif first["partitions"] != partitions:
            problems.append(f"snapshot {sid}: taken under {first['partitions']} partitions, not {partitions}")
        elif first["config"] != config:
            problems.append(f"snapshot {sid}: taken under {first['config']}, not {config}")
        else:
            complete.append(FoldSnapshot(partition, partitions, dict(first["offsets"]), config, {}, sid, count))
    return sorted(complete, key=lambda c: (-c.records, c.snapshot_id)), found, problems


def complete_snapshots(messages: Iterable[tuple[bytes | None, bytes | None]], partition: int, partitions: int,
                       config: str) -> list[FoldSnapshot]:
    """Every complete snapshot of ``partition`` under ``partitions`` and ``config`` (accounts not
    read), most records first."""
    return _chunks(messages, partition, partitions, config)[0]


def best(messages: Iterable[tuple[bytes | None, bytes | None]], partition: int, partitions: int,
         config: str) -> tuple[FoldSnapshot | None, list[str]]:
    """The complete, readable snapshot of ``partition`` with the most records among ``messages``
    (a compacted topic's (key, value) in offset order), taken under ``partitions`` and ``config``;
    and why any other snapshot of the partition was not used."""
    complete, found, problems = _chunks(messages, partition, partitions, config)
    for snap in complete:
        head = found[snap.snapshot_id][0][0]
        body = b"".join(found[snap.snapshot_id][i][1] for i in range(snap.chunks))
        if _digest(head, body) != head["digest"]:
            problems.append(f"snapshot {snap.snapshot_id}: damaged (its digest does not match)")
            continue
        try:
            accounts, settled = _body(json.loads(zlib.decompress(body)), head["state"])
        except (ValueError, TypeError, KeyError, zlib.error) as exc:  # pydantic's ValidationError is a ValueError
            problems.append(f"snapshot {snap.snapshot_id}: unreadable ({str(exc)[:200]})")
            continue
        return FoldSnapshot(partition, partitions, snap.offsets, config, accounts, snap.snapshot_id,
                            snap.chunks, settled), problems
    return None, problems


def _key(k: object) -> bytes | None:
    if k is not None and type(k) is not str:
        raise TypeError(f"a key that is neither a string nor null: {k!r:.60}")
    return None if k is None else base64.b64decode(k, validate=True)


def _body(body: object, state: int) -> tuple[Accounts, SettledIndex]:
    """A snapshot body's accounts and settled index (version 1: a list of accounts, nothing settled)."""
    if state == 1:
        body = {"accounts": body, "settled": []}
    if not isinstance(body, dict) or not isinstance(body["accounts"], list) or not isinstance(body["settled"], list):
        raise TypeError("a snapshot body of the wrong shape")
    accounts = {_key(k): JobAccount.model_validate_json(a) for k, a in body["accounts"]}
    settled: SettledIndex = {}
    for k, *mark in body["settled"]:
        if len(mark) != 3 or any(type(o) is not int or o < -1 for o in mark) or mark[0] < 0:
            raise TypeError(f"a settled account's mark that is not one: {mark!r:.60}")
        settled[_key(k)] = pack((mark[0], mark[1], mark[2]))
    if settled.keys() & accounts.keys():
        raise TypeError("a job both in memory and settled")
    return accounts, settled


def resume(snapshot: FoldSnapshot | None, committed: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Where a rebuild folds from per topic, and where consumption resumes: from the snapshot's
    offset up to the committed one; where the snapshot is ahead (its records' outputs were made
    durable before it was written, the commit after it failed), consumption resumes at the
    snapshot's. Without a snapshot: from 0 up to the committed offsets."""
    start = {t: (snapshot.offsets.get(t, 0) if snapshot else 0) for t in committed}
    return start, {t: max(start[t], o) for t, o in committed.items()}


# --------------------------------------------------------------------------- settled accounts

#: The fields of a settled account's header, each of the type it must have
_SETTLED_TYPES = {"format": int, "state": int, "partition": int, "partitions": int, "config": str, "digest": str}


def settled_key(partition: int, key: bytes | None, progress: tuple[int, int]) -> bytes:
    """The key of a settled account on ``accounting.settled``: the input partition, the job's key, and
    how far its records were applied (``progress``): ``<partition>/<job id>@<node.ipc>.<jobs.lifecycle>``.
    One key per state, not per job: a member that lost the partition and still writes an earlier
    state of the job (a zombie) must not have compaction drop the later one the index names. Equal
    keys are equal states (the same records of the partition applied), so compaction loses none."""
    return f"{partition}/".encode() + (key or b"") + f"@{progress[0]}.{progress[1]}".encode()


def encode_settled(partition: int, partitions: int, config: str, account: JobAccount) -> bytes:
    """A settled account as a message value: a JSON header line (what it was folded under, and the
    digest of the rest), then the account compressed."""
    body = zlib.compress(account.model_dump_json().encode(), 6)
    head = {"format": FORMAT, "state": SETTLED_VERSION, "partition": partition, "partitions": partitions,
            "config": config, "digest": hashlib.sha256(body).hexdigest()}
    return json.dumps(head, sort_keys=True).encode() + b"\n" + body


def decode_settled(value: bytes | None, partition: int, partitions: int, config: str, key: bytes | None) -> JobAccount:
    """The account a settled message holds, checked to be ``key``'s of ``partition`` folded under
    ``partitions`` and ``config``; raises SnapshotProblem saying why it cannot be used."""
    head_raw, sep, body = (value or b"").partition(b"\n")
    try:
        head = json.loads(head_raw) if sep else None
    except (ValueError, RecursionError):
        head = None
    if not isinstance(head, dict) or any(type(head.get(k)) is not t for k, t in _SETTLED_TYPES.items()):
        raise SnapshotProblem("not a settled account (no header of the right shape)")
    if (head["format"], head["state"]) != (FORMAT, SETTLED_VERSION):
        raise SnapshotProblem(f"a settled account of format {head['format']}, state {head['state']}; this build reads "
                              f"{FORMAT}, {SETTLED_VERSION}")
    if (head["partition"], head["partitions"], head["config"]) != (partition, partitions, config):
        raise SnapshotProblem(f"a settled account of partition {head['partition']} of {head['partitions']} under "
                              f"{head['config']}, not {partition} of {partitions} under {config}")
    if hashlib.sha256(body).hexdigest() != head["digest"]:
        raise SnapshotProblem("a damaged settled account (its digest does not match)")
    try:
        account = JobAccount.model_validate_json(zlib.decompress(body))
    except (ValueError, zlib.error) as exc:
        raise SnapshotProblem(f"an unreadable settled account ({str(exc)[:200]})") from None
    if key is None or account.job_id.encode() != key:
        raise SnapshotProblem(f"a settled account of job {account.job_id!r}, not of key {key!r:.80}")
    return account


def progress(account: JobAccount, partition: int) -> tuple[int, int]:
    """How far the job's records of ``partition`` were applied to the account: the highest offset
    of ``node.ipc`` and of ``jobs.lifecycle`` (-1: none)."""
    return (account.applied.get(f"{NODE_IPC.name}:{partition}", -1),
            account.applied.get(f"{JOBS_LIFECYCLE.name}:{partition}", -1))


def at_least(account: JobAccount, partition: int, mark: Mark) -> bool:
    """Whether ``account`` has applied every record the account ``mark`` stands for had: it, or a
    later state of it. An earlier one (a copy written by a member that had lost the partition)
    lacks records this partition's fold has consumed, and would charge without them."""
    ipc, life = progress(account, partition)
    return ipc >= mark[1] and life >= mark[2]


def settled(account: JobAccount) -> bool:
    """Whether an account may leave memory: charged, with no terminal event waiting for a node. What
    it may still receive (a correction, a lost node's late data, a copy) is rare, and reads it back."""
    return account.revision >= 0 and account.awaiting() is None
