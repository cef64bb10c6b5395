"""Every job the resource manager says ran on a node gets its stream closed there, once, whether
the agent's rescan ever saw it or not (producers/agent/lifecycle.py; issue 40, item 4).

A job is charged only when its terminal event has arrived and every node it lists has sent a
JobLeftNode marker; a second marker with another time would read as a new run of a requeued job.
The agent's lifecycle follower hands it the events naming its node (``Agent.job_event``); here the
tests hand them over themselves, with no broker."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from unit.test_agent import FakeSource, agent_on, spooled

from nodeshare.producers.agent.jobs import LocalJob
from nodeshare.producers.agent.lifecycle import KEEP, META_PREFIX, Closed, LifecycleFollower
from nodeshare.producers.agent.spool import Spool
from nodeshare.schemas import JobEvent, JobState, encode

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)


def lifecycle(job_id: str, state: JobState, nodes: tuple[str, ...] = ("n1",), start_s: float | None = 0.0,
              end_s: float = 0.5) -> JobEvent:
    """A resource manager's event; ``start_s`` None: a job cancelled before it started."""
    start = None if start_s is None else T0 + timedelta(seconds=start_s)
    end = None if state is JobState.STARTED else T0 + timedelta(seconds=end_s)
    return JobEvent(event_id=f"slurm/{job_id}/{state.value}/{start_s}", source="slurm", event_time=end or start or T0,
                    job_id=job_id, state=state, user="u", account="a", program="p", cores=1, nodes=nodes,
                    start_time=start, end_time=end)


def markers(tmp_path: Path) -> list[tuple[str, str, str, int]]:
    return [(e["job_id"], e["event_id"], e["event_time"], e["blocks_sent"])
            for e in spooled(tmp_path) if e["kind"] == "job_left_node"]


def job(job_id: str) -> LocalJob:
    return LocalJob(job_id, frozenset())  # no process to signal: the rescan only lists it


def test_a_job_that_ended_between_two_rescans_gets_one_marker(tmp_path: Path) -> None:
    agent = agent_on(tmp_path, FakeSource({}, {}))
    agent.rescan()
    # job 7 starts and ends before the next rescan: only its lifecycle says it ran here
    agent.job_event(lifecycle("7", JobState.STARTED))
    agent.job_event(lifecycle("7", JobState.ENDED))
    agent.rescan()
    agent.job_event(lifecycle("7", JobState.ENDED))  # a redelivery (a crash before the commit)
    agent.close(0)
    end = (T0 + timedelta(seconds=0.5)).isoformat()
    assert markers(tmp_path) == [("7", "n1/left/7", end.replace("+00:00", "Z"), 0)]
    (left,) = [e for e in spooled(tmp_path) if e["kind"] == "job_left_node"]
    assert (left["last_cycle"], left["paused_us"], left["alone_us"], left["node"]) == (-1, 0, 0, "n1")


def test_a_node_listed_for_a_job_with_no_process_there_gets_one_marker(tmp_path: Path) -> None:
    agent = agent_on(tmp_path, FakeSource({}, {}))
    agent.rescan()
    agent.job_event(lifecycle("8", JobState.FAILED, nodes=("n0", "n1", "n2"), end_s=3600))
    agent.job_event(lifecycle("9", JobState.ENDED, nodes=("n0", "n2")))  # not this node's
    agent.job_event(lifecycle("10", JobState.CANCELLED, start_s=None))  # never started: nothing ran
    agent.rescan()
    agent.close(0)
    assert [m[:2] for m in markers(tmp_path)] == [("8", "n1/left/8")]


def test_a_job_the_rescan_saw_gets_one_marker_whatever_the_order(tmp_path: Path) -> None:
    """Three jobs seen by the rescan: the terminal event of one arrives while it is still open, of
    another after the rescan closed it, of the third before it is seen at all (Slurm has not reaped
    its processes yet: the rescan must not take it up and close it a second time)."""
    source = FakeSource({"a": job("a"), "b": job("b")}, {})
    agent = agent_on(tmp_path, source)
    agent.rescan()
    agent.job_event(lifecycle("a", JobState.ENDED, end_s=700))  # a is open here: the rescan closes it
    source.jobs.clear()
    agent.rescan()
    agent.job_event(lifecycle("b", JobState.ENDED, end_s=700))  # b was closed by the rescan
    agent.job_event(lifecycle("c", JobState.ENDED, end_s=700))  # c: never seen, closed here...
    source.jobs["c"] = job("c")
    agent.rescan()  # ...and its lingering processes are not taken up
    assert "c" not in agent.jobs and "c" not in agent.state
    source.jobs.clear()
    agent.rescan()
    agent.close(0)
    assert sorted(m[:2] for m in markers(tmp_path)) == [("a", "n1/left/a"), ("b", "n1/left/b"), ("c", "n1/left/c")]


def test_a_requeued_job_closed_unseen_is_taken_up_again_when_its_next_run_starts(tmp_path: Path) -> None:
    source = FakeSource({}, {})
    agent = agent_on(tmp_path, source)
    agent.job_event(lifecycle("r", JobState.ENDED, end_s=0.5))  # run 1: unseen
    agent.job_event(lifecycle("r", JobState.STARTED, start_s=60))  # run 2 starts here
    source.jobs["r"] = job("r")
    agent.rescan()
    assert "r" in agent.state
    agent.job_event(lifecycle("r", JobState.ENDED, start_s=60, end_s=61))  # open: left to the rescan
    source.jobs.clear()
    agent.rescan()
    agent.job_event(lifecycle("r", JobState.ENDED, start_s=86_400, end_s=86_400.5))  # run 3 (after now): unseen again
    agent.close(0)
    times = [m[2] for m in markers(tmp_path)]
    assert [m[1] for m in markers(tmp_path)] == ["n1/left/r"] * 3 and len(set(times)) == 3
    assert times[0] == (T0 + timedelta(seconds=0.5)).isoformat().replace("+00:00", "Z")


def test_a_restarted_agent_sends_no_second_marker(tmp_path: Path) -> None:
    source = FakeSource({"a": job("a")}, {})
    first = agent_on(tmp_path, source)
    first.rescan()
    source.jobs.clear()
    first.rescan()  # a closed by the rescan
    first.job_event(lifecycle("u", JobState.ENDED))  # u closed from its terminal event
    first.close(0)
    # the follower reads both terminal events again (they came after its last commit)
    source.jobs["u"] = job("u")  # and u's processes still show
    second = agent_on(tmp_path, source)
    second.job_event(lifecycle("a", JobState.ENDED, end_s=700))
    second.job_event(lifecycle("u", JobState.ENDED))
    second.rescan()
    assert "u" not in second.state
    second.close(0)
    assert sorted(m[1] for m in markers(tmp_path)) == ["n1/left/a", "n1/left/u"]


def test_the_record_of_markers_is_bounded_by_age(tmp_path: Path) -> None:
    old = T0 - KEEP - timedelta(days=1)
    spool = Spool(tmp_path / "spool.db")
    spool.put([], {META_PREFIX + "old": Closed(old, unseen=True).dump()})  # a marker a previous run sent
    spool.close()
    agent = agent_on(tmp_path, FakeSource({}, {}))
    assert agent.closed.shut("old")
    # ended before the horizon: its record may be gone already, so it is not acted on
    agent.job_event(lifecycle("late", JobState.ENDED).model_copy(
        update={"start_time": old, "end_time": old + timedelta(seconds=1)}))
    assert markers(tmp_path) == []
    agent.job_event(lifecycle("new", JobState.ENDED))  # the next marker forgets the records past the horizon
    assert set(agent.spool.metas(META_PREFIX)) == {"new"} and not agent.closed.shut("old")
    agent.close(0)
    assert [m[0] for m in markers(tmp_path)] == ["new"]


def test_the_follower_hands_over_only_this_nodes_events(tmp_path: Path) -> None:
    seen: list[str] = []
    follower = LifecycleFollower(None, "n1", lambda e: seen.append(e.job_id))
    follower.handle(encode(lifecycle("x", JobState.ENDED, nodes=("n2",))), write=True)
    follower.handle(encode(lifecycle("y", JobState.ENDED, nodes=("n1", "n2"))), write=True)
    follower.handle(b"{not json", write=True)  # skipped, not a crash
    assert seen == ["y"] and json.loads(encode(lifecycle("y", JobState.ENDED)))["kind"] == "job_event"
