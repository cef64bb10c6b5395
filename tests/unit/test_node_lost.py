"""A node lost for good (issue 39): a ``NodeDown`` record on node.ipc closes the stream its agent
never will, so the job is charged from what the node sent before it went, marked ``node_lost``;
the node's late data (it came back) is a new revision. Same charges in every interleaving of the
two topics, through serialized state, and in the audit of the archive."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from factories import POLICY, T0, archive_records, block, job_event, left
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.schemas import EstimateStatus, JobState, NodeDown, Record, encode
from nodeshare.sinks.audit import audit
from nodeshare.streams.core.accounting import JobAccount, Origin, fold_messages, process_message

IPC, LIFE = "node.ipc", "jobs.lifecycle"


def as_messages(records: list[Record], topic: str, start: int = 0) -> list[tuple]:
    return [(Origin(topic, 0, start + i), r.job_id.encode(), encode(r), 0.0) for i, r in enumerate(records)]


def down(job: str, node: str, reason: str = "Slurm NODE_FAIL") -> NodeDown:
    return NodeDown(event_id=f"down-{job}-{node}", source="test", event_time=T0 + timedelta(seconds=7200),
                    job_id=job, node=node, reason=reason)


def lost_node_job(job: str = "j1", late: bool = False) -> tuple[list[Record], list[Record]]:
    """A job on n1 and n2; n2 sends two blocks and is lost (its agent never closes its stream).
    With ``late``: n2 comes back and sends one more block and its marker."""
    ipc = [block(1.0, 2.0, 1.0, job=job, node="n1", cycle=0), block(1.0, 0.9, 1.0, job=job, node="n2", cycle=1),
           block(0.8, 1.0, 0.82, job=job, node="n1", cycle=3), block(0.9, 1.2, 0.9, job=job, node="n2", cycle=2),
           left(job, "n1", 2, 3), down(job, "n2")]
    if late:
        ipc += [block(0.7, 1.4, 0.7, job=job, node="n2", cycle=4), left(job, "n2", 3, 4)]
    life = [job_event(job, JobState.STARTED, nodes=("n1", "n2")),
            job_event(job, JobState.FAILED, nodes=("n1", "n2"), cores=32, run_s=7200)]
    return ipc, life


def merged(a: list, b: list, order: list[int]) -> list:
    ia, ib = iter(a), iter(b)
    return [next(ia) if which == 0 else next(ib) for which in order]


def test_a_job_that_lost_a_node_is_charged_from_what_the_node_sent_before():
    ipc, life = lost_node_job()
    [charge] = fold_messages(as_messages(ipc, IPC) + as_messages(life, LIFE), POLICY)
    assert charge.estimate_status is EstimateStatus.NODE_LOST and charge.revision == 0
    assert {n.node: n.blocks for n in charge.nodes} == {"n1": 2, "n2": 2}
    assert charge.blocks_used + charge.blocks_rejected == 4
    [problem] = charge.evidence_problems
    assert problem.startswith("node n2: lost before it closed its stream: Slurm NODE_FAIL (test, node.down record "
                              "at node.ipc:0:5)")
    # no marker: no pause credit, no time alone claimed for the lost node
    assert charge.nodes[1].paused_s == charge.nodes[1].alone_s == 0.0
    # without the record the job waits for ever, as before
    assert fold_messages(as_messages(ipc[:-1], IPC) + as_messages(life, LIFE), POLICY) == []


def test_a_down_record_after_the_nodes_own_marker_changes_nothing():
    ipc, life = lost_node_job()
    closed = [*ipc[:-1], left("j1", "n2", 2, 2), down("j1", "n2")]
    [charge] = fold_messages(as_messages(closed, IPC) + as_messages(life, LIFE), POLICY)
    [plain] = fold_messages(as_messages(closed[:-1], IPC) + as_messages(life, LIFE), POLICY)
    assert charge == plain and charge.estimate_status is not EstimateStatus.NODE_LOST


def test_late_data_from_the_lost_node_is_a_new_revision_priced_from_every_block():
    ipc, life = lost_node_job(late=True)
    lost, full = fold_messages(as_messages(ipc, IPC) + as_messages(life, LIFE), POLICY)
    assert (lost.revision, full.revision) == (0, 1)
    assert lost.estimate_status is EstimateStatus.NODE_LOST and {n.node: n.blocks for n in lost.nodes}["n2"] == 2
    assert full.estimate_status is not EstimateStatus.NODE_LOST and not full.evidence_problems
    assert {n.node: n.blocks for n in full.nodes} == {"n1": 2, "n2": 3}
    assert full.revision_reason == ("late data: node n2, declared lost, closed its stream with its marker at "
                                    "node.ipc:0:7")
    # revision 1 prices the blocks an uninterrupted run would have: the same charge but for its identity
    uninterrupted = [r for r in ipc if not isinstance(r, NodeDown)]
    [whole] = fold_messages(as_messages(uninterrupted, IPC) + as_messages(life, LIFE), POLICY)
    same = {"event_id", "revision", "revision_reason", "event_range"}
    assert full.model_dump(exclude=same) == whole.model_dump(exclude=same)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.booleans())
def test_every_revision_of_a_job_that_lost_a_node_is_the_same_in_every_interleaving(data, late):
    ipc, life = lost_node_job(late=late)
    a, b = as_messages(ipc, IPC), as_messages(life, LIFE)
    order = data.draw(st.permutations([0] * len(a) + [1] * len(b)))
    reference = fold_messages(a + b, POLICY)
    assert len(reference) == 1 + late
    assert fold_messages(merged(a, b, order), POLICY) == reference


def test_a_lost_stream_and_its_late_data_survive_the_state_round_trip():
    """The worker keeps accounts serialized between messages (faust tables): the lost stream, its
    late copy and the revision that prices it persist."""
    ipc, life = lost_node_job(late=True)
    msgs = as_messages(ipc[:6], IPC) + as_messages(life, LIFE) + as_messages(ipc[6:], IPC, start=6)
    state, charges = None, []
    for origin, key, value, ts in msgs:
        state_new, out, _ = process_message(state, origin, key, value, ts, POLICY)
        state = state_new if state_new is not None else state
        charges += [o.value for o in out if o.topic == "ledger.charges"]
    assert charges == [encode(c) for c in fold_messages(msgs, POLICY)] and len(charges) == 2
    account = JobAccount.model_validate_json(state)
    assert account.nodes["n2"].lost and account.nodes["n2"].late is not None and account.nodes["n2"].late.closed
    assert [t.late for t in account.ends] == [[], ["n2"]]


def test_the_audit_recomputes_the_charges_of_a_job_that_lost_a_node(tmp_path: Path):
    ipc, life = lost_node_job(late=True)
    other_ipc, other_life = lost_node_job("j2")  # lost, and never came back
    archive, ledger, n = archive_records(tmp_path, [*ipc, *other_ipc, *life, *other_life])
    assert n == 3
    report = audit(archive, ledger, POLICY)
    assert report.ok and report.matches == 3, report.as_dict()
    assert report.fast_path_jobs == 0  # the vectorized path leaves jobs with a node.down record to the reference


def test_an_operator_lists_the_charges_of_jobs_that_lost_a_node(tmp_path: Path):
    from typer.testing import CliRunner

    from nodeshare.cli import app

    ipc, life = lost_node_job(late=True)  # its current revision has every block
    other_ipc, other_life = lost_node_job("j2")  # still lost
    _, ledger, _ = archive_records(tmp_path, [*ipc, *other_ipc, *life, *other_life])
    result = CliRunner().invoke(app, ["charges", "--ledger", str(ledger), "--incomplete", "-P", "-n",
                                      "-o", "JobID,Revision,EstimateStatus"])
    assert result.exit_code == 0 and result.output.split() == ["j2|0|node_lost"], result.output
    result = CliRunner().invoke(app, ["charges", "--ledger", str(ledger), "--incomplete", "--all-revisions",
                                      "-P", "-n", "-o", "JobID,Revision"])
    assert result.output.split() == ["j1|0", "j2|0"], result.output


def test_the_report_names_the_jobs_charged_with_a_node_lost(tmp_path: Path):
    from nodeshare.sinks.analysis.report import build_report

    ipc, life = lost_node_job(late=True)  # current revision complete: not listed
    other_ipc, other_life = lost_node_job("j2")
    archive, ledger, _ = archive_records(tmp_path, [*ipc, *other_ipc, *life, *other_life])
    page = build_report(ledger, archive, tmp_path / "report").html.read_text()
    assert "<tr><th>jobs charged with a node lost (node_lost)</th><td>1: j2</td></tr>" in page


def test_a_correction_and_late_data_price_the_same_current_charge_in_either_order():
    """The corner docs/charges.md names: a lifecycle correction and the lost node's late marker,
    both after the first charge. The intermediate revision depends on which came first; the
    current one prices the same evidence (the corrected event, every block) either way."""
    ipc, life = lost_node_job(late=True)
    fix = job_event("j1", JobState.FAILED, nodes=("n1", "n2"), cores=64, run_s=7200).model_copy(
        update={"event_id": "fix"})
    ipc_msgs, life_msgs = as_messages(ipc, IPC), as_messages([*life, fix], LIFE)
    late_first = fold_messages(ipc_msgs + life_msgs, POLICY)  # the late marker, then the correction
    fix_first = fold_messages(ipc_msgs[:6] + life_msgs + ipc_msgs[6:], POLICY)
    assert [c.revision for c in late_first] == [c.revision for c in fix_first] == [0, 1, 2]
    assert late_first[0] == fix_first[0] and late_first[0].estimate_status is EstimateStatus.NODE_LOST
    assert (late_first[1].cores, late_first[1].estimate_status) == (32, EstimateStatus.OK)  # late data, old event
    assert (fix_first[1].cores, fix_first[1].estimate_status) == (64, EstimateStatus.NODE_LOST)  # corrected, lost
    same = {"revision_reason", "event_range"}
    assert late_first[2].model_dump(exclude=same) == fix_first[2].model_dump(exclude=same)
    assert late_first[2].cores == 64 and {n.node: n.blocks for n in late_first[2].nodes} == {"n1": 2, "n2": 3}
