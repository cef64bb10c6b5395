"""The Slurm lifecycle source's pure parts, on hook environments recorded from a real Slurm 22.05."""

from __future__ import annotations

import logging
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from nodeshare.producers.slurm import (
    HookEvent,
    HookFileError,
    SlurmSource,
    event_from_hook,
    from_jobcomp_json,
    read_hook_file,
    total_cpus,
)
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.schemas import JobEvent, JobState

DATA = Path(__file__).parent.parent / "data"
AT = datetime(2026, 11, 22, 1, 0, tzinfo=UTC)


def recorded(hook: str, **changes: str) -> HookEvent:
    env = dict(line.split("=", 1) for line in (DATA / f"slurm-{hook}.env").read_text().splitlines()
               if not line.startswith("#"))
    return HookEvent(hook, AT, {**env, **changes})


def one_node(expr: str) -> tuple[str, ...]:
    return (expr,) if expr else ()


@pytest.mark.parametrize(("text", "cpus"), [("1", 1), ("4(x2),2", 10), ("16(x4)", 64)])
def test_cpus_per_node_expressions(text: str, cpus: int) -> None:
    assert total_cpus(text) == cpus


def test_prolog_is_a_start_with_the_hooks_time() -> None:
    e = event_from_hook(recorded("prolog_ctld"), one_node)
    assert e is not None
    assert (e.job_id, e.state, e.user, e.account, e.program, e.cores, e.nodes) == (
        "1", JobState.STARTED, "root", "default", "myprog", 1, ("vm",))  # "(null)" account -> default
    assert e.start_time == AT and e.event_id == "slurm/nodeshare-test/1/started"


def test_jobcomp_is_the_end_with_slurms_own_times() -> None:
    e = event_from_hook(recorded("jobcomp"), one_node)
    assert e is not None and e.state is JobState.ENDED
    assert (e.submit_time, e.start_time, e.end_time) == tuple(
        datetime.fromtimestamp(t, UTC) for t in (1795308724, 1795308726, 1795308727))
    assert e.event_id == "slurm/slurm/1/ended"  # CLUSTER is empty in jobcomp/script's environment
    assert event_from_hook(recorded("jobcomp", EXITCODE="1:0"), one_node).state is JobState.FAILED  # type: ignore[union-attr]
    assert event_from_hook(recorded("jobcomp", EXITCODE="0:9"), one_node).state is JobState.FAILED  # type: ignore[union-attr]
    cancelled = event_from_hook(recorded("jobcomp", JOBSTATE="CANCELLED by 0"), one_node)
    assert cancelled is not None and cancelled.state is JobState.CANCELLED
    with pytest.raises(HookFileError, match="not a final state"):
        event_from_hook(recorded("jobcomp", JOBSTATE="RUNNING"), one_node)


def test_the_epilog_ends_a_job_only_when_asked_and_only_after_its_prolog() -> None:
    assert event_from_hook(recorded("epilog_ctld"), one_node) is None  # jobcomp/script is the authority
    with pytest.raises(HookFileError, match="without a known start"):
        event_from_hook(recorded("epilog_ctld"), one_node, terminal_from_epilog=True)
    start = datetime(2026, 11, 22, 0, 59, tzinfo=UTC)
    e = event_from_hook(recorded("epilog_ctld"), one_node, terminal_from_epilog=True, started={"1": start})
    assert e is not None and e.state is JobState.ENDED and (e.start_time, e.end_time) == (start, AT)


def test_a_jobcomp_kafka_record_becomes_the_terminal_event() -> None:
    e = from_jobcomp_json({"jobid": 42, "username": "ana", "account": "phys", "job_name": "lulesh", "total_cpus": 8,
                           "nodes": "n1,n2", "state": "TIMEOUT", "exit_code": "0:15",
                           "@start": "2026-11-22T00:00:00", "@end": "2026-11-22T01:00:00+00:00"})
    assert (e.job_id, e.state, e.cores, e.nodes, e.user) == ("42", JobState.FAILED, 8, ("n1", "n2"), "ana")
    assert (e.end_time - e.start_time).total_seconds() == 3600  # type: ignore[operator]
    with pytest.raises(HookFileError, match="missing or unknown"):
        from_jobcomp_json({"jobid": 1, "state": "RUNNING"})


def test_installed_hooks_record_their_environment_and_always_succeed(tmp_path: Path) -> None:
    lines = install_hooks(tmp_path / "hooks", tmp_path / "events")
    assert str(lines["JobCompType"]) == "jobcomp/script" and lines["JobCompLoc"].name == "jobcomp.sh"
    env = {k: v for k, v in (line.split("=", 1) for line in (DATA / "slurm-prolog_ctld.env").read_text().splitlines()
                             if not line.startswith("#"))}
    subprocess.run([str(lines["PrologSlurmctld"])], env={"PATH": os.environ["PATH"], **env}, check=True)
    [written] = list((tmp_path / "events").iterdir())
    h = read_hook_file(written)
    assert h.hook == "prolog_ctld" and h.env["SLURM_JOB_ID"] == "1"
    # a missing events directory must not fail the hook (slurmctld would hold the job)
    written.unlink()
    (tmp_path / "events").rmdir()
    hook = subprocess.run([str(lines["PrologSlurmctld"])], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True)
    assert hook.returncode == 0 and not (tmp_path / "events").exists()


def test_bad_hook_files_are_moved_aside_with_their_reason(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    (events / "123-jobcomp-9").write_bytes(b"JOBID=5\0JOBSTATE=RUNNING\0")
    (events / "124-prolog_ctld-9").write_bytes(b"\0".join(
        f"{k}={v}".encode() for k, v in recorded("prolog_ctld").env.items()))
    (events / ".125-jobcomp-9").write_bytes(b"half written")  # still being written: not touched

    class NoSlurm:
        def hostnames(self, expr: str) -> tuple[str, ...]:
            return one_node(expr)

        def job_tres(self, job_id: str) -> dict[str, float]:
            return {}

        def queue(self) -> list[dict[str, str]]:
            return []

    source = SlurmSource(events, NoSlurm())  # type: ignore[arg-type]
    published, files = source.step()
    assert [e.state for e in published] == [JobState.STARTED] and [f.name for f in files] == ["124-prolog_ctld-9"]
    assert "not a final state" in (events / "bad" / "123-jobcomp-9.reason").read_text()
    source.done(files)
    assert sorted(p.name for p in events.iterdir()) == [".125-jobcomp-9", "bad"]


class FailedNodes:
    """Slurm's client commands for a job on n1 and n2 that Slurm ended with NODE_FAIL."""

    def __init__(self, states: dict[str, str] | None = None, fails: bool = False) -> None:
        self.states, self.fails, self.asked = states or {}, fails, 0

    def hostnames(self, expr: str) -> tuple[str, ...]:
        return ("n1", "n2") if expr == "n[1-2]" else one_node(expr)

    def job_tres(self, job_id: str) -> dict[str, float]:
        return {}

    def queue(self) -> list[dict[str, str]]:
        return []

    def node_states(self, nodes: tuple[str, ...]) -> dict[str, str]:
        self.asked += 1
        if self.fails:
            raise RuntimeError("sinfo failed (1): slurm_load_partitions: Unable to contact slurm controller")
        return {n: self.states.get(n, "idle") for n in nodes}


def node_fail_file(events: Path) -> None:
    env = {**recorded("jobcomp").env, "JOBSTATE": "NODE_FAIL", "NODES": "n[1-2]", "PROCS": "2"}
    events.mkdir(exist_ok=True)
    (events / "123-jobcomp-9").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()))


def test_a_node_fail_end_sends_a_node_down_record_for_each_node_slurm_reports_lost(tmp_path: Path) -> None:
    """Issue 39: the rule that lets a job that lost a node be charged is a record in the log."""
    from nodeshare.schemas import NodeDown
    from nodeshare.schemas.catalog import TOPIC_OF_RECORD

    events = tmp_path / "events"
    node_fail_file(events)
    source = SlurmSource(events, FailedNodes({"n2": "down*"}))  # type: ignore[arg-type]
    published, files = source.step()
    end, lost = published
    assert isinstance(end, JobEvent) and end.state is JobState.FAILED and end.nodes == ("n1", "n2")
    assert isinstance(lost, NodeDown) and (lost.job_id, lost.node) == ("1", "n2")
    assert lost.event_id == "slurm/slurm/1/node_down/n2" and lost.event_time == end.end_time
    assert lost.reason == "Slurm ended the job with NODE_FAIL; node state down*"
    assert TOPIC_OF_RECORD[NodeDown].name == "node.ipc" and len(files) == 1


@pytest.mark.parametrize(("state", "lost"), [("down", True), ("down*", True), ("idle*", True), ("fail", True),
                                             ("down+drain", True), ("idle", False), ("mixed", False),
                                             ("drained", False), ("allocated", False)])
def test_which_sinfo_states_are_a_lost_node(state: str, lost: bool) -> None:
    from nodeshare.producers.slurm_lost_nodes import node_lost

    assert node_lost(state) is lost


def test_a_node_fail_end_with_no_node_down_sends_no_record_and_one_sinfo_failure_is_retried(tmp_path: Path) -> None:
    events = tmp_path / "events"
    node_fail_file(events)
    healthy = SlurmSource(events, FailedNodes())  # type: ignore[arg-type]
    published, _ = healthy.step()
    assert [type(e).__name__ for e in published] == ["JobEvent"]  # an operator decides (nodeshare nodes down)
    broken = FailedNodes(fails=True)
    source = SlurmSource(events, broken)  # type: ignore[arg-type]
    assert source.step() == ([], [])  # the file stays, not moved aside
    broken.fails, broken.states = False, {"n1": "down"}
    published, files = source.step()
    assert [getattr(e, "node", None) for e in published] == [None, "n1"] and broken.asked == 2 and len(files) == 1


def _watching(events: Path, slurm: FailedNodes, **kw: float) -> SlurmSource:
    source = SlurmSource(events, slurm, **kw)  # type: ignore[arg-type]
    source.watch.ask_every_s = 0  # every poll asks sinfo (30 s apart in service)
    ended = datetime.fromtimestamp(int(recorded("jobcomp").env["END"]), UTC)  # the hook file's job
    source.watch.clock = lambda: ended + timedelta(seconds=1)  # read at once
    return source


def _at(source: SlurmSource, end: JobEvent, seconds: float) -> None:
    assert end.end_time is not None
    source.watch.clock = lambda: end.end_time + timedelta(seconds=seconds)  # type: ignore[operator]


def test_a_node_fail_job_whose_nodes_read_fine_is_watched_until_sinfo_names_them_lost(tmp_path: Path) -> None:
    """A node that dies while slurmd's answer to a launch is in flight is returned to service by it
    and reads idle until SlurmdTimeout: the source asks again, across a restart, until it reads lost;
    each node of a job on two is sent when it reads lost, the second later than the first."""
    from nodeshare.producers.slurm_lost_nodes import WATCH_FILE

    events = tmp_path / "events"
    node_fail_file(events)
    slurm = FailedNodes()
    source = _watching(events, slurm)
    published, files = source.step()
    assert [type(e).__name__ for e in published] == ["JobEvent"] and len(source.watch.jobs) == 1
    end = published[0]
    source.done(files)
    assert (events / WATCH_FILE).exists() and not (events / "123-jobcomp-9").exists()
    restarted = _watching(events, slurm)
    _at(restarted, end, 100)
    assert restarted.step() == ([], []) and slurm.asked == 2  # still fine: asked, nothing sent
    slurm.states = {"n2": "idle*"}  # SlurmdTimeout passed: not responding
    published, files = restarted.step()
    assert [(d.job_id, d.node, d.event_time) for d in published] == [("1", "n2", end.end_time)]
    assert published[0].event_id == "slurm/slurm/1/node_down/n2" and files == []
    restarted.done([])
    _at(restarted, end, 300)
    slurm.states = {"n1": "down", "n2": "idle*"}  # the other node, later
    published, _ = restarted.step()
    assert [d.node for d in published] == ["n1"]  # n2 was sent and acknowledged: not again
    restarted.done([])
    assert restarted.watch.jobs == {} and not (events / WATCH_FILE).exists()
    assert restarted.step() == ([], []) and slurm.asked == 4


def test_a_node_lost_at_once_is_sent_with_the_end_and_its_partner_when_it_reads_lost(tmp_path: Path) -> None:
    events = tmp_path / "events"
    node_fail_file(events)
    slurm = FailedNodes({"n1": "down*"})
    source = _watching(events, slurm)
    published, files = source.step()
    assert [getattr(e, "node", None) for e in published] == [None, "n1"]
    source.done(files)
    slurm.states = {"n1": "down*", "n2": "down"}  # a rack: the second node goes too
    assert [d.node for d in source.step()[0]] == ["n2"]


def test_a_record_whose_publish_failed_is_sent_again_even_after_a_poll_that_found_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(A hostile review: the failed poll's records were settled by the next, empty, step.)"""
    events = tmp_path / "events"
    node_fail_file(events)
    slurm = FailedNodes()
    source = _watching(events, slurm)
    with caplog.at_level(logging.WARNING, logger="nodeshare.slurm"):
        source.step()  # the broker refuses the end: its file is read again
        source.done(source.step()[1])
    assert caplog.text.count("nodes not reading lost yet") == 1  # watched once, said once
    slurm.states = {"n2": "idle*"}
    assert [d.node for d in source.step()[0]] == ["n2"]  # the broker refuses it: done() is not called
    slurm.fails = True
    assert [d.node for d in source.step()[0]] == ["n2"]  # seen lost: sent again, sinfo or not
    slurm.states, slurm.fails = {"n2": "idle"}, False  # the node reads fine again for a while
    assert [d.node for d in source.step()[0]] == ["n2"]
    source.done([])  # now acknowledged
    assert source.step() == ([], []) and source.watch.jobs and source.watch.jobs.popitem()[1].pending == {"n1"}


def test_two_runs_of_a_requeued_job_are_watched_apart(tmp_path: Path) -> None:
    from nodeshare.producers.slurm_lost_nodes import LostNodeWatch

    first = event_from_hook(recorded("jobcomp", JOBSTATE="NODE_FAIL", NODES="n1"), one_node)
    second = event_from_hook(recorded("jobcomp", JOBSTATE="NODE_FAIL", NODES="n2",
                                      END=str(int(first.end_time.timestamp()) + 60)), one_node)  # type: ignore[union-attr]
    assert first is not None and second is not None and first.job_id == second.job_id
    watch = LostNodeWatch(None, ask_every_s=0, clock=lambda: second.end_time)  # type: ignore[arg-type, return-value]
    watch.add(first, {}, found=False)
    watch.add(second, {}, found=False)
    assert len(watch.jobs) == 2
    down = watch.poll(lambda nodes: {n: "down" for n in nodes})
    assert sorted((d.node, d.event_time) for d in down) == [("n1", first.end_time), ("n2", second.end_time)]


def test_a_watched_job_is_given_up_once_after_the_wait_and_a_failing_sinfo_changes_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    events = tmp_path / "events"
    node_fail_file(events)
    slurm = FailedNodes()
    source = _watching(events, slurm, lost_wait_s=60)
    (end,), files = source.step()
    source.done(files)
    slurm.fails = True
    _at(source, end, 30)
    with caplog.at_level(logging.ERROR, logger="nodeshare.slurm"):
        assert source.step() == ([], []) and source.step() == ([], [])  # sinfo failed: kept
        assert len(source.watch.jobs) == 1 and caplog.text.count("until it answers") == 1  # said once
        slurm.fails = False
        _at(source, end, 61)
        assert source.step() == ([], []) and source.step() == ([], [])  # past the wait: not asked
        assert slurm.asked == 3 and len(source.watch.jobs) == 1  # nor forgotten before a done()
        source.done([])
    assert source.watch.jobs == {}
    assert caplog.text.count("job 1 ended with NODE_FAIL but Slurm reports none of its nodes down "
                             "(n1 fine, n2 fine) within 60 s of its end") == 1
    slurm.states = {"n1": "down"}
    assert source.step() == ([], [])  # forgotten: a later failure of the node is not this job's


def test_a_run_read_after_its_wait_is_given_up_once_though_its_file_is_read_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    events = tmp_path / "events"
    node_fail_file(events)
    source = _watching(events, FailedNodes(), lost_wait_s=60)
    ended = datetime.fromtimestamp(int(recorded("jobcomp").env["END"]), UTC)
    source.watch.clock = lambda: ended + timedelta(hours=2)  # a source catching up
    with caplog.at_level(logging.ERROR, logger="nodeshare.slurm"):
        for _ in range(3):  # the broker down: the file is read again at each step
            assert [type(e).__name__ for e in source.step()[0]] == ["JobEvent"]
    assert source.watch.jobs == {} and caplog.text.count("so it is not watched") == 1


def test_a_zero_wait_asks_once_a_bad_wait_is_refused_and_an_unreadable_watch_is_moved_aside(tmp_path: Path) -> None:
    from nodeshare.producers.slurm_lost_nodes import WATCH_FILE

    events = tmp_path / "events"
    node_fail_file(events)
    source = SlurmSource(events, FailedNodes(), lost_wait_s=0)  # type: ignore[arg-type]
    assert [type(e).__name__ for e in source.step()[0]] == ["JobEvent"] and source.watch.jobs == {}
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="lost-node wait"):
            SlurmSource(events, FailedNodes(), lost_wait_s=bad)  # type: ignore[arg-type]
    (events / WATCH_FILE).write_text("{not json")
    assert SlurmSource(events, FailedNodes()).watch.jobs == {}  # type: ignore[arg-type]
    (aside,) = events.glob(f"{WATCH_FILE}.unreadable-*")
    assert aside.read_text() == "{not json"


def test_the_cli_s_lost_node_wait_is_the_watch_s() -> None:
    """The command line keeps the domain out of its imports, so it writes the default and bound
    again: they must stay the watch's."""
    import typer.main

    from nodeshare.cli import app
    from nodeshare.producers.slurm_lost_nodes import DEFAULT_WAIT_S, MAX_WAIT_S

    slurm = typer.main.get_command(app).commands["slurm"].commands["source"]  # type: ignore[attr-defined]
    (option,) = [p for p in slurm.params if p.name == "lost_node_wait"]
    assert option.default == DEFAULT_WAIT_S and option.max == MAX_WAIT_S


def test_the_source_keeps_going_when_squeue_fails_and_publishes_what_waited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A CI run lost two charges when one failing squeue (a loaded controller) ended the source's
    loop: every job that ended after went unpublished. Now the poll is made again; the hook file
    waits, and the outage is said once, and its end once."""
    from nodeshare.producers.slurm import run_source

    events = tmp_path / "events"
    events.mkdir()
    (events / "124-prolog_ctld-9").write_bytes(b"\0".join(
        f"{k}={v}".encode() for k, v in recorded("prolog_ctld").env.items()))

    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def hostnames(self, expr: str) -> tuple[str, ...]:
            return one_node(expr)

        def job_tres(self, job_id: str) -> dict[str, float]:
            return {}

        def queue(self) -> list[dict[str, str]]:
            self.calls += 1
            if self.calls <= 3:
                raise RuntimeError("squeue failed (1): slurm_load_jobs error: Socket timed out on send/recv operation")
            return []

    slurm, sent = Flaky(), []
    source = SlurmSource(events, slurm)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="nodeshare.slurm"):
        n = run_source(source, sent.append, poll_s=0.0, stop=lambda: slurm.calls >= 5, sleep=lambda _: None)
    assert n == 1 and [[e.state for e in batch] for batch in sent] == [[JobState.STARTED]]
    assert not list(events.iterdir())  # published, so its file is gone
    said = [r.getMessage().split(":")[0] for r in caplog.records]
    assert said == ["squeue failed", "squeue answers again"]
