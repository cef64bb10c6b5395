"""Learned co-location pairing (Seed 003): pair times, matchings, makespan, the model; by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_runs import run_json

from nodeshare.producers.pairs import FEATURES, pair_degradation, solo_profiles
from nodeshare.producers.workloads import BUILTIN
from nodeshare.streams.core.pairing import (
    DegradationModel,
    Task,
    blossom_pairs,
    candidate_edges,
    exclusive_times,
    fifo,
    fifo_shared,
    greedy_pairs,
    makespan,
    pair_level,
    pair_queue,
    pair_time,
    pair_weights,
    r2,
    whole_server,
)


def test_pair_time_by_hand():
    # i: 100 s at +25% -> would end at 125 s; j: 300 s at +50%. At 125 s j has done 125 / 1.5 = 83.3 s
    # of its work, the remaining 216.7 s run alone: 125 + 216.7 = 341.7 s
    assert pair_time(100, 300, 25, 50) == pytest.approx(125 + 300 - 125 / 1.5)
    assert pair_time(300, 100, 50, 25) == pytest.approx(pair_time(100, 300, 25, 50))  # symmetric
    assert pair_time(100, 100, 0, 0) == 100  # no interference: both done together


def test_pair_weights_agree_with_pair_time_and_exclusive_times_by_hand():
    times = np.array([100.0, 300.0, 200.0])
    deg = np.array([[60.0, 25.0, 10.0], [50.0, 0.0, 5.0], [20.0, 30.0, 100.0]])
    w = pair_weights(times, deg)
    assert w[0, 1] == pytest.approx(pair_time(100, 300, 25, 50)) and w[1, 0] == pytest.approx(w[0, 1])
    assert np.isinf(np.diag(w)).all()
    # alone on a whole node: twice the cores, slowed by sharing with itself: T * (1 + Deg_ii) / 2
    assert exclusive_times(times, deg).tolist() == [80.0, 150.0, 200.0]


def test_greedy_takes_the_cheapest_pair_first_and_blossom_the_cheapest_sum():
    # weights: (0,1) 10, (2,3) 100, (0,2) 11, (1,3) 11: greedy takes 10 then must take 100 (sum 110);
    # the perfect matching (0,2) + (1,3) costs 22
    big = 1e6
    w = np.array([[np.inf, 10, 11, big], [10, np.inf, big, 11], [11, big, np.inf, 100], [big, 11, 100, np.inf]])
    alone = np.full(4, 1e9)  # never worth serializing
    assert [t.jobs for t in greedy_pairs(alone, w)] == [(0, 1), (2, 3)]
    assert [t.jobs for t in blossom_pairs(alone, w)] == [(0, 2), (1, 3)]


def test_odd_queues_leave_one_job_alone_and_bad_pairs_are_serialized():
    w = np.array([[np.inf, 9, 50], [9, np.inf, 50], [50, 50, np.inf]])
    alone = np.array([4.0, 4.0, 30.0])
    # blossom with a dummy vertex: (0,1) + 2 alone = 9 + 30 beats (0,2) + 1 alone = 50 + 4
    tasks = blossom_pairs(alone, w)
    assert tasks == [Task((0, 1), serialized=True), Task((2,))]  # 9 > 4 + 4: sharing predicted slower
    assert greedy_pairs(alone, w, serialize=False) == [Task((0, 1)), Task((2,))]


def test_makespan_by_hand():
    times = np.array([100.0, 100.0, 100.0, 100.0])
    deg = np.zeros((4, 4))  # no interference, and two copies side by side scale perfectly
    # alone each job takes 50 s on a whole node; FIFO on 2 nodes: 2 rounds = 100 s
    assert makespan(fifo(4), times, deg, 2) == 100.0
    # shared: a pair takes 100 s; 2 pairs on 2 nodes = 100 s; on 1 node 200 s
    assert makespan(fifo_shared(4), times, deg, 2) == 100.0 and makespan(fifo_shared(4), times, deg, 1) == 200.0
    deg[0, 0] = deg[1, 1] = 100.0  # jobs 0 and 1 gain nothing from a second half of the node
    assert makespan([Task((0,))], times, deg, 1) == 100.0


def test_r2_by_hand():
    assert r2(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])) == 1.0
    # residual 1 + 0 + 1 = 2; total 1 + 0 + 1 = 2 -> 0
    assert r2(np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0])) == 0.0


def test_the_machine_says_what_the_seeds_say_about_pairs():
    progs = [BUILTIN[n] for n in ("MILC", "GTC", "LAMMPS", "POP", "MG", "NULL")]
    deg = pair_degradation(progs)
    k = {w.name: i for i, w in enumerate(progs)}
    assert deg[k["MILC"], k["MILC"]] > 20 and deg[k["MG"], k["MG"]] > 20  # heavy
    assert deg[k["GTC"], k["LAMMPS"]] < 3 and deg[k["LAMMPS"], k["POP"]] < 3  # barely
    assert deg[k["MILC"], k["NULL"]] < 1  # a busy loop takes nothing from the socket
    feats = solo_profiles(progs)
    assert feats.shape == (6, len(FEATURES)) and np.isfinite(feats).all()
    mean_bw = feats[:, FEATURES.index("mem_bw_gbps_mean")]
    assert mean_bw[k["MG"]] > mean_bw[k["LAMMPS"]]  # MG is the bandwidth-bound one


def test_the_model_learns_degradation_from_profiles():
    progs = [w for n, w in BUILTIN.items() if n != "NULL"]
    feats, deg = solo_profiles(progs), pair_degradation(progs)
    n = len(progs)
    i, j = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(n), indexing="ij"))
    model = DegradationModel(trees=50, seed=1).fit(feats[i], feats[j], deg[i, j])
    assert r2(deg[i, j], model.predict(feats[i], feats[j])) > 0.9  # fits what it saw
    assert model.matrix(feats[:3]).shape == (3, 3) and (model.matrix(feats) >= 0).all()
    with pytest.raises(ValueError, match="at least two"):
        DegradationModel().fit(feats[:1], feats[:1], deg[:1, 0])


def test_experiment_pairing_json_and_plot(tmp_path: Path):
    png = tmp_path / "p.png"
    r = run_json("experiment", "pairing", "--json", "--png", str(png), "--queues", "3", "--trees", "30")
    assert {"makespan_vs_fifo_pct", "r2"} <= set(r) and 0.5 < r["r2"] <= 1.0
    assert r["fit"]["trained_on"] == "measured" and r["fit"]["charges_measured"] > 0  # issue 37: measured D
    assert set(r["makespan_vs_fifo_pct"]) == {"fifo_shared", "rf_greedy", "rf_blossom", "oracle_blossom"}
    assert r["makespan_vs_fifo_pct"]["fifo_shared"] > r["makespan_vs_fifo_pct"]["oracle_blossom"]
    assert png.stat().st_size > 10_000


def test_bench_placement_writes_its_json(tmp_path: Path):
    out = tmp_path / "b.json"
    r = run_json("bench", "placement", "--repeats", "3", "--greedy-jobs", "100", "--blossom-jobs", "20",
                 "--predict-jobs", "10", "--queued", "30", "--out", str(out))
    assert {"greedy_100_ms", "blossom_20_ms", "predict_10_ms"} <= set(r) and out.exists()
    assert r["decide_learned_30_queued_ms"] > 0 and r["decide_SNS_30_queued_ms"] > 0  # issue 37


@pytest.mark.parametrize("n", [2, 7, 30, 31])
def test_blossom_finds_a_perfect_matching_as_light_as_networkx(n):
    nx = pytest.importorskip("networkx")
    rng = np.random.default_rng(n)
    times = rng.lognormal(np.log(600.0), 0.8, n)
    deg = rng.uniform(0.0, 80.0, (n, n))
    w, alone = pair_weights(times, deg), exclusive_times(times, deg)
    ours = blossom_pairs(alone, w, serialize=False)
    assert sorted(k for t in ours for k in t.jobs) == list(range(n)) and sum(len(t.jobs) == 1 for t in ours) == n % 2
    g = nx.Graph()
    g.add_weighted_edges_from((i, j, w[i, j]) for i in range(n) for j in range(i + 1, n))
    g.add_weighted_edges_from((k, n, alone[k]) for k in range(n) if n % 2)
    best = sum(g[a][b]["weight"] for a, b in nx.min_weight_matching(g))
    cost = sum(w[t.jobs] if len(t.jobs) == 2 else alone[t.jobs[0]] for t in ours)
    assert cost == pytest.approx(best, abs=n * 1e-3)  # weights are rounded to the millisecond


def test_candidate_edges_rank_partners_by_what_sharing_saves():
    # four short jobs, two long ones; no contention except 10% between the long two
    times = np.array([100.0, 100.0, 100.0, 100.0, 1000.0, 1000.0])
    deg = np.zeros((6, 6))
    deg[4, 5] = deg[5, 4] = 10.0
    w, alone = pair_weights(times, deg), exclusive_times(times, deg)
    assert w[4, 0] == 1000.0 and w[4, 5] == 1100.0  # by wall time a short job is the long one's nearest
    iu, ju = candidate_edges(alone, w, neighbours=1)
    edges = set(zip(iu.tolist(), ju.tolist(), strict=True))
    assert (4, 5) in edges  # reduced cost 1100 - 500 - 500 = 100 s against 1000 - 500 - 50 = 450 s for a short partner
    assert len(edges) < 15  # sparse: not the 15 edges of the whole graph
    assert len(candidate_edges(alone, w, neighbours=5)[0]) == 15  # a queue of neighbours + 1: all of them


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sparse_blossom_matches_as_lightly_as_the_whole_graph(seed):
    rng = np.random.default_rng(seed)
    n = 151  # odd: the dummy vertex too
    times = rng.lognormal(np.log(600.0), 0.8, n)
    deg = rng.gamma(1.0, 15.0, (n, n))
    w, alone = pair_weights(times, deg), exclusive_times(times, deg)

    def cost(tasks):
        assert sorted(k for t in tasks for k in t.jobs) == list(range(n))
        return sum(w[t.jobs] if len(t.jobs) == 2 else alone[t.jobs[0]] for t in tasks)

    exact = cost(blossom_pairs(alone, w, serialize=False, neighbours=None))
    assert cost(blossom_pairs(alone, w, serialize=False, neighbours=32)) == pytest.approx(exact, abs=1e-6)
    assert cost(greedy_pairs(alone, w, serialize=False)) > exact


def test_pair_queue_keeps_pairs_within_alpha_and_faster_than_serial():
    times = np.full(4, 100.0)
    # 0 and 1 are cache-hungry (80% next to each other), 2 and 3 compute-bound; 0/2 and 1/3 mix well
    deg = np.array([[80.0, 80.0, 5.0, 8.0], [80.0, 80.0, 8.0, 5.0], [5.0, 8.0, 0.0, 0.0], [8.0, 5.0, 0.0, 0.0]])
    alphas = np.full(4, 0.9)
    assert pair_queue(times, alphas, deg) == [(0, 2), (1, 3)]
    # greedy takes the cheapest edge first, (2, 3) at 0%, and is left with (0, 1) at 80%: beyond alpha
    assert pair_queue(times, alphas, deg, "greedy") == [(2, 3)]
    # a stricter job refuses what a 5% slowdown costs it: 0.96 * 1.05 > 1
    assert pair_queue(times, np.array([0.96, 0.9, 0.9, 0.9]), deg) == [(1, 3)]
    # two jobs that slow each other 3x are better run one after the other: not paired
    assert pair_queue(np.full(2, 100.0), np.full(2, 0.1), np.full((2, 2), 200.0)) == []
    with pytest.raises(ValueError, match="pairing must be one of"):
        pair_queue(times, alphas, deg, "fifo")


def test_whole_server_terms_by_hand():
    # half-node times 100 s; 0 next to 1: 20%, 1 next to 0: 50%; each next to a copy of itself: 0 / 60%
    times = np.array([100.0, 100.0])
    deg = np.array([[0.0, 20.0], [50.0, 60.0]])
    alone, shared = whole_server(times, deg)
    # alone on the server: 100 (1 + Deg_ii) / 2 = 50 s and 80 s
    assert alone == pytest.approx([50.0, 80.0])
    # sharing every core: 100 x 1.2 = 120 s against 50 -> +140%; 100 x 1.5 = 150 s against 80 -> +87.5%
    assert shared[0, 1] == pytest.approx(140.0) and shared[1, 0] == pytest.approx(87.5)
    # Seed 003's level: max(50 x 2.4, 80 x 1.875) = 150 against 130 s one after the other
    assert pair_level(alone, shared, 0, 1) == pytest.approx(150.0 / 130.0)
    # programs whose second half of cores buys nothing (Deg_ii 100%) share for free with a neighbour
    # that costs them nothing (Deg_ij 0), and pay double next to a copy of themselves
    assert whole_server(times, np.array([[100.0, 0.0], [0.0, 100.0]]))[1] == pytest.approx(np.diag([100.0, 100.0]))


def test_paper_queues_hold_pairs_of_their_level_and_scoring_uses_server_times():
    from nodeshare.experiments.pairing import level_queue, library
    from nodeshare.streams.core.pairing import PAIR_LEVELS

    programs = library()
    half = pair_degradation(programs)
    base = np.random.default_rng(1).lognormal(np.log(600.0), 0.8, len(programs))
    for kind in ("medium", "high"):
        drawn = level_queue(kind, 10, base, half, np.random.default_rng(2), "whole-server")
        assert drawn is not None
        prog, t = drawn
        alone, true = whole_server(t, half[np.ix_(prog, prog)])
        lo, hi = PAIR_LEVELS[kind]
        assert all(lo <= pair_level(alone, true, k, k + 1) < hi for k in range(0, 10, 2))
        # FIFO on one server is the sum of the times alone on it
        assert makespan(fifo(10), alone, true, 1, alone) == pytest.approx(alone.sum())
    assert level_queue("low", 10, base, half, np.random.default_rng(2), "whole-server", attempts=2000) is None


def test_experiment_pairing_paper_queues_json(tmp_path: Path):
    r = run_json("experiment", "pairing", "--queues", "paper", "--per-level", "1", "--jobs", "10", "--trees", "20",
                 "--json", "--png", str(tmp_path / "p.png"))
    assert r["sharing"] == "whole-server" and r["servers"] == 1
    assert set(r["makespan_vs_fifo_pct"]["by_level"]) == {"low", "medium", "high"}
    assert "rf_blossom" in r["makespan_vs_fifo_pct"]["overall"] and (tmp_path / "p.png").exists()


def test_the_forest_trains_on_what_the_fold_charged_not_on_the_truth(monkeypatch):
    """Issue 37: the measured matrix is built from the stream worker's charges of the calibrated runs;
    it is near the truth (the estimate's error) without being it."""
    import nodeshare.experiments.poppa as poppa
    from nodeshare.experiments.pairing import measured_degradation
    from nodeshare.producers.pairs import pair_degradation
    from nodeshare.producers.workloads import BUILTIN

    folded = []
    original = poppa.charges_of
    monkeypatch.setattr(poppa, "charges_of", lambda events, policy=None: folded.append(1) or original(events, policy))
    programs = [BUILTIN[n] for n in ("CG", "MG", "LAMMPS")]
    measured, charges = measured_degradation(programs, seed=5, iterations=1)
    truth = pair_degradation(programs)
    assert folded == [1] and charges >= 9
    assert (measured > 0).any() and not np.allclose(measured, truth)
    assert np.abs(measured - truth).mean() < 3.0  # percent points
