"""The Slurm adapter's pure part: what each placement decision does to a job as Slurm reports it,
and Slurm's nodes as the placement manager's inventory. (Mutations: releasing a job that is not
held, or acting on a delay, fail here.)"""

from __future__ import annotations

import pytest
from factories import T0

from nodeshare.producers.slurm_scheduler import SlurmJob, inventory, parse_nodes, plan
from nodeshare.schemas.events import PlacementAction, PlacementDecision


def decision(job: str, action: PlacementAction, nodes: tuple[str, ...] = (), partner: str | None = None,
             ) -> PlacementDecision:
    return PlacementDecision(event_id=f"p-{job}-{action}", source="test", event_time=T0, job_id=job,
                             action=action, policy="sns", nodes=nodes, cores_per_node=1 if nodes else None,
                             paired_with=partner, reason="test")


HELD = SlurmJob("7", "PENDING", "JobHeldUser")


def test_a_placed_held_job_is_pinned_to_its_nodes_then_released():
    p = plan(decision("7", PlacementAction.PLACE, ("n1", "n2")), HELD)
    assert p.outcome == "applied"
    assert p.commands == (("scontrol", "update", "JobId=7", "NodeList=n1,n2", "NumNodes=2"),
                          ("scontrol", "release", "7"))
    paired = plan(decision("7", PlacementAction.PAIR, ("n3",), partner="8"), SlurmJob("7", "PENDING", "JobHeldAdmin"))
    assert paired.commands[0][3:] == ("NodeList=n3", "NumNodes=1") and "next to 8" in paired.why


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
