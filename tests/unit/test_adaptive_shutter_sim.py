"""The calibrated simulator under an adaptive shutter schedule (issue 36): the S of each cycle is
the lone job's policy choice, blocks carry it, and every job stays within the pause budget."""

from __future__ import annotations

import json

import pytest

from nodeshare.experiments.adaptive_shutter import score, summary
from nodeshare.experiments.poppa import charges_of
from nodeshare.producers.calibrated import CalibratedConfig, run_pairwise
from nodeshare.producers.calibrated_records import with_records
from nodeshare.schemas import ShutterBatch
from nodeshare.streams.core.accounting import PricingPolicy
from nodeshare.streams.core.degradation import MIXED_S
from nodeshare.streams.core.shutter_policy import ShutterPolicy

PAIRS = [("MILC", "LAMMPS"), ("GTC", "MG"), ("POP", "CG")]


def run(cfg: CalibratedConfig):
    return with_records(cfg, lambda sink: run_pairwise(cfg, PAIRS, iterations=1, sink=sink))


def test_a_one_level_ladder_is_the_fixed_schedule():
    """Ladder (3.2 ms,), never sparse: every node is shuttered every cycle as POPPA's agent does
    (3.2 ms every 419 ms pauses a co-runner 0.76% of its time, inside the 0.9% budget)."""
    fixed = run(CalibratedConfig(seed=3))
    adaptive = run(CalibratedConfig(seed=3, schedule=ShutterPolicy(ladder_us=(3200,), tight_se=0.0)))
    a, b = charges_of(fixed.events), charges_of(adaptive.events)
    assert a.keys() == b.keys()
    for j in a:
        assert (a[j].blocks_used, a[j].blocks_rejected) == (b[j].blocks_used, b[j].blocks_rejected)
        assert b[j].degradation == pytest.approx(a[j].degradation, abs=1e-9)
        assert b[j].run_time_s == pytest.approx(a[j].run_time_s, abs=1e-6)


def test_blocks_carry_the_policy_s_and_no_job_is_paused_beyond_its_budget():
    pol = ShutterPolicy()
    sim = run(CalibratedConfig(seed=5, schedule=pol))
    seen = {e.sample_us for e in sim.events if isinstance(e, ShutterBatch)}
    assert seen <= set(pol.ladder_us) and 51200 in seen and 3200 in seen
    for t in sim.truth:  # budget 0.9% of the run, plus one 3.2 ms sample
        assert t.paused_s <= pol.budget_share * t.run_time_s + 0.0032 + 1e-9
    s = summary(score(sim.truth, sim.events))
    assert s["jobs"] == len(sim.truth) and s["paused_share_pct"]["max"] <= 1.0


def test_the_fold_charges_every_block_by_its_s_as_the_prototype_does():
    """Every batch reaches the fold in its stream's order (a batch cut because S changed once sorted
    after the next one, whose blocks the fold then ignored), and the fold's mixed_s charge is the
    prototype's mixed estimate (exact sums against float running sums: the same to 1e-12)."""
    sim = run(CalibratedConfig(seed=4, schedule=ShutterPolicy()))  # seed 4: 7 blocks ignored before
    charges = charges_of(sim.events, PricingPolicy(estimator=MIXED_S))
    assert all(c.blocks_ignored == 0 and not c.evidence_problems for c in charges.values())
    assert any(len(c.levels) > 1 for c in charges.values())
    rows = score(sim.truth, sim.events)
    for r in rows:
        assert r["fold"] == pytest.approx(r["mixed"], abs=1e-12), r["job"]
    assert summary(rows)["fold"] == summary(rows)["mixed"]


def test_a_schedule_that_cannot_fit_its_cycle_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        CalibratedConfig(schedule=ShutterPolicy(ladder_us=(3200, 102400)))
    with pytest.raises(ValueError, match="shortest S"):
        CalibratedConfig(sample_us=6400, schedule=ShutterPolicy())


def test_the_experiment_command_compares_and_refuses_what_it_cannot_run():
    from typer.testing import CliRunner

    from nodeshare.cli import app

    r = CliRunner().invoke(app, ["experiment", "adaptive-shutter", "--programs", "MILC,LAMMPS", "--seed", "3",
                                 "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout[r.stdout.index("{"):])
    assert got["jobs"] >= 4 and set(got) >= {"fold", "mixed", "blocks_accepted", "paused_share_pct"}
    assert got["paused_share_pct"]["max"] <= 1.0
    assert set(got) >= {"every_block"}
    # the ladder is built from --sample-us: 16 x 51.2 ms in three windows cannot fit a 200 ms cycle
    bad = CliRunner().invoke(app, ["experiment", "adaptive-shutter", "--sample-us", "51200"])
    assert bad.exit_code == 2 and "S <= 4444 us at 200 ms" in bad.output, bad.output
    unknown = CliRunner().invoke(app, ["experiment", "adaptive-shutter", "--scenario", "long"])
    assert unknown.exit_code == 2 and "--scenario is pairs or short" in unknown.output


def test_the_every_block_prototype_keeps_the_blocks_alg4_rejects():
    """experiment adaptive-shutter's every_block column: the refill-corrected moments of every block
    (x = during + after - before, y = before), where the mixed prototype keeps Alg. 4's blocks only."""
    import numpy as np

    from nodeshare.experiments.adaptive_shutter import every_block_levels
    from nodeshare.streams.core.shutter_policy import levels_of

    # block 1 passes Alg. 4 (x = 1.1, y = 1.0); block 2 has after above during (x = 1.1 + 0.12, y = 1.0)
    m = np.array([[1.0, 1.1, 1.0], [1.0, 1.1, 1.12]])
    every = every_block_levels([(3200, m)])[3200]
    alg4 = levels_of([(3200, m)])[3200]
    assert (alg4.n, alg4.rejected, every.n) == (1, 1, 2)
    assert every.sx == pytest.approx(1.1 + 1.22) and every.sy == pytest.approx(2.0)
    assert every.degradation == pytest.approx(1 - 2.0 / 2.32)
    assert alg4.degradation == pytest.approx(1 - 1.0 / 1.1)
