"""Simulated clusters chosen on the command line: engines, traces, profiles, streaming."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from factories import profile_csv
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.scenarios import ClusterChoice, ScenarioError, build, stream
from nodeshare.schemas import JobEvent, JobState, ShutterBatch, encode, key_of

TRACE = ("; two usable jobs and one without a run time\n"
         "1 0 0 30 8 -1 -1 8 60 -1 1 3 7 2 -1 -1 -1 -1\n"
         "2 5 0 40 16 -1 -1 16 60 -1 1 4 7 5 -1 -1 -1 -1\n"
         "3 6 0 -1 8 -1 -1 8 60 -1 0 4 7 5 -1 -1 -1 -1\n"
         "4 8 0 20 8 -1 -1 8 60 -1 1 5 8 1 -1 -1 -1 -1\n")


def ended(events: list) -> list[JobEvent]:
    return [e for e in events if isinstance(e, JobEvent) and e.state is JobState.ENDED]


def test_a_trace_sets_arrivals_run_times_and_users(tmp_path: Path) -> None:
    trace = tmp_path / "t.swf"
    trace.write_text(TRACE)
    cluster = build(ClusterChoice(nodes=3, jobs=2, trace=trace, time_scale=0.5))
    ends = ended(cluster.events)
    assert len(ends) == len(cluster.truth) == 2  # --jobs 2: the first two usable jobs
    assert sorted(e.user for e in ends) == ["user3", "user4"]
    # run time 30 s x 0.5 = 15 solo-seconds of work, stretched by sharing and run-to-run noise
    first = min(cluster.truth, key=lambda t: t.job_id)
    assert first.solo_time_s == pytest.approx(15.0, rel=0.05) and first.run_time_s >= first.solo_time_s
    assert {len(e.nodes) for e in ends} == {1, 2}  # 16 processors span two 8-core slots


def test_profiles_decide_which_programs_run(tmp_path: Path) -> None:
    csv = profile_csv(tmp_path / "p.csv", "alpha", "beta")
    cluster = build(ClusterChoice(nodes=2, jobs=4, profiles=csv, mean_work_s=10.0, span_s=5.0))
    assert {e.program for e in ended(cluster.events)} <= {"alpha", "beta"}
    assert any(isinstance(e, ShutterBatch) for e in cluster.events)  # they shared nodes and were measured


def test_streaming_sends_the_same_events_in_the_same_order_per_key() -> None:
    choice = ClusterChoice(nodes=3, jobs=6, seed=4, mean_work_s=12.0, span_s=10.0)
    whole = build(choice)
    batches: list[list] = []
    seen: list[tuple[float, int, int]] = []
    truth, sent = stream(choice, batches.append, progress=lambda *p: seen.append(p))
    streamed = [e for b in batches for e in b]
    assert sent == len(streamed) == len(whole.events) and len(batches) > 10
    assert truth == whole.truth and seen == sorted(seen) and seen[-1][1:] == (6, 6)

    def per_key(events: list) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = defaultdict(list)
        for e in events:
            out[key_of(e)].append(encode(e))
        return out

    assert per_key(streamed) == per_key(whole.events)  # Kafka orders per key: that is what must hold


def test_streaming_stops_at_the_horizon() -> None:
    choice = ClusterChoice(nodes=2, jobs=4, seed=4, mean_work_s=600.0, span_s=1.0)
    truth, sent = stream(choice, lambda batch: None, until_s=5.0)
    assert truth == [] and sent > 0  # nothing ended within 5 s, but the nodes were measured


def test_simple_engine_still_builds() -> None:
    cluster = build(ClusterChoice(engine="simple", nodes=2, jobs=3))
    assert len(ended(cluster.events)) == len(cluster.truth) == 3


@pytest.mark.parametrize(("choice", "message"), [
    ({"engine": "fancy"}, "unknown engine 'fancy'"),
    ({"engine": "simple", "trace": Path("x.swf")}, "need the calibrated engine"),
    ({"time_scale": 0.0}, "time scale must be positive"),
])
def test_impossible_choices_are_refused(choice: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        ClusterChoice(**choice)


def test_unreadable_inputs_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("BENCH,NR_WAYS,ipc\n")
    with pytest.raises(ScenarioError, match=r"bad.csv: missing columns"):
        build(ClusterChoice(profiles=bad))
    with pytest.raises(ScenarioError, match=r"nope.swf: No such file"):
        build(ClusterChoice(trace=tmp_path / "nope.swf"))
    clash = profile_csv(tmp_path / "clash.csv", "MILC")
    with pytest.raises(ScenarioError, match=r"built-in programs"):
        build(ClusterChoice(profiles=clash))


def test_the_cli_refuses_a_bad_engine_before_starting_anything(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["demo", "--engine", "fancy", "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "unknown engine 'fancy'" in r.output
    r = CliRunner().invoke(app, ["simulate", "--engine", "simple", "--profiles", __file__, "--bootstrap", "x:1"])
    assert r.exit_code == 2 and "need the calibrated engine" in r.output
    bad = tmp_path / "bad.csv"
    bad.write_text("BENCH,NR_WAYS,ipc\n")
    r = CliRunner().invoke(app, ["demo", "--profiles", str(bad), "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "missing columns" in r.output
    assert not (tmp_path / "d").exists()  # refused before any broker or directory
