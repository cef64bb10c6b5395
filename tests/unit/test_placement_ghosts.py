"""Placement decisions that must not be taken (issue 43): a job placed again from a re-published
submission (a ghost booked for ever), a node Slurm does not run jobs on, pairs of younger jobs
taking the node an aged job waits for. (Mutations: dropping the lifecycle gate, the usable check
or the aged-pair rule fail here.)"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from factories import T0
from unit.test_profiles_placement import ev, inventory

from nodeshare.producers.slurm import SlurmSource
from nodeshare.schemas import JobState, encode
from nodeshare.schemas.catalog import TOPIC_OF_RECORD
from nodeshare.schemas.events import PlacementAction, PlacementDecision, Record
from nodeshare.streams.core.placement.stream import PlacementManager


def decisions(m: PlacementManager, *records: Record) -> list[PlacementDecision]:
    out = []
    for r in records:
        out += m.apply(TOPIC_OF_RECORD[type(r)].name, encode(r))
    return [d for d in out if isinstance(d, PlacementDecision)]


def test_a_resubmission_of_a_running_or_finished_job_changes_nothing() -> None:
    m = PlacementManager()
    decisions(m, inventory("n1"), inventory("n2"))
    [d] = decisions(m, ev("x", JobState.SUBMITTED, "LAMMPS", ()))
    assert d.action is PlacementAction.PLACE and d.nodes == ("n1",)
    decisions(m, ev("x", JobState.STARTED, "LAMMPS", d.nodes, start_s=10))
    # a restarted Slurm source publishes the same submission again (same event id)
    assert decisions(m, ev("x", JobState.SUBMITTED, "LAMMPS", ())) == []
    assert m.scheduler is not None and m.scheduler.nodes_of("x") == {"n1"} and not m.scheduler.queue
    decisions(m, ev("x", JobState.ENDED, "LAMMPS", d.nodes, start_s=10, end_s=100))
    assert decisions(m, ev("x", JobState.SUBMITTED, "LAMMPS", ())) == []  # a ghost: finished long ago
    assert decisions(m, ev("x", JobState.STARTED, "LAMMPS", ("n2",), start_s=10)) == []  # a late start
    assert all(not load.jobs for load in m.scheduler.loads.values()) and not m.scheduler.queue
    [y] = decisions(m, ev("y", JobState.SUBMITTED, "LAMMPS", (), submit_s=200))
    assert y.action is PlacementAction.PLACE  # nothing is booked for the ghost


def test_a_job_that_started_or_ended_before_any_node_was_known_is_not_queued_then() -> None:
    m = PlacementManager()
    decisions(m, ev("a", JobState.SUBMITTED, "CG", ()), ev("a", JobState.STARTED, "CG", ("n1",)),
              ev("a", JobState.ENDED, "CG", ("n1",), end_s=50), ev("b", JobState.SUBMITTED, "CG", ()))
    placed = decisions(m, inventory("n1"))
    assert [d.job_id for d in placed] == ["b"] and m.scheduler is not None and not m.scheduler.queue


def test_the_slurm_source_publishes_no_submission_for_a_job_squeue_shows_finished(tmp_path: Path) -> None:
    class Squeue:
        def hostnames(self, expr: str) -> tuple[str, ...]:
            return (expr,)

        def job_tres(self, job_id: str) -> dict[str, float]:
            return {}

        def queue(self) -> list[dict[str, str]]:
            return [dict(job_id=j, user="u", account="a", program="P", cores="4",
                         submit="2026-03-01T00:00:00+00:00", state=state)
                    for j, state in (("1", "COMPLETED"), ("2", "CANCELLED"), ("3", "RUNNING"), ("4", "PENDING"))]

    events, _ = SlurmSource(tmp_path, Squeue()).step()  # type: ignore[arg-type]
    assert [(e.job_id, e.state) for e in events] == [("3", JobState.SUBMITTED), ("4", JobState.SUBMITTED)]


def test_an_unusable_node_is_never_chosen_and_is_again_once_usable() -> None:
    m = PlacementManager()
    down = inventory("n2").model_copy(update={"usable": False, "event_id": "inv-n2-down"})
    decisions(m, inventory("n1"), down, ev("busy", JobState.STARTED, "X", ("n1",)))
    [d] = decisions(m, ev("j", JobState.SUBMITTED, "LAMMPS", (), submit_s=1))
    assert d.action is PlacementAction.DELAY and d.nodes == ()
    up = inventory("n2").model_copy(update={"event_id": "inv-n2-up", "event_time": T0 + timedelta(seconds=5)})
    [d] = decisions(m, up)
    assert d.job_id == "j" and d.action is PlacementAction.PLACE and d.nodes == ("n2",)


#: Predicted Deg (%): the aged job's program (PA) mixes badly with both younger ones, they mix well.
DEG = {("PA", "PB"): 200.0, ("PB", "PA"): 200.0, ("PA", "PC"): 200.0, ("PC", "PA"): 200.0,
       ("PB", "PC"): 0.0, ("PC", "PB"): 0.0}


@pytest.mark.parametrize("pairing", ["blossom", "greedy"])
def test_with_pairing_on_younger_pairs_do_not_take_the_node_an_aged_job_waits_for(pairing: str) -> None:
    m = PlacementManager(pairing=pairing)
    m.pairs.model = object()  # type: ignore[assignment]  # a trained forest stands in: predictions below
    m.pairs.matrix = lambda book, progs: np.array(  # type: ignore[method-assign]
        [[DEG.get((a, b), 50.0) for b in progs] for a in progs])
    m.pairs.predict = lambda book, prog, others: [DEG.get((prog, o), 50.0) for o in others]  # type: ignore[method-assign]
    decisions(m, inventory("n1"), ev("R", JobState.STARTED, "PR", ("n1",)))
    decisions(m, ev("A", JobState.SUBMITTED, "PA", (), cores=8, submit_s=0),
              ev("B", JobState.SUBMITTED, "PB", (), cores=8, submit_s=3700),
              ev("C", JobState.SUBMITTED, "PC", (), cores=8, submit_s=3700))  # A is past the 1 h age limit
    out = decisions(m, ev("R", JobState.ENDED, "PR", ("n1",), end_s=4000))  # n1 frees
    placed = {d.job_id: d.action for d in out if d.nodes}
    assert placed == {"A": PlacementAction.PLACE}
    assert m.scheduler is not None and m.scheduler.nodes_of("A") == {"n1"}


def test_an_aged_job_still_pairs_with_a_younger_one() -> None:
    m = PlacementManager(pairing="greedy")
    deg = {("PA", "PB"): 0.0, ("PB", "PA"): 0.0}
    m.pairs.model = object()  # type: ignore[assignment]
    m.pairs.matrix = lambda book, progs: np.array(  # type: ignore[method-assign]
        [[deg.get((a, b), 300.0) for b in progs] for a in progs])
    m.pairs.predict = lambda book, prog, others: [deg.get((prog, o), 300.0) for o in others]  # type: ignore[method-assign]
    decisions(m, inventory("n1"), ev("R", JobState.STARTED, "PR", ("n1",)))
    decisions(m, ev("A", JobState.SUBMITTED, "PA", (), cores=8, submit_s=0),
              ev("B", JobState.SUBMITTED, "PB", (), cores=8, submit_s=3700))
    out = decisions(m, ev("R", JobState.ENDED, "PR", ("n1",), end_s=4000))
    assert sorted((d.job_id, d.action, d.paired_with) for d in out if d.nodes) == [
        ("A", PlacementAction.PAIR, "B"), ("B", PlacementAction.PAIR, "A")]
