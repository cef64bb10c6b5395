"""The vectorized audit path equals the streaming (reference) path on the same events."""

from __future__ import annotations

import itertools
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from factories import POLICY, T0, archive_records, batch, block, build, job_event, left, scan_order

from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.schemas import JobState, encode
from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.audit import archived_messages, audit, recompute
from nodeshare.sinks.fast_audit import fast_recompute


def _both(archive):
    fast = fast_recompute(archive, {}, POLICY)
    reference = recompute(archived_messages(ParquetArchive(archive)), {}, POLICY)
    return fast, reference


def test_fast_path_equals_the_reference_on_a_simulated_cluster(tmp_path):
    archive, _, n = build(tmp_path)
    fast, reference = _both(archive)
    assert not fast.ineligible and len(fast.charges) == n == len(reference)
    assert fast.charges == reference  # every field, bit for bit
    assert fast.samples == 3 * sum(c.blocks_used + c.blocks_rejected for c in reference.values())


def test_fast_path_equals_the_reference_on_a_larger_multi_node_run(tmp_path):
    sim = simulate(SimConfig(nodes=12, jobs=40, seed=9, multi_node_share=0.6))
    archive, _, n = archive_records(tmp_path, sim.events)
    fast, reference = _both(archive)
    assert len(fast.charges) == n and fast.charges == reference
    assert any(len(c.nodes) == 2 for c in reference.values())


def test_fast_path_equals_the_reference_under_every_estimator(tmp_path):
    from dataclasses import replace

    from nodeshare.streams.core.degradation import ESTIMATORS, UNFILTERED

    archive, _, n = build(tmp_path)
    seen = {}
    for name in ESTIMATORS:
        policy = replace(POLICY, estimator=name)
        fast = fast_recompute(archive, {}, policy)
        reference = recompute(archived_messages(ParquetArchive(archive)), {}, policy)
        assert fast.charges == reference and len(reference) == n
        assert {c.estimator for c in reference.values()} == {name}
        seen[name] = {job: c.price for job, c in reference.items()}
    assert seen[UNFILTERED] != seen[POLICY.estimator]  # the estimator does change what jobs pay


def test_per_job_deltas_are_applied_whatever_the_default(tmp_path):
    """Most jobs share a delta unlike the CLI default (the query's constant is the common one) and two
    jobs have their own; the fast path still equals the reference job by job."""
    from dataclasses import replace

    archive, _, n = build(tmp_path)
    common_policies = {job: replace(POLICY, delta=0.3) for job, _ in recompute(
        archived_messages(ParquetArchive(archive)), {}, POLICY)}
    common = recompute(archived_messages(ParquetArchive(archive)), common_policies, POLICY)
    jobs = sorted(common, key=lambda k: -common[k].blocks_used)  # the three with the most blocks first
    policies = dict(common_policies)
    policies[jobs[0][0]] = replace(POLICY, delta=0.001)
    policies[jobs[1][0]] = replace(POLICY, delta=1e-9)
    fast = fast_recompute(archive, policies, POLICY)
    reference = recompute(archived_messages(ParquetArchive(archive)), policies, POLICY)
    assert not fast.ineligible and fast.charges == reference and len(reference) == n
    assert reference[jobs[1]].blocks_used == 0 < common[jobs[1]].blocks_used  # each job's own delta did matter
    assert reference[jobs[0]].blocks_used < common[jobs[0]].blocks_used
    assert reference[jobs[2]] == common[jobs[2]]


def test_messy_jobs_are_left_to_the_reference_path(tmp_path):
    clean = [block(1.0, 2.0, 1.0, job="ok", cycle=0), left("ok", "n1", 1, 0), job_event("ok", JobState.ENDED)]
    out_of_order = [block(1.0, 2.0, 1.0, job="ooo", cycle=3), block(1.0, 2.0, 1.0, job="ooo", cycle=2),
                    left("ooo", "n1", 2, 3), job_event("ooo", JobState.ENDED)]
    k2 = [block((1.0, 1.0), (2.0, 2.0), (1.0, 1.0), job="k2", cycle=0), left("k2", "n1", 1, 0),
          job_event("k2", JobState.ENDED)]
    corrected = [left("fix", "n1", 0, -1), job_event("fix", JobState.ENDED),
                 job_event("fix", JobState.FAILED, run_s=100).model_copy(update={"event_id": "e2"})]
    garbage = [("node.ipc", b"ok", b"{not json"), ("node.ipc", b"bad", encode(block(1, 2, 1, job="other")))]
    archive, ledger, n = archive_records(tmp_path, clean + out_of_order + k2 + corrected + garbage)
    fast, reference = _both(archive)
    # 'ok' too: a record under its key is not JSON, so only the models' decoder may say what it is
    assert fast.ineligible >= {"ooo", "k2", "fix", "ok"} and fast.suspect_rows == 2
    assert all(reference[k] == c for k, c in fast.charges.items())
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.charges_checked == n == 5  # 'fix' has two revisions
    assert report.fast_path_jobs == 0 and report.reference_path_jobs >= 4


def test_a_wrong_clock_sends_the_job_to_the_reference_path(tmp_path):
    """A block dated a day after the broker received it was dead-lettered by the worker: the fast
    path, which would count it, must leave the job to the reference path, which does not."""
    late = block(1.0, 1.5, 1.0, job="clk", cycle=1).model_copy(update={"event_time": T0 + timedelta(days=1)})
    records = [block(1.0, 2.0, 1.0, job="clk", cycle=0), ("node.ipc", b"clk", encode(late)),  # raw: sent at T0
               left("clk", "n1", 2, 1), job_event("clk", JobState.ENDED)]
    archive, ledger, n = archive_records(tmp_path, records)
    fast, reference = _both(archive)
    assert "clk" in fast.ineligible and n == 1
    assert reference[("clk", 0)].blocks_used + reference[("clk", 0)].blocks_rejected == 1  # the late block is out
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.reference_path_jobs == 1 and report.fast_path_jobs == 0


def test_fast_and_reference_audits_agree_on_every_verdict(tmp_path):
    archive, ledger, n = build(tmp_path)
    fast, slow = audit(archive, ledger, POLICY), audit(archive, ledger, POLICY, fast=False)
    assert fast.ok and slow.ok and fast.matches == slow.matches == n
    assert fast.fast_path_jobs == n and slow.fast_path_jobs == 0


def test_the_bench_archive_is_what_the_archive_sink_would_hold(tmp_path):
    from nodeshare.bench.audit import write_simulated_archive

    jobs = write_simulated_archive(tmp_path / "a", 2000, nodes=8, partitions=3)
    fast, reference = _both(tmp_path / "a")
    assert not fast.ineligible and len(fast.charges) == jobs == len(reference)
    assert fast.charges == reference and fast.suspect_rows == 0
    offsets = defaultdict(list)
    for topic, ev in ParquetArchive(tmp_path / "a").events(["node.ipc", "jobs.lifecycle"]):
        offsets[(topic, ev.partition)].append(ev.offset)
    assert {p for _, p in offsets} == {0, 1, 2}  # the keys spread over the partitions
    assert all(o == list(range(len(o))) for o in offsets.values())  # each partition numbered from 0, no gap


def test_bench_audit_runs_and_reports_its_figures(tmp_path):
    import json

    from typer.testing import CliRunner

    from nodeshare.cli import app

    result = CliRunner().invoke(app, ["bench", "audit", "--blocks", "3000", "--workdir", str(tmp_path),
                                      "--out", str(tmp_path / "audit.json"), "--rounds", "2"])
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "audit.json").read_text())
    # The simulator runs every job to its end: about the blocks asked (contention stretches runs a little)
    assert 3000 <= body["blocks"] <= 3600 and body["samples"] == 3 * body["blocks"] and body["jobs"] > 100
    assert body["rounds"] == 2 and 0 < body["ratio_range"][0] <= body["ratio_range"][1]
    # the rate is the samples over the audit's median time, not another figure under its name
    # (audit_s is rounded to the millisecond)
    t = body["audit_s"]
    assert body["samples"] / (t + 5e-4) - 1 <= body["samples_per_s"] <= body["samples"] / max(t - 5e-4, 1e-9) + 1
    # the same audit on one thread, and on 1 and 2 local Dask workers (default --workers 1,2)
    import pytest

    single, scaling = body["single_thread_samples_per_s"], body["by_workers"]
    assert single > 0 and set(scaling) == {"1", "2"} and body["tasks"] >= 1 and body["row_groups"] >= body["files"]
    for n, row in scaling.items():
        assert row["efficiency"] == pytest.approx(row["samples_per_s"] / (int(n) * single), abs=2e-3)
        assert row["tasks"] >= 1
    assert body["speedup_2_workers"] == pytest.approx(scaling["2"]["samples_per_s"] / single, rel=1e-3)
    assert body["efficiency_1_worker"] == scaling["1"]["efficiency"]
    assert body["bench"] == "audit" and body["targets"]["speedup_2_workers"] == ">= 1.5"
    assert body["targets"]["efficiency_1_worker"] == ">= 0.8"
    # the one thread's steps: the tasks are part of the whole, the serial part is the rest
    steps = body["steps_s"]
    assert {"plan_s", "tasks_s", "merge_s", "terminals_s", "duplicates_s", "charges_s", "total_s"} <= set(steps)
    assert 0 < steps["tasks_s"] < steps["total_s"]
    parallel = steps["tasks_s"] + steps["charges_s"]
    assert body["serial_fraction"] == pytest.approx(1 - parallel / steps["total_s"], abs=2e-4)
    bound = body["speedup_bound"]
    assert 1 < bound["2"] <= bound["4"] <= bound["16"] <= 1 / body["serial_fraction"] + 0.01


def test_the_speedup_bound_is_amdahl_s_law_with_what_runs_beside_the_tasks():
    """Worked by hand: 10 s in all, 8 of them tasks, 1 s of decoding beside them, 0.8 s of charges
    built on the workers, 1.2 s the driver's alone. Two workers: 1.2 + 0.4 + 4 = 5.6 s, 1.786x;
    eight: 1.2 + 0.1 + max(1, 1) = 2.3 s, 4.348x; sixteen: 1.2 + 0.05 + 1 (the decoding does not
    shrink) = 2.25 s, 4.444x, where without it 1.2 + 0.05 + 0.5 = 1.75 s, 5.714x."""
    from nodeshare.bench.audit import speedup_bound

    steps = {"total_s": 10.0, "tasks_s": 8.0, "charges_s": 0.8, "terminals_s": 1.0, "duplicates_s": 0.25}
    assert speedup_bound(steps, 1) == pytest.approx(1.0)
    assert speedup_bound(steps, 2) == pytest.approx(10 / 5.6)
    assert speedup_bound(steps, 8) == pytest.approx(10 / 2.3)
    assert speedup_bound(steps, 16) == pytest.approx(10 / 2.25)
    assert speedup_bound({**steps, "terminals_s": 0.0}, 16) == pytest.approx(10 / 1.75)


# ---------------------------------------------------------------- typed archive columns


def _ipc_files(archive):
    return sorted((archive / "topic=node.ipc").rglob("*.parquet"))


def _edit(path, column, row, value):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[row] = value
    i = table.schema.get_field_index(column)
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type)), path)


def test_node_ipc_files_carry_typed_columns_equal_to_the_decoded_value(tmp_path):
    import pyarrow.parquet as pq

    from nodeshare.schemas import BY_NAME, decode

    archive, _, _ = build(tmp_path)
    rows = pq.read_table(_ipc_files(archive)[0]).to_pylist()
    batches = [r for r in rows if r["kind"] == "shutter_batch"]
    assert batches
    for r in batches:
        rec = decode(BY_NAME["node.ipc"], r["value"])
        assert (r["job_id"], r["node"], r["l_cycle"], r["k"], r["seq"]) == (rec.job_id, rec.node, list(rec.cycle),
                                                                           rec.k, rec.seq)
        assert (r["l_b_instructions"], r["l_d_cycles"], r["l_a_threads"]) == (
            list(rec.before.instructions), list(rec.during.cycles), list(rec.after.threads))
    fast = fast_recompute(archive, {}, POLICY)
    assert fast.suspect_rows == 0 and fast.typed_rows == sum(1 for _ in ParquetArchive(archive).events(["node.ipc"]))


def test_the_value_rules_when_typed_columns_disagree_with_it(tmp_path):
    """Typed columns are a cache: edited alone, the row's job goes to the reference path and the
    audit still passes; a value edited with its typed columns to match is a changed event, and the
    audit says so."""
    import json

    import pyarrow.parquet as pq

    archive, ledger, n = build(tmp_path)
    f = _ipc_files(archive)[0]
    rows = pq.read_table(f).to_pylist()
    row = next(i for i, r in enumerate(rows) if r["kind"] == "shutter_batch")
    _edit(f, "l_d_instructions", row, [1, *rows[row]["l_d_instructions"][1:]])  # the cache: it barely ran alone
    fast = fast_recompute(archive, {}, POLICY)
    assert fast.suspect_rows == 1 and rows[row]["job_id"] in fast.ineligible
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == n

    rec = json.loads(pq.read_table(f).column("value")[row].as_py())
    rec["during"]["instructions"][0] = 1
    _edit(f, "value", row, json.dumps(rec, separators=(",", ":")).encode())  # value and cache agree again
    assert fast_recompute(archive, {}, POLICY).suspect_rows == 0  # byte-exact: the cache is trusted...
    report = audit(archive, ledger, POLICY)
    assert not report.ok and {m.job_id for m in report.mismatches} == {rec["job_id"]}  # ...and the edit is seen


def test_overlapping_files_are_counted_once(tmp_path):
    """A compaction that crashed between writing the merged file and removing its inputs leaves
    offsets in two files: the fast path removes the copies, as the reference path does."""
    import shutil

    archive, ledger, n = build(tmp_path)
    f = _ipc_files(archive)[0]
    shutil.copy(f, f.parent / (f.stem.rsplit("-", 1)[0] + "-999999999999.parquet"))  # same first offset
    fast, reference = _both(archive)
    assert fast.charges == reference and len(fast.charges) == n
    assert audit(archive, ledger, POLICY).ok


def test_compaction_gives_old_files_their_typed_columns(tmp_path):
    import pyarrow.parquet as pq

    from nodeshare.sinks.archive import ARCHIVE_SCHEMA

    archive, ledger, n = build(tmp_path, batch=5)  # several files, which compaction merges
    for f in _ipc_files(archive):  # as written before typed columns existed
        pq.write_table(pq.read_table(f, columns=ARCHIVE_SCHEMA.names), f)
    before = fast_recompute(archive, {}, POLICY)
    assert before.typed_rows == 0 and not before.charges and len(before.ineligible) == n  # the reference path's
    assert audit(archive, ledger, POLICY).ok
    ParquetArchive(archive).compact(min_rows=10**9)
    after = fast_recompute(archive, {}, POLICY)
    assert after.suspect_rows == 0 and len(after.charges) == n and not after.ineligible
    assert audit(archive, ledger, POLICY).ok


def test_an_ipc_outside_the_exact_fixed_point_range_goes_to_the_reference_path(tmp_path):
    records = []
    # IPC 2**-40: x * 2**82 is not an integer; IPC 2**52: x * 2**82 does not fit 128 bits
    for job, sample in (("tiny", samples_of(1, 2**40)), ("huge", samples_of(2**52, 1))):
        odd = block(1.0, 2.0, 1.0, job=job, cycle=0).model_copy(update={"during": sample})
        records += [odd, left(job, "n1", 1, 0), job_event(job, JobState.ENDED)]
    archive, ledger, n = archive_records(tmp_path, records)
    fast = fast_recompute(archive, {}, POLICY)
    assert fast.ineligible == {"tiny", "huge"} and n == 2
    assert audit(archive, ledger, POLICY).ok


def samples_of(instructions, cycles):
    from nodeshare.schemas.events import IpcSample

    return (IpcSample(instructions=instructions, cycles=cycles),)


# ---------------------------------------------------------------- the order check and the two passes


def _backwards(rows):
    import duckdb

    from nodeshare.sinks.fast_audit import out_of_order_streams

    return out_of_order_streams(duckdb.connect(config={"threads": 1}), scan_order(rows))


def test_the_order_check_by_hand():
    # j/a: two runs (two files), increasing across them; j/b: a cycle repeated inside a run
    rows = [("j", "a", 1, 10), ("j", "a", 5, 11), ("j", "b", 2, 3), ("j", "b", 6, 3),
            ("j", "a", 7, 12), ("j", "a", 9, 20)]
    assert _backwards(rows) == {("j", "b")}
    # k/a: runs disjoint in offsets but the second starts at a lower cycle
    assert _backwards([("k", "a", 1, 5), ("k", "a", 2, 6), ("x", "a", 3, 0), ("k", "a", 4, 4)]) == {("k", "a")}
    # m/a: runs that overlap in offsets (1, 3 | 2, 4) are refused even where the cycles would interleave
    assert _backwards([("m", "a", 1, 1), ("m", "a", 3, 5), ("x", "a", 0, 0), ("m", "a", 2, 6), ("m", "a", 4, 7)]) \
        == {("m", "a")}
    # batches: p/a's second batch starts at its first's last cycle; q/a's batch goes back inside itself;
    # r/a's batches follow each other (and a single block after them)
    assert _backwards([("p", "a", 1, (1, 2)), ("p", "a", 2, (2, 3)), ("q", "a", 3, (3, 5, 4)),
                       ("r", "a", 4, (1, 2)), ("r", "a", 5, (3, 9)), ("r", "a", 6, 10)]) == {("p", "a"), ("q", "a")}


def test_the_order_check_never_misses_a_stream_out_of_order():
    """Any scan order: a stream whose cycles do not strictly increase in offset order is always
    named; in the archive's own order (sorted by job, node, offset) a stream that does is not."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    streams = st.lists(st.tuples(st.sampled_from("jk"), st.sampled_from("ab"), st.integers(0, 6)),
                       min_size=1, max_size=14)

    @settings(max_examples=60, deadline=None)
    @given(streams, st.randoms(use_true_random=False))
    def check(draw, rnd):
        rows = [(j, n, offset, c) for offset, (j, n, c) in enumerate(draw)]
        truth = set()
        for key in {(j, n) for j, n, _, _ in rows}:
            cycles = [c for j, n, _, c in rows if (j, n) == key]
            if any(b <= a for a, b in itertools.pairwise(cycles)):
                truth.add(key)
        shuffled = rows[:]
        rnd.shuffle(shuffled)
        assert truth <= _backwards(shuffled)
        assert _backwards(sorted(rows)) == truth

    check()


def test_node_ipc_files_are_sorted_by_job_node_and_offset(tmp_path):
    import pyarrow.parquet as pq

    archive, _, _ = build(tmp_path)
    for f in _ipc_files(archive):
        rows = pq.read_table(f, columns=["job_id", "node", "offset"]).to_pylist()
        keys = [(r["job_id"], r["node"], r["offset"]) for r in rows]
        assert keys == sorted(keys) and len(keys) > 1
    ParquetArchive(archive).compact(min_rows=10**9)
    (merged,) = _ipc_files(archive)
    keys = [(r["job_id"], r["node"], r["offset"]) for r in pq.read_table(merged).to_pylist()]
    assert keys == sorted(keys)


def test_a_typed_job_id_claiming_another_job_sends_both_to_the_reference_path(tmp_path):
    import pyarrow.parquet as pq

    archive, ledger, n = build(tmp_path)
    f = _ipc_files(archive)[0]
    rows = pq.read_table(f).to_pylist()
    row = next(i for i, r in enumerate(rows) if r["kind"] == "shutter_batch")
    other = next(r["job_id"] for r in rows if r["job_id"] != rows[row]["job_id"])
    _edit(f, "job_id", row, other)  # the cache files one of A's blocks under B
    fast, reference = _both(archive)
    assert fast.suspect_rows == 1 and {rows[row]["job_id"], other} <= fast.ineligible
    assert all(reference[k] == c for k, c in fast.charges.items()) and len(reference) == n
    assert audit(archive, ledger, POLICY).ok


def test_a_null_typed_column_never_vouches_for_a_value(tmp_path):
    """concat prints a null as nothing: a value edited to match that (an empty cycle, invalid JSON)
    must not be taken for the record its typed columns describe."""
    import pyarrow.parquet as pq

    archive, ledger, _n = build(tmp_path)
    f = _ipc_files(archive)[0]
    rows = pq.read_table(f).to_pylist()
    row = next(i for i, r in enumerate(rows) if r["kind"] == "shutter_batch")
    cycles = ",".join(map(str, rows[row]["l_cycle"]))
    _edit(f, "l_cycle", row, None)
    _edit(f, "value", row, rows[row]["value"].replace(f'"cycle":[{cycles}],'.encode(), b'"cycle":,'))
    fast = fast_recompute(archive, {}, POLICY)
    assert fast.suspect_rows == 1 and fast.typed_rows == len(rows) - 1 + sum(
        pq.ParquetFile(g).metadata.num_rows for g in _ipc_files(archive)[1:])
    report = audit(archive, ledger, POLICY)  # the worker never counted that block: it is no longer valid
    assert not report.ok and {m.job_id for m in report.mismatches} == {rows[row]["job_id"]}


def test_a_block_exactly_delta_apart_is_refused_by_every_path(tmp_path):
    """Alg. 4 line 3 is strict: |before - after| < delta. IPCs 0.10 and 0.05 are exactly delta = 0.05
    apart in float64, so that block is refused, and one 0.049 apart counts, in the scalar reference,
    the batch fold and the DuckDB fast path alike. (Mutation `<` -> `<=` in any of the three fails here.)"""
    from nodeshare.streams.core.accounting import Origin, apply_message
    from nodeshare.streams.core.degradation import DEFAULT_DELTA, filtered_degradation

    assert DEFAULT_DELTA == 0.05 == 0.10 - 0.05  # exactly on the boundary
    edge, inside = block(0.10, 0.30, 0.05, job="edge", cycle=0), block(0.10, 0.30, 0.051, job="edge", cycle=1)
    records = [edge, inside, left("edge", "n1", 2, 1), job_event("edge", JobState.ENDED)]
    archive, _, _ = archive_records(tmp_path, records)
    fast, reference = _both(archive)
    assert "edge" not in fast.ineligible
    for charge in (fast.charges[("edge", 0)], reference[("edge", 0)]):
        assert (charge.blocks_used, charge.blocks_rejected) == (1, 1)
    _, _, counts = apply_message(None, Origin("node.ipc", 0, 0), b"edge", encode(batch(edge, inside)), 0.0, POLICY)
    assert counts is not None and (counts.accepted, counts.rejected) == (1, 1)
    scalar = filtered_degradation([edge, inside])  # single blocks: one at a time, in scalar floats
    assert (scalar.blocks_used, scalar.blocks_rejected) == (1, 1)


def test_blocks_sent_comes_from_the_marker_not_from_the_blocks_that_arrived(tmp_path):
    """The agent sent 5 blocks, 3 reached the archive (two lost upstream): the charge says 5 sent and
    3 used, in both paths. (Mutation: blocks_sent counted from the archived blocks fails here.)"""
    records = [block(1.0, 2.0, 1.0, job="lossy", cycle=c) for c in (0, 2, 4)]
    records += [left("lossy", "n1", 5, 4), job_event("lossy", JobState.ENDED)]
    archive, _, _ = archive_records(tmp_path, records)
    fast, reference = _both(archive)
    assert "lossy" not in fast.ineligible
    for charge in (fast.charges[("lossy", 0)], reference[("lossy", 0)]):
        assert (charge.nodes[0].blocks_sent, charge.nodes[0].blocks) == (5, 3)


def test_the_time_a_job_ran_alone_comes_from_its_markers_in_both_paths(tmp_path):
    """A node with one job is never shuttered: the blocks measure D over the shared time only. A job
    alone 1,800 s of its 3,600 s is charged half that D; a two-node job alone 3,000 s on one node
    and 1,000 s on the other was alone on both for at least 400 s. Both paths read the markers'
    alone_us from typed columns (a version-3 marker without it too) and agree bit for bit.
    (Mutations: alone_us dropped from the fast path's stream, or the lower bound taken as the
    smallest node's time, fail here.)"""
    import json

    blocks = {j: [block(1.0, 1.4, 1.02, job=j, cycle=c) for c in range(3)] for j in ("half", "two", "never", "v3")}
    v3_left = json.loads(encode(left("v3", "n1", 3, 2, alone_us=900_000_000)))
    v3_left["schema_version"] = 3
    del v3_left["alone_us"]  # written before version 4: it said nothing of the time alone
    records = [*blocks["half"], left("half", "n1", 3, 2, alone_us=1_800_000_000), job_event("half", JobState.ENDED),
               *blocks["never"], left("never", "n1", 3, 2), job_event("never", JobState.ENDED),
               *blocks["v3"], ("node.ipc", b"v3", json.dumps(v3_left, separators=(",", ":")).encode()),
               job_event("v3", JobState.ENDED),
               *blocks["two"], *[block(1.0, 1.4, 1.02, job="two", node="n2", cycle=c) for c in range(3)],
               left("two", "n1", 3, 2, alone_us=3_000_000_000), left("two", "n2", 3, 2, alone_us=1_000_000_000),
               job_event("two", JobState.ENDED, nodes=("n1", "n2"))]
    archive, _, _ = archive_records(tmp_path, records)
    fast, reference = _both(archive)
    assert not fast.ineligible and fast.suspect_rows == 0 and fast.charges == reference
    got = {job: reference[(job, 0)] for job in ("half", "two", "never", "v3")}
    shared = got["never"].degradation
    assert shared > 0 and all(c.degradation_shared == shared for c in got.values())
    assert (got["never"].alone_s, got["v3"].alone_s, got["half"].alone_s, got["two"].alone_s) == (0, 0, 1800, 400)
    assert got["v3"].degradation == shared
    assert got["half"].degradation == shared * 0.5
    assert got["two"].degradation == shared * (1 - 400 / 3600)
    assert got["half"].price > got["never"].price  # less discount: half its run was undisturbed


def _one_batch_job(tmp_path, before, during, after):
    """An archive of one job: one batch of blocks with these (instructions, cycles, threads) per
    region and block, closed, ended."""
    from nodeshare.schemas import CounterSource, ShutterBatch

    def cols(region):
        return {f: tuple(b[i] for b in region) for i, f in enumerate(("instructions", "cycles", "threads"))}
    b = ShutterBatch.model_validate({
        "event_id": "bat", "source": "t", "event_time": T0, "job_id": "j1", "node": "n1", "seq": 0, "k": 1,
        "sample_us": 3200, "counter": CounterSource.SIMULATED, "cycle": tuple(range(len(before))),
        "before": cols(before), "during": cols(during), "after": cols(after)})
    return archive_records(tmp_path, [b, left("j1", "n1", len(before), len(before) - 1),
                                      job_event("j1", JobState.ENDED)])


def test_a_block_without_threads_is_refused_by_both_paths_and_the_fast_audit_never_accepts_its_price(tmp_path):
    """A block with threads = 0 is refused by the reference; the fast path counted it, so a ledger row
    priced with it (9.09 where the reference says 15.36) passed `audit`. Both paths now refuse it."""
    from nodeshare.schemas import encode
    from nodeshare.sinks.ledger import Ledger

    m = 10**6
    archive, _, _ = _one_batch_job(tmp_path, [(m, m, 1), (m, m, 1)], [(1_250_000, m, 1), (2 * m, m, 0)],
                                   [(m, m, 1), (m, m, 1)])
    fast, reference = _both(archive)
    ref = reference[("j1", 0)]
    assert ref.blocks_used == 1 and ref.price == 15.360000000000003  # 24 * 0.8 * 0.8: D 0.2 from one block
    assert fast.charges.get(("j1", 0), ref) == ref
    wrong = ref.model_copy(update={"blocks_used": 2, "degradation": 1 - 1 / 1.625, "price": 9.088757396449704})
    with Ledger(tmp_path / "forged.duckdb") as ledger:
        ledger.append([(wrong, encode(wrong), 0, 0)])
    for path in (True, False):
        assert not audit(archive, tmp_path / "forged.duckdb", POLICY, fast=path).ok


def test_a_co_located_ipc_below_the_fixed_point_is_left_to_the_reference(tmp_path):
    """before 0 and after one instruction in 1,073,736,824 cycles: after is in the fixed point's range,
    their mean (half of it) is not, and the fast path's cast rounded it (degradation ...635 where the
    reference says ...634). It must decline the job, or equal the reference."""
    c = 1_073_736_824
    archive, _, _ = _one_batch_job(tmp_path, [(0, 10**6, 1)], [(1, c - 1, 1)], [(1, c, 1)])
    fast, reference = _both(archive)
    assert reference[("j1", 0)].degradation_filtered == 0.5000000004656634
    assert "j1" in fast.ineligible and ("j1", 0) not in fast.charges


def _patched(record, **fields):
    """A record's bytes with some fields set to what its model refuses, keyed by its job."""
    import json

    body = json.loads(encode(record))
    body.update(fields)
    return "node.ipc", record.job_id.encode(), json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.parametrize("case", ["event_id_empty", "event_id_long", "source_empty", "counter", "schema_version",
                                  "naive_time", "space_in_time", "seq", "batch_counter", "paused_us"])
def test_a_record_its_model_refuses_is_never_folded_by_the_fast_path(tmp_path, case):
    """The byte check proves the typed columns are the value's fields, not that the model accepts
    them: every rule of the models the block checks do not cover (lengths, patterns, the counter's
    values, the schema version, a time zone, seq and paused_us >= 0) is checked too, so the fast
    path never counts a record the reference decoder refuses. Found by a hostile review: a ledger
    forged to the fast result passed the default audit."""
    job = "j"
    blocks = [block(1.0, 1.8, 1.0, job=job, cycle=0), block(1.0, 1.5, 1.0, job=job, cycle=1)]
    patch = {"event_id_empty": {"event_id": ""}, "event_id_long": {"event_id": "x" * 129},
             "source_empty": {"source": ""}, "counter": {"counter": "bogus"}, "schema_version": {"schema_version": 99},
             "naive_time": {"event_time": "2026-03-01T12:00:01"},
             "space_in_time": {"event_time": "2026-03-01 12:00:01+00:00"}}.get(case)
    if case in ("seq", "batch_counter"):
        records = [_patched(batch(*blocks), **({"seq": -1} if case == "seq" else {"counter": "bogus"})),
                   left(job, "n1", 2, 1)]
    elif case == "paused_us":
        records = [*blocks, _patched(left(job, "n1", 2, 1), paused_us=-5)]
    else:
        records = [blocks[0], _patched(blocks[1], **patch), left(job, "n1", 2, 1)]
    archive, _, _ = archive_records(tmp_path, [*records, job_event(job, JobState.ENDED)])
    fast, reference = _both(archive)
    assert job in fast.ineligible and not fast.charges and fast.suspect_rows == 0  # its bytes are canonical
    charge = reference.get((job, 0))
    if case == "space_in_time":  # the models accept this spelling, the encoder never writes it: the reference prices it
        assert charge is not None and charge.blocks_used + charge.blocks_rejected == 2
    else:  # the reference refused the record (a refused marker leaves the stream open: no charge)
        assert charge is None or charge.blocks_used + charge.blocks_rejected < 2


def test_extra_elements_in_a_single_blocks_typed_lists_are_not_folded(tmp_path):
    """A version-1/2 block prints its lists' first elements: typed columns edited to hold a second,
    made-up block must fail the byte check (the job goes to the reference path), not be unnested.
    Found by a hostile review."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    archive, _, _ = archive_records(tmp_path, [block(1.0, 2.0, 1.0, job="j", cycle=0), left("j", "n1", 1, 0),
                                               job_event("j", JobState.ENDED)])
    f = _ipc_files(archive)[0]
    table = pq.read_table(f)
    rows = table.to_pylist()
    row = next(r for r in rows if r["kind"] == "shutter_block")
    row["l_cycle"] = [0, 1]
    for name in ("b", "d", "a"):
        for field in ("instructions", "cycles", "threads"):
            row[f"l_{name}_{field}"] = row[f"l_{name}_{field}"] * 2
    row["l_d_instructions"][1] *= 9
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), f)
    fast, reference = _both(archive)
    assert fast.suspect_rows == 1 and "j" in fast.ineligible and not fast.charges
    assert reference[("j", 0)].blocks_used + reference[("j", 0)].blocks_rejected == 1


@pytest.mark.parametrize("case", ["string_for_integer", "float_for_integer", "extra_field", "repeated_key",
                                  "marker_extra_field"])
def test_a_record_whose_bytes_are_not_canonical_goes_to_the_reference_path(tmp_path, case):
    """Bytes the encoder would not write (a string or float for an integer, an extra field, a key
    twice) fail the byte check: the job is recomputed by the reference decoder, never folded from
    JSON parsed in SQL, which would take "3200" or 3.2e3 for 3200, ignore an extra field and keep
    the first of two keys where the models keep the last. Found by a hostile review: a ledger
    forged to such a fold passed the default audit."""
    job = "j"
    first, second, marker = (block(1.0, 2.0, 1.0, job=job, cycle=0), block(1.0, 1.5, 1.0, job=job, cycle=1),
                             left(job, "n1", 2, 1))
    text = encode(second).decode()
    raw = {"string_for_integer": _patched(second, sample_us="3200"), "float_for_integer": _patched(second, k=1.0),
           "extra_field": _patched(second, extra=1),
           "repeated_key": ("node.ipc", b"j", (text[:-1] + ',"cycle":7}').encode()),
           "marker_extra_field": _patched(marker, extra=1)}[case]
    records = [first, marker, raw] if case == "marker_extra_field" else [first, raw, marker]
    archive, _, _ = archive_records(tmp_path, [*records, job_event(job, JobState.ENDED)])
    fast, _ = _both(archive)
    assert fast.suspect_rows == 1 and job in fast.ineligible and not fast.charges
    assert audit(archive, archive.parent / "ledger.duckdb", POLICY).ok


def test_a_block_exactly_at_the_clock_limit_is_judged_by_the_same_arithmetic_in_both_paths(tmp_path):
    """3,600 s ahead of its broker timestamp at 2**30 s: (event - broker) rounds to 3600.0000001 >
    3600 in clock_problem, while event <= broker + 3600 rounds the other way; the fast path now
    computes the difference as clock_problem does, so it refuses the block too. Found by a hostile
    review."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    at = datetime(2004, 1, 10, 13, 37, 4, 5000, tzinfo=UTC)  # 1073741824.005 s
    def moved(rec, t):
        return rec.model_copy(update={"event_time": t})

    end = job_event("j", JobState.ENDED).model_copy(update={
        "event_time": at + timedelta(seconds=20), "submit_time": at - timedelta(seconds=100),
        "start_time": at - timedelta(seconds=100), "end_time": at + timedelta(seconds=20)})
    records = [moved(block(1.0, 2.0, 1.0, job="j", cycle=0), at - timedelta(seconds=10)),
               moved(block(1.0, 1.5, 1.0, job="j", cycle=1), at),
               moved(left("j", "n1", 2, 1), at + timedelta(seconds=10)), end]
    archive, _, _ = archive_records(tmp_path, records)
    f = _ipc_files(archive)[0]
    table = pq.read_table(f)
    rows = table.to_pylist()
    for r in rows:
        if r["kind"] == "shutter_block" and r["l_cycle"] == [1]:
            r["timestamp_ms"] = 1073741824005 - 3_600_000
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), f)
    assert at.timestamp() - (1073741824005 - 3_600_000) / 1000 > 3600  # clock_problem's verdict: too far ahead
    fast, reference = _both(archive)
    assert "j" in fast.ineligible and reference[("j", 0)].blocks_used + reference[("j", 0)].blocks_rejected == 1


def test_both_paths_price_the_short_sample_margin_alike(tmp_path):
    """At the default short-sample margin: a simulated cluster (3.2 ms blocks only: every job gets
    it), and jobs on two nodes with a long level of 3 blocks (unchecked: the margin), 4 (checked:
    none), or 4 of which Alg. 4 rejects 2 (unchecked but probed: none in the price), split between
    the nodes. The fast path's charges are the reference's, field by field."""
    from dataclasses import replace

    from nodeshare.schemas import CounterSource
    from nodeshare.schemas.events import EstimateStatus

    margin = replace(POLICY, short_margin=0.03)
    archive, _, n = build(tmp_path / "sim")
    fast = fast_recompute(archive, {}, margin)
    reference = recompute(archived_messages(ParquetArchive(archive)), {}, margin)
    assert len(reference) == n and fast.charges == reference and not fast.ineligible
    assert all(c.short_margin_applied == (0.03 if c.estimate_status is EstimateStatus.OK and not c.evidence_problems
                                          else 0.0) for c in reference.values())
    assert sum(c.short_margin_applied > 0 for c in reference.values()) >= n // 2

    def long(job: str, node: str, first: int, count: int) -> list:
        # the job "probed" took four long samples; Alg. 4 rejects its first on each node (solo IPC low)
        return [block(1.0, 0.9 if job == "probed" and i == 0 else 1.3 + 0.01 * i, 1.0, job=job, node=node,
                      cycle=first + i).model_copy(update={"sample_us": 51200, "counter": CounterSource.SIMULATED})
                for i in range(count)]

    records = []
    for job, longs in (("three", 3), ("four", 4), ("probed", 4)):
        for node, share in (("n1", longs // 2), ("n2", longs - longs // 2)):
            short = [block(1.0, 1.25 + 0.01 * i, 1.0, job=job, node=node, cycle=i) for i in range(10)]
            records += [batch(*short), batch(*long(job, node, 10, share), seq=1),
                        left(job, node, 10 + share, 9 + share)]
        records.append(job_event(job, JobState.ENDED, nodes=("n1", "n2")))
    archive, _, _ = archive_records(tmp_path / "levels", records)
    fast = fast_recompute(archive, {}, margin)
    reference = recompute(archived_messages(ParquetArchive(archive)), {}, margin)
    assert fast.charges == reference and not fast.ineligible
    assert {j: c.short_margin_applied for (j, _), c in reference.items()} == {"three": 0.03, "four": 0.0,
                                                                               "probed": 0.0}
    probed = reference[("probed", 0)]  # two long blocks accepted: unchecked, its interval widened, not its price
    assert probed.blocks_rejected == 2 and probed.degradation == probed.degradation_point
