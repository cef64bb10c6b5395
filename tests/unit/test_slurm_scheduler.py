"""The Slurm adapter's pure part: what each placement decision does to a job as Slurm reports it,
and Slurm's nodes as the placement manager's inventory. (Mutations: releasing a job that is not
held, or acting on a delay, fail here.)"""

from __future__ import annotations

import base64

import pytest
from factories import T0
from unit.test_ledger_archive_audit import _Msg  # the Message methods a sink reads

from nodeshare.config import Settings
from nodeshare.producers.slurm_scheduler import (
    NodeWatch,
    SlurmJob,
    SlurmScheduler,
    inventory,
    parse_nodes,
    plan,
    usable,
)
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
    """Slurm's jobs by state; records the commands run."""

    def __init__(self, **states: str) -> None:
        self.states = states
        self.ran: list[tuple[str, ...]] = []

    def job(self, job_id: str) -> SlurmJob | None:
        state = self.states.get(job_id)
        return None if state is None else SlurmJob(job_id, state, "None")

    def run(self, command: tuple[str, ...]) -> None:
        self.ran.append(command)
        self.states[command[2]] = {"suspend": "SUSPENDED", "resume": "RUNNING"}[command[1]]


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
    sink = SlurmScheduler(Settings(), slurm, on_plan=lambda d, p: seen.append((d.job_id, p.outcome)))  # type: ignore[arg-type]
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
    from nodeshare.producers.slurm_scheduler import power_plan

    suspend, resume = power_log()[1], power_log()[3]
    assert power_plan(suspend, None).outcome == "skipped"
    assert power_plan(suspend, SlurmJob("j2", "COMPLETED", "None")).commands == ()
    assert power_plan(resume, SlurmJob("j2", "RUNNING", "None")).commands == ()  # an operator resumed it
    assert power_plan(resume, SlurmJob("j2", "SUSPENDED", "None")).commands == (("scontrol", "resume", "j2"),)
