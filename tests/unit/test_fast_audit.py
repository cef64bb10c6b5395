"""The vectorized audit path equals the streaming (reference) path on the same events."""

from __future__ import annotations

from datetime import timedelta

from factories import POLICY, T0, archive_records, block, build, job_event, left

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
    assert fast.ineligible >= {"ooo", "k2", "fix"}
    assert fast.charges[("ok", 0)] == reference[("ok", 0)]
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.charges_checked == n == 5  # 'fix' has two revisions
    assert report.fast_path_jobs == 1 and report.reference_path_jobs >= 3


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


def test_bench_audit_runs_and_reports_its_figures(tmp_path):
    import json

    from typer.testing import CliRunner

    from nodeshare.cli import app

    result = CliRunner().invoke(app, ["bench", "audit", "--blocks", "3000", "--workdir", str(tmp_path),
                                      "--out", str(tmp_path / "audit.json")])
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "audit.json").read_text())
    assert body["blocks"] == 3000 and body["samples"] == 9000 and body["jobs"] == 3
    assert body["samples_per_s"] > 0 and body["ratio_to_scan"] > 0
