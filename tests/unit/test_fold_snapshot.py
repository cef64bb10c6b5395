"""The charge fold's snapshots (streams/core/fold_snapshot.py, issue 44: "rebuild time bounded by
state snapshots so that retention can be short"): chunked, complete or not used, the newest
complete one taken, and the rebuild's ranges. The worker's use of them, under rebalances, zombies,
crashes and retention, is tests/unit/test_fold_partitions_property.py's."""

from __future__ import annotations

import json

import pytest
from unit.test_fold_partitions_property import IPC, LIFE, POLICY, PREFIX, records

from nodeshare.streams.core import fold_snapshot as fs
from nodeshare.streams.core.accounting import Origin, fold_states

CONFIG = repr(POLICY)


def accounts(seed: int = 3, jobs: int = 6) -> dict:
    offsets = {IPC: 0, LIFE: 0}
    msgs = []
    for r in records(seed, jobs):
        msgs.append((Origin(r.topic, 0, offsets[r.topic]), r.key, r.value, 0.0))
        offsets[r.topic] += 1
    return fold_states(msgs, POLICY, PREFIX)[0]


def test_a_snapshot_is_cut_into_chunks_and_reads_back_to_the_same_accounts():
    state = accounts()
    chunks = fs.encode_snapshot(0, 4, {IPC: 30, LIFE: 9}, CONFIG, state, "s1", chunk_bytes=200)
    assert len(chunks) > 3 and all(len(v.partition(b"\n")[2]) <= 200 for _, v in chunks)
    assert [k for k, _ in chunks] == [f"0/s1/{i}".encode() for i in range(len(chunks))]
    snap, problems = fs.best(chunks, 0, 4, CONFIG)
    assert problems == [] and snap is not None
    assert (snap.offsets, snap.snapshot_id, snap.chunks, snap.records) == ({IPC: 30, LIFE: 9}, "s1", len(chunks), 39)
    assert snap.accounts == state and snap.accounts is not state


def test_an_incomplete_damaged_or_foreign_snapshot_is_never_used_and_says_why():
    state = accounts()
    good = fs.encode_snapshot(0, 4, {IPC: 10, LIFE: 2}, CONFIG, state, "old", chunk_bytes=300)
    newer = fs.encode_snapshot(0, 4, {IPC: 20, LIFE: 5}, CONFIG, state, "new", chunk_bytes=300)
    # a writer killed after its first chunks: the older complete snapshot is the one used
    snap, problems = fs.best(good + newer[:-1], 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "old" and any("of" in p and "new" in p for p in problems)
    # a chunk's bytes changed: its digest no longer matches
    key, value = newer[1]
    damaged = [*newer[:1], (key, value[:-1] + bytes([value[-1] ^ 1])), *newer[2:]]
    snap, problems = fs.best(good + damaged, 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "old" and any("damaged" in p for p in problems)
    # another policy, another partition count, another partition: not this fold's
    other = fs.encode_snapshot(0, 4, {IPC: 99, LIFE: 9}, CONFIG + "x", state, "policy")
    grown = fs.encode_snapshot(0, 8, {IPC: 99, LIFE: 9}, CONFIG, state, "grown")
    elsewhere = fs.encode_snapshot(1, 4, {IPC: 99, LIFE: 9}, CONFIG, state, "p1")
    snap, problems = fs.best(good + other + grown + elsewhere, 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "old"
    assert any("policy" in p for p in problems) and any("8 partitions" in p for p in problems)
    # a chunk that is not one, or names another place than its key
    bogus = [(b"0/x/0", b"no header"), (b"0/y/0", newer[0][1])]
    assert fs.best(bogus, 0, 4, CONFIG)[0] is None and len(fs.best(bogus, 0, 4, CONFIG)[1]) == 2


def test_tombstones_delete_a_replaced_snapshot_and_the_one_with_most_records_wins():
    state = accounts()
    first = fs.encode_snapshot(2, 4, {IPC: 5, LIFE: 1}, CONFIG, state, "a", chunk_bytes=500)
    second = fs.encode_snapshot(2, 4, {IPC: 7, LIFE: 4}, CONFIG, state, "b", chunk_bytes=500)
    log = first + second + fs.tombstones(2, "a", len(first))
    assert [s.snapshot_id for s in fs.complete_snapshots(log, 2, 4, CONFIG)] == ["b"]
    assert [s.snapshot_id for s in fs.complete_snapshots(first + second, 2, 4, CONFIG)] == ["b", "a"]
    assert fs.best(fs.tombstones(2, "b", len(second)) + second, 2, 4, CONFIG)[0] is not None  # order matters
    assert fs.best(second + fs.tombstones(2, "b", len(second)), 2, 4, CONFIG)[0] is None


def test_the_rebuild_folds_from_the_snapshot_to_the_commit_or_resumes_at_the_snapshot_where_it_is_ahead():
    snap = fs.FoldSnapshot(0, 4, {IPC: 10, LIFE: 4}, CONFIG, {})
    assert fs.resume(None, {IPC: 12, LIFE: 3}) == ({IPC: 0, LIFE: 0}, {IPC: 12, LIFE: 3})
    assert fs.resume(snap, {IPC: 12, LIFE: 6}) == ({IPC: 10, LIFE: 4}, {IPC: 12, LIFE: 6})
    # the commit after the snapshot failed: what the snapshot holds is not read or consumed again
    assert fs.resume(snap, {IPC: 7, LIFE: 6}) == ({IPC: 10, LIFE: 4}, {IPC: 10, LIFE: 6})


def test_a_chunk_header_says_what_it_is():
    [(key, value)] = fs.encode_snapshot(3, 4, {IPC: 1, LIFE: 0}, CONFIG, {}, "z")
    head = json.loads(value.partition(b"\n")[0])
    assert key == b"3/z/0" and head["count"] == 1 and head["format"] == fs.FORMAT
    with pytest.raises(fs.SnapshotProblem, match="format"):
        fs._head(json.dumps({**head, "format": 99}).encode() + b"\n")


def test_only_delta_decides_whether_a_snapshot_fits_the_policy():
    """The accounts depend on delta alone (which blocks are kept); a new rate, estimator or
    confidence prices the same accounts, so it must not throw every snapshot away (a review found
    every partition refused after a rate change once retention had deleted offset 0)."""
    from nodeshare.runtime.config import Settings

    base = Settings()
    same = [base.model_copy(update=u).policy() for u in (
        {"rate_per_core_hour": 1.1}, {"confidence": 0.9}, {"estimator": "refill_corrected"},
        {"price_at_bound": True})]
    assert {fs.config_of(p) for p in same} == {fs.config_of(base.policy())}
    assert fs.config_of(base.model_copy(update={"delta": 0.1}).policy()) != fs.config_of(base.policy())


def test_a_header_changed_after_the_fact_or_of_the_wrong_shape_is_refused_never_a_crash():
    state = accounts()
    good = fs.encode_snapshot(0, 4, {IPC: 10, LIFE: 2}, CONFIG, state, "good", chunk_bytes=300)
    forged = []
    for key, value in fs.encode_snapshot(0, 4, {IPC: 20, LIFE: 5}, CONFIG, state, "forged", chunk_bytes=300):
        head, _, part = value.partition(b"\n")
        h = json.loads(head)
        h["offsets"][IPC] = 10**15  # claims far more records than it holds
        forged.append((key, json.dumps(h, sort_keys=True).encode() + b"\n" + part))
    snap, problems = fs.best(good + forged, 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "good" and any("damaged" in p for p in problems)
    head = json.loads(good[0][1].partition(b"\n")[0])
    for bad in ({"id": ["x"]}, {"offsets": {IPC: "7"}}, {"digest": None}, {"index": "0"}, {"index": -1},
                {"count": 1.5}, {"offsets": [1, 2]}):
        value = json.dumps({**head, **bad}).encode() + b"\n" + b"body"
        snap, problems = fs.best([(b"0/good/0", value)], 0, 4, CONFIG)
        assert snap is None and len(problems) == 1 and "wrong type or range" in problems[0], (bad, problems)


def test_another_releases_snapshot_is_neither_used_nor_deleted(monkeypatch):
    state = accounts()
    ours = fs.encode_snapshot(0, 4, {IPC: 10, LIFE: 2}, CONFIG, state, "ours")
    broken = fs.encode_snapshot(0, 4, {IPC: 11, LIFE: 2}, CONFIG, state, "broken", chunk_bytes=300)[:1]
    monkeypatch.setattr(fs, "STATE_VERSION", fs.STATE_VERSION + 1)  # a newer release's, with more records
    theirs = fs.encode_snapshot(0, 4, {IPC: 30, LIFE: 9}, CONFIG, state, "theirs")
    monkeypatch.undo()
    snap, problems = fs.best(theirs + ours + broken, 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "ours" and any("state version 3" in p for p in problems)
    assert sorted(fs.replaceable(theirs + ours + broken, 0)) == sorted([k for k, _ in ours + broken])


def _state_1(partition: int, offsets: dict, state: dict, sid: str) -> list[tuple[bytes, bytes]]:
    """A snapshot as the release before settled accounts wrote it: state version 1, the body a list."""
    import base64
    import hashlib
    import zlib
    body = zlib.compress(json.dumps([[base64.b64encode(k).decode(), a.model_dump_json()]
                                     for k, a in sorted(state.items())]).encode())
    whole = {"format": 1, "state": 1, "partition": partition, "partitions": 4, "id": sid, "count": 1,
             "offsets": offsets, "config": CONFIG}
    said = json.dumps(whole, sort_keys=True).encode()
    digest = hashlib.sha256(said + b"\n" + body).hexdigest()
    head = json.dumps({**whole, "index": 0, "digest": digest}).encode()
    return [(fs.chunk_key(partition, sid, 0), head + b"\n" + body)]


def test_the_previous_releases_snapshot_is_read_after_an_upgrade_and_kept_for_a_rollback():
    """An upgrade to settled accounts (state version 2) rebuilds from the snapshots it finds (version
    1: every account, nothing settled), not from offset 0; they stay for a rollback to read."""
    state = accounts()
    old = _state_1(0, {IPC: 30, LIFE: 9}, state, "old")
    snap, problems = fs.best(old, 0, 4, CONFIG)
    assert problems == [] and snap is not None and snap.accounts == state and snap.settled == {}
    new = fs.encode_snapshot(0, 4, {IPC: 31, LIFE: 9}, CONFIG, state, "new", settled={b"gone": fs.pack((17, 30, -1))})
    snap, _ = fs.best(old + new, 0, 4, CONFIG)
    assert snap is not None and snap.snapshot_id == "new" and snap.settled == {b"gone": fs.pack((17, 30, -1))}
    assert fs.replaceable(old + new, 0) == [k for k, _ in new]  # the version-1 chunk stays


def test_a_settled_account_reads_back_only_as_what_it_was_written_as():
    state = accounts()
    key, account = next((k, a) for k, a in state.items() if fs.settled(a))
    value = fs.encode_settled(2, 4, CONFIG, account)
    assert fs.settled_key(2, key, fs.progress(account, 0)) == b"2/" + key + b"@%d.%d" % fs.progress(account, 0)
    assert fs.decode_settled(value, 2, 4, CONFIG, key) == account
    head, _, body = value.partition(b"\n")
    other = next(k for k in state if k != key)
    for bad, why in [(value, "partition 2 of 4"), (b"garbage", "no header"), (head + b"\n" + body[:-1], "digest"),
                     (json.dumps({**json.loads(head), "state": 9}).encode() + b"\n" + body, "state 9")]:
        with pytest.raises(fs.SnapshotProblem, match=why):
            fs.decode_settled(bad, 3 if bad is value else 2, 4, CONFIG, key)
    with pytest.raises(fs.SnapshotProblem, match="not of key"):
        fs.decode_settled(value, 2, 4, CONFIG, other)
    with pytest.raises(fs.SnapshotProblem, match="under"):
        fs.decode_settled(value, 2, 4, "delta=0.1", key)


def test_only_a_charged_account_with_nothing_waiting_is_settled():
    offsets = {IPC: 0, LIFE: 0}
    msgs = []
    for r in records(5, 10):
        msgs.append((Origin(r.topic, 0, offsets[r.topic]), r.key, r.value, 0.0))
        offsets[r.topic] += 1
    state: dict = {}
    for upto in range(0, len(msgs), 7):  # jobs part-way through, and every one at the end
        state |= fold_states(msgs[:upto], POLICY, PREFIX)[0]
    state |= {b"x" + k: a for k, a in fold_states(msgs, POLICY, PREFIX)[0].items()}
    for a in state.values():
        assert fs.settled(a) == (a.revision >= 0 and a.revision + 1 == len(a.ends))
    assert any(fs.settled(a) for a in state.values()) and not all(fs.settled(a) for a in state.values())


def test_a_header_that_claims_huge_counts_or_nests_deep_is_refused_never_a_crash():
    """(A second review: ``"count": 10**18`` raised MemoryError, a deeply nested header
    RecursionError, out of every assignment.)"""
    [(key, value)] = fs.encode_snapshot(0, 4, {IPC: 1, LIFE: 0}, CONFIG, {}, "z")
    head = json.loads(value.partition(b"\n")[0])
    for bad in (json.dumps({**head, "count": 10**18}).encode(), b"[" * 200_000):
        snap, problems = fs.best([(key, bad + b"\n")], 0, 4, CONFIG)
        assert snap is None and len(problems) == 1
    assert fs.replaceable([(key, b"[" * 200_000 + b"\n")], 0) == [key]  # nobody's: deleted


def test_chunks_of_another_format_are_kept_for_the_release_that_wrote_them():
    [(key, value)] = fs.encode_snapshot(0, 4, {IPC: 1, LIFE: 0}, CONFIG, {}, "z")
    head = json.loads(value.partition(b"\n")[0])
    newer = json.dumps({**head, "format": fs.FORMAT + 1, "config": {"delta": 0.05}}).encode() + b"\n"
    assert fs.replaceable([(b"0/y/0", newer), (key, value)], 0) == [key]


def test_a_failed_read_is_tried_again_then_stops_the_worker_and_the_age_is_of_unsaved_messages(monkeypatch):
    import time

    from nodeshare.runtime.config import Settings
    from nodeshare.streams.worker import fold_snapshots

    monkeypatch.setattr(fold_snapshots, "READ_BACKOFF_S", 0.0)
    answers = [RuntimeError("still reading"), [(b"k", b"v")]]

    def read(settings, topic):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    snaps = fold_snapshots.Snapshots(Settings(), read=read)
    assert snaps.read() == [(b"k", b"v")]  # the second attempt
    answers[:] = [RuntimeError("no")] * fold_snapshots.READ_ATTEMPTS
    with pytest.raises(fold_snapshots.SnapshotsUnreadable, match="attempts"):
        snaps.read()
    # the age: of the oldest message no snapshot holds; a partition with none does not age
    snaps.loaded(0, [], 0, None)
    snaps.loaded(1, [], 5, time.time() - 3600)  # rebuilt with a tail whose first record is an hour old
    assert snaps.age({0}) == 0.0 and 3590 < snaps.age({0, 1}) < 3700


@pytest.mark.parametrize("mark", [(0, -1, -1), (17, 30, -1), (2**48 - 1, 2**48 - 2, 5)])
def test_a_mark_packs_into_one_integer_and_back(mark):
    assert fs.unpack(fs.pack(mark)) == mark


@pytest.mark.parametrize("mark", [(-1, 0, 0), (0, -2, 0), (2**48, 0, 0), (0, 0, 2**48 - 1)])
def test_a_mark_out_of_range_is_refused(mark):
    with pytest.raises(ValueError, match="out of range"):
        fs.pack(mark)


def test_a_snapshot_with_a_job_both_in_memory_and_settled_is_not_used():
    state = accounts()
    key = next(iter(state))
    snap, problems = fs.best(fs.encode_snapshot(0, 4, {IPC: 1, LIFE: 0}, CONFIG, state, "s",
                                                settled={key: fs.pack((3, 1, 1))}), 0, 4, CONFIG)
    assert snap is None and "both in memory and settled" in problems[0]
