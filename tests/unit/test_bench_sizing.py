"""`nodeshare bench sizing` (issue 42, item 7): the scaling arithmetic against figures worked out
by hand, what it counts on a few records, and a small simulated cluster's block rate against the
shutter schedule's."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from nodeshare.bench.sizing import (
    AUDIT_SAMPLES_PER_S,
    FOLD_BLOCKS_PER_S,
    LEDGER_WINDOWS_PER_S,
    run_sizing_bench,
    scale,
    traffic,
)
from nodeshare.schemas import JobEvent, JobLeftNode, JobState, Record, encode

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_the_figures_scale_linearly_with_nodes_as_worked_out_by_hand() -> None:
    per_node_hour = {"messages": 7200.0, "bytes": 3.6e6, "blocks": 3600.0, "samples": 10800.0,
                     "archive_bytes": 1e6, "windows": 7200.0}
    state = {"running_jobs_per_node": 2.0, "running_memory_bytes": 10_000, "running_json_bytes": 2_000,
             "charged_memory_bytes": 5_000, "settled_index_bytes": 100.0, "settled_record_bytes": 1_000,
             "snapshot_us_per_settled": 5.0}
    small, big = scale(per_node_hour, state, (100, 10_000), fold_blocks_per_s=50.0, audit_samples_per_s=300.0,
                       job_ends_per_node_hour=1.0, ledger_windows_per_s=400.0, evict_after_s=3600.0)
    # 100 nodes: 2 messages and 1 block a second each; 1,000 bytes a second each
    assert small["messages_per_s"] == 200.0 and small["blocks_per_s"] == 100 and small["ingest_mb_per_s"] == 0.1
    assert small["worker_cores"] == 2.0  # 100 blocks/s at 50 a core
    assert small["shutter_windows_per_s"] == 200 and small["ledger_sink_load"] == 0.5  # 200 of 400 a second
    assert small["archive_gb_per_day"] == 2.4  # 1 MB x 100 nodes x 24 h
    assert small["running_jobs"] == 200 and small["worker_state_running_mb"] == 2.0  # 200 x 10 kB
    assert small["running_json_mb"] == 0.4
    # 1 end a node-hour: 2,400 a day, 100 an hour; each in memory for an hour after its charge
    assert small["worker_state_charged_mb"] == 0.5  # 100 x 5 kB, whatever the day
    assert small["worker_settled_index_mb_per_day"] == 0.2  # 2,400 x 100 B (0.24)
    assert small["settled_topic_mb_per_day"] == 2.4  # 2,400 x 1 kB on the broker
    assert small["snapshot_s_per_day_of_index"] == 0.01  # 2,400 x 5 us, a round of snapshots (0.012 s)
    assert small["worker_state_charged_mb_per_day_kept"] == 12.0  # without eviction: 2,400 a day x 5 kB
    assert small["audit_core_hours_per_archived_day"] == 24.0  # 10,800 x 100 x 24 samples at 300/s: 86,400 s
    assert big["blocks_per_s"] == 100 * small["blocks_per_s"] and big["archive_gb_per_day"] == 240.0


def _end(job: str, at: datetime) -> JobEvent:
    return JobEvent(event_id=f"{job}-end", source="t", event_time=at, job_id=job, state=JobState.ENDED, user="u",
                    account="a", program="p", cores=1, nodes=("n1",), start_time=T0, end_time=at)


def test_traffic_counts_each_topic_s_messages_and_bytes_after_the_warm_up() -> None:
    left = JobLeftNode(event_id="l", source="t", event_time=T0, job_id="j1", node="n1", blocks_sent=0,
                       last_cycle=-1)
    records: list[tuple[float, Record]] = [(0.0, _end("j0", T0)), (10.0, _end("j1", T0)), (11.0, left)]
    flows = traffic(records, since_s=5.0)
    assert flows["jobs.lifecycle"]["messages"] == 1  # j0's end came in the warm-up
    assert flows["jobs.lifecycle"]["value_bytes"] == len(encode(records[1][1]))
    assert flows["jobs.lifecycle"]["key_bytes"] == 2 and flows["node.ipc"]["blocks"] == 0


@pytest.mark.slow
def test_a_small_cluster_sends_one_block_per_node_per_shutter_cycle_and_its_jobs_are_weighed() -> None:
    """The calibrated agents shutter one job per node each cycle of 3 x S + P = 209.6 ms: 17,176
    blocks a node-hour (batches straddling the warm-up cut move it a little); the archive holds less
    than the JSON carried (typed, compressed); every kind of account is counted and weighed."""
    r = run_sizing_bench(nodes=2, hours=0.5, clusters=(100,), jobs_at_scale=50)
    per, state = r["per_node_hour"], r["worker_state"]
    assert per["blocks"] == pytest.approx(3600 / 0.2096, rel=0.05)
    assert per["samples"] == pytest.approx(3 * per["blocks"], abs=0.2)
    assert 0 < per["archive_bytes"] < per["bytes"]
    assert state["accounts"] == state["running_jobs"] + state["charged_jobs"] + state["queued_jobs"]
    assert state["running_jobs"] > 0 and state["charged_jobs"] > 0 and not r["warnings"]
    assert state["charged_memory_bytes"] > state["queued_memory_bytes"] > 0  # blocks and a charge weigh more
    assert state["charged_json_bytes"] > state["queued_json_bytes"] > 0
    assert r["clusters"][0]["nodes"] == 100
    # at scale: as many jobs held as asked (copies of the cluster's), each weighed; a settled
    # job's index entry is a small fraction of the account it replaces
    for kind in ("running", "charged"):  # copies weigh what the live fold's accounts weigh, within a fifth
        assert state[f"{kind}_memory_bytes_at_scale"] == pytest.approx(state[f"{kind}_memory_bytes"], rel=0.2)
    assert 0 < state["settled_index_bytes"] < state["charged_memory_bytes"] / 20
    assert state["snapshot_us_per_settled"] > 0
    assert 0 < state["settled_record_bytes"] < state["charged_json_bytes"]  # compressed


def test_the_cli_s_defaults_are_the_module_s() -> None:
    """The command line writes the two measured inputs again (it keeps the benches out of its
    imports): they must stay the module's."""
    import typer.main

    from nodeshare.cli import app

    sizing = typer.main.get_command(app).commands["bench"].commands["sizing"]  # type: ignore[attr-defined]
    defaults = {p.name: p.default for p in sizing.params}
    assert defaults["fold_blocks_per_s"] == FOLD_BLOCKS_PER_S
    assert defaults["audit_samples_per_s"] == AUDIT_SAMPLES_PER_S
    assert defaults["ledger_windows_per_s"] == LEDGER_WINDOWS_PER_S


def test_lost_records_are_told_as_runs() -> None:
    from nodeshare.bench.broker_acks import ranges

    assert ranges([7, 1, 3, 2]) == [(1, 3), (7, 7)] and ranges([]) == []
