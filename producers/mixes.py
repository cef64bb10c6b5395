"""Job mixes beyond pairs run to completion (issue 36 part 3): what breaks a fixed shutter schedule.

Each mix is a deterministic function of its seed and the programs it is given:

* ``trace-times``: run times drawn from a Standard Workload Format trace (5 s to hours), each job
  next to a co-runner from the library that restarts for as long as the job runs;
* ``arrivals``: a job whose co-runners arrive and leave mid-run, several in sequence, with the
  node to itself in between: it shares its node for only part of its run;
* ``short-phases``: variants of the programs whose phases alternate faster than one shutter sample;
* ``thrashing``: pairs of the programs with the largest LLC demand (by their curves, not names).

``run_lanes`` runs one script per node on the calibrated engine. The jobs it scores are the
scripts' own (``Run.scored``); co-runners that only load the node are charged but not scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .calibrated import SLOTS, USERS, CalibratedConfig, Engine, JobSpec, Result, Sink, job_id
from .swf import swf_lines
from .workloads import Micro, Workload

#: A trace job's run time is clipped to [MIN_RUN_S, max_run_s] (the default maximum: one hour).
MIN_RUN_S = 5.0
MAX_RUN_S = 3600.0


@dataclass(frozen=True)
class Run:
    """One job of a node's script: it starts in its slot once the slot is free and ``start_s`` has come."""

    program: str
    work_s: float
    start_s: float = 0.0
    scored: bool = True


@dataclass(frozen=True)
class Lane:
    """One node's script: each slot's runs in order; a slot's ``filler`` program (if any) restarts
    there whenever the slot's runs are used up, until every scored run of the node has ended."""

    slots: tuple[tuple[Run, ...], tuple[Run, ...]]
    fillers: tuple[str | None, str | None] = (None, None)


def run_lanes(cfg: CalibratedConfig, lanes: Sequence[Lane], programs: dict[str, Workload],
              sink: Sink | None = None, max_s: float = 36_000.0) -> tuple[Result, set[str]]:
    """Every lane on a node of its own; a node whose scored runs have all ended is left empty
    (jobs still running there are not counted, as in ``run_pairwise``). Returns the result and
    the ids of the scored jobs."""
    cfg = replace(cfg, nodes=len(lanes))
    eng = Engine(cfg, programs, sink or Sink())
    nxt = np.zeros((len(lanes), SLOTS), np.int64)
    left = np.array([sum(r.scored for s in lane.slots for r in s) for lane in lanes])
    scored: set[int] = set()
    ended: list[int] = []
    eng.on_finish = lambda j, _slot: ended.append(j)

    def launch(node: int, slot: int, program: str, work_s: float, score: bool) -> None:
        user, account = USERS[(node + slot) % len(USERS)]
        j = eng.submit(JobSpec(program, work_s, eng.t, 1, user, account))
        eng.start(j, [node], slot)
        if score:
            scored.add(j)

    while left.any() and eng.t < max_s:
        for node in np.flatnonzero((left > 0) & (eng.slot_job < 0).any(axis=1)).tolist():
            lane = lanes[node]
            for slot in range(SLOTS):
                if eng.slot_job[node, slot] >= 0:
                    continue
                runs, i = lane.slots[slot], int(nxt[node, slot])
                if i < len(runs):
                    if runs[i].start_s <= eng.t:
                        launch(node, slot, runs[i].program, runs[i].work_s, runs[i].scored)
                        nxt[node, slot] += 1
                elif (filler := lane.fillers[slot]) is not None:
                    launch(node, slot, filler, programs[filler].solo_s, False)
        eng.step()
        for j in ended:
            if j in scored:
                node = eng.jobs.nodes[j][0]
                left[node] -= 1
                if left[node] == 0:
                    eng.slot_job[node] = -1  # data collection stops: the node is left alone
        ended.clear()
    return eng.result(), {job_id(j) for j in scored}


# --------------------------------------------------------------------------- the mixes


def trace_run_times(path: Path, n: int, seed: int, max_run_s: float = MAX_RUN_S) -> np.ndarray:
    """``n`` run times drawn (with replacement) from the jobs of an SWF trace with a positive run
    time (field 4), clipped to [MIN_RUN_S, max_run_s]."""
    runs = []
    for line_no, f in swf_lines(path):
        try:
            run = float(f[3])
        except ValueError as exc:
            raise ValueError(f"{path}:{line_no}: {exc}") from None
        if run > 0:
            runs.append(run)
    if not runs:
        raise ValueError(f"{path}: no job with a positive run time")
    rng = np.random.default_rng(seed)
    return np.clip(rng.choice(np.array(runs), n), MIN_RUN_S, max(MIN_RUN_S, max_run_s))


def trace_times_lanes(run_times: Sequence[float], programs: Sequence[str], seed: int) -> list[Lane]:
    """One job per run time (a library program), next to a co-runner that restarts all along."""
    rng = np.random.default_rng(seed)
    names = list(programs)
    return [Lane(((Run(names[int(rng.integers(len(names)))], float(t)),), ()),
                 (None, names[int(rng.integers(len(names)))])) for t in run_times]


def arrivals_lanes(n: int, programs: Sequence[str], library: dict[str, Workload], seed: int) -> list[Lane]:
    """``n`` jobs of 2-4 times their program's solo run; co-runners (each 10-30% of that) arrive
    one after another, the first after 5-25% of it, with 5-20% of it alone between them: every
    job runs part of its time alone and shares the rest with two or more co-runners in turn."""
    rng = np.random.default_rng(seed)
    names = list(programs)
    lanes = []
    for _ in range(n):
        prog = names[int(rng.integers(len(names)))]
        work = float(library[prog].solo_s * rng.uniform(2.0, 4.0))
        t = work * float(rng.uniform(0.05, 0.25))
        co: list[Run] = []
        while t < 0.8 * work or len(co) < 2:
            w = work * float(rng.uniform(0.1, 0.3))
            co.append(Run(names[int(rng.integers(len(names)))], w, t, scored=False))
            t += w * 1.5 + work * float(rng.uniform(0.05, 0.2))  # 1.5: room for the co-runner's slowdown
        lanes.append(Lane(((Run(prog, work),), tuple(co))))
    return lanes


SHORT_SUFFIX = "-short"


def short_phase_variants(programs: Sequence[str], library: dict[str, Workload], sample_us: int,
                         seed: int) -> dict[str, Workload]:
    """A variant of each program (named ``<program>-short``) whose behaviour alternates faster
    than one sample S: a burst of 25-45% of every 0.3-0.9 S (IPC x 0.6, bandwidth x 2.2, as NPB
    FT's transposes), so both the burst and the rest are shorter than S. The programs keep their
    own (longer) phases; the built-ins are not changed."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in programs:
        period = sample_us * float(rng.uniform(0.3, 0.9))
        share = float(rng.uniform(0.25, 0.45))
        out[p + SHORT_SUFFIX] = replace(library[p], name=p + SHORT_SUFFIX, micro=Micro(period, share, 0.6, 2.2),
                                        notes=f"{p} with sub-sample bursts")
    return out


def llc_demand(w: Workload) -> float:
    """LLC references per kilo-cycle with the whole cache: the access rate that sets how much of a
    shared LLC a program takes (contention.py shares ways in proportion to it)."""
    return w.llc_rpki * w.ipc[-1]


def thrashing_programs(programs: Sequence[str], library: dict[str, Workload], k: int | None = None) -> list[str]:
    """The ``k`` programs (default: a quarter of them, at least two) with the largest LLC demand."""
    k = k or max(2, math.ceil(len(programs) / 4))
    return sorted(programs, key=lambda p: (-llc_demand(library[p]), p))[:k]


def random_pairs(programs: Sequence[str], n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` ordered pairs drawn without replacement from every pair of ``programs`` (all of them
    when there are no more than ``n``), in a fixed order."""
    every = [(a, b) for a in programs for b in programs]
    if n >= len(every):
        return every
    rng = np.random.default_rng(seed)
    return [every[i] for i in sorted(rng.choice(len(every), n, replace=False).tolist())]
