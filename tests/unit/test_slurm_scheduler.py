"""The Slurm adapter's pure part: what each placement decision does to a job as Slurm reports it,
and Slurm's nodes as the placement manager's inventory. (Mutations: releasing a job that is not
held, or acting on a delay, fail here.)"""

from __future__ import annotations

import base64
import json
import os

import pytest
from factories import T0
from unit.test_ledger_archive_audit import _Msg  # the Message methods a sink reads

from nodeshare.producers.slurm_nodes import NodeWatch, inventory, parse_nodes, usable
from nodeshare.producers.slurm_scheduler import SlurmJob, SlurmScheduler, plan
from nodeshare.runtime.config import Settings
from nodeshare.schemas import decode_model, encode
from nodeshare.schemas.events import DeadLetter, PlacementAction, PlacementDecision


def decision(job: str, action: PlacementAction, nodes: tuple[str, ...] = (), partner: str | None = None,
             ) -> PlacementDecision:
    return PlacementDecision(event_id=f"p-{job}-{action}", source="test", event_time=T0, job_id=job,
                             action=action, policy="sns", nodes=nodes, cores_per_node=1 if nodes else None,
                             paired_with=partner, reason="test")


HELD = SlurmJob("7", "PENDING", "JobHeldUser")


def test_a_placed_held_job_is_pinned_to_its_nodes_then_released():
    p = plan(decision("7", PlacementAction.PLACE, ("n1", "n2")), HELD)
    assert p.outcome == "applied"
    # the cores per node the placement booked reach Slurm (they never did: the co-runner's share was Slurm's to take)
    assert p.commands == (("scontrol", "update", "JobId=7", "NodeList=n1,n2", "NumNodes=2", "MinCPUsNode=1"),
                          ("scontrol", "release", "7"))
    paired = plan(decision("7", PlacementAction.PAIR, ("n3",), partner="8"), HELD)
    assert paired.commands[0][3:] == ("NodeList=n3", "NumNodes=1", "MinCPUsNode=1") and "next to 8" in paired.why
    unbooked = plan(decision("7", PlacementAction.PLACE, ("n1",)).model_copy(update={"cores_per_node": None}), HELD)
    assert unbooked.commands[0][-1] == "NumNodes=1"


@pytest.mark.parametrize(("action", "job", "outcome", "says"), [
    (PlacementAction.DELAY, HELD, "kept_held", "stays held"),
    (PlacementAction.SERIALIZE, HELD, "kept_held", "stays held"),
    (PlacementAction.PLACE, None, "skipped", "Slurm no longer has it"),
    (PlacementAction.PLACE, SlurmJob("7", "RUNNING", "None"), "skipped", "RUNNING (None), not held"),
    (PlacementAction.PAIR, SlurmJob("7", "PENDING", "Resources"), "skipped", "not held"),  # released before
    (PlacementAction.PLACE, SlurmJob("7", "COMPLETED", "None"), "skipped", "not held"),
])
def test_a_decision_that_must_not_act_runs_no_command_and_says_why(action, job, outcome, says):
    p = plan(decision("7", action, ("n1",)), job)
    assert p.commands == () and p.outcome == outcome and says in p.why


def test_a_placement_without_nodes_keeps_the_job_held():
    p = plan(decision("7", PlacementAction.PLACE), HELD)
    assert p.commands == () and p.outcome == "kept_held"


def test_slurm_nodes_become_inventory():
    text = ("NodeName=c01 Arch=x86_64 CoresPerSocket=16 CPUAlloc=0 CPUTot=32 CPULoad=0.01 Sockets=2 "
            "Boards=1 State=IDLE ThreadsPerCore=1 Reason=maintenance done by admin\n"
            "NodeName=c02 Arch=x86_64 CPUTot=2 State=MIXED\n")
    nodes = parse_nodes(text)
    assert [(n["NodeName"], n["CPUTot"], n.get("Sockets")) for n in nodes] == [("c01", "32", "2"), ("c02", "2", None)]
    inv = inventory(nodes, "hpc", 11, 40.0, T0)
    assert [(i.node, i.cores, i.sockets, i.llc_ways, i.mem_bandwidth_gbps) for i in inv] == [
        ("c01", 32, 2, 11, 40.0), ("c02", 2, 1, 11, 40.0)]
    # published again at the next start: the same ids, de-duplicated downstream
    assert [i.event_id for i in inventory(nodes, "hpc", 11, 40.0, T0)] == [i.event_id for i in inv]
    assert inv[0].event_id != inventory(nodes, "hpc", 12, 40.0, T0)[0].event_id  # a changed shape is news


def test_an_operators_hold_is_never_released():
    p = plan(decision("7", PlacementAction.PLACE, ("n1",)), SlurmJob("7", "PENDING", "JobHeldAdmin"))
    assert p.commands == () and p.outcome == "kept_held" and "operator" in p.why


NODES = ("NodeName=c1 CPUTot=16 Sockets=2 State=ALLOCATED\n"
         "NodeName=c2 CPUTot=16 Sockets=2 State=DOWN+NOT_RESPONDING Reason=dead\n"
         "NodeName=c3 CPUTot=16 Sockets=2 State=IDLE+DRAIN Reason=maint\n"
         "NodeName=c4 CPUTot=16 Sockets=2 State=MIXED+RESERVED\n"
         "NodeName=c5 CPUTot=16 Sockets=2 State=IDLE+POWERED_DOWN\n")


def test_nodes_slurm_runs_no_job_on_are_published_unusable():
    assert [(i.node, i.usable) for i in inventory(parse_nodes(NODES), "c", 11, 50.0, T0)] == [
        ("c1", True), ("c2", False), ("c3", False), ("c4", False), ("c5", True)]
    assert usable("IDLE") and usable("MIXED") and not usable("DOWN*") and not usable("") and not usable("drained")


def test_the_inventory_follows_node_state_and_publishes_only_changes():
    watch = NodeWatch()
    first = watch.changes(inventory(parse_nodes(NODES), "c", 11, 50.0, T0), T0)
    assert len(first) == 5 and watch.changes(inventory(parse_nodes(NODES), "c", 11, 50.0, T0), T0) == []
    again = NODES.replace("State=IDLE+DRAIN", "State=IDLE").split("\n", 1)[1]  # c3 undrained, c1 gone
    changed = watch.changes(inventory(parse_nodes(again), "c", 11, 50.0, T0), T0)
    assert sorted((i.node, i.usable) for i in changed) == [("c1", False), ("c3", True)]  # c1: Slurm dropped it
    assert len({i.event_id for i in first + changed}) == 7


class Refusing:
    def __init__(self, message: str) -> None:
        self.message = message
        self.ran: list[tuple[str, ...]] = []

    def job(self, job_id: str) -> SlurmJob:
        return SlurmJob(job_id, "PENDING", "JobHeldUser")

    def run(self, command: tuple[str, ...]) -> None:
        if "JobId=7" in command:
            raise RuntimeError(f"scontrol update JobId=7 failed (1): {self.message}")
        self.ran.append(command)


class Letters:
    def __init__(self) -> None:
        self.sent: list[DeadLetter] = []
        self.flushed = 0

    def send(self, record: DeadLetter) -> None:
        self.sent.append(record)

    def flush(self, timeout: float = 30.0) -> None:
        self.flushed += 1


def test_a_refused_command_is_a_dead_letter_with_slurms_message_and_the_adapter_goes_on():
    commands, letters = Refusing("Requested node configuration is not available"), Letters()
    sink = SlurmScheduler(Settings(), commands, dead_letters=letters)  # type: ignore[arg-type]
    batch = [_Msg("decisions.placement", encode(decision("7", PlacementAction.PLACE, ("gpu1",))), 4),
             _Msg("decisions.placement", encode(decision("8", PlacementAction.PLACE, ("c1",))), 5)]
    sink.write(batch)  # type: ignore[arg-type]
    assert [c[-1] for c in commands.ran] == ["MinCPUsNode=1", "8"]  # job 8 placed after 7 was refused
    assert sink.outcomes["refused"] == 1 and sink.outcomes["applied"] == 1
    [dl] = letters.sent
    assert isinstance(dl, DeadLetter) and letters.flushed == 1
    assert "Requested node configuration is not available" in dl.reason and "job 7" in dl.reason
    assert (dl.origin_topic, dl.origin_offset) == ("decisions.placement", 4)
    assert decode_model(PlacementDecision, base64.b64decode(dl.value_b64)).job_id == "7"


def test_a_slurm_it_cannot_reach_stops_the_batch_to_try_it_again():
    commands = Refusing("slurm_update error: Unable to contact slurm controller (connect failure)")
    sink = SlurmScheduler(Settings(), commands, dead_letters=Letters())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Unable to contact"):
        sink.write([_Msg("decisions.placement", encode(decision("7", PlacementAction.PLACE, ("c1",))), 0)])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the power-gated start


class Jobs:
    """Slurm's jobs by state, with the time each was last suspended or resumed (whole seconds, as
    Slurm keeps it: slurm.h, "time job last suspended or resumed"); records the commands run.
    ``operator`` runs a command as someone else would."""

    def __init__(self, **states: str) -> None:
        self.states = states
        self.ran: list[tuple[str, ...]] = []
        self.clock = 1_795_600_000
        self.suspend_times: dict[str, int] = {}

    def job(self, job_id: str) -> SlurmJob | None:
        state = self.states.get(job_id)
        return None if state is None else SlurmJob(job_id, state, "None")

    def suspended_at(self, job_id: str) -> int | None:
        return self.suspend_times.get(job_id)

    def run(self, command: tuple[str, ...]) -> None:
        self.ran.append(command)
        self.operator(command[1], command[2])

    def operator(self, verb: str, job_id: str) -> None:
        self.clock += 7
        self.states[job_id] = {"suspend": "SUSPENDED", "resume": "RUNNING"}[verb]
        self.suspend_times[job_id] = self.clock


def power_log() -> list:
    """Real manager decisions: j1 takes node C; j2 on B cannot get its processors' min power (it is
    suspended); j1 ends, j2 gets its power (it is resumed)."""
    from unit.test_power_decisions_right import NODES, Site, inv, job

    from nodeshare.schemas.events import JobState

    site = Site(200.0)
    site.feed(*(inv(n, 2) for n in NODES))
    site.feed(job("j1", JobState.STARTED, 24, ("C",)), job("j2", JobState.STARTED, 24, ("B",), at=1),
              job("j1", JobState.ENDED, 24, ("C",), at=2))
    return site.decisions


def test_a_power_gated_job_is_suspended_and_resumed_when_its_power_is_found():
    """(p2/p2b: before, the scheduler did nothing with a power decision and j2 ran uncapped.)"""
    from nodeshare.schemas.events import PowerAction

    log = power_log()
    assert [(d.job_id, d.action) for d in log] == [("j1", PowerAction.START), ("j2", PowerAction.SUSPEND),
                                                   ("j1", PowerAction.RELEASE), ("j2", PowerAction.START)]
    slurm = Jobs(j1="RUNNING", j2="RUNNING")
    seen: list = []
    sink = SlurmScheduler(Settings(), slurm, on_plan=lambda d, p: seen.append((d.job_id, p.outcome)),  # type: ignore[arg-type]
                          clock=lambda: slurm.clock)
    sink.write([_Msg("decisions.power", encode(d), i) for i, d in enumerate(log[:2])])  # type: ignore[arg-type]
    assert slurm.ran == [("scontrol", "suspend", "j2")] and slurm.states["j2"] == "SUSPENDED"
    assert seen == [("j2", "applied")]  # j1's caps are the agents' business: nothing run, nothing said
    sink.write([_Msg("decisions.power", encode(d), i + 2) for i, d in enumerate(log[2:])])  # type: ignore[arg-type]
    assert slurm.ran[1:] == [("scontrol", "resume", "j2")] and slurm.states["j2"] == "RUNNING"
    # Delivered again (the adapter died before committing): one job's decisions share a partition,
    # so they come again in order and leave the job as the last one says.
    sink.write([_Msg("decisions.power", encode(d), i) for i, d in enumerate(log)])  # type: ignore[arg-type]
    assert slurm.states["j2"] == "RUNNING"


def test_a_power_gate_for_a_job_slurm_no_longer_runs_is_skipped():
    from nodeshare.producers.slurm_scheduler import Suspended, power_plan

    suspend, resume = power_log()[1], power_log()[3]
    ours = Suspended(tried_at=100, suspended_at=101)
    assert power_plan(suspend, None).outcome == "skipped"
    assert power_plan(suspend, SlurmJob("j2", "COMPLETED", "None")).commands == ()
    assert power_plan(resume, SlurmJob("j2", "RUNNING", "None"), ours).commands == ()  # an operator resumed it
    resumed = power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", 101), ours)
    assert resumed.commands == (("scontrol", "resume", "j2"),)
    # Slurm cannot date the suspend, or dates it otherwise: never resumed on a guess
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", None), ours).outcome == "kept_suspended"
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", 130), ours).outcome == "kept_suspended"
    # an attempt whose time was never read: the suspend is the adapter's only if Slurm dates it
    # within a minute after the attempt began
    attempt = Suspended(tried_at=100)
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", 130), attempt).outcome == "applied"
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", 95), attempt).outcome == "kept_suspended"
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None", 200), attempt).outcome == "kept_suspended"


# --------------------------------------------------------------------------- an operator's suspend


def gated(slurm: Jobs, book=None) -> tuple[SlurmScheduler, list]:
    seen: list = []
    sink = SlurmScheduler(Settings(), slurm, on_plan=lambda d, p: seen.append((d.job_id, p.outcome)),  # type: ignore[arg-type]
                          book=book, clock=lambda: slurm.clock)
    return sink, seen


def feed(sink: SlurmScheduler, decisions: list, first: int = 0) -> None:
    sink.write([_Msg("decisions.power", encode(d), first + i) for i, d in enumerate(decisions)])  # type: ignore[arg-type]


def test_a_job_an_operator_suspended_is_never_resumed_by_a_power_decision():
    """(Before: the ``start`` that ``resumes`` j2 ran ``scontrol resume`` on any SUSPENDED job.)"""
    log = power_log()
    slurm = Jobs(j1="RUNNING", j2="RUNNING")
    slurm.operator("suspend", "j2")  # the operator's, before the power manager gates it
    sink, seen = gated(slurm)
    feed(sink, log)
    assert slurm.ran == [] and slurm.states["j2"] == "SUSPENDED"
    assert seen == [("j2", "skipped"), ("j2", "kept_suspended")]
    assert sink.outcomes["kept_suspended"] == 1 and sink.book.jobs == {}


def test_a_job_an_operator_resumed_and_suspended_again_stays_suspended():
    log = power_log()
    slurm = Jobs(j1="RUNNING", j2="RUNNING")
    sink, seen = gated(slurm)
    feed(sink, log[:3])
    assert slurm.ran == [("scontrol", "suspend", "j2")]
    assert sink.book.jobs["j2"].suspended_at == slurm.suspend_times["j2"]
    slurm.operator("resume", "j2")
    slurm.operator("suspend", "j2")  # the operator's suspend now: a later time than the book's
    feed(sink, log[3:], 3)
    assert slurm.ran == [("scontrol", "suspend", "j2")] and slurm.states["j2"] == "SUSPENDED"
    assert seen[-1] == ("j2", "kept_suspended") and sink.book.jobs == {}


def test_the_book_outlives_a_restart_and_a_crash_between_the_suspend_and_its_time(tmp_path):
    from nodeshare.producers.slurm_scheduler import SuspendBook

    path = tmp_path / "state" / "suspended.json"
    log = power_log()
    slurm = Jobs(j1="RUNNING", j2="RUNNING")
    sink, _ = gated(slurm, SuspendBook.load(path))
    feed(sink, log[:2])
    assert SuspendBook.load(path).jobs["j2"].suspended_at == slurm.suspend_times["j2"]
    sink, seen = gated(slurm, SuspendBook.load(path))  # a new adapter
    feed(sink, log[2:], 2)
    assert slurm.ran[-1] == ("scontrol", "resume", "j2") and seen == [("j2", "applied")]
    assert SuspendBook.load(path).jobs == {}
    # killed after its ``scontrol suspend`` ran, before it read Slurm's time: the batch comes again
    slurm = Jobs(j1="RUNNING", j2="SUSPENDED")
    slurm.suspend_times["j2"] = slurm.clock + 2
    path.write_text(json.dumps({"j2": {"tried_at": slurm.clock, "suspended_at": None}}))
    sink, seen = gated(slurm, SuspendBook.load(path))
    feed(sink, log)
    assert seen == [("j2", "applied"), ("j2", "applied")] and slurm.ran == [("scontrol", "resume", "j2")]
    # ... but killed before its suspend ran, while an operator suspended the job: not adopted
    slurm = Jobs(j1="RUNNING", j2="SUSPENDED")
    slurm.suspend_times["j2"] = slurm.clock - 30
    path.write_text(json.dumps({"j2": {"tried_at": slurm.clock, "suspended_at": None}}))
    sink, seen = gated(slurm, SuspendBook.load(path))
    feed(sink, log)
    assert seen == [("j2", "skipped"), ("j2", "kept_suspended")] and slurm.ran == []


def test_a_refused_suspend_leaves_no_entry_and_an_unreadable_book_is_moved_aside(tmp_path):
    from nodeshare.producers.slurm_scheduler import SuspendBook

    log = power_log()

    class Refuses(Jobs):
        def run(self, command: tuple[str, ...]) -> None:
            raise RuntimeError("scontrol suspend j2 failed (1): Access/permission denied")

    sink, seen = gated(Refuses(j1="RUNNING", j2="RUNNING"))
    feed(sink, log[:2])
    assert seen == [("j2", "refused")] and sink.book.jobs == {}
    path = tmp_path / "suspended.json"
    path.write_text('{"j2": "yesterday"}')
    assert SuspendBook.load(path).jobs == {}
    [aside] = tmp_path.glob("suspended.json.unreadable.*")
    assert aside.read_text() == '{"j2": "yesterday"}'


def test_slurms_suspend_time_is_read_from_squeue_json_not_from_a_name_that_forges_it():
    from nodeshare.producers.slurm_scheduler import SchedulerCommands

    class Squeue(SchedulerCommands):
        def __init__(self, printed: str) -> None:
            self.printed = printed

        def _run(self, *args: str) -> str:
            assert args[:2] == ("squeue", "--json")
            if self.printed.startswith("fail:"):
                raise RuntimeError(self.printed[5:])
            return self.printed

    job = {"job_id": 12, "name": "x SuspendTime=2020-01-01T00:00:00", "job_state": "SUSPENDED"}
    assert Squeue(json.dumps({"jobs": [{**job, "suspend_time": 1795667708}]})).suspended_at("12") == 1795667708
    assert Squeue(json.dumps({"jobs": [{**job, "suspend_time": 1795667708}]})).suspended_at("13") is None
    # Slurm 23.11 and later print times as {"set", "infinite", "number"}
    number = {"set": True, "infinite": False, "number": 1795667708}
    assert Squeue(json.dumps({"jobs": [{**job, "suspend_time": number}]})).suspended_at("12") == 1795667708
    assert Squeue(json.dumps({"jobs": [{**job, "suspend_time": {**number, "set": False}}]})).suspended_at("12") is None
    assert Squeue(json.dumps({"jobs": [{**job, "suspend_time": 0}]})).suspended_at("12") is None
    assert Squeue("fail:squeue: error: no data_parser plugin").suspended_at("12") is None  # logged, not resumed
    with pytest.raises(RuntimeError, match="Socket timed out"):  # Slurm not reached: the batch comes again
        Squeue("fail:slurm_load_jobs error: Socket timed out on send/recv operation").suspended_at("12")


def test_a_book_that_cannot_be_read_stops_the_adapter_instead_of_forgetting_its_jobs(tmp_path):
    from nodeshare.producers.slurm_scheduler import SuspendBook

    path = tmp_path / "suspended.json"
    path.mkdir()  # reading it fails with an OSError that is not a missing file
    with pytest.raises(OSError):
        SuspendBook.load(path)


def test_a_slurm_command_that_hangs_is_slurm_not_reached_not_a_crash(monkeypatch):
    """(A review: subprocess's TimeoutExpired escaped every handler and ended the adapter.)"""
    import subprocess

    from nodeshare.producers import slurm
    from nodeshare.producers.slurm_scheduler import UNREACHABLE, SchedulerCommands

    def hang(*a, **k):
        raise subprocess.TimeoutExpired(a[0], 30)

    monkeypatch.setattr(slurm.subprocess, "run", hang)
    with pytest.raises(RuntimeError) as caught:
        SchedulerCommands().job("7")
    assert any(s in str(caught.value) for s in UNREACHABLE)


# ----------------------------------------------------------------------------- placement fails open

def test_a_held_job_never_answered_is_released_after_the_stated_time_and_no_sooner():
    from nodeshare.producers.slurm_scheduler import Waiting, unplaced_due

    t = 10_000.0
    waiting = [Waiting("1", "JobHeldUser"),  # seen held 600 s, never answered: due
               Waiting("2", "JobHeldUser"),  # seen held 599 s
               Waiting("3", "JobHeldAdmin"),  # an operator's hold: never
               Waiting("4", "Resources"),  # released already, waits for nodes: not held
               Waiting("5", "JobHeldUser", single=False),  # an array task: its id is another in decisions
               Waiting("6", "JobHeldUser")]  # delayed: the manager answered and holds it on purpose
    since = {"1": t - 600, "2": t - 599, "3": t - 9_000, "4": t - 9_000, "5": t - 9_000, "6": t - 9_000}
    assert unplaced_due(waiting, t, since, {"6"}, 600.0) == ["1"]
    assert unplaced_due(waiting, t + 1, since, {"6"}, 600.0) == ["1", "2"]
    assert unplaced_due(waiting, t, {}, set(), 600.0) == []  # first seen now: the wait starts now
    assert unplaced_due(waiting, t, since, set(), 0.0) == []  # off


class _Slurm:
    """The adapter's Slurm commands, faked: pending jobs, their state, and the commands run."""

    def __init__(self, waiting: list) -> None:
        self.waiting_jobs, self.ran = waiting, []

    def waiting(self) -> list:
        return list(self.waiting_jobs)

    def job(self, job_id: str) -> SlurmJob:
        return SlurmJob(job_id, "PENDING", "JobHeldUser")

    def run(self, command: tuple) -> None:
        self.ran.append(command)
        if command[-1] == "2":
            raise RuntimeError("scontrol release 2: Job is no longer pending execution")


def test_the_adapter_releases_unanswered_jobs_only_and_remembers_every_answer_across_a_restart(tmp_path):
    """The sweep releases a held job nobody answered once it has seen it held for the stated time;
    a delay (sent once per job) keeps its job held for good, also after the adapter restarts (the
    decided book); a job the sweep released is not released again when its user holds it later."""
    from nodeshare.producers.slurm_scheduler import DecidedBook, Waiting

    now = [1_000_000.0]
    slurm = _Slurm([Waiting(j, "JobHeldUser") for j in ("1", "2", "3")])
    settings = Settings(placement_release_after_s=600.0)
    book = tmp_path / "decided.json"
    adapter = SlurmScheduler(settings, slurm, clock=lambda: now[0], decided=DecidedBook.load(book))  # type: ignore[arg-type]
    assert adapter.release_unplaced() == []  # first seen held now
    now[0] += 300
    adapter.write([_Msg("decisions.placement", encode(decision("3", PlacementAction.DELAY)), 0)])
    now[0] += 300
    assert adapter.release_unplaced() == ["1"]  # 2: Slurm refused (placed meanwhile); 3: answered
    assert slurm.ran == [("scontrol", "release", "1"), ("scontrol", "release", "2")]
    # noted before each release (a crash in between must not undo a later hold), refused or not
    assert adapter.outcomes["released_unplaced"] == 1 and set(json.loads(book.read_text())) == {"1", "2", "3"}
    # restarted much later, jobs 1 and 2 held again by their users, job 3 still delayed
    restarted = SlurmScheduler(settings, slurm, clock=lambda: now[0], decided=DecidedBook.load(book))  # type: ignore[arg-type]
    restarted.release_unplaced()
    now[0] += 10_000
    slurm.ran.clear()
    assert restarted.release_unplaced() == [] and slurm.ran == []
    slurm.waiting_jobs = [Waiting("3", "JobHeldUser")]  # 1 and 2 ended and Slurm purged them: forgotten
    now[0] += 1
    restarted.release_unplaced()
    assert set(json.loads(book.read_text())) == {"3"}


def test_a_failed_listing_is_no_empty_queue_and_an_answer_during_the_listing_is_kept(tmp_path):
    """squeue --json reporting errors (or no job list) raises: read as "nothing pending" it would
    wipe every answer, and every delayed job would be released later. A delay written while the
    sweep was listing (its job submitted after the listing) is not pruned with the jobs Slurm no
    longer lists."""
    from nodeshare.producers.slurm_scheduler import DecidedBook, SchedulerCommands, Waiting

    class Squeue(SchedulerCommands):
        def __init__(self, text: str) -> None:
            self.text = text

        def _run(self, *args: str) -> str:
            return self.text

    for text in ('{"errors": [{"error": "Unable to contact slurm controller"}], "jobs": []}', '{"meta": {}}', "[]"):
        with pytest.raises(RuntimeError, match="squeue --json"):
            Squeue(text).waiting()
    listed = Squeue(json.dumps({"jobs": [
        {"job_id": 5, "job_state": "PENDING", "state_reason": "JobHeldUser", "array_job_id": 0, "het_job_id": 0},
        {"job_id": 6, "job_state": ["PENDING", "REQUEUED"], "state_reason": "JobHeldUser",
         "array_job_id": {"set": True, "infinite": False, "number": 4}},
        {"job_id": 7, "job_state": ["RUNNING"], "state_reason": "None"}]})).waiting()
    assert listed == [Waiting("5", "JobHeldUser", True, True), Waiting("6", "JobHeldUser", False, True),
                      Waiting("7", "None", True, False)]
    now = [1_000.0]
    book = DecidedBook.load(tmp_path / "decided.json")
    book.note("old", 10.0)
    adapter = SlurmScheduler(Settings(placement_release_after_s=600.0), _Slurm([]), clock=lambda: now[0],  # type: ignore[arg-type]
                             decided=book)
    original = adapter.commands.waiting

    def listing_while_a_delay_lands() -> list:
        adapter.decided.note("9", now[0] + 1)  # the consumer notes job 9's delay meanwhile
        return original()

    adapter.commands.waiting = listing_while_a_delay_lands  # type: ignore[method-assign]
    adapter.release_unplaced()
    assert set(book.jobs) == {"9"}  # "old" is no longer listed: forgotten; 9 kept


def test_a_refused_placement_is_not_an_answer_and_fail_open_off_keeps_no_book(tmp_path):
    from nodeshare.producers.slurm_scheduler import DecidedBook

    class Refusing(_Slurm):
        def run(self, command: tuple) -> None:
            raise RuntimeError("scontrol update: Invalid node name specified")

    adapter = SlurmScheduler(Settings(placement_release_after_s=600.0), Refusing([]),  # type: ignore[arg-type]
                             decided=DecidedBook.load(tmp_path / "a.json"))
    adapter.write([_Msg("decisions.placement", encode(decision("4", PlacementAction.PLACE, ("n9",))), 0),
                   _Msg("decisions.placement", encode(decision("5", PlacementAction.DELAY)), 1)])
    assert set(adapter.decided.jobs) == {"5"}  # 4: refused, so it still fails open later
    off = SlurmScheduler(Settings(placement_release_after_s=0.0), _Slurm([]),  # type: ignore[arg-type]
                         decided=DecidedBook.load(tmp_path / "b.json"))
    off.write([_Msg("decisions.placement", encode(decision("5", PlacementAction.DELAY)), 0)])
    assert off.decided.jobs == {} and not (tmp_path / "b.json").exists()


def test_a_decided_book_that_cannot_be_written_does_not_stop_placement(tmp_path):
    from nodeshare.producers.slurm_scheduler import DecidedBook

    (tmp_path / "ro").mkdir()
    book = DecidedBook(tmp_path / "ro" / "decided.json")
    (tmp_path / "ro").chmod(0o500)
    try:
        adapter = SlurmScheduler(Settings(placement_release_after_s=600.0), _Slurm([]), decided=book)  # type: ignore[arg-type]
        if os.geteuid() == 0:  # root writes anyway: make the write itself fail
            book.path = tmp_path / "ro" / "missing-dir" / "decided.json"
        adapter.write([_Msg("decisions.placement", encode(decision("5", PlacementAction.DELAY)), 0)])
        assert book.jobs.keys() == {"5"} and book.dirty  # kept, tried again at the next change
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_a_decided_book_that_is_not_one_is_moved_aside(tmp_path):
    from nodeshare.producers.slurm_scheduler import DecidedBook

    (tmp_path / "decided.json").write_text("[1, 2]")
    assert DecidedBook.load(tmp_path / "decided.json").jobs == {}
    assert [p.name.split(".unreadable.")[0] for p in tmp_path.iterdir()] == ["decided.json"]


def test_nodes_whose_publication_failed_are_published_again_at_the_next_look():
    """The broker unreachable when the adapter starts: the nodes count as unpublished, so the
    watcher's next look sends them (they were marked published before the flush)."""
    from nodeshare.producers.slurm_nodes import publish_inventory

    class Producer:
        def __init__(self, fail: bool) -> None:
            self.fail, self.sent = fail, []

        def send_all(self, records: list) -> None:
            self.sent += records

        def flush(self, timeout: float) -> None:
            if self.fail:
                raise RuntimeError("2 records still undelivered after 30 s")

    class Nodes:
        def nodes(self) -> list:
            return parse_nodes("NodeName=c1 CPUTot=16 State=IDLE\nNodeName=c2 CPUTot=16 State=IDLE\n")

    watch, shape = NodeWatch(), {"cluster": "hpc", "llc_ways": 11, "mem_bandwidth_gbps": 40.0}
    with pytest.raises(RuntimeError, match="undelivered"):
        publish_inventory(Producer(True), Nodes(), watch, **shape)  # type: ignore[arg-type]
    assert [r.node for r in publish_inventory(Producer(False), Nodes(), watch, **shape)] == ["c1", "c2"]  # type: ignore[arg-type]
    assert publish_inventory(Producer(False), Nodes(), watch, **shape) == []  # type: ignore[arg-type]
