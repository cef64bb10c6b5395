"""The workload library, the socket contention model and the calibrated simulator."""

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from factories import profile_csv

from nodeshare.experiments.poppa import charges_of, predicted_run_time
from nodeshare.producers.calibrated import CalibratedConfig, JobSpec, run_cluster, run_pairwise, state_tables
from nodeshare.producers.calibrated_records import ParquetSink, with_records
from nodeshare.producers.contention import (
    MLC_LOADED_LATENCY,
    Socket,
    bandwidth_ipc,
    fill_path,
    loaded_latency,
    normalized_latency_curve,
    socket_latency,
)
from nodeshare.producers.swf import swf_jobs
from nodeshare.producers.workloads import BUILTIN, WAYS, interp_ways, load_profiles, shaped
from nodeshare.schemas import TOPIC_OF_RECORD, JobEvent, JobState, ShutterBatch, encode
from nodeshare.streams.core.shutter_overhead import dilated_run_time

# ----------------------------------------------------------------------------- workload library


def test_curves_interpolate_between_ways_and_clamp_outside():
    curves = np.tile(np.arange(1.0, WAYS + 1.0), (5, 1))  # one curve per query; value = ways
    got = interp_ways(curves, np.array([0.2, 1.0, 2.5, 11.0, 14.0]))
    assert got.tolist() == [1.0, 1.0, 2.5, 11.0, 11.0]


def test_shaped_curves_by_hand():
    ipc, bw = shaped(2.0, 0.5, 1.0, 1.0, power=1.0)
    # at 1 way x = 1: IPC 2.0 * (1 - 0.5) = 1.0, bandwidth 1.0 * (1 + 1) = 2.0; at 11 ways x = 0
    assert (ipc[0], ipc[-1], bw[0], bw[-1]) == (1.0, 2.0, 2.0, 1.0)
    assert ipc[5] == pytest.approx(2.0 * (1 - 0.5 * 0.5))  # 6 ways: x = 5 / 10


def test_load_profiles_reads_the_csv_shape(tmp_path: Path):
    [w] = load_profiles(profile_csv(tmp_path / "p.csv", "toy")).values()
    assert (w.name, w.ipc[0], w.ipc[-1], w.bw_gbps[0], w.mem_stall, w.llc_rpki) == ("toy", 1.01, 1.11, 2.9, 0.3, 7.5)


def test_load_profiles_names_what_is_wrong(tmp_path: Path):
    f = tmp_path / "bad.csv"
    f.write_text("BENCH,NR_WAYS,ipc\nx,1,1.0\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_profiles(f)
    f.write_text("BENCH,NR_WAYS,ipc,bandwidth_mbps,stalls_l3_miss,llcrpki\nx,1,1.0,1,0.1,1\n")
    with pytest.raises(ValueError, match=r"x has ways \[1\], need every one of 1..11"):
        load_profiles(f)


#: The 40 SPEC programs' measured profiles (pbbcache/cachesim's metrics.csv), where a site keeps them.
REAL_PROFILES = Path(os.environ.get("NODESHARE_SPEC_PROFILES", "llc_profiles_spec.csv"))


@pytest.mark.skipif(not REAL_PROFILES.exists(), reason="real data not present (set NODESHARE_SPEC_PROFILES)")
def test_the_real_spec_profiles_load():
    lib = load_profiles(REAL_PROFILES)
    assert len(lib) == 40 and lib["milc06"].mem_stall > 0.4 and lib["namd06"].bw_gbps[-1] < 0.1


# ----------------------------------------------------------------------------- contention


def test_loaded_latency_by_hand():
    # 1 + queue * rho / (1 - rho): rho = 0.5, queue = 0.4 -> 1.4
    assert loaded_latency(np.array(0.5), 0.4) == pytest.approx(1.4)
    assert loaded_latency(np.array(0.0), 0.4) == 1.0


def test_bandwidth_cap_shares_in_proportion_to_demand():
    # No latency sensitivity (stall 0): two streaming jobs demanding 4 x 10 and 4 x 5 GB/s on a
    # 30 GB/s socket delivering at most 90%: scaled by 27 / 60, so each keeps 45% of its IPC.
    s = Socket(bw_gbps=30.0, max_util=0.9, queue=0.35, procs=4)
    ipc, rho = bandwidth_ipc(np.array([1.0, 2.0]), np.array([10.0, 5.0]), np.zeros(2), np.array([True, True]), s)
    assert ipc == pytest.approx([0.45, 0.9]) and rho == pytest.approx(0.9)


def test_a_measured_latency_curve_is_read_at_the_share_of_what_the_socket_delivers():
    # rows (MB/s, ns): 1,000 at 80 ns (idle), 51,000 at 100 ns, 101,000 at 160 ns
    load, ratio = normalized_latency_curve(((1000.0, 80.0), (51000.0, 100.0), (101000.0, 160.0)))
    assert load == pytest.approx((0.0, 0.5, 1.0)) and ratio == pytest.approx((1.0, 1.25, 2.0))
    s = Socket(bw_gbps=100.0, max_util=0.8, latency_curve=(load, ratio))
    # rho = 0.4 of 100 GB/s is half of the 80 GB/s it delivers: 1.25; a quarter of it: halfway to 1.25
    assert socket_latency(np.array([0.0, 0.2, 0.4, 0.8, 0.9]), s) == pytest.approx([1.0, 1.125, 1.25, 2.0, 2.0])
    assert socket_latency(np.array(0.5), Socket(queue=0.4)) == pytest.approx(1.4)  # no curve: the M/M/1 shape
    # the MLC measurement: 130.31 ns at 135.7 GB/s over 81.96 ns idle
    assert MLC_LOADED_LATENCY[1][-1] == pytest.approx(130.31 / 81.96) and MLC_LOADED_LATENCY[0][-1] == 1.0


def test_bandwidth_partitions_keep_each_co_runner_to_its_own():
    # stall 0, no latency effect: a 4 x 10 GB/s streamer and a 4 x 1 GB/s job on 30 GB/s (90% deliverable)
    s = Socket(bw_gbps=30.0, max_util=0.9, queue=0.35, procs=4)
    ipc0, bw0, both = np.array([1.0, 1.0]), np.array([10.0, 1.0]), np.array([True, True])
    shared, _ = bandwidth_ipc(ipc0, bw0, np.zeros(2), both, s)
    assert shared == pytest.approx([27 / 44, 27 / 44])  # one pool: both scaled by 27 / 44
    # MBA halves: each partition delivers 13.5 GB/s; the streamer gets 13.5 of 40, the other all its 4
    parted, rho = bandwidth_ipc(ipc0, bw0, np.zeros(2), both, s, share=np.array([0.5, 0.5]))
    assert parted == pytest.approx([13.5 / 40, 1.0]) and rho == pytest.approx((13.5 + 4.0) / 30.0)
    # with memory stalls, latency follows the socket's load; the partition bounds the streamer's
    # share of it, so the small job keeps more of its IPC than in one pool, and less than alone
    stall = np.array([0.5, 0.5])
    pooled, _ = bandwidth_ipc(ipc0, bw0, stall, both, s)
    parted, _ = bandwidth_ipc(ipc0, bw0, stall, both, s, share=np.array([0.5, 0.5]))
    alone, _ = bandwidth_ipc(ipc0[1:], bw0[1:], stall[1:], both[1:], s, share=np.array([0.5]))
    assert pooled[1] < parted[1] < alone[0]


def test_fill_path_at_a_constant_miss_bandwidth_grows_linearly_and_stops_at_the_target():
    # 1.25 GB/s into 2.5 MB ways = 0.5 ways/ms; a 4 ms window in 2 slices has midpoints 1 and 3 ms.
    s = Socket(way_mb=2.5)
    flat = np.full(11, 1.25)
    path, end = fill_path(flat, np.array(1.0), np.array(10.0), 4.0, s, points=2)
    assert path == pytest.approx([1.5, 2.5]) and end == pytest.approx(3.0)
    path, end = fill_path(flat, np.array(1.0), np.array(2.0), 4.0, s, points=2)
    assert path == pytest.approx([1.5, 2.0]) and end == pytest.approx(2.0)  # never past the solo share
    path, end = fill_path(flat, np.array(3.0), np.array(2.0), 4.0, s, points=2)
    assert path == pytest.approx([3.0, 3.0]) and end == pytest.approx(3.0)  # a shrinking share is the other's fill


def test_fill_path_follows_the_miss_rate_as_it_falls():
    # bandwidth proportional to ways (bw = 0.25 w GB/s): dw/dt = 0.1 w, so w = e^(0.1 t) from 1 way
    s = Socket(way_mb=2.5)
    curve = 0.25 * np.arange(1, 12, dtype=float)
    path, end = fill_path(curve, np.array(1.0), np.array(11.0), 5.0, s, points=5)
    assert path == pytest.approx(np.exp(0.1 * np.array([0.5, 1.5, 2.5, 3.5, 4.5])), rel=5e-4)  # Euler: 1e-2 off
    assert end == pytest.approx(np.exp(0.5), rel=5e-4)


def test_library_pairs_behave_as_the_seeds_report():
    t = state_tables(list(BUILTIN.values()), Socket(), 3.2)
    o = t.offset

    def deg(a: str, b: str) -> float:
        return float(1 - t.co[o[a], o[b]] / t.solo[o[a]])

    assert deg("MILC", "MILC") > 0.15  # MILC with itself degrades heavily (Seed 002 Section 8.3)
    assert deg("GTC", "LAMMPS") < 0.03 and deg("LAMMPS", "POP") < 0.03  # barely
    assert deg("MG", "MG") > deg("MG", "LAMMPS") + 0.15  # bandwidth bound (Seed 001 Section 2)
    assert deg("CG", "NULL") < 1e-3 and deg("NULL", "MILC") == 0.0  # a busy loop neither hurts nor suffers
    # the lone job's IPC in a short shutter is below its solo IPC (the cache is refilling) ...
    assert t.during[o["CG"], o["MG"]] < t.solo[o["CG"]]
    # ... and a longer shutter sees more of it
    assert state_tables([BUILTIN["CG"], BUILTIN["MG"]], Socket(), 25.6).during[1, 2] > t.during[o["CG"], o["MG"]]


# ----------------------------------------------------------------------------- the simulator


def test_same_seed_same_events_and_truth():
    cfg = CalibratedConfig(seed=3)
    pairs = [("MILC", "LAMMPS")]
    a = with_records(cfg, lambda s: run_pairwise(cfg, pairs, iterations=1, sink=s))
    b = with_records(cfg, lambda s: run_pairwise(cfg, pairs, iterations=1, sink=s))
    assert [encode(e) for e in a.events] == [encode(e) for e in b.events] and a.truth == b.truth
    c = with_records(replace(cfg, seed=4), lambda s: run_pairwise(replace(cfg, seed=4), pairs, iterations=1, sink=s))
    assert [encode(e) for e in c.events] != [encode(e) for e in a.events]


def test_shutter_overhead_next_to_null_is_eq10():
    """A job next to NULL suffers no contention: all its slowdown is the shutter's pauses."""
    cfg = CalibratedConfig(seed=5, sample_us=6400)
    res = run_pairwise(cfg, [("LU", "NULL")], iterations=1)
    lu = next(t for t in res.truth if t.program == "LU")
    expected = dilated_run_time(lu.solo_time_s, 2, 6400e-6, 0.2)
    assert lu.run_time_s == pytest.approx(expected, rel=2e-3)  # within one cycle of ~60 s


def test_truth_stays_off_the_topics_and_charges_do_not_depend_on_it():
    cfg = CalibratedConfig(seed=2)
    sim = with_records(cfg, lambda s: run_pairwise(cfg, [("MILC", "MILC"), ("GTC", "LAMMPS")], iterations=1, sink=s))
    assert all(type(e) in TOPIC_OF_RECORD for e in sim.events)
    wire = b"".join(encode(e) for e in sim.events)
    assert b"true_degradation" not in wire and b"solo_time" not in wire
    charges = charges_of(sim.events)  # the worker's fold sees only what the wire carries
    assert {t.job_id for t in sim.truth} == set(charges)
    for t in sim.truth:  # and they follow the truth closely (a calibrated estimator)
        c = charges[t.job_id]
        assert abs(predicted_run_time(t, c, c.degradation) - t.run_time_s) / t.run_time_s < 0.04


def test_cluster_from_a_swf_trace(tmp_path: Path):
    f = tmp_path / "t.swf"
    f.write_text("; header\n"
                 "1 0 0 30 8 -1 -1 8 60 -1 1 3 7 2 -1 -1 -1 -1\n"
                 "2 5 0 40 16 -1 -1 16 60 -1 1 4 7 5 -1 -1 -1 -1\n"
                 "3 6 0 -1 8 -1 -1 8 60 -1 0 4 7 5 -1 -1 -1 -1\n")  # no run time: skipped
    specs = swf_jobs(f, cores_per_node=16, max_nodes=4)
    assert [(s.submit_s, s.work_s, s.nodes, s.user, s.account) for s in specs] == [
        (0.0, 30.0, 1, "user3", "group7"), (5.0, 40.0, 2, "user4", "group7")]
    cfg = CalibratedConfig(nodes=3, seed=1)
    sim = with_records(cfg, lambda s: run_cluster(cfg, specs, sink=s))
    ends = [e for e in sim.events if isinstance(e, JobEvent) and e.state is JobState.ENDED]
    assert len(ends) == len(sim.truth) == 2
    assert any(len(e.nodes) == 2 for e in ends) and sum(isinstance(e, ShutterBatch) for e in sim.events) > 0
    bad = tmp_path / "bad.swf"
    bad.write_text("1 2 3\n")
    with pytest.raises(ValueError, match="18 fields"):
        swf_jobs(bad, cores_per_node=16, max_nodes=4)


def test_parquet_sink_writes_the_same_blocks_as_records(tmp_path: Path):
    import pyarrow.parquet as pq

    cfg = CalibratedConfig(nodes=4, seed=9)
    specs = [JobSpec(p, 20.0, 0.0) for p in ("MILC", "MG", "GTC", "POP", "CG", "FT", "LU", "NekBone")]
    sink = ParquetSink(cfg, tmp_path, flush_rows=50)
    run_cluster(cfg, specs, sink=sink)
    sink.close()
    sim = with_records(cfg, lambda s: run_cluster(cfg, specs, sink=s))
    batches = [e for e in sim.events if isinstance(e, ShutterBatch)]
    table = pq.read_table(tmp_path / "blocks.parquet").to_pylist()
    assert len(table) == sum(b.blocks for b in batches) == sink.rows["blocks"] > 0
    first = batches[0]
    row = next(r for r in table if r["cycle"] == first.cycle[0] and f"node{r['node']:05d}" == first.node)
    assert (row["before"], row["during"], row["after"]) == (
        first.before.instructions[0], first.during.instructions[0], first.after.instructions[0])


def test_every_marker_says_how_long_its_job_was_the_nodes_only_job():
    """Worked out from the lifecycle alone, the time each job had its nodes to itself is what the
    engine's markers say: a node's occupancy is read at each region's start, so a co-runner that
    ends inside a region is credited from the next one (less than one period, 0.2 s, per end)."""
    from factories import alone_from_lifecycle

    from nodeshare.schemas import JobLeftNode

    cfg = CalibratedConfig(nodes=3, seed=4)
    specs = [JobSpec(p, 10.0 + 5 * i, 2.0 * i) for i, p in enumerate(("MILC", "MG", "GTC", "POP", "CG", "LU"))]
    sim = with_records(cfg, lambda s: run_cluster(cfg, specs, sink=s))
    expected = alone_from_lifecycle(sim.events)
    said = {(e.job_id, e.node): e.alone_us / 1e6 for e in sim.events if isinstance(e, JobLeftNode)}
    assert said.keys() == expected.keys()
    for k, v in said.items():
        assert expected[k] - 0.2 * len(specs) <= v <= expected[k] + 1e-6, (k, v, expected[k])
    assert any(v > 1.0 for v in said.values())
