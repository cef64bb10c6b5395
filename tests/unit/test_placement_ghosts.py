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
from nodeshare.schemas.events import JobEvent, PlacementAction, PlacementDecision, Record
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

        def node_ranges(self) -> dict[str, tuple[int, int | None]]:
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


def test_a_job_that_asked_for_two_nodes_is_placed_on_two_and_never_paired() -> None:
    """A job of 2 cores submitted with ``-N 2`` (``nodes_requested``, schema 9) fits one 16-core node
    but asked for two: it is placed on two, and not offered to Seed 003's pairing, which starts both
    jobs of a pair on one node. (Before, it was packed onto one node, and the Slurm adapter's
    NumNodes=1 overrode the user's request: the multi-node Slurm test caught it.)"""
    m = PlacementManager(pairing="greedy")
    m.pairs.model = object()  # type: ignore[assignment]  # every pair predicted harmless
    m.pairs.matrix = lambda book, progs: np.zeros((len(progs), len(progs)))  # type: ignore[method-assign]
    m.pairs.predict = lambda book, prog, others: [0.0 for _ in others]  # type: ignore[method-assign]
    decisions(m, inventory("n1"), inventory("n2"), ev("R", JobState.STARTED, "PR", ("n1", "n2"), cores=32))
    wide = ev("W", JobState.SUBMITTED, "PW", (), cores=2).model_copy(update={"nodes_requested": 2, "nodes_max": 2})
    decisions(m, wide, ev("B", JobState.SUBMITTED, "PB", (), cores=2), ev("C", JobState.SUBMITTED, "PC", (), cores=2))
    out = decisions(m, ev("R", JobState.ENDED, "PR", ("n1", "n2"), cores=32, end_s=100))
    placed = {d.job_id: d for d in out if d.nodes}
    assert placed["W"].action is PlacementAction.PLACE and sorted(placed["W"].nodes) == ["n1", "n2"]
    assert placed["W"].cores_per_node == 1
    assert {placed["B"].action, placed["C"].action} == {PlacementAction.PAIR}  # the others still pair


def test_the_slurm_source_says_which_node_count_a_pending_job_asked_for(tmp_path: Path) -> None:
    """``scontrol show job``'s NumNodes (min-max where the job gave ``-N``, a bare minimum where it
    gave none) becomes ``nodes_requested`` and ``nodes_max`` of a pending job's submission, asked in
    one call per poll that has new waiting jobs and not again for them; a job no longer pending
    carries neither; a count Slurm would not run is left out, the job still published; a controller
    that does not answer leaves the submissions to the next poll. The job name is read last, so a
    name with a ``|`` does not lose the job."""
    from nodeshare.producers.slurm import SlurmCommands

    shown = ("JobId=7 JobName=w NumNodes=2-2 NumCPUs=2 NumTasks=2\nJobId=8 NumNodes=1 NumCPUs=4\n"
             "JobId=9 NumNodes=3-3 NumCPUs=2\nJobId=10 NumNodes=1-2 NumCPUs=2\nJobId=11 NumNodes=2 NumCPUs=8\n")
    queue = ["7|u|a|2|2026-03-01T00:00:00|PENDING|wide|job", "8|u|a|4|2026-03-01T00:00:00|PENDING|narrow",
             "9|u|a|2|2026-03-01T00:00:00|PENDING|odd", "10|u|a|2|2026-03-01T00:00:00|RUNNING|started"]
    asked: list[tuple[str, ...]] = []

    class Slurm(SlurmCommands):
        away = False

        def _run(self, *args: str) -> str:
            asked.append(args[:3])
            if args[:3] == ("scontrol", "show", "job"):
                assert args == ("scontrol", "show", "job", "-o")  # every job in one call
                if self.away:
                    raise RuntimeError("scontrol failed (1): Unable to contact slurm controller")
                return shown
            assert args[:2] == ("squeue", "-h") and args[-1] == "%i|%u|%a|%C|%V|%T|%j", args
            return "\n".join(queue) + "\n"

        def hostnames(self, expr: str) -> tuple[str, ...]:
            return (expr,)

    away = Slurm({})
    away.away = True
    source = SlurmSource(tmp_path, away)
    assert source.step()[0] == []  # not published without the counts: at the next poll
    source.commands = Slurm({})
    events, _ = source.step()
    assert [(e.job_id, e.program, e.cores, e.nodes_requested, e.nodes_max) for e in events] == [
        ("7", "wide|job", 2, 2, 2), ("8", "narrow", 4, None, None), ("9", "odd", 2, None, None),
        ("10", "started", 2, None, None)]
    queue.append("11|u|a|8|2026-03-01T00:00:00|PENDING|pinned")  # -w n1,n2: a bare minimum of 2
    asked.clear()
    source.seen_submitted.discard("7")  # its publish failed: sent again, with the count kept
    again, _ = source.step()
    assert [(e.job_id, e.nodes_requested, e.nodes_max) for e in again] == [("7", 2, 2), ("11", 2, None)]
    assert asked.count(("scontrol", "show", "job")) == 1
    asked.clear()
    source.seen_submitted.discard("7")
    assert [e.job_id for e in source.step()[0]] == ["7"] and ("scontrol", "show", "job") not in asked
    with pytest.raises(ValueError, match="nodes_requested: 3 nodes for 2 cores"):
        JobEvent.model_validate({**events[0].model_dump(), "nodes_requested": 3, "nodes_max": 3})
    with pytest.raises(ValueError, match="nodes_max: 1 is below nodes_requested"):
        JobEvent.model_validate({**events[0].model_dump(), "nodes_max": 1})


def test_the_placement_manager_places_a_job_on_the_node_count_its_submission_carries() -> None:
    """From the lifecycle event to the decision: ``-N 1 -n 32`` (nodes_requested 1, nodes_max 1) on
    a 16-core and a 64-core node is placed on the big node alone (sized by the small node it would
    need two, which it did not ask for)."""
    m = PlacementManager()
    decisions(m, inventory("small", cores=16), inventory("big", cores=64))
    one = ev("J", JobState.SUBMITTED, "PJ", (), cores=32).model_copy(update={"nodes_requested": 1, "nodes_max": 1})
    [d] = decisions(m, one)
    assert d.action is PlacementAction.PLACE and d.nodes == ("big",) and d.cores_per_node == 32


def test_a_node_count_is_written_only_where_the_job_gave_one_and_an_older_pickle_reads_without() -> None:
    """Version 9's fields are left out of a record that does not use them (an older reader forbids
    unknown fields), and a JobEvent a schema-8 worker pickled into a placement snapshot reads them
    as unset rather than failing at their first use."""
    import json
    import pickle

    plain = ev("P", JobState.SUBMITTED, "PP", (), cores=2)
    assert not {"nodes_requested", "nodes_max"} & json.loads(encode(plain)).keys()
    asked = plain.model_copy(update={"nodes_requested": 2, "nodes_max": 2})
    assert json.loads(encode(asked))["nodes_requested"] == 2 and json.loads(encode(asked))["nodes_max"] == 2
    state = plain.__getstate__()
    added = ("nodes_requested", "nodes_max")
    older = {**state, "__dict__": {k: v for k, v in state["__dict__"].items() if k not in added}}
    revived = pickle.loads(pickle.dumps(plain))
    revived.__setstate__(older)
    assert revived.nodes_requested is None and revived.nodes_max is None and revived == plain


def test_a_job_record_that_is_not_utf8_does_not_stop_the_source(tmp_path: Path) -> None:
    """The node counts come from every job's record in one listing, and a user's job name, path or
    comment need not be UTF-8: the listing is read with those bytes replaced (before, one such byte
    raised UnicodeDecodeError out of the source's step, and its restart met it again)."""
    import os
    import stat

    from nodeshare.producers.slurm import SlurmCommands

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_bytes(b"#!/bin/sh\nprintf 'JobId=7 JobName=j\\366rg NumNodes=2-2 NumCPUs=2 WorkDir=/home/j\\366rg\\n"
                     b"JobId=8 NumNodes=1 NumCPUs=1\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    commands = SlurmCommands({**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert commands.node_ranges() == {"7": (2, 2)}  # job 8's bare 1 bounds nothing
