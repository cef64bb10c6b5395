"""Seed 003 on the calibrated machine: a Random Forest learns pairwise degradation from solo
counter profiles; queues are paired greedily or by blossom matching and scored by makespan
against FIFO (no sharing) and FIFO-shared (neighbours in the queue share).

Features come from :mod:`producers.pairs`. The forest trains on 75% of the ordered program
pairs and is scored (R2, against the simulator's truth) on the rest; by default (issue 37) it
trains on what the pipeline *measured*: each pair run on the calibrated simulator
(``run_pairwise``), its events folded into charges by the stream worker's fold, and a program's
Deg next to a co-runner is 100 D / (1 - D) of its charges' shared-time D (``measured_degradation``);
``train_on="truth"`` trains on the simulator's truth instead (:func:`producers.pairs.pair_degradation`).
Queues are scheduled with the forest's predictions and their makespans computed with the true
degradations (the experiment's judge, never the scheduler's input).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nodeshare.experiments import pyplot, save
from nodeshare.producers.pairs import FEATURES, pair_degradation, solo_profiles
from nodeshare.producers.workloads import BUILTIN, Workload
from nodeshare.streams.core.pairing import (
    BLOSSOM_NEIGHBOURS,
    PAIR_LEVELS,
    DegradationModel,
    Task,
    blossom_pairs,
    exclusive_times,
    fifo,
    fifo_shared,
    greedy_pairs,
    makespan,
    pair_level,
    pair_weights,
    r2,
    server_degradation,
    whole_server,
)

POLICIES = ("fifo_shared", "rf_greedy", "rf_blossom", "oracle_blossom")
#: What the forest trains on: the pipeline's measured D (default) or the simulator's truth.
TRAIN_ON = ("measured", "truth")
#: Runs of each program pair on the calibrated simulator that the measured D averages.
MEASURE_ITERATIONS = 2


def measured_degradation(programs: Sequence[Workload], seed: int, iterations: int = MEASURE_ITERATIONS,
                         ) -> tuple[np.ndarray, int]:
    """``deg[i, j]``: percent by which program i's run time grows next to program j as the pipeline
    measured it: every ordered pair run on a node of the calibrated simulator, its events folded
    into charges (``charges_of``, the worker's fold), Deg = 100 D / (1 - D) of the charges'
    shared-time D, averaged over the pair's runs. Which program ran next to which comes from the
    charge's program and node (the layout the experiment chose), not from the simulator's truth.
    Also: the number of charges measured."""
    from nodeshare.experiments.poppa import _pairs_simulated, charges_of
    from nodeshare.streams.core.accounting import PricingPolicy

    names = tuple(w.name for w in programs)
    pairs, _truth, events = _pairs_simulated(seed, iterations, 3200, 200, names, tuple(programs))
    charges = charges_of(events, PricingPolicy()).values()  # the fold's output, and only it, from here
    index = {n: i for i, n in enumerate(names)}
    total, count = np.zeros((len(names), len(names))), np.zeros((len(names), len(names)))
    for c in charges:
        a, b = pairs[int(c.nodes[0].node.removeprefix("node"))] if c.nodes else (None, None)
        if a is None or c.program not in (a, b):
            continue
        co = b if c.program == a else a
        d = min(c.degradation_shared, 0.95)
        total[index[c.program], index[co]] += 100.0 * d / (1.0 - d)
        count[index[c.program], index[co]] += 1
    return np.divide(total, count, out=np.zeros_like(total), where=count > 0), len(charges)


def library(profiles: dict[str, Workload] | None = None) -> list[Workload]:
    """The programs of the experiment: the built-ins (without the NULL busy loop) and any loaded ones."""
    return [w for n, w in BUILTIN.items() if n != "NULL"] + list((profiles or {}).values())


#: Where two jobs share a node: each on its half (the HPC mode), or both on every core (Seed 003's).
SHARING = ("half-node", "whole-server")


def train(programs: Sequence[Workload], seed: int, trees: int = 200, holdout: float = 0.25,
          sharing: str = "half-node", half: np.ndarray | None = None, train_on: str = "measured",
          ) -> tuple[DegradationModel, np.ndarray, np.ndarray, dict[str, Any]]:
    """Fit on a random 1 - ``holdout`` of the ordered program pairs; R2 against the truth on the
    others. With ``sharing="whole-server"`` the forest learns Deg on the whole server's terms, as
    Seed 003's did. ``half``: the programs' half-node truth, when the caller has it already.
    ``train_on``: ``measured`` (the pipeline's charges, ``measured_degradation``) or ``truth``."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    feats = solo_profiles(programs)
    truth = pair_degradation(programs) if half is None else half
    measured, charges = measured_degradation(programs, seed) if train_on == "measured" else (truth, 0)
    if sharing == "whole-server":
        truth = server_degradation(truth)
        measured = server_degradation(measured)
    target = measured if train_on == "measured" else truth
    n = len(programs)
    i, j = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(n), indexing="ij"))
    rng = np.random.default_rng(seed)
    test = rng.random(len(i)) < holdout
    model = DegradationModel(trees, seed).fit(feats[i[~test]], feats[j[~test]], target[i[~test], j[~test]])
    pred = model.predict(feats[i[test]], feats[j[test]])
    actual = truth[i[test], j[test]]
    fit = {"r2": r2(actual, pred), "train_pairs": int((~test).sum()), "test_pairs": int(test.sum()),
           "mae_pct_points": float(np.abs(actual - pred).mean()),
           "trained_on": train_on, "charges_measured": charges,
           "measured_vs_truth_mae_pct_points": float(np.abs(measured - truth).mean()),
           "heldout": {"actual": actual.tolist(), "predicted": pred.tolist()}}
    return model, feats, truth, fit


def schedules(times: np.ndarray, predicted: np.ndarray, true: np.ndarray,
              alone: np.ndarray | None = None) -> dict[str, list[Task]]:
    """Every policy's tasks for one queue. ``alone``: each job's time alone on a server when
    ``times`` are already that (whole-server sharing); by default derived from half-node times."""
    weights = pair_weights(times, predicted)
    mine = exclusive_times(times, predicted) if alone is None else alone
    truths = exclusive_times(times, true) if alone is None else alone
    return {"fifo": fifo(len(times)), "fifo_shared": fifo_shared(len(times)),
            "rf_greedy": greedy_pairs(mine, weights), "rf_blossom": blossom_pairs(mine, weights),
            "oracle_blossom": blossom_pairs(truths, pair_weights(times, true))}


def experiment_pairing(seed: int = 7, queues: int = 20, jobs: int = 50, servers: Sequence[int] = (1, 2, 3, 4, 5),
                       profiles: dict[str, Workload] | None = None, trees: int = 200,
                       progress: Callable[[int, int], None] | None = None, train_on: str = "measured",
                       ) -> dict[str, Any]:
    programs = library(profiles)
    model, feats, truth, fit = train(programs, seed, trees, train_on=train_on)
    rng = np.random.default_rng(seed + 1)
    base = rng.lognormal(np.log(600.0), 0.8, len(programs))  # each program's typical solo run time
    rel: dict[str, dict[int, list[float]]] = {p: {m: [] for m in servers} for p in POLICIES}
    serialized = paired = 0
    for q in range(queues):
        prog = rng.integers(len(programs), size=jobs)
        times = base[prog] * rng.lognormal(0.0, 0.1, jobs)
        true = truth[np.ix_(prog, prog)]
        predicted = model.matrix(feats[prog])
        plans = schedules(times, predicted, true)
        serialized += sum(t.serialized for t in plans["rf_blossom"])
        paired += sum(len(t.jobs) == 2 for t in plans["rf_blossom"])
        for m in servers:
            ref = makespan(plans["fifo"], times, true, m)
            for p in POLICIES:
                rel[p][m].append(100.0 * (makespan(plans[p], times, true, m) / ref - 1.0))
        if progress:
            progress(q + 1, queues)
    by_policy = {p: float(np.mean([v for m in servers for v in rel[p][m]])) for p in POLICIES}
    return {"experiment": "pairing", "programs": [w.name for w in programs], "features": list(FEATURES),
            "seed": seed, "queues": queues, "jobs": jobs, "servers": list(servers),
            "r2": fit["r2"], "fit": {k: v for k, v in fit.items() if k != "heldout"}, "heldout": fit["heldout"],
            "makespan_vs_fifo_pct": by_policy,
            "by_servers": {p: {str(m): float(np.mean(rel[p][m])) for m in servers} for p in POLICIES},
            "worst_vs_fifo_pct": {p: float(np.max([v for m in servers for v in rel[p][m]])) for p in POLICIES},
            "rf_blossom_pairs": paired, "rf_blossom_serialized": serialized,
            "mean_true_degradation_pct": float(truth[~np.eye(len(programs), dtype=bool)].mean())}


def level_queue(kind: str, jobs: int, base: np.ndarray, truth_half: np.ndarray, rng: np.random.Generator,
                sharing: str, attempts: int = 100_000) -> tuple[np.ndarray, np.ndarray] | None:
    """One of Seed 003 Section 4.4.1's queues: ``jobs`` applications arriving in pairs whose
    ``pair_level`` (on the true degradations) is of ``kind``; programs and run times drawn as
    for the random queues. None when ``attempts`` draws find too few such pairs."""
    lo, hi = PAIR_LEVELS[kind]
    prog: list[int] = []
    times: list[float] = []
    for _ in range(attempts):
        if len(prog) >= jobs:
            break
        pair = rng.integers(len(base), size=2)
        t = base[pair] * rng.lognormal(0.0, 0.1, 2)
        deg = truth_half[np.ix_(pair, pair)]
        alone, d = whole_server(t, deg) if sharing == "whole-server" else (exclusive_times(t, deg), deg)
        if lo <= pair_level(alone, d, 0, 1) < hi:
            prog += pair.tolist()
            times += t.tolist()
    if len(prog) < jobs:
        return None
    return np.array(prog[:jobs]), np.array(times[:jobs])


def experiment_pairing_levels(seed: int = 7, queues: int = 5, jobs: int = 50, sharing: str = "whole-server",
                              profiles: dict[str, Workload] | None = None, trees: int = 200,
                              progress: Callable[[int, int], None] | None = None, train_on: str = "measured",
                              ) -> dict[str, Any]:
    """Seed 003 Fig. 8: ``queues`` queues of ``jobs`` applications for each of the low, medium
    and high degradation levels, on one server; FIFO (one after the other), FIFO-shared
    (consecutive pairs), RF-greedy, RF-blossom and blossom on the truth; makespan against FIFO
    per level and overall. ``sharing``: whole-server (the paper's: both on every core) or half-node."""
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {SHARING}, got {sharing!r}")
    programs = library(profiles)
    half = pair_degradation(programs)
    model, feats, truth, fit = train(programs, seed, trees, sharing=sharing, half=half, train_on=train_on)
    rng = np.random.default_rng(seed + 1)
    base = rng.lognormal(np.log(600.0), 0.8, len(programs))
    rel: dict[str, dict[str, list[float]]] = {k: {p: [] for p in POLICIES} for k in PAIR_LEVELS}
    missing: list[str] = []
    done = 0
    for kind in PAIR_LEVELS:
        for _ in range(queues):
            drawn = level_queue(kind, jobs, base, half, rng, sharing)
            done += 1
            if drawn is None:
                missing.append(kind)
                continue
            prog, t = drawn
            predicted = model.matrix(feats[prog])
            true = truth[np.ix_(prog, prog)]  # on the terms the forest learned
            alone = exclusive_times(t, half[np.ix_(prog, prog)]) if sharing == "whole-server" else None
            times = t if alone is None else alone
            plans = schedules(times, predicted, true, alone)
            ref = makespan(plans["fifo"], times, true, 1, alone)
            for p in POLICIES:
                rel[kind][p].append(100.0 * (makespan(plans[p], times, true, 1, alone) / ref - 1.0))
            if progress:
                progress(done, queues * len(PAIR_LEVELS))
    by_level = {k: {p: float(np.mean(v)) for p, v in r.items() if v} for k, r in rel.items()}
    overall = {p: float(np.mean([v for k in rel for v in rel[k][p]])) for p in POLICIES
               if any(rel[k][p] for k in rel)}
    return {"experiment": "pairing-levels", "sharing": sharing, "programs": [w.name for w in programs],
            "seed": seed, "queues_per_level": queues, "jobs": jobs, "servers": 1,
            "r2": fit["r2"], "fit": {k: v for k, v in fit.items() if k != "heldout"},
            "makespan_vs_fifo_pct": {"by_level": by_level, "overall": overall},
            "queues_not_built": {k: missing.count(k) for k in PAIR_LEVELS if k in missing},
            "paper": {"fifo_shared_vs_fifo_pct": {"high": 130.0, "medium": -23.0, "low": -40.0},
                      "rf_vs_fifo": "below FIFO on every level; blossom a little above FIFO-shared on medium and low"}}


def plot_pairing_levels(result: dict[str, Any], path: Path) -> Path:
    """Seed 003 Fig. 8: makespan against FIFO per degradation level and policy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    levels = [k for k in PAIR_LEVELS if k in result["makespan_vs_fifo_pct"]["by_level"]]
    width = 0.8 / len(POLICIES)
    for k, p in enumerate(POLICIES):
        ys = [result["makespan_vs_fifo_pct"]["by_level"][lv].get(p, np.nan) for lv in levels]
        ax.bar(np.arange(len(levels)) + k * width, ys, width, label=p)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(np.arange(len(levels)) + width * (len(POLICIES) - 1) / 2, levels)
    ax.set(xlabel="degradation level of the queue's pairs", ylabel="makespan vs FIFO (%)",
           title=f"{result['queues_per_level']} queues of {result['jobs']} per level, one server, "
                 f"{result['sharing']} sharing (Seed 003 Fig. 8)")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_pairing(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    servers = result["servers"]
    width = 0.8 / len(POLICIES)
    for k, p in enumerate(POLICIES):
        ys = [result["by_servers"][p][str(m)] for m in servers]
        mean = result["makespan_vs_fifo_pct"][p]
        ax1.bar(np.arange(len(servers)) + k * width, ys, width, label=f"{p} (mean {mean:+.1f}%)")
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.set_xticks(np.arange(len(servers)) + width * (len(POLICIES) - 1) / 2, [str(m) for m in servers])
    ax1.set(xlabel="servers", ylabel="makespan vs FIFO (%)",
            title=f"{result['queues']} queues of {result['jobs']} jobs (Seed 003 Fig. 7)")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    actual, pred = np.array(result["heldout"]["actual"]), np.array(result["heldout"]["predicted"])
    ax2.scatter(actual, pred, s=8, alpha=0.6)
    top = float(max(actual.max(), pred.max(), 1.0))
    ax2.plot([0, top], [0, top], color="grey", lw=0.8)
    ax2.set(xlabel="true degradation (%)", ylabel="predicted (%)",
            title=f"Random Forest on {result['fit']['test_pairs']} held-out pairs: R2 {result['r2']:.3f}")
    return save(fig, path)


def decision_times(policy: str, queued: int, timed: Callable[[Callable[[], object]], float], seed: int,
                   nodes: int = 128) -> dict[str, float]:
    """Issue 37: what one submission costs the placement manager with ``queued`` jobs waiting on a
    busy cluster of ``nodes`` testbed nodes (each with 1 of 28 cores free and a job of a measured
    program; nothing fits, so every pass scans the whole queue, the worst case): the pass it runs
    after a submission (``decide_*_ms``), and that per
    queued job. The learned policy's model has 2,000 measured jobs of the library's programs."""
    from nodeshare.experiments.sns import ModelProfile, testbed_machine
    from nodeshare.streams.core.placement.learned import InterferenceModel
    from nodeshare.streams.core.placement.sns import POLICIES, NodeCapacity, PendingJob, Placement, Scheduler

    machine = testbed_machine()
    names = [w.name for w in machine.programs]
    rng = np.random.default_rng(seed)
    model = InterferenceModel()
    for _ in range(2000):
        a, b = rng.integers(len(names), size=2)
        model.total.add(float(rng.uniform(0, 0.3)))
        model.by_program.setdefault(names[a], type(model.total)()).add(float(rng.uniform(0, 0.3)))
        model.by_pair.setdefault((names[a], names[b]), type(model.total)()).add(float(rng.uniform(0, 0.3)))
    cap = NodeCapacity(machine.cores, int(machine.node.ways), machine.node.bw_gbps * machine.node.max_util)
    sched = Scheduler({f"n{i:04d}": cap for i in range(nodes)}, POLICIES[policy], model=model)
    for i in range(nodes):
        sched.program_of[f"r{i}"] = names[i % len(names)]
        sched.allocate(f"r{i}", Placement(1, (f"n{i:04d}",), machine.cores - 1, 10, 30.0, None))
    profiles = [ModelProfile(machine, p, machine.runtime_by_scale(p, machine.cores)) for p in range(len(names))]
    for i in range(queued):
        p = int(rng.integers(len(names)))
        sched.submit(PendingJob(f"q{i}", int(rng.choice([16, 28])), 0.9, float(i), profiles[p], names[p]))
    ms = timed(lambda: sched.schedule(float(queued)))
    return {f"decide_{policy}_{queued}_queued_ms": ms, f"decide_{policy}_per_queued_job_ms": ms / queued}


def bench_placement(seed: int = 7, repeats: int = 5, greedy_jobs: int = 1000, blossom_jobs: int = 1000,
                    predict_jobs: int = 50, exact: bool = True, queued: int = 1000) -> dict[str, Any]:
    """Median times: greedy pairing of 1,000 jobs, blossom for 1,000, predicting all pairs of 50
    (targets: 200 ms, 1 s, 100 ms). Keys name the sizes. With ``exact``, blossom on the whole
    graph runs once too, and ``blossom_gap_to_exact_pct`` says how much heavier the sparse
    graph's matching is (0: none)."""
    programs = library()
    model, feats, truth, _ = train(programs, seed, train_on="truth")  # the times do not depend on what it learned
    rng = np.random.default_rng(seed)

    def timed(fn: Callable[[], object]) -> float:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            runs.append(1000.0 * (time.perf_counter() - t0))
        return float(np.median(runs))

    def queue(n: int) -> tuple[np.ndarray, np.ndarray]:
        prog = rng.integers(len(programs), size=n)
        return rng.lognormal(np.log(600.0), 0.8, n), truth[np.ix_(prog, prog)]

    tg, dg = queue(greedy_jobs)
    wg, eg = pair_weights(tg, dg), exclusive_times(tg, dg)
    tb, db = queue(blossom_jobs)
    wb, eb = pair_weights(tb, db), exclusive_times(tb, db)
    fp = feats[rng.integers(len(programs), size=predict_jobs)]
    extra: dict[str, Any] = {"blossom_neighbours": BLOSSOM_NEIGHBOURS}
    if exact:
        def weight(tasks: list[Task]) -> float:
            return float(sum(wb[t.jobs] if len(t.jobs) == 2 else eb[t.jobs[0]] for t in tasks))

        t0 = time.perf_counter()
        whole = weight(blossom_pairs(eb, wb, serialize=False, neighbours=None))
        extra[f"blossom_whole_graph_{blossom_jobs}_ms"] = 1000.0 * (time.perf_counter() - t0)
        extra["blossom_gap_to_exact_pct"] = 100.0 * (weight(blossom_pairs(eb, wb, serialize=False)) / whole - 1.0)
        extra["greedy_gap_to_exact_pct"] = 100.0 * (weight(greedy_pairs(eb, wb, serialize=False)) / whole - 1.0)
    for policy in ("SNS", "learned"):
        extra.update(decision_times(policy, queued, timed, seed))
    return {f"greedy_{greedy_jobs}_ms": timed(lambda: greedy_pairs(eg, wg)),
            f"blossom_{blossom_jobs}_ms": timed(lambda: blossom_pairs(eb, wb)),
            f"predict_{predict_jobs}_ms": timed(lambda: model.matrix(fp)),
            f"weights_{greedy_jobs}_ms": timed(lambda: pair_weights(tg, dg)),
            "repeats": repeats, "trees": model.forest.n_estimators, **extra}
