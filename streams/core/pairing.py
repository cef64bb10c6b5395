"""Learned co-location pairing (Seed 003): predict each job's degradation next to another from
their counter profiles, build the degradation graph, and pair the queue greedily or by
minimum-weight perfect matching (blossom); a pair predicted slower than running its two jobs
one after the other is serialized.

Pure functions and a thin model wrapper; no I/O. Degradation follows Seed 003 Eq. 1,
``Deg_ij = 100 (T_coloc_ij - T_alone_i) / T_alone_i`` (percent, >= 0), with one difference
that matters for HPC nodes: T_alone is the job alone in *its half* of the node (the slot it
would hold when shared), so Deg is what contention costs and nothing else. Running alone
(FIFO) the job gets the whole node; a program that runs two of itself side by side at
Deg_ii gains 2 / (1 + Deg_ii / 100) from the second half (``exclusive_times``). In Seed 003,
where each program used every core, Deg included halving the cores.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import rustworkx as rx
from sklearn.ensemble import RandomForestRegressor


def exclusive_times(times: np.ndarray, deg: np.ndarray) -> np.ndarray:
    """Run time of each job alone on a whole node: its half-node time ``times`` sped up by the
    second half as much as two copies of it side by side allow (Deg_ii on the diagonal)."""
    return times * (1.0 + np.maximum(np.diag(deg), 0.0) / 100.0) / 2.0


def whole_server(times: np.ndarray, deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seed 003's own setting, from the half-node measurements: each application alone uses every
    core of the server, and two that share it both run on all its cores. Returns each job's time
    alone on the server and Deg on the server's terms (Seed 003 Eq. 1 against that time, >= 0).

    Alone, a job takes ``exclusive_times``; sharing every core with another, the operating system
    gives each half the cores' time, so it runs as on its half of the node next to the other:
    ``times_i (1 + Deg_ij)``. On the server's terms that is ``2 (1 + Deg_ij) / (1 + Deg_ii) - 1``:
    a program whose second half of cores buys little (a high Deg_ii: its own copies contend)
    loses little by sharing, which is what makes sharing a whole server pay in Seed 003."""
    return exclusive_times(times, deg), server_degradation(deg)


def server_degradation(deg: np.ndarray) -> np.ndarray:
    """Deg on the whole server's terms (``whole_server``) from the half-node matrix; times do not enter it."""
    d = np.maximum(deg, 0.0) / 100.0
    return np.maximum(100.0 * (2.0 * (1.0 + d) / (1.0 + np.diag(d))[:, None] - 1.0), 0.0)


def pair_level(alone: np.ndarray, deg: np.ndarray, i: int, j: int) -> float:
    """Seed 003 Section 4.4.1's measure of a pair: its longer degraded run time,
    ``max(T_i (1 + Deg_ij), T_j (1 + Deg_ji))``, relative to running both one after the other
    (FIFO): below 0.75 a low-degradation pair, 0.75 to 1 medium, above 1 high."""
    longest = max(alone[i] * (1.0 + deg[i, j] / 100.0), alone[j] * (1.0 + deg[j, i] / 100.0))
    return float(longest / (alone[i] + alone[j]))


#: Seed 003 Section 4.4.1's queue kinds by ``pair_level``: [low, high) bounds.
PAIR_LEVELS = {"low": (0.0, 0.75), "medium": (0.75, 1.0), "high": (1.0, np.inf)}


@dataclass(frozen=True)
class Task:
    """What one server runs: a pair (co-located, or serialized when that is predicted faster) or a single job."""

    jobs: tuple[int, ...]
    serialized: bool = False


def pair_weights(times: np.ndarray, deg: np.ndarray) -> np.ndarray:
    """The degradation graph's edge weights: predicted wall time of every pair (i, j), i != j,
    from half-node solo times and a degradation matrix ``deg[i, j]`` (i next to j, percent).

    Each job runs at 1 / (1 + Deg/100) of its solo speed while both run; once the first ends, the
    other runs alone at full speed. (Seed 003 weights an edge by the pair's "highest degraded
    runtime", max(T_i (1 + Deg_ij), T_j (1 + Deg_ji)); this also credits the solo tail.)"""
    si = 1.0 + np.maximum(deg, 0.0) / 100.0
    ti, tj = times[:, None], times[None, :]
    first_i, first_j = ti * si, tj * si.T
    w = np.where(first_i <= first_j, first_i + (tj - first_i / si.T), first_j + (ti - first_j / si))
    np.fill_diagonal(w, np.inf)
    return w


def pair_time(t_i: float, t_j: float, deg_ij: float, deg_ji: float) -> float:
    """Wall time until both jobs of a pair are done when they start together on one node
    (one edge of ``pair_weights``)."""
    return float(pair_weights(np.array([t_i, t_j]), np.array([[0.0, deg_ij], [deg_ji, 0.0]]))[0, 1])


def _tasks(pairs: list[tuple[int, int]], left: Sequence[int], exclusive: np.ndarray, weights: np.ndarray,
           serialize: bool) -> list[Task]:
    out = []
    for i, j in pairs:
        slower = serialize and weights[i, j] > exclusive[i] + exclusive[j]
        out.append(Task((min(i, j), max(i, j)), serialized=bool(slower)))
    out += [Task((k,)) for k in left]
    return sorted(out, key=lambda t: t.jobs[0])  # queue order of each task's first job


def greedy_pairs(exclusive: np.ndarray, weights: np.ndarray, serialize: bool = True) -> list[Task]:
    """Seed 003's greedy heuristic: take the pair with the lowest predicted wall time among jobs
    not yet paired, repeatedly (O(n^2 log n) for the sort). ``exclusive``: each job's predicted
    time alone on a node (for serialization)."""
    n = len(exclusive)
    iu, ju = np.triu_indices(n, 1)
    order = np.argsort(weights[iu, ju], kind="stable")
    taken = bytearray(n)  # plain Python objects in the loop: numpy scalars would cost 5x more
    pairs: list[tuple[int, int]] = []
    for i, j in zip(iu[order].tolist(), ju[order].tolist(), strict=True):
        if not taken[i] and not taken[j]:
            taken[i] = taken[j] = 1
            pairs.append((i, j))
            if len(pairs) == n // 2:
                break
    return _tasks(pairs, [k for k in range(n) if not taken[k]], exclusive, weights, serialize)


#: Blossom works on integer weights (exact arithmetic): wall times are rounded to this many per second.
WEIGHT_RESOLUTION = 1000

#: Past this many jobs, blossom matches on a sparse graph: each job's BLOSSOM_NEIGHBOURS best
#: partners by what sharing saves, plus the greedy pairs (so a perfect matching always exists and
#: the result is never worse than greedy). Measured by ``nodeshare bench placement`` against the
#: exact matching on the whole graph.
BLOSSOM_NEIGHBOURS = 64


def candidate_edges(exclusive: np.ndarray, weights: np.ndarray,
                    neighbours: int | None = BLOSSOM_NEIGHBOURS) -> tuple[np.ndarray, np.ndarray]:
    """The edges (i < j) blossom matches on. All of them for a queue of at most ``neighbours + 1``
    jobs (or ``neighbours=None``); otherwise each job's ``neighbours`` lightest edges by reduced
    cost ``w_ij - exclusive_i - exclusive_j`` (the time the pair saves over running both jobs
    alone), together with the greedy matching's pairs.

    The reduced cost changes no perfect matching's ranking (every job is in exactly one pair, so
    the same sum of exclusive times is subtracted from each), but it ranks partners by what they
    save instead of by length: by raw wall time every job's nearest partners would be the
    shortest jobs of the queue, and the long jobs, which must pair with one another, would lose
    the edges they need."""
    n = len(exclusive)
    if neighbours is None or n - 1 <= neighbours:
        return np.triu_indices(n, 1)
    saved = weights - exclusive[:, None] - exclusive[None, :]
    np.fill_diagonal(saved, np.inf)
    best = np.argpartition(saved, neighbours - 1, axis=1)[:, :neighbours]
    greedy = [t.jobs for t in greedy_pairs(exclusive, weights, serialize=False) if len(t.jobs) == 2]
    i = np.concatenate([np.repeat(np.arange(n), neighbours), [a for a, _ in greedy]])
    j = np.concatenate([best.ravel(), [b for _, b in greedy]])
    keys = np.unique(np.minimum(i, j).astype(np.int64) * n + np.maximum(i, j))
    return keys // n, keys % n


def blossom_pairs(exclusive: np.ndarray, weights: np.ndarray, serialize: bool = True,
                  neighbours: int | None = BLOSSOM_NEIGHBOURS) -> list[Task]:
    """Minimum-weight perfect matching on the degradation graph (Edmonds' blossom), on the edges
    ``candidate_edges`` keeps (the whole graph up to ``neighbours + 1`` jobs). With an odd queue
    one job stays single: a dummy vertex takes it at the cost of running it alone.

    rustworkx's ``max_weight_matching`` is the same primal-dual blossom algorithm as networkx's
    (a port of it, in Rust): about 100x faster (36 ms for 200 jobs against 3.9 s), and a test
    checks the two give matchings of equal weight. A perfect matching of least weight is one of
    greatest ``top - weight`` among the maximum-cardinality matchings; weights are rounded to
    1/WEIGHT_RESOLUTION s so that the algorithm runs in exact integer arithmetic."""
    n = len(exclusive)
    iu, ju = candidate_edges(exclusive, weights, neighbours)
    w = weights[iu, ju]
    if n % 2:
        iu, ju = np.concatenate([iu, np.arange(n)]), np.concatenate([ju, np.full(n, n)])
        w = np.concatenate([w, exclusive])
    q = np.rint(np.asarray(w, dtype=float) * WEIGHT_RESOLUTION).astype(np.int64)
    top = int(q.max(initial=0)) + 1
    g = rx.PyGraph(multigraph=False)
    g.add_nodes_from(range(n + n % 2))
    g.add_edges_from(list(zip(iu.tolist(), ju.tolist(), (top - q).tolist(), strict=True)))
    matching = rx.max_weight_matching(g, max_cardinality=True, weight_fn=int)
    pairs = [(min(a, b), max(a, b)) for a, b in matching if a < n and b < n]
    single = [min(a, b) for a, b in matching if max(a, b) == n]
    return _tasks(pairs, single, exclusive, weights, serialize)


PAIRINGS = {"greedy": greedy_pairs, "blossom": blossom_pairs}


def pair_queue(times: np.ndarray, alphas: np.ndarray, deg: np.ndarray,
               method: str = "blossom") -> list[tuple[int, int]]:
    """The pairs of a waiting queue worth starting together on one node, in queue order: matched
    (``method``: greedy or blossom) on the degradation graph, not serialized, and each job's
    predicted slowdown ``1 + Deg/100`` within the ``1/alpha`` it accepts (Seed 001's threshold).

    Unlike Seed 003's experiment, a job here keeps its processes: alone on a node it takes its
    ``times`` (the rest of the node is not its to use), so serial means ``t_i + t_j``."""
    if method not in PAIRINGS:
        raise ValueError(f"pairing must be one of {sorted(PAIRINGS)}, got {method!r}")
    tasks = PAIRINGS[method](np.asarray(times, dtype=float), pair_weights(times, deg))
    slow = 1.0 + np.maximum(deg, 0.0) / 100.0
    return [(i, j) for t in tasks if len(t.jobs) == 2 and not t.serialized
            for i, j in [t.jobs] if slow[i, j] * alphas[i] <= 1.0 and slow[j, i] * alphas[j] <= 1.0]


def fifo(n: int) -> list[Task]:
    """No sharing: every job alone, in queue order."""
    return [Task((k,)) for k in range(n)]


def fifo_shared(n: int) -> list[Task]:
    """Sharing without knowledge: consecutive jobs of the queue paired."""
    return [Task(tuple(range(k, min(k + 2, n)))) for k in range(0, n, 2)]


def task_time(task: Task, times: np.ndarray, deg: np.ndarray, alone: np.ndarray | None = None) -> float:
    """How long a task occupies its node under degradations ``deg`` (the truth, for scoring): a
    single job, or a serialized pair, runs alone on the whole node; a pair shares it. ``alone``:
    each job's time alone on the node when ``times`` are not half-node times (``whole_server``)."""
    exclusive = (exclusive_times(times[list(task.jobs)], deg[np.ix_(task.jobs, task.jobs)]) if alone is None
                 else alone[list(task.jobs)])
    if len(task.jobs) == 1 or task.serialized:
        return float(exclusive.sum())
    i, j = task.jobs
    return pair_time(float(times[i]), float(times[j]), float(deg[i, j]), float(deg[j, i]))


def makespan(tasks: Sequence[Task], times: np.ndarray, deg: np.ndarray, servers: int,
             alone: np.ndarray | None = None) -> float:
    """List scheduling in task order: each task goes to the node that frees first (``alone``: see ``task_time``)."""
    free = [0.0] * servers
    heapq.heapify(free)
    end = 0.0
    for t in tasks:
        start = heapq.heappop(free)
        done = start + task_time(t, times, deg, alone)
        end = max(end, done)
        heapq.heappush(free, done)
    return end


class DegradationModel:
    """A Random Forest predicting Deg_ij (percent) from the two programs' counter profiles
    (``[features_i, features_j]``); negative targets are noise and clipped to 0 (Seed 003 3.2)."""

    def __init__(self, trees: int = 200, seed: int = 0) -> None:
        self.forest = RandomForestRegressor(n_estimators=trees, random_state=seed, n_jobs=1, min_samples_leaf=1)
        self.samples = 0

    @staticmethod
    def rows(fi: np.ndarray, fj: np.ndarray) -> np.ndarray:
        return np.concatenate([fi, fj], axis=-1)

    def fit(self, fi: np.ndarray, fj: np.ndarray, deg: np.ndarray) -> DegradationModel:
        if len(deg) < 2:
            raise ValueError("the model needs at least two measured pairs")
        self.forest.fit(self.rows(fi, fj), np.maximum(deg, 0.0))
        self.samples = len(deg)
        return self

    def predict(self, fi: np.ndarray, fj: np.ndarray) -> np.ndarray:
        return np.maximum(self.forest.predict(self.rows(fi, fj)), 0.0)

    def matrix(self, features: np.ndarray) -> np.ndarray:
        """Predicted Deg for every ordered pair of the queue's jobs: ``out[i, j]`` is i next to j."""
        n = len(features)
        i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        return self.predict(features[i.ravel()], features[j.ravel()]).reshape(n, n)  # diagonal: next to itself


def r2(actual: np.ndarray, predicted: np.ndarray) -> float:
    """Seed 003 Eq. 2: 1 - residual sum of squares / total sum of squares."""
    ss_res = float(np.sum((actual - predicted) ** 2))
    ss_tot = float(np.sum((actual - actual.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
