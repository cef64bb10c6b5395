"""Benchmarks: each prints numbers and writes them to a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    Bootstrap,
    comma_numbers,
    load_settings,
    out,
    progress_bar,
    staged_progress,
)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print numbers and write them to a JSON file.")


def write_bench(name: str, figures: dict[str, Any], out_file: Path,
                targets: dict[str, tuple[str, float]] | None = None) -> None:
    """A benchmark's numbers in the one result shape (nodeshare.bench.result): printed, and
    written to its JSON file."""
    from nodeshare.bench.result import bench_result

    result = bench_result(name, figures, targets)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    out.print_json(json.dumps(result))
    out.print(f"wrote {out_file}")


@bench_app.command("audit")
def bench_audit(
    blocks: Annotated[int, typer.Option(min=1000, help="about this many shutter blocks in the simulated archive")
                      ] = 1_000_000,
    workdir: Annotated[Path, typer.Option(help="where the simulated archive is written")] = Path("bench"),
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/audit.json"),
    rounds: Annotated[int, typer.Option(min=1, help="alternating rounds of scan and audit (about 1.2 s each at "
                                                    "1 M blocks; the noisier the machine, the more)")] = 11,
    workers: Annotated[str, typer.Option(
        help="also time the audit on local Dask clusters of these many worker processes, e.g. 1,2,4 ('' for "
        "none): its tasks are the archive's row groups cut into two per worker")] = "1,2",
) -> None:
    """Samples per second the vectorized audit recomputes from a large archive made by the calibrated
    simulator, and its ratio to a plain DuckDB scan of the same files (medians over alternating rounds);
    then on one thread and on Dask workers: throughput, efficiency and tasks per worker count."""
    from dataclasses import asdict

    from nodeshare.bench.audit import run_audit_bench

    counts = comma_numbers(workers, int, "--workers", allow_empty=True)
    with progress_bar() as bar:
        task = bar.add_task("simulating the cluster", total=blocks)
        result = run_audit_bench(workdir, blocks, rounds, progress=lambda done: bar.update(
            task, completed=min(done, blocks)), workers=counts)
    write_bench("audit", asdict(result), out_file, {"samples_per_s": (">=", 3_000_000), "ratio_to_scan": (">=", 0.3),
                                                    "efficiency_1_worker": (">=", 0.8),
                                                    "speedup_2_workers": (">=", 1.5)})


@bench_app.command("ledger")
def bench_ledger(
    windows: Annotated[int, typer.Option(min=1000, help="shutter windows to count")] = 100_000,
    nodes: Annotated[int, typer.Option(min=1, help="nodes they come from")] = 1_000,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/ledger.json"),
) -> None:
    """Shutter windows per second the ledger sink decodes and counts into its co-runner table."""
    from nodeshare.bench.ledger import run_ledger_bench

    write_bench("ledger", run_ledger_bench(windows=windows, nodes=nodes), out_file)


@bench_app.command("power")
def bench_power(
    repeats: Annotated[int, typer.Option(min=3, help="runs per measurement (median)")] = 15,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/power.json"),
) -> None:
    """PTune over 550 processors and one PPartition dispatch across 100 running jobs (median ms)."""
    from nodeshare.experiments.power import bench_power as run

    result = run(repeats=repeats)
    write_bench("power", result, out_file, {"ptune_550_ms": ("<=", 20.0), "ppartition_100_ms": ("<=", 100.0)})


@bench_app.command("stream")
def bench_stream(
    blocks: Annotated[int, typer.Option(min=10_000, help="shutter blocks for the throughput run")] = 1_000_000,
    rate: Annotated[float, typer.Option(min=100.0, help="shutter blocks per second offered in the latency run "
                                                         "(48,000: a 10,000-node cluster)")] = 48_000.0,
    seconds: Annotated[float, typer.Option(min=2.0, help="length of the latency run")] = 20.0,
    per_message: Annotated[int, typer.Option(min=1, max=4096, help="blocks per node.ipc message (the agents' "
                                                                   "default flush)")] = 64,
    job_ends: Annotated[float, typer.Option(min=0.1, help="jobs ending per second in the latency run (80: above "
                                                          "the busiest hour of a real trace, 50/s on 10,000 nodes)")]
    = 80.0,
    workdir: Annotated[Path, typer.Option(help="scratch space (removed after)")] = Path("bench"),
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/stream.json"),
    bootstrap: Bootstrap = None,
) -> None:
    """Shutter blocks per second through one stream worker, its ratio to a raw confluent-kafka
    consumer of the same topic, and job-end to charge-row latency at a steady input rate."""
    from nodeshare.bench.stream import as_dict, run_stream_bench

    settings = load_settings(bootstrap=bootstrap)
    with progress_bar() as bar:
        result = run_stream_bench(settings, workdir, blocks=blocks, rate=rate, seconds=seconds,
                                  per_message=per_message, job_ends=job_ends, progress=staged_progress(bar))
    write_bench("stream", as_dict(result), out_file,
                {"blocks_per_s": (">=", 100_000), "ratio_to_raw": (">=", 0.25), "latency_p99_s": ("<=", 2.0)})


@bench_app.command("agent")
def bench_agent(
    jobs: Annotated[int, typer.Option(min=2, help="real workloads sharing the machine")] = 2,
    seconds: Annotated[float, typer.Option(min=1.0, help="measured seconds per slot")] = 4.0,
    slots: Annotated[int, typer.Option(min=2, help="slots without, and as many with, the agent (alternating)")]
    = 10,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/agent.json"),
    bootstrap: Bootstrap = None,
) -> None:
    """The node agent's overhead on real processes: its CPU use and the co-runners' dilation, vs Eq. 10."""
    from nodeshare.bench.agent import measure
    from nodeshare.deploy.broker import broker_for

    settings = load_settings(bootstrap=bootstrap)
    with broker_for(settings.bootstrap) as where, progress_bar() as bar:
        task = bar.add_task("slot pairs", total=slots)
        env = {**settings.model_copy(update={"bootstrap": where}).as_env(), "NODESHARE_CONFIG": ""}
        result = measure(env, jobs=jobs, seconds=seconds, slots=slots,
                         progress=lambda done, total: bar.update(task, completed=done))
    write_bench("agent", result, out_file, {"agent_cpu_pct_of_one_core": ("<=", 1.0)})


@bench_app.command("placement")
def bench_placement(
    repeats: Annotated[int, typer.Option(min=3, help="runs per measurement (median)")] = 5,
    greedy_jobs: Annotated[int, typer.Option(min=2, help="queue size for greedy pairing")] = 1000,
    blossom_jobs: Annotated[int, typer.Option(min=2, help="queue size for blossom matching")] = 1000,
    predict_jobs: Annotated[int, typer.Option(min=2, help="queue size for predicting every pair")] = 50,
    exact: Annotated[bool, typer.Option(help="also match the whole graph once, for the sparse graph's gap")] = True,
    queued: Annotated[int, typer.Option(min=1, help="jobs waiting when one more is submitted (decide_*)")] = 1000,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/placement.json"),
) -> None:
    """Greedy pairing of 1,000 jobs, blossom matching of 1,000, predicting all pairs of 50 (median
    ms); with --exact (default) also blossom on the whole graph once, and how far the sparse graph's
    matching is from it. decide_*: the scheduling pass a submission triggers with --queued jobs
    waiting on a busy 128-node cluster, under SNS and the learned policy (target 10 ms)."""
    from nodeshare.experiments.pairing import bench_placement as run

    result = run(repeats=repeats, greedy_jobs=greedy_jobs, blossom_jobs=blossom_jobs, predict_jobs=predict_jobs,
                 exact=exact, queued=queued)
    write_bench("placement", result, out_file, {f"greedy_{greedy_jobs}_ms": ("<=", 200.0),
                                                f"blossom_{blossom_jobs}_ms": ("<=", 1000.0),
                                                f"predict_{predict_jobs}_ms": ("<=", 100.0),
                                                f"decide_learned_{queued}_queued_ms": ("<=", 10.0)})


@bench_app.command("simulate")
def bench_simulate(
    nodes: Annotated[int, typer.Option(min=1, help="cluster size")] = 10_000,
    hours: Annotated[float, typer.Option(min=0.001, help="simulated time")] = 1.0,
    keep: Annotated[Path | None, typer.Option(help="keep the typed Parquet event tables here")] = None,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/simulate.json"),
) -> None:
    """The calibrated simulator's speed: a full cluster's event stream (blocks, shutter windows,
    lifecycle, job-left markers) written as typed Parquet; events per second of wall time."""
    from nodeshare.experiments.poppa import bench_simulate as run

    with progress_bar() as bar:
        task = bar.add_task("simulated seconds", total=round(hours * 3600))
        result = run(nodes=nodes, hours=hours, out_dir=keep,
                     progress=lambda t, _span: bar.update(task, completed=round(t)))
    write_bench("simulate", result, out_file)


@bench_app.command("sizing")
def bench_sizing(
    nodes: Annotated[int, typer.Option(min=2, help="nodes of the simulated cluster")] = 16,
    hours: Annotated[float, typer.Option(min=0.5, max=4.0, help="simulated time (the first fifth is warm-up; "
                                                                  "every record is held: about 1 GB per 10 node-hours)")
                     ] = 1.0,
    clusters: Annotated[str, typer.Option(help="cluster sizes (nodes) to scale the figures to")] = "100,1000,10000",
    fold_blocks_per_s: Annotated[float, typer.Option(min=1.0, help="blocks one stream worker folds per second "
                                                                   "(`bench stream` on your machine)")] = 188_928.0,
    audit_samples_per_s: Annotated[float, typer.Option(min=1.0, help="samples one audit thread recomputes per "
                                                                     "second (`bench audit`)")] = 1_890_000.0,
    ledger_windows_per_s: Annotated[float, typer.Option(min=1.0, help="shutter windows the ledger sink counts per "
                                                                      "second (`bench ledger`)")] = 107_481.0,
    jobs_at_scale: Annotated[int, typer.Option(min=1, help="jobs held at once to weigh the worker's memory per "
                                                           "running and per charged job")] = 10_000,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/sizing.json"),
) -> None:
    """What a cluster asks of the pipeline per node-hour (messages, bytes, blocks, archive growth,
    worker state per job, at 10,000 jobs, and once settled), from a full simulated cluster, scaled
    to the cluster sizes given."""
    from nodeshare.bench.sizing import run_sizing_bench

    sizes = tuple(comma_numbers(clusters, int, "--clusters"))
    if min(sizes) < 1:
        raise typer.BadParameter("cluster sizes are node counts, at least 1", param_hint="--clusters")
    with progress_bar() as bar:
        task = bar.add_task("simulated seconds", total=round(hours * 3600))
        result = run_sizing_bench(nodes=nodes, hours=hours, clusters=sizes, fold_blocks_per_s=fold_blocks_per_s,
                                  audit_samples_per_s=audit_samples_per_s, ledger_windows_per_s=ledger_windows_per_s,
                                  progress=lambda t, _total: bar.update(task, completed=round(t)),
                                  jobs_at_scale=jobs_at_scale)
    write_bench("sizing", result, out_file)


@bench_app.command("broker-acks")
def bench_broker_acks(
    records: Annotated[int, typer.Option(min=100, help="numbered records sent; the broker is killed after half")]
    = 4000,
    workdir: Annotated[Path | None, typer.Option(help="the broker's storage and log (default: a new temporary "
                                                      "directory, kept)")] = None,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/broker-acks.json"),
) -> None:
    """Whether the bundled broker on durable storage (`nodeshare broker --data`) keeps every record
    it acknowledged when it is SIGKILLed mid-write and restarted on the same storage."""
    from nodeshare.bench.broker_acks import run_broker_acks

    with progress_bar() as bar:
        task = bar.add_task("records sent", total=records)
        result = run_broker_acks(records, workdir, progress=lambda n, _total: bar.update(task, completed=n))
    write_bench("broker-acks", result, out_file, {"acknowledged_but_lost": ("<=", 0), "duplicates": ("<=", 0)})
