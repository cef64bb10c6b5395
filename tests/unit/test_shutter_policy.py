"""The adaptive shutter schedule and the mixed-S estimator (streams.core.shutter_policy), by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nodeshare.streams.core.shutter_policy import LevelStats, ShutterPolicy, levels_of, mixed_estimate


def level(d: float, n: int, spread: float = 0.0) -> LevelStats:
    """n accepted blocks with before = 1 - d (co), during = 1 + e, after = before: x = 1 + e, y = 1 - d.
    e alternates +spread / -spread, so D = 1 - (1 - d) = d exactly when n is even."""
    st = LevelStats()
    for i in range(n):
        e = spread if i % 2 == 0 else -spread
        assert st.add(1.0 - d, 1.0 + e, 1.0 - d)
    return st


def test_level_moments_by_hand():
    st = LevelStats()
    # x = during + after - before: 1.2 + 1.0 - 1.0 = 1.2 and 1.1 + 0.9 - 0.9 = 1.1; y = before = 1.0, 0.9
    assert st.add(1.0, 1.2, 1.0) and st.add(0.9, 1.1, 0.9)
    assert not st.add(1.0, 1.2, 1.1)  # |before - after| = 0.1 >= delta: Alg. 4 rejects
    assert not st.add(1.0, 0.99, 1.0)  # during below before: rejected
    assert (st.n, st.rejected) == (2, 2)
    assert st.degradation == pytest.approx(1 - 1.9 / 2.3)  # 0.173913
    # R = 1.9 / 2.3; residuals e = y - R x: 1 - 1.2 R = 0.008696, 0.9 - 1.1 R = -0.008696
    r = 1.9 / 2.3
    e = [1.0 - r * 1.2, 0.9 - r * 1.1]
    assert st.se == pytest.approx(math.sqrt((e[0] ** 2 + e[1] ** 2) * 2 / 1) / 2.3)  # 0.00756
    assert LevelStats().se == math.inf and LevelStats().degradation is None


def test_add_many_is_add():
    b, d, a = np.array([1.0, 0.9, 1.0]), np.array([1.2, 1.1, 1.2]), np.array([1.0, 0.9, 1.1])
    one = LevelStats()
    for row in zip(b, d, a, strict=True):
        one.add(*row)
    many = LevelStats()
    many.add_many(b, d, a)
    assert (one.n, one.rejected) == (many.n, many.rejected) == (2, 1)
    assert one.degradation == pytest.approx(many.degradation)
    assert levels_of([(3200, np.stack([b, d, a], 1))])[3200].n == 2


def test_one_level_is_the_refill_corrected_estimate():
    st = level(0.05, 10, 0.01)
    est = mixed_estimate({3200: st})
    # x = 1 +- 0.01 (mean 1), y = 0.95: D = 1 - 9.5 / 10 = 0.05
    assert est.degradation == pytest.approx(0.05) and est.levels_used == (3200,) and est.blocks == 10


def test_a_short_level_lower_beyond_noise_is_left_out_and_an_agreeing_one_is_pooled():
    short, long_ = level(0.01, 40, 0.005), level(0.07, 6, 0.005)
    est = mixed_estimate({3200: short, 51200: long_})
    assert est.levels_used == (51200,) and est.degradation == pytest.approx(0.07)
    # 0.069 vs 0.07: 0.1 pp apart, within z * se + 0.2 pp: both kept, weighted by 1 / se^2
    short = level(0.069, 40, 0.005)
    est = mixed_estimate({3200: short, 51200: long_})
    assert est.levels_used == (3200, 51200)
    # se of a level = 0.00465 * sqrt(n / (n - 1)) / sqrt(n) (residuals +-0.931 * 0.005 and +-0.93 * 0.005)
    se_s = 0.931 * 0.005 * math.sqrt(40 / 39) / math.sqrt(40)
    se_l = 0.93 * 0.005 * math.sqrt(6 / 5) / math.sqrt(6)
    assert (short.se, long_.se) == (pytest.approx(se_s), pytest.approx(se_l))
    w_s, w_l = 1 / se_s**2, 1 / se_l**2
    assert est.degradation == pytest.approx((w_s * 0.069 + w_l * 0.07) / (w_s + w_l))
    assert est.se == pytest.approx((w_s + w_l) ** -0.5)
    # 0.065 vs 0.07, se 0.074 and 0.19 pp: 0.5 pp > 1 x hypot = 0.2 pp, + 0.2 pp: left out
    assert mixed_estimate({3200: level(0.065, 40, 0.005), 51200: long_}).levels_used == (51200,)
    # a longest level with fewer than n_min blocks borrows the largest per-block spread of the others:
    # 12.8 ms: residuals +-0.96 x 0.005, spread = se x sqrt(n) = 0.0048 x sqrt(4 / 3) = 0.005543 (3.2 ms: 0.005013)
    est = mixed_estimate({3200: level(0.01, 40, 0.005), 12800: level(0.04, 4, 0.005), 51200: level(0.07, 3)})
    assert est.se == pytest.approx(0.0048 * math.sqrt(4 / 3) / math.sqrt(3))  # 0.0032
    # 0.07 - 0.04 = 3 pp > z_few 2 x hypot(0.32, 0.277 pp) + 0.2 pp = 1.05 pp: 12.8 ms left out, 3.2 ms too
    assert est.level_us == 51200 and est.levels_used == (51200,) and est.degradation == pytest.approx(0.07)
    # one long block that agrees: kept with the short level, by inverse variance
    est = mixed_estimate({3200: level(0.01, 40, 0.005), 51200: level(0.012, 1)})
    assert est.levels_used == (3200, 51200) and 0.01 < est.degradation < 0.0101
    # nothing with n_min blocks: everything pooled
    est = mixed_estimate({3200: level(0.02, 2), 51200: level(0.06, 2)})
    assert est.levels_used == (3200, 51200) and est.degradation == pytest.approx(1 - (2 * 0.98 + 2 * 0.94) / 4)
    assert mixed_estimate({}).degradation is None


def test_the_schedule_starts_dense_probes_the_longest_and_settles():
    p = ShutterPolicy()  # ladder 3.2 / 12.8 / 51.2 ms, n_start 6, n_level 4
    big = 1.0
    assert p.choose({}, big).sample_us == 3200  # dense start
    assert p.choose({3200: level(0.01, 5)}, big).sample_us == 3200
    assert p.choose({3200: level(0.01, 6)}, big).sample_us == 51200  # probe the longest
    assert p.choose({3200: level(0.01, 6), 51200: level(0.01, 3)}, big).sample_us == 51200
    # agree: settle at 3.2 ms, keeping a quarter of the 3.2 ms time at 51.2 ms (check_share 0.25):
    # 4 x 51.2 = 204.8 ms >= 0.25 x n x 3.2 ms while n <= 256
    agree = {3200: level(0.01, 6, 0.005), 51200: level(0.01, 4, 0.005)}
    assert p.choose(agree, big).sample_us == 3200
    agree[3200] = level(0.01, 256, 0.005)
    assert p.choose(agree, big).sample_us == 3200
    agree[3200] = level(0.01, 257, 0.005)
    assert p.choose(agree, big).sample_us == 51200
    # disagree: the level in between is probed; if it agrees with the longest, settle there
    dis = {3200: level(0.01, 6, 0.005), 51200: level(0.07, 4, 0.005)}
    assert p.choose(dis, big).sample_us == 12800
    dis[12800] = level(0.069, 4, 0.005)
    assert p.choose(dis, big).sample_us == 12800  # 4 x 12.8 < 4 x 51.2: no check due yet
    dis[12800] = level(0.04, 4, 0.005)  # still climbing at 12.8 ms: stay at the longest
    assert p.choose(dis, big).sample_us == 51200


def test_the_budget_of_the_paused_co_runners_holds_every_shutter():
    p = ShutterPolicy()  # budget 0.9% of the co-runner's run, plus one 3.2 ms sample
    assert p.pause_budget_s(10.0, 0.05) == pytest.approx(0.009 * 10 + 0.0032 - 0.05)  # 0.0432 s
    levels = {3200: level(0.01, 6)}  # wants 51.2 ms
    assert p.choose(levels, 0.0432) is None  # 51.2 ms > 43.2 ms, and no 51.2 ms sample has earned a fill yet
    assert p.choose(levels, 0.0512).sample_us == 51200
    # one 51.2 ms block earns fill_share x 51.2 = 12.8 ms of 3.2 ms samples (4) while the next waits
    levels[51200] = level(0.01, 1)
    assert p.choose(levels, 0.0432).sample_us == 3200
    levels[3200] = level(0.01, 6 + 3)
    assert p.choose(levels, 0.0432).sample_us == 3200
    levels[3200] = level(0.01, 6 + 4)
    assert p.choose(levels, 0.0432) is None
    assert p.choose(levels, 0.0031) is None  # nor a 3.2 ms one without its budget
    assert p.choose({}, 0.0031) is None and p.choose({}, 0.0032).sample_us == 3200


def rejected(n: int) -> LevelStats:
    """n blocks Alg. 4 rejects: IPC after the window above IPC during it (a cache still refilling)."""
    st = LevelStats()
    for _ in range(n):
        assert not st.add(0.9, 1.0, 1.02)
    return st


def test_a_job_whose_short_blocks_are_all_rejected_is_measured_at_longer_s():
    """cactusADM06 in the calibrated simulator: its IPC still climbs after a 3.2 ms window, so Alg. 4
    rejects every 3.2 ms block; the dense start ends after start_tries x n_start blocks taken there
    (it used to wait for 6 accepted ones for ever, and the job was priced by the prior)."""
    p = ShutterPolicy()  # n_start 6, start_tries 4
    assert p.choose({3200: rejected(23)}, 1.0).sample_us == 3200
    assert p.choose({3200: rejected(24)}, 1.0).sample_us == 51200
    few = rejected(20)
    for _ in range(5):
        few.add(1.0, 1.1, 1.0)  # 5 accepted of 25 taken: still short of n_start, but tried enough
    assert p.choose({3200: few}, 1.0).sample_us == 51200


def test_a_tried_out_level_is_not_taken_again_over_a_whole_run():
    """A job whose blocks Alg. 4 rejects at 3.2 and 12.8 ms but accepts at 51.2 ms, shuttered turn
    after turn with budget to spare: after the dense start's 24 tries and 16 at 12.8 ms it is
    measured at 51.2 ms for the rest of its run (a first version went back to 3.2 ms for good once
    four 51.2 ms blocks were in, since 3.2 ms then lay "between" and had fewer than four)."""
    p = ShutterPolicy()
    levels: dict[int, LevelStats] = {}
    taken = []
    for _ in range(300):
        ch = p.choose(levels, 1.0)
        assert ch is not None
        taken.append(ch.sample_us)
        st = levels.setdefault(ch.sample_us, LevelStats())
        if ch.sample_us == 51200:
            st.add(0.92, 1.0, 0.92)  # accepted: D = 0.08
        else:
            st.add(0.9, 1.0, 1.02)  # rejected: IPC still climbing after the window
    assert taken.count(3200) == 24 and taken.count(12800) == 16
    assert taken[-200:] == [51200] * 200
    assert mixed_estimate(levels).degradation == pytest.approx(0.08)


def test_the_fill_counts_every_block_taken_not_only_accepted_ones():
    """A rejected block paused the co-runners as long as an accepted one: the fill's share of time
    at the shortest S counts both, so rejections cannot starve the longer samples."""
    p = ShutterPolicy()
    levels = {3200: level(0.01, 6), 51200: level(0.01, 1)}  # one 51.2 ms block earns 12.8 ms: 4 short ones
    short = levels[3200]
    for _ in range(3):
        short.add(0.9, 1.0, 1.02)
    assert p.choose(levels, 0.0432).sample_us == 3200  # 3 taken since the start: 9.6 ms < 12.8 ms
    short.add(0.9, 1.0, 1.02)
    assert p.choose(levels, 0.0432) is None  # 4 taken, none accepted: 12.8 ms spent, the fill waits


def test_sparser_once_tight():
    p = ShutterPolicy()
    # probing the longest S (3 of n_level 4 blocks there) is never sparse, however tight the short level
    probing = {3200: level(0.03, 65, 0.0001), 51200: level(0.03, 3, 0.0001)}
    ch = p.choose(probing, 1.0)
    assert (ch.sample_us, ch.period_ms) == (51200, 200)
    # probed and tight (se well under 0.25 pp): every shutter waits 4 x P
    tight = {3200: level(0.03, 257, 0.0001), 51200: level(0.03, 4, 0.0001)}
    ch = p.choose(tight, 1.0)
    assert (ch.sample_us, ch.period_ms) == (51200, 800)
    wide = {3200: level(0.1, 64, 0.05), 51200: level(0.1, 8, 0.05)}  # se ~0.56 pp
    assert p.choose(wide, 1.0).period_ms == 200


def test_bad_ladders_are_refused():
    with pytest.raises(ValueError):
        ShutterPolicy(ladder_us=(12800, 3200))
    with pytest.raises(ValueError):
        ShutterPolicy(budget_share=0.0)
