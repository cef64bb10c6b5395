"""Experiments of the source papers: JSON and a PNG plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import typer

from .common import (
    FullJson,
    comma_numbers,
    progress_bar,
    staged_progress,
)
from .experiment_common import (
    DEFAULT_SETTINGS,
    EstimatorOpt,
    LibraryProfiles,
    PeriodMs,
    Programs,
    SampleUs,
    checked_estimator,
    checked_schedule,
    chosen_programs,
    experiment_app,
    experiment_out,
    program_library,
)


@experiment_app.command("ptune")
def experiment_ptune(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/ptune.png"),
    seed: Annotated[int, typer.Option(help="population and sampling seed")] = 4,
    margin: Annotated[float, typer.Option(min=0.0, max=1.0, help="PTune's noise margin")] = 0.01,
) -> None:
    """PTune against uniform power on 16-128 processors from quartile mixes of a 600-chip population
    (Seed 004, Fig. 13-14): run-time reduction and processors freed."""
    from nodeshare.experiments.power import experiment_ptune as run
    from nodeshare.experiments.power import plot_ptune

    r = run(seed=seed, margin=margin)
    experiment_out(r, as_json, png, plot_ptune, [
        f"{r['configurations']} configurations (4 programs x 6 quartile mixes x 4 sizes x 4 budgets)",
        f"run-time reduction vs uniform power: max {r['max_speedup_pct']:.1f}%, mean {r['mean_speedup_pct']:.1f}%, "
        f"min {r['min_speedup_pct']:.1f}% ({r['slower_than_uniform']} slower than uniform)",
        f"processors freed: max {r['max_freed_pct']:.1f}%, mean {r['mean_freed_pct']:.1f}%; "
        f"uniform power kept (gain below the {margin:.0%} margin) in {r['uniform_kept']}"])


@experiment_app.command("ppartition")
def experiment_ppartition(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/ppartition.png"),
    seed: Annotated[int, typer.Option(help="population and queue seed")] = 4,
    budget_watts: Annotated[float, typer.Option(min=1.0, help="the machine's power bound Pm/c")] = 28_000.0,
    processors: Annotated[int, typer.Option(min=8, max=600, help="Nmax")] = 550,
    admit: Annotated[str, typer.Option(help="fair (the paper) or throughput")] = "fair",
) -> None:
    """PPartition + PTune on a power-bounded machine fed by a job queue, against uniform capping at
    Pm/c/Nmax, 75 W and TDP (Seed 004, Fig. 15-17): jobs started and machine throughput."""
    from nodeshare.experiments.power import experiment_ppartition as run
    from nodeshare.experiments.power import plot_ppartition
    from nodeshare.streams.core.power.ppartition import PowerPolicy

    if admit not in ("fair", "throughput"):
        raise typer.BadParameter("must be 'fair' or 'throughput'", param_hint="--admit")
    policy = PowerPolicy(admit=cast(Literal["fair", "throughput"], admit))
    r = run(seed=seed, processors=processors, budget_w=budget_watts, policy=policy)
    gains = ", ".join(f"{s['throughput_gain_pct']:+.1f}% vs uniform {s['cap_watts']:.0f} W ({s['jobs_scheduled']} jobs)"
                      for s in r["uniform"].values())
    experiment_out(r, as_json, png, plot_ppartition, [
        f"{r['jobs_scheduled']} of {r['queue']['jobs']} jobs started on {r['processors_used']} processors at "
        f"{r['allocated_watts']:.0f} W (admit={admit}); uniform Pm/c/Nmax: {r['jobs_scheduled_uniform']} jobs",
        f"throughput: {gains}"])


def _pairwise_summary(r: dict[str, Any]) -> list[str]:
    est = r["estimators"]
    return [
        f"{r['pairs']} pairs, {r['runs']} completed runs; mean true degradation {r['mean_degradation_pct']:.1f}%",
        *(f"{name:17s} MAE {s['mae_pct']:.2f}%  max |err| {s['max_abs_err_pct']:.2f}%  bias {s['bias_pct']:+.2f}%  "
          f"pairs above 6%: {s['pairs_above_6_pct']}  worst {s['worst'][0]['job']} next to "
          f"{s['worst'][0]['co_runner']}" for name, s in est.items()),
        f"worst ten ({r['estimator']}): " + ", ".join(f"{w['job']}/{w['co_runner']} {w['err_pct']:+.1f}"
                                                      for w in est[r['estimator']]['worst']),
        f"applied estimator: {r['estimator']}; {r['schedule']} shutter schedule"]


def _pricing_summary(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['jobs']} (program, co-runner) jobs from {r['runs']} runs; price / solo baseline:",
        f"SOP    mean {r['sop_mean']:.4f}  min {r['sop_min']:.4f}  max {r['sop_max']:.4f}",
        f"POPPA  mean {r['poppa_mean']:.4f}  min {r['poppa_min']:.4f}  max {r['poppa_max']:.4f}  ({r['estimator']})",
        f"Oracle mean {r['oracle_mean']:.4f}  min {r['oracle_min']:.4f}  max {r['oracle_max']:.4f}",
        f"POPPA - oracle: {r['poppa_minus_oracle_pp']:+.2f} pp; charged above the baseline: {r['overcharged_jobs']} "
        f"jobs (mean surcharge {r['overcharge_mean_pct']:.2f}%), {r['overcharged_runs']} of {r['runs']} runs",
        _runs_line(r["overall"]) + f"; {r['schedule']} shutter schedule"]


def _runs_line(m: dict[str, Any]) -> str:
    """One line of a set of runs' per-job figures (experiments.mixes.mix_metrics)."""
    if not m.get("jobs"):
        return "per run: no completed run"
    cov = "" if m["coverage_clamped"] is None else f", interval coverage {100 * m['coverage_clamped']:.1f}%"
    return (f"per run: D MAE {m['mae_pct']:.2f} pp, max {m['max_abs_err_pct']:.1f} pp; "
            f"{m['overcharged_jobs_over_0_5pct']} of {m['jobs']} runs > 0.5% above their solo baseline{cov}; "
            f"revenue {m['revenue_vs_oracle_pp']:+.2f} pp of the oracle's")


def _charged_pairs_command(kind: str, summary: Callable[[dict[str, Any]], list[str]],
                           doc: str) -> Callable[..., None]:
    """``experiment pairwise`` and ``experiment pricing``: the same runs and options (Seed 002's
    pairs on the calibrated simulator, charged by the worker's fold), their own figure and summary."""

    def command(
        as_json: FullJson = False,
        png: Annotated[Path, typer.Option(help="plot file")] = Path(f"experiments/{kind}.png"),
        seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
        iterations: Annotated[int, typer.Option(min=1, help="runs each program completes next to its co-runner")]
        = 5,
        profiles: LibraryProfiles = None,
        programs: Programs = None,
        sample_us: SampleUs = DEFAULT_SETTINGS["sample_us"],
        period_ms: PeriodMs = DEFAULT_SETTINGS["period_ms"],
        estimator: EstimatorOpt = DEFAULT_SETTINGS["estimator"],
        mix: Annotated[str, typer.Option(
            help="pairs (every pair run to completion: Fig. 10-12), trace-times (run times from --trace), "
                 "arrivals (co-runners arriving and leaving mid-run), short-phases (bursts shorter than S), "
                 "thrashing (the programs of largest LLC demand paired), or all-mixes: a per-job report per "
                 "mix and overall")] = "pairs",
        jobs: Annotated[int | None, typer.Option(
            min=1, help="jobs of trace-times and arrivals, pairs of short-phases (default: 4 per program)")] = None,
        trace: Annotated[Path | None, typer.Option(
            exists=True, dir_okay=False, help="Standard Workload Format trace whose run times trace-times draws")]
        = None,
        max_run_s: Annotated[float, typer.Option(
            min=5.0, help="trace-times: run times are clipped to [5 s, this] so a run ends in minutes")] = 3600.0,
        schedule: Annotated[str, typer.Option(
            help="the shutter schedule: adaptive (issue 36: S, 4 S and 16 S from --sample-us, at --period-ms) "
                 "or fixed (--sample-us every --period-ms: POPPA's, with --estimator refill_corrected)")]
        = DEFAULT_SETTINGS["shutter_schedule"],
    ) -> None:
        from nodeshare.experiments import poppa
        from nodeshare.experiments.mixes import MIX_NAMES, mixes_table, plot_mixes

        if mix not in MIX_NAMES:
            raise typer.BadParameter(f"must be one of {', '.join(MIX_NAMES)}", param_hint="--mix")
        if mix == "trace-times" and trace is None:
            raise typer.BadParameter("the trace-times mix draws its run times from --trace", param_hint="--trace")
        lib = program_library(profiles)
        with progress_bar() as bar:
            task = bar.add_task("simulating and charging", total=None)
            kwargs: dict[str, Any] = {"schedule": checked_schedule(schedule, sample_us, period_ms)}
            if mix != "pairs":
                kwargs.update(mix=mix, jobs=jobs, trace=trace, max_run_s=max_run_s)
                bar.update(task, description=f"simulating and charging: {mix}")
            r: dict[str, Any] = getattr(poppa, f"experiment_{kind}")(
                seed=seed, iterations=iterations, library=lib, programs=chosen_programs(programs, lib, profiles),
                sample_us=sample_us, period_ms=period_ms, estimator=checked_estimator(estimator), **kwargs)
        if mix == "pairs":
            experiment_out(r, as_json, png, getattr(poppa, f"plot_{kind}"), summary(r))
        else:
            experiment_out(r, as_json, png, plot_mixes, mixes_table(r))

    command.__doc__ = doc
    return command


experiment_app.command("pairwise")(_charged_pairs_command("pairwise", _pairwise_summary, """Every pair co-located as
    in Seed 002 Section 7 on the calibrated simulator, charged by the stream worker's fold: Fig. 10
    (run-time prediction error % per estimator) and Fig. 11 (degradation %). Charged as a site is by
    default (the adaptive shutter schedule and mixed_s); POPPA's own setup is --schedule fixed
    --estimator refill_corrected."""))
experiment_app.command("pricing")(_charged_pairs_command("pricing", _pricing_summary, """Seed 002 Fig. 12: prices
    relative to the solo baseline under SOP, POPPA (the ledger's charge) and the oracle, for every
    (program, co-runner). Charged as a site is by default (the adaptive shutter schedule and mixed_s);
    POPPA's own setup is --schedule fixed --estimator refill_corrected."""))


@experiment_app.command("pairing")
def experiment_pairing(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/pairing.png"),
    seed: Annotated[int, typer.Option(help="seed of the train/test split and the queues")] = 7,
    queues: Annotated[str, typer.Option(
        help="random queues (a number), or 'paper': Seed 003 Fig. 8's low, medium and high degradation "
             "queues on one server")] = "20",
    jobs: Annotated[int, typer.Option(min=2, help="jobs per queue")] = 50,
    trees: Annotated[int, typer.Option(min=1, help="trees of the Random Forest")] = 200,
    sharing: Annotated[str | None, typer.Option(
        help="half-node (each job on its half: the HPC mode) or whole-server (both on every core: the paper's); "
             "default: half-node for random queues, whole-server for 'paper'")] = None,
    per_level: Annotated[int, typer.Option(min=1, help="with --queues paper: queues per degradation level")] = 5,
    profiles: LibraryProfiles = None,
    train_on: Annotated[str, typer.Option(
        help="what the forest learns from: measured (each pair run on the calibrated simulator, D from the "
             "fold's charges) or truth (the simulator's contention model)")] = "measured",
) -> None:
    """Seed 003: a Random Forest predicts pairwise degradation from solo counter profiles; queues
    paired greedily or by blossom matching, makespan against FIFO and FIFO-shared on 1-5 nodes
    (random queues), or on one server per degradation level (--queues paper, Fig. 8)."""
    from nodeshare.experiments.pairing import SHARING, TRAIN_ON, plot_pairing, plot_pairing_levels
    from nodeshare.experiments.pairing import experiment_pairing as run
    from nodeshare.experiments.pairing import experiment_pairing_levels as run_levels
    from nodeshare.producers.workloads import BUILTIN

    paper = queues == "paper"
    if not paper and not (queues.isdigit() and int(queues) >= 1):
        raise typer.BadParameter(f"a number of random queues or 'paper', got {queues!r}", param_hint="--queues")
    if train_on not in TRAIN_ON:
        raise typer.BadParameter(f"must be one of {', '.join(TRAIN_ON)}", param_hint="--train-on")
    sharing = sharing or ("whole-server" if paper else "half-node")
    if sharing not in SHARING:
        raise typer.BadParameter(f"must be one of {', '.join(SHARING)}", param_hint="--sharing")
    loaded = {k: w for k, w in program_library(profiles).items() if k not in BUILTIN}
    if paper:
        with progress_bar() as bar:
            task = bar.add_task("scheduling queues", total=3 * per_level)
            r = run_levels(seed=seed, queues=per_level, jobs=jobs, sharing=sharing, profiles=loaded, trees=trees,
                           progress=lambda done, total: bar.update(task, completed=done), train_on=train_on)
        levels = r["makespan_vs_fifo_pct"]["by_level"]
        experiment_out(r, as_json, png, plot_pairing_levels, [
            f"{len(r['programs'])} programs, {sharing} sharing; Random Forest (trained on {train_on}) R2 "
            f"{r['r2']:.3f}",
            *(f"{lv:<6} makespan vs FIFO: " + (", ".join(f"{p} {v:+.1f}%" for p, v in levels[lv].items())
                                               or "no queue: the library has no such pairs")
              for lv in levels),
            "overall: " + ", ".join(f"{p} {v:+.1f}%" for p, v in r["makespan_vs_fifo_pct"]["overall"].items())])
        return
    if sharing != "half-node":
        raise typer.BadParameter("random queues run half-node (multi-server list scheduling)", param_hint="--sharing")
    with progress_bar() as bar:
        task = bar.add_task("scheduling queues", total=int(queues))
        r = run(seed=seed, queues=int(queues), jobs=jobs, profiles=loaded, trees=trees,
                progress=lambda done, total: bar.update(task, completed=done), train_on=train_on)
    m = r["makespan_vs_fifo_pct"]
    experiment_out(r, as_json, png, plot_pairing, [
        f"{len(r['programs'])} programs; Random Forest (trained on {train_on}) R2 {r['r2']:.3f} on "
        f"{r['fit']['test_pairs']} held-out pairs "
        f"(mean abs error {r['fit']['mae_pct_points']:.2f} points)",
        f"makespan vs FIFO over {queues} queues of {jobs} jobs on {r['servers'][0]}-{r['servers'][-1]} nodes: "
        + ", ".join(f"{p} {v:+.1f}%" for p, v in m.items()),
        f"rf_blossom: {r['rf_blossom_pairs']} pairs, {r['rf_blossom_serialized']} serialized (slower shared)"])


#: Options of the commands that replay a trace.
TraceMinCores = Annotated[int, typer.Option("--min-procs", min=1,
                                            help="keep jobs with at least this many cores on the trace's machine")]
TraceCoresPerNode = Annotated[float | None, typer.Option(
    min=1.0, help="cores of a node of the trace's machine (default: the header's MaxProcs / MaxNodes; "
                  "needed when the trace counts whole nodes as processors)")]


@experiment_app.command("sns")
def experiment_sns(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="job trace in Standard Workload Format")],
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/sns.png"),
    scaling_ratio: Annotated[float, typer.Option(min=0.01, max=0.99, help="chance a job runs a scaling program")] = 0.5,
    nodes: Annotated[int | None, typer.Option(min=1, help="simulated nodes (default: the trace's MaxNodes)")] = None,
    min_procs: TraceMinCores = 36,
    cores_per_node: TraceCoresPerNode = None,
    limit: Annotated[int | None, typer.Option(min=1, help="replay only the first N kept jobs")] = None,
    alpha: Annotated[float, typer.Option(min=0.01, max=1.0, help="every job's slowdown threshold")] = 0.9,
    age_limit_s: Annotated[float, typer.Option(min=0.0, help="wait after which a job blocks younger ones")] = 3600.0,
    bandwidth_budget: Annotated[float, typer.Option(min=0.05, max=1.0,
                                                    help="share of a node's peak bandwidth SNS hands out")] = 0.92,
    seed: Annotated[int, typer.Option(help="seed of the job-to-program mapping")] = 7,
) -> None:
    """Seed 001 Section 6.4: a real trace replayed on a simulated cluster under CE, CS and SNS:
    throughput (1 / mean turnaround), wait and run times, and alpha violations."""
    from nodeshare.experiments.sns_trace import experiment_sns as run
    from nodeshare.experiments.sns_trace import plot_sns

    try:
        with progress_bar() as bar:
            progress = staged_progress(bar, "replaying under {}")
            r = run(trace, scaling_ratio=scaling_ratio, nodes=nodes, min_procs=min_procs, limit=limit, alpha=alpha,
                    age_limit_s=age_limit_s, seed=seed, bandwidth_budget=bandwidth_budget,
                    cores_per_node=cores_per_node, progress=progress)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from None
    pol = r["policies"]
    experiment_out(r, as_json, png, plot_sns, [
        f"{r['jobs']} jobs of {trace.name} on {r['nodes']} nodes of {r['node']['cores']} cores "
        f"(scaling ratio {scaling_ratio}: {100 * r['scaling_core_hours_share']:.0f}% of core-hours scaling)",
        *(f"{p:<4} wait {v['mean_wait_s']:>9.0f} s  run {v['mean_run_s']:>9.0f} s  turnaround "
          f"{v['mean_turnaround_s']:>9.0f} s  run/CE {v['run_vs_ce_geomean']:.3f}  "
          f"alpha violations {v['alpha_violations']}" for p, v in pol.items()),
        "throughput vs CE: " + ", ".join(f"{p} {g:+.1f}%" for p, g in r["throughput_gain_vs_ce_pct"].items())])


@experiment_app.command("sns-clusters")
def experiment_sns_clusters(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="job trace in Standard Workload Format")],
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/sns-clusters.png"),
    nodes: Annotated[str | None, typer.Option(
        help="cluster sizes, comma-separated (default: the trace's MaxNodes x 1/2, 1, 4: the paper's 4K:8K:32K)")]
    = None,
    scaling_ratios: Annotated[str, typer.Option(help="scaling ratios, comma-separated (the paper: 0.5, 0.9)")]
    = "0.5,0.9",
    min_procs: TraceMinCores = 36,
    cores_per_node: TraceCoresPerNode = None,
    limit: Annotated[int | None, typer.Option(min=1, help="replay only the first N kept jobs")] = None,
    seed: Annotated[int, typer.Option(help="seed of the job-to-program mapping")] = 7,
) -> None:
    """Seed 001 Section 6.4 and Fig. 20: a real trace on clusters of several sizes at each scaling
    ratio, CE vs CS vs SNS: throughput gain and the run/wait breakdown normalized to CE's turnaround."""
    from nodeshare.experiments.sns_trace import experiment_sns_clusters as run
    from nodeshare.experiments.sns_trace import plot_sns_clusters

    sizes = comma_numbers(nodes, int, "--nodes") if nodes else None
    ratios = comma_numbers(scaling_ratios, float, "--scaling-ratios")
    if sizes and min(sizes) < 1:
        raise typer.BadParameter("cluster sizes are at least 1 node", param_hint="--nodes")
    if not all(0.0 < r < 1.0 for r in ratios):
        raise typer.BadParameter("scaling ratios are within (0, 1)", param_hint="--scaling-ratios")
    try:
        with progress_bar() as bar:
            r = run(trace, nodes=sizes, scaling_ratios=ratios, min_procs=min_procs, limit=limit, seed=seed,
                    cores_per_node=cores_per_node, progress=staged_progress(bar, "{}"))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from None
    experiment_out(r, as_json, png, plot_sns_clusters, [
        f"{trace.name}: {r['runs'][0]['jobs']} jobs ({r['runs'][0]['skipped_too_big']} over {min(r['nodes'])} nodes "
        "left out) on nodes of 28 cores",
        *(f"{x['nodes']:>6} nodes, ratio {x['scaling_ratio']}: throughput vs CE CS "
          f"{x['throughput_gain_vs_ce_pct']['CS']:+.1f}%, SNS {x['throughput_gain_vs_ce_pct']['SNS']:+.1f}%; "
          f"SNS wait {x['breakdown']['SNS']['wait']:.2f} run {x['breakdown']['SNS']['run']:.2f} "
          f"(CE {x['breakdown']['CE']['wait']:.2f} + {x['breakdown']['CE']['run']:.2f})" for x in r["runs"]),
        "the paper (Trinity, 4K/8K/32K nodes): SNS +15.7% at 32K and ratio 0.9"])


@experiment_app.command("sns-testbed")
def experiment_sns_testbed(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/sns-testbed.png"),
    sequences: Annotated[int, typer.Option(min=1, help="random job sequences")] = 36,
    jobs: Annotated[int, typer.Option(min=1, help="jobs per sequence, all submitted at once")] = 20,
    alpha: Annotated[float, typer.Option(min=0.01, max=1.0, help="every job's slowdown threshold")] = 0.9,
    seed: Annotated[int, typer.Option(help="seed of the sequences")] = 7,
    comm_growth: Annotated[float, typer.Option(
        min=0.0, help="communication's growth per doubling of nodes (the model's assumption)")] = 0.5,
    latency: Annotated[str, typer.Option(
        help="loaded-latency curve: measured (Intel MLC) or mm1 (1 + q rho / (1 - rho))")] = "measured",
    loaded_latency_queue: Annotated[float, typer.Option(
        min=0.0, help="q of the mm1 curve")] = 0.35,
    mba: Annotated[bool, typer.Option(help="SNS's bandwidth allocations are partitions of their own (Intel MBA)")]
    = True,
    programs_mix: Annotated[str, typer.Option(
        "--programs",
        help="draw programs by the paper's class mix (5 scaling, 4 neutral, 3 compact) or uniformly")] = "paper",
) -> None:
    """Seed 001 Section 6.2 on its own testbed: 8 nodes of 28 cores, sequences of 20 jobs of 16 or
    28 processes submitted at once, under CE, CS and SNS: each sequence's scaling ratio and
    throughput gain over CE (Fig. 14), and how often SNS beats CS."""
    from nodeshare.experiments.sns import LATENCY_CURVES
    from nodeshare.experiments.sns_testbed import PROGRAM_MIXES, plot_sns_testbed
    from nodeshare.experiments.sns_testbed import experiment_sns_testbed as run

    for value, allowed, hint in ((latency, LATENCY_CURVES, "--latency"), (programs_mix, PROGRAM_MIXES, "--programs")):
        if value not in allowed:
            raise typer.BadParameter(f"must be one of {', '.join(allowed)}", param_hint=hint)

    with progress_bar() as bar:
        task = bar.add_task("sequences", total=sequences)
        r = run(sequences=sequences, jobs=jobs, seed=seed, alpha=alpha, comm_growth=comm_growth,
                latency=latency, loaded_latency_queue=loaded_latency_queue, mba=mba, programs_mix=programs_mix,
                progress=lambda done, _total: bar.update(task, completed=done))
    gain, span = r["throughput_gain_vs_ce_pct"], r["throughput_gain_vs_ce_range_pct"]
    paper = r["paper"]["throughput_gain_vs_ce_pct"]
    experiment_out(r, as_json, png, plot_sns_testbed, [
        f"{r['sequences']} sequences of {r['jobs_per_sequence']} jobs on {r['nodes']} nodes of "
        f"{r['node']['cores']} cores; scaling ratios {min(r['scaling_ratio']):.2f}-{max(r['scaling_ratio']):.2f}",
        *(f"{p:<7} throughput vs CE {gain[p]:+.1f}% (range {span[p][0]:+.1f} to {span[p][1]:+.1f}"
          + (f"; paper {paper[p]:+.1f}%)" if p in paper else ")")
          + f"; jobs beyond 1/alpha of exclusive {r['beyond_1_over_alpha_pct'][p]:.1f}%" for p in gain),
        "beats CS in: " + ", ".join(f"{p} {n} of {r['sequences']}" for p, n in r["beats_cs"].items())
        + f" (paper SNS: 26 of 36); SNS below CE in {r['sns_below_ce']}",
        f"learned: from {r['learned']['measured_jobs']} measured jobs; {r['learned']['warmup_jobs']} warm-up jobs "
        "(placed before anything was measured)"])


@experiment_app.command("sns-sweep")
def experiment_sns_sweep(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/sns-sweep.png"),
    ratios: Annotated[str, typer.Option(help="scaling ratios, comma-separated")] =
    "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
    sequences: Annotated[int, typer.Option(min=1, help="random job sequences per ratio")] = 10,
    seed: Annotated[int, typer.Option(help="seed of the sequences")] = 7,
) -> None:
    """Seed 001 Section 6.3 (Fig. 19) on the 8-node testbed: SNS's and CS's run, wait and
    turnaround time relative to CE as the share of scaling jobs goes from 0 to 1."""
    from nodeshare.experiments.sns_testbed import experiment_sns_sweep as run
    from nodeshare.experiments.sns_testbed import plot_sns_sweep

    values = comma_numbers(ratios, float, "--ratios")
    if not all(0.0 <= v <= 1.0 for v in values):
        raise typer.BadParameter("scaling ratios are within [0, 1]", param_hint="--ratios")
    with progress_bar() as bar:
        task = bar.add_task("sequences", total=len(values) * sequences)
        r = run(ratios=values, sequences=sequences, seed=seed,
                progress=lambda done, _total: bar.update(task, completed=done))
    experiment_out(r, as_json, png, plot_sns_sweep, [
        f"{sequences} sequences of {r['jobs_per_sequence']} jobs per ratio; relative to CE (run / wait / turnaround):",
        *(f"ratio {x['scaling_ratio']:.2f}: " + "   ".join(
            f"{p} {x[p]['run']:.3f} / {x[p]['wait']:.3f} / {x[p]['turnaround']:.3f}" for p in ("SNS", "CS"))
          for x in r["ratios"])])
