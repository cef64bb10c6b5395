"""The ``nodeshare`` command line."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nodeshare import __version__

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="nodeshare: fair, measured and safe node sharing for HPC clusters.")
topics_app = typer.Typer(no_args_is_help=True, help="The topic catalog on the broker.")
schemas_app = typer.Typer(no_args_is_help=True, help="The record contract as JSON Schema.")
sink_app = typer.Typer(no_args_is_help=True, help="Run a sink in the foreground.")
archive_app = typer.Typer(no_args_is_help=True, help="Archive housekeeping.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print numbers and write them to a JSON file.")
config_app = typer.Typer(no_args_is_help=True, help="The effective configuration.")
experiment_app = typer.Typer(no_args_is_help=True, help="Experiments of the source papers: JSON and a PNG plot.")
decisions_app = typer.Typer(no_args_is_help=True, help="Decision topics, as a scheduler sees them.")
app.add_typer(config_app, name="config")
app.add_typer(topics_app, name="topics")
app.add_typer(schemas_app, name="schemas")
app.add_typer(sink_app, name="sink")
app.add_typer(bench_app, name="bench")
app.add_typer(archive_app, name="archive")
app.add_typer(experiment_app, name="experiment")
app.add_typer(decisions_app, name="decisions")

out = Console()
if not out.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    out = Console(width=140)
err = Console(stderr=True, soft_wrap=True)  # one line per message: greppable


@app.callback()
def _global_options(
    config: Annotated[Path | None, typer.Option(
        "--config", help="TOML configuration file (default: NODESHARE_CONFIG); environment variables win over it",
        dir_okay=False)] = None,
) -> None:
    from nodeshare.config import CONFIG_FILE

    CONFIG_FILE.set(config)  # None: fall back to NODESHARE_CONFIG


def _settings(**overrides: Any) -> Any:
    from nodeshare.config import Settings, config_file

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        where = f" or '{field}' in {config_file()}" if config_file() else ""
        err.print(f"[red]configuration error[/red]: NODESHARE_{field.upper().replace('.', '_')}{where}: "
                  f"{first['msg']}")
        raise typer.Exit(2) from None
    except (FileNotFoundError, ValueError) as exc:  # a missing or malformed TOML file
        err.print(f"[red]configuration error[/red]: {exc}")
        raise typer.Exit(2) from None


def _require_bootstrap(settings: Any) -> None:
    if not settings.bootstrap:
        err.print("[red]no broker[/red]: pass --bootstrap or set NODESHARE_BOOTSTRAP "
                  "(or run `nodeshare broker` to start the bundled one)")
        raise typer.Exit(2)


Bootstrap = Annotated[str | None, typer.Option(help="Kafka bootstrap servers (default: NODESHARE_BOOTSTRAP)")]
FullJson = Annotated[bool, typer.Option("--json", help="print the full result as JSON")]


def _progress() -> Progress:
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False)


@config_app.command("show")
def config_show(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """Print the effective configuration (defaults < config file < environment), secrets masked."""
    from nodeshare.config import config_file

    data = _settings().masked()
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    table = Table(title=f"Effective configuration (file: {config_file() or 'none'})")
    table.add_column("key")
    table.add_column("value")
    for k, v in data.items():
        table.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    out.print(table)


@app.command()
def version() -> None:
    """Print the version."""
    out.print(__version__)


EngineOpt = Annotated[str, typer.Option(
    "--engine", help="calibrated: the workload library with per-socket contention; simple: four toy programs")]
TraceOpt = Annotated[Path | None, typer.Option(
    "--trace", help="Standard Workload Format trace: the first --jobs usable jobs arrive as it says",
    exists=True, dir_okay=False)]
ProfilesOpt = Annotated[Path | None, typer.Option(
    "--profiles", help="CSV shaped like llc_profiles_spec.csv: jobs run these programs", exists=True,
    dir_okay=False)]
TimeScaleOpt = Annotated[float, typer.Option("--time-scale", min=1e-6,
                                             help="multiply the trace's run and submit times by this")]


def _cluster_choice(settings: Any, **choice: Any) -> Any:
    from nodeshare.scenarios import ClusterChoice, ScenarioError

    try:
        picked = ClusterChoice.from_settings(settings, **choice)
        if picked.engine == "calibrated":
            _ = picked.calibrated  # a bad trace or profile file fails here, before any broker starts
        return picked
    except ScenarioError as exc:
        err.print(f"[red]bad simulation choice[/red]: {exc}")
        raise typer.Exit(2) from None


@app.command()
def demo(
    nodes: Annotated[int, typer.Option(min=1, help="simulated nodes")] = 6,
    jobs: Annotated[int, typer.Option(min=1, help="simulated jobs")] = 12,
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    engine: EngineOpt = "calibrated",
    trace: TraceOpt = None,
    profiles: ProfilesOpt = None,
    time_scale: TimeScaleOpt = 1.0,
    out_dir: Annotated[Path, typer.Option("--out", help="where the ledger, archive and logs go")] = Path(
        "nodeshare-demo"),
    timeout: Annotated[float, typer.Option(help="seconds to wait for every charge")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Run the whole pipeline locally: simulator -> broker -> stream worker -> ledger + archive -> audit.

    Uses the bundled Tansu broker unless a bootstrap server is configured.
    """
    from nodeshare.demo import DemoError, run_demo
    from nodeshare.scenarios import source

    settings = _settings(bootstrap=bootstrap)
    choice = _cluster_choice(settings, engine=engine, nodes=nodes, jobs=jobs, seed=seed, trace=trace,
                             profiles=profiles, time_scale=time_scale)
    tasks: dict[str, Any] = {}
    with _progress() as bar:
        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        try:
            result = run_demo(settings, source(choice), out_dir, timeout_s=timeout, progress=progress)
        except DemoError as exc:
            err.print(f"[red]demo failed[/red]: {exc}")
            raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        _print_charges(result.charges)
        d = result.as_dict()
        out.print(f"\n{d['jobs_ended']} jobs ended, {d['charges']} charges; "
                  f"standard price {d['total_standard_price']:.4f} SU, charged {d['total_price']:.4f} SU, "
                  f"co-location dividend {d['total_dividend']:.4f} SU")
        verdict = "[green]0 mismatches[/green]" if result.audit.ok else (
            f"[red]{d['audit_mismatches']} mismatches[/red]")
        out.print(f"audit: {result.audit.charges_checked} charges recomputed from "
                  f"{result.audit.events_read} archived events, {verdict}")
        out.print(f"ledger:  {result.ledger}\narchive: {result.archive}\ntruth:   {result.truth}  "
                  f"(ground truth, never read by pricing)\nbroker:  {result.broker} at {result.bootstrap}; "
                  f"{result.elapsed_s:.1f} s")
    if not result.audit.ok:
        raise typer.Exit(1)


def _print_charges(charges: list[Any]) -> None:
    table = Table(title="Charges (service units; L = rate per core-hour)")
    for col in ("job", "user", "account", "program", "cores", "T_co s", "paused s", "D", "blocks used/all",
                "SOP", "price", "dividend"):
        table.add_column(col, justify="left" if col in ("job", "user", "account", "program") else "right")
    for c in sorted(charges, key=lambda c: (c.job_id, c.revision)):
        d = f"{c.degradation:.3f}" if c.estimate_status.value == "ok" else f"0 ({c.estimate_status.value})"
        table.add_row(c.job_id, c.user, c.account, c.program, str(c.cores), f"{c.run_time_s:.1f}",
                      f"{c.pause_credit_s:.2f}", d,
                      f"{c.blocks_used}/{c.blocks_used + c.blocks_rejected}",
                      f"{c.standard_price:.4f}", f"{c.price:.4f}", f"{c.dividend:.4f}")
    out.print(table)


@app.command()
def broker(port: Annotated[int | None, typer.Option(help="port on 127.0.0.1 (default: a free one)")] = None) -> None:
    """Run the bundled Tansu broker in the foreground (in-memory storage) until Ctrl-C."""
    from nodeshare.deploy.broker import BundledBroker

    with BundledBroker(port=port) as b:
        out.print(f"Tansu broker on {b.bootstrap} (pid {b.pid}); export NODESHARE_BOOTSTRAP={b.bootstrap}")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()


@topics_app.command("create")
def topics_create(bootstrap: Bootstrap = None) -> None:
    """Create every catalog topic that is missing (safe to run again)."""
    from nodeshare.deploy.topics import create_topics

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    for name, status in sorted(create_topics(settings).items()):
        out.print(f"{status:8} {name}")


@topics_app.command("describe")
def topics_describe(bootstrap: Bootstrap = None) -> None:
    """The catalog's topics as the broker has them: present, partitions, cleanup policy."""
    from nodeshare.sinks.inspect import describe_topics

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    table = Table(title=f"Topics on {settings.bootstrap}")
    for col in ("topic", "exists", "partitions", "cleanup.policy", "expected"):
        table.add_column(col)
    for t in describe_topics(settings):
        policy = t.cleanup_policy or "(not reported)"
        flag = "" if t.cleanup_policy in (None, t.expected_cleanup_policy) else " [red](differs)[/red]"
        table.add_row(t.name, "yes" if t.exists else "[red]missing[/red]", str(t.partitions or "-"),
                      policy + flag, t.expected_cleanup_policy)
    out.print(table)


dlq_app = typer.Typer(no_args_is_help=True, help="The dead-letter topic.")
app.add_typer(dlq_app, name="dlq")


@dlq_app.command("show")
def dlq_show(
    first: Annotated[int, typer.Option(min=0, help="how many records to show")] = 10,
    idle: Annotated[float, typer.Option(help="stop after the topic has been quiet this many seconds")] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Dead letters by reason and origin, and the first records with their bytes."""
    from nodeshare.sinks.inspect import preview, read_dead_letters

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    summary = read_dead_letters(settings, first=first, idle_s=idle)
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
        return
    out.print(f"{summary.total} dead letters on {settings.topic('dlq')}"
              + (f" ({summary.undecodable} not readable as dead letters)" if summary.undecodable else ""))
    reasons = Table(title="By reason")
    reasons.add_column("count", justify="right")
    reasons.add_column("reason")
    for reason, n in summary.by_reason.most_common():
        reasons.add_row(str(n), reason)
    out.print(reasons)
    records = Table(title=f"First {len(summary.first)}")
    for col in ("origin", "reason", "field", "bytes"):
        records.add_column(col)
    for d in summary.first:
        records.add_row(f"{d.origin_topic}[{d.origin_partition}]@{d.origin_offset}", d.reason, d.field or "",
                        preview(d.value_b64))
    out.print(records)


@topics_app.command("list")
def topics_list() -> None:
    """Print the topic catalog."""
    from nodeshare.schemas import TOPICS

    settings = _settings()
    table = Table(title="Topics")
    for col in ("topic", "key", "value", "partitions", "cleanup", "role", "what"):
        table.add_column(col)
    for t in TOPICS:
        value = " | ".join(r.__name__ for r in t.record_types)
        table.add_row(settings.topic(t.name), t.key_field, value, str(t.partitions or settings.partitions),
                      t.cleanup_policy, t.role.value, t.description)
    out.print(table)


@schemas_app.command("export")
def schemas_export(
    directory: Annotated[Path | None, typer.Option("--dir", help="target directory")] = None,
) -> None:
    """Write one JSON Schema file per topic (default: the package's schemas/json)."""
    from nodeshare.schemas.jsonschema import export_schemas, schema_dir

    for path in export_schemas(directory or schema_dir()):
        out.print(f"wrote {path}")


@app.command()
def worker(
    datadir: Annotated[Path, typer.Option(help="faust data directory")] = Path(".nodeshare-worker"),
    loglevel: Annotated[str, typer.Option(help="faust log level")] = "warning",
    count_only: Annotated[bool, typer.Option("--count-only", hidden=True,
                                             help="only count node.ipc messages (bench stream's yardstick)")] = False,
) -> None:
    """Run one stream worker (faust) in the foreground."""
    from nodeshare.streams.app import run_worker
    from nodeshare.streams.kafka_security import SecurityConfigError, faust_credentials

    settings = _settings()
    _require_bootstrap(settings)
    try:
        faust_credentials(settings.kafka)  # refuse settings faust cannot honour before connecting at all
    except SecurityConfigError as exc:
        err.print(f"[red]configuration error[/red]: kafka: {exc}")
        raise typer.Exit(2) from None
    run_worker(settings, datadir, loglevel, count_only)


def _run_sink(sink: Any) -> None:
    from nodeshare import logs, metrics

    logs.configure(sink.settings, f"{sink.name}-sink")
    metrics.serve(sink.settings.metrics_port, sink.settings.metrics_addr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sink.run(stop)


@sink_app.command("ledger")
def sink_ledger(ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
                bootstrap: Bootstrap = None) -> None:
    """Consume ledger.charges into the DuckDB ledger (idempotent on job id and revision)."""
    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.sinks.ledger import LedgerSink

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    with EventProducer(settings, client_id="nodeshare-ledger-dlq") as dlq:
        _run_sink(LedgerSink(settings, ledger, dead_letters=dlq))


@sink_app.command("archive")
def sink_archive(archive: Annotated[Path, typer.Option(help="archive root directory")] = Path("archive"),
                 bootstrap: Bootstrap = None) -> None:
    """Consume every input topic into the Parquet archive."""
    from nodeshare.sinks.archive import ArchiveSink

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    _run_sink(ArchiveSink(settings, archive))


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@app.command()
def agent(
    jobs: Annotated[Path | None, typer.Option(
        "--jobs", help="static job file (TOML [[jobs]]: id, pids or command, progress, user, account, program, "
        "cores)", dir_okay=False, exists=True)] = None,
    slurm: Annotated[bool, typer.Option(help="take the jobs from Slurm (scontrol listpids, job cgroups)")] = False,
    node: Annotated[str | None, typer.Option(help="node name (default: the short host name, as Slurm names it)")]
    = None,
    spool: Annotated[Path, typer.Option(help="store-and-forward spool (SQLite)")] = Path(".nodeshare-agent/spool.db"),
    spool_max_mb: Annotated[float, typer.Option(min=1.0, help="spool bound; shutters stop when it is full")] = 256.0,
    progress_dir: Annotated[Path, typer.Option(
        help="application progress counters: <dir>/<job id> unless the job file names one")]
    = Path(".nodeshare-agent/progress"),
    duration: Annotated[float | None, typer.Option(min=0.0, help="stop after this many seconds")] = None,
    until_idle: Annotated[bool, typer.Option(help="stop once every job has ended and the spool is drained")]
    = False,
    hardware_counters: Annotated[bool, typer.Option(help="try perf_event_open before application counters")]
    = True,
    drain_timeout: Annotated[float, typer.Option(
        min=0.0, help="at exit, seconds to wait for the broker to take what is spooled (the rest stays spooled)")]
    = 10.0,
    power_caps: Annotated[bool, typer.Option(
        help="apply decisions.power to this node's processor packages through powercap (needs root); every "
        "limit changed is restored at exit, by the watchdog if the agent is killed")] = False,
    powercap_root: Annotated[Path, typer.Option(help="the kernel's powercap tree")] = Path("/sys/class/powercap"),
    resctrl: Annotated[bool, typer.Option(
        help="give each job the LLC ways and memory bandwidth decisions.placement booked, through resctrl "
        "(needs root and RDT); every group is removed at exit, by the watchdog if the agent is killed")] = False,
    resctrl_root: Annotated[Path, typer.Option(help="where resctrl is mounted")] = Path("/sys/fs/resctrl"),
    mem_bandwidth_gbps: Annotated[float, typer.Option(
        min=0.0, help="this node's memory bandwidth in GB/s, for MBA percentages (0: no MBA)")] = 0.0,
    bootstrap: Bootstrap = None,
) -> None:
    """Run the node agent: POPPA's shutters on this node's real jobs; events go through a local spool."""
    import socket

    from nodeshare import logs, metrics
    from nodeshare.producers.agent.agent import AgentOptions, build
    from nodeshare.producers.agent.jobs import JobFileError
    from nodeshare.producers.agent.processes import Refused
    from nodeshare.producers.agent.resctrl import ResctrlUnavailable
    from nodeshare.producers.agent.watchdog import WatchdogLost

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    node = node or socket.gethostname().split(".")[0]
    logs.configure(settings, "agent", node=node)
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    options = AgentOptions(
        node=node, spool=spool, sample_us=settings.sample_us,
        k=settings.samples_per_region, period_ms=settings.period_ms, spool_max_bytes=int(spool_max_mb * 2**20),
        hardware_counters=hardware_counters, flush=settings.flush_policy(), power_caps=power_caps,
        powercap_root=powercap_root, resctrl=resctrl, resctrl_root=resctrl_root, mem_bandwidth_gbps=mem_bandwidth_gbps)
    try:
        the_agent = build(settings, options, job_file=jobs, slurm=slurm, progress_dir=progress_dir)
    except (ValueError, JobFileError, ResctrlUnavailable) as exc:
        err.print(f"[red]agent[/red]: {exc}")
        raise typer.Exit(2) from None
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwinds through the agent's resume-and-close paths
    try:
        stats = the_agent.run(duration_s=duration, until_idle=until_idle, drain_s=drain_timeout)
    except (Refused, WatchdogLost) as exc:  # nothing is left paused: each shutter resumes before it returns
        err.print(f"[red]agent stopped[/red]: {exc}")
        raise typer.Exit(3) from None
    out.print(f"{stats.cycles} shutter cycles (mean pause {stats.mean_shutter_ms:.2f} ms); "
              f"{stats.skipped_spool_full} skipped with a full spool")


slurm_app = typer.Typer(no_args_is_help=True, help="Job lifecycle from a real Slurm.")
app.add_typer(slurm_app, name="slurm")


@slurm_app.command("install-hooks")
def slurm_install_hooks(
    hooks_dir: Annotated[Path, typer.Option(help="where the hook scripts go (readable by slurmctld)")]
    = Path("/etc/slurm/nodeshare"),
    events_dir: Annotated[Path, typer.Option(help="where the hooks drop one file per event")]
    = Path("/var/spool/nodeshare/slurm-events"),
) -> None:
    """Write the controller hooks (PrologSlurmctld, EpilogSlurmctld, jobcomp/script) and print the
    slurm.conf lines that enable them."""
    from nodeshare.producers.slurm import install_hooks

    try:
        lines = install_hooks(hooks_dir, events_dir)
    except (OSError, ValueError) as exc:
        err.print(f"[red]install-hooks[/red]: {exc}")
        raise typer.Exit(2) from None
    err.print(f"hooks written to {hooks_dir}; add to slurm.conf and run `scontrol reconfigure`:")
    for key, value in lines.items():
        out.print(f"{key}={value}", highlight=False)


@slurm_app.command("source")
def slurm_source(
    events_dir: Annotated[Path, typer.Option(help="the hooks' events directory")]
    = Path("/var/spool/nodeshare/slurm-events"),
    poll: Annotated[float, typer.Option(min=0.1, help="seconds between squeue polls and directory scans")] = 2.0,
    duration: Annotated[float | None, typer.Option(min=0.0, help="stop after this many seconds")] = None,
    terminal_from_epilog: Annotated[bool, typer.Option(
        help="take job ends from EpilogSlurmctld (when jobcomp/script is not configured)")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Publish Slurm job lifecycle events (hooks and squeue) to jobs.lifecycle."""
    import time

    from nodeshare import logs
    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.producers.slurm import SlurmCommands, SlurmSource, run_source

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    logs.configure(settings, "slurm-source")
    if not events_dir.is_dir():
        err.print(f"[red]slurm source[/red]: no events directory {events_dir}: run `nodeshare slurm install-hooks`")
        raise typer.Exit(2)
    commands = SlurmCommands()
    source = SlurmSource(events_dir, commands, commands.cluster_name(), terminal_from_epilog)
    end = None if duration is None else time.monotonic() + duration
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with EventProducer(settings, client_id="nodeshare-slurm") as producer:
        def publish(events: list[Any]) -> None:
            producer.send_all(events)
            producer.flush(30)

        sent = run_source(source, publish, poll_s=poll, stop=lambda: end is not None and time.monotonic() > end)
    out.print(f"published {sent} lifecycle events")


@slurm_app.command("scheduler")
def slurm_scheduler(
    llc_ways: Annotated[int, typer.Option(min=1, help="LLC ways of each node's processors (Slurm does not know)")]
    = 11,
    mem_bandwidth_gbps: Annotated[float, typer.Option(
        min=0.1, help="memory bandwidth of each node, GB/s (Slurm does not know)")] = 50.0,
    duration: Annotated[float | None, typer.Option(min=0.0, help="stop after this many seconds")] = None,
    bootstrap: Bootstrap = None,
) -> None:
    """Apply decisions.placement to Slurm: held jobs are pinned to the decided nodes and released.

    Submit jobs held (sbatch --hold or a job_submit rule); publishes Slurm's nodes on
    cluster.inventory first. While it is down, jobs stay held and no decision is lost."""
    import threading

    from nodeshare import logs, metrics
    from nodeshare.producers.slurm_scheduler import SchedulerCommands, run_scheduler

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    logs.configure(settings, "slurm-scheduler")
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    stop = threading.Event()
    if duration is not None:
        threading.Timer(duration, stop.set).start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        done = run_scheduler(settings, SchedulerCommands(), stop, llc_ways=llc_ways,
                             mem_bandwidth_gbps=mem_bandwidth_gbps)
    except RuntimeError as exc:  # a Slurm command failed (not reachable, not allowed)
        err.print(f"[red]slurm scheduler[/red]: {exc}")
        raise typer.Exit(3) from None
    out.print(", ".join(f"{n} {k.replace('_', ' ')}" for k, n in done.outcomes.items()))


@app.command()
def workload(
    kind: Annotated[str, typer.Option(help="stream (memory-bound) or compute (cache-resident)")] = "stream",
    seconds: Annotated[float, typer.Option(min=0.0)] = 10.0,
    progress: Annotated[Path | None, typer.Option(
        help="counter file (default: $NODESHARE_PROGRESS_FILE, or $NODESHARE_PROGRESS_DIR/$SLURM_JOB_ID)")] = None,
) -> None:
    """A real workload that counts its progress for the agent (to try shutters without an instrumented code)."""
    from nodeshare.producers.agent.workload import progress_path, run

    try:
        done = run(kind, seconds, progress_path(progress))
    except ValueError as exc:
        err.print(f"[red]workload[/red]: {exc}")
        raise typer.Exit(2) from None
    out.print(f"{done} units of {kind} work in {seconds:g} s")


@app.command()
def simulate(
    nodes: Annotated[int, typer.Option(min=1)] = 6,
    jobs: Annotated[int, typer.Option(min=1, help="jobs (with --trace: the first this many of the trace)")] = 12,
    seed: int = 7,
    engine: EngineOpt = "calibrated",
    trace: TraceOpt = None,
    profiles: ProfilesOpt = None,
    time_scale: TimeScaleOpt = 1.0,
    hours: Annotated[float | None, typer.Option(
        min=0.0, help="stop after this much simulated time (default: when the last job ends)")] = None,
    truth: Annotated[Path, typer.Option(help="where the ground truth goes")] = Path("truth.parquet"),
    bootstrap: Bootstrap = None,
) -> None:
    """Simulate a cluster and publish its events to the broker as they are made; ground truth goes to a file."""
    from nodeshare.demo import write_truth
    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.scenarios import stream

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    choice = _cluster_choice(settings, engine=engine, nodes=nodes, jobs=jobs, seed=seed, trace=trace,
                             profiles=profiles, time_scale=time_scale)
    until = hours * 3600.0 if hours is not None else None
    with _progress() as bar, EventProducer(settings, client_id="nodeshare-simulator") as producer:
        # with a horizon the bar counts simulated seconds, else the jobs that ended
        task = bar.add_task("simulated seconds" if until else "jobs ended", total=until)

        def progress(t: float, done: int, total: int) -> None:
            bar.update(task, completed=int(t) if until else done, total=until or total)

        ended, sent = stream(choice, producer.send_all, until_s=until, progress=progress)
    write_truth(ended, truth)
    out.print(f"published {sent} events; {len(ended)} jobs ended; truth in {truth}")


@app.command()
def replay(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    bootstrap: Bootstrap = None,
    topic_prefix: Annotated[str | None, typer.Option(help="prefix of the fresh target topics")] = None,
) -> None:
    """Re-publish the archive into a broker (original partition, order, key, bytes and timestamp),
    creating the target topics first. Run a worker and sinks on them to rebuild every state."""
    from nodeshare.deploy.topics import create_topics
    from nodeshare.producers.replay import ReplayError
    from nodeshare.producers.replay import replay as run_replay

    settings = _settings(bootstrap=bootstrap, topic_prefix=topic_prefix)
    _require_bootstrap(settings)
    create_topics(settings)
    with _progress() as bar:
        task = bar.add_task("replaying", total=None)
        try:
            result = run_replay(archive, settings, progress=lambda done, total: bar.update(
                task, completed=done, total=total))
        except ReplayError as exc:
            err.print(f"[red]replay failed[/red]: {exc}")
            raise typer.Exit(2) from None
    for topic, n in sorted(result.per_topic.items()):
        out.print(f"{n:>10} {settings.topic(topic)}")
    out.print(f"replayed {result.events} events")


@app.command()
def audit(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    workers: Annotated[int | None, typer.Option(
        min=1, help="recompute on a local Dask cluster of this many processes, one task per archive partition")]
    = None,
    scheduler: Annotated[str | None, typer.Option(
        help="recompute on this Dask scheduler (tcp://host:8786), e.g. workers started as Slurm jobs by "
        "dask-jobqueue; the archive and the ledger must be reachable from its workers")] = None,
) -> None:
    """Verify the ledger's hash chain and conservation, recompute every charge from the archive and
    compare. Exit 1 on any failure."""
    from nodeshare.sinks.audit import audit as run_audit
    from nodeshare.sinks.audit import dask_client

    settings = _settings()
    if workers is not None and scheduler is not None:
        err.print("[red]audit[/red]: --workers starts a local cluster, --scheduler uses one: give one of them")
        raise typer.Exit(2)
    try:
        with dask_client(workers, scheduler) as client, _progress() as bar:
            task = bar.add_task("partitions audited", total=None, visible=client is not None)

            def progress(done: int, total: int, samples: int) -> None:
                bar.update(task, completed=done, total=total,
                           description=f"partitions ({samples / 1e6:.1f} M samples)")
            report = run_audit(archive.resolve(), ledger.resolve(), settings.policy(), client=client,
                               progress=progress)
    except FileNotFoundError as exc:
        err.print(f"[red]audit failed[/red]: {exc}")
        raise typer.Exit(2) from None
    except (OSError, TimeoutError) as exc:  # connecting to the Dask scheduler
        err.print(f"[red]audit failed[/red]: the Dask cluster is not reachable ({scheduler or 'local'}): {exc}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        out.print(f"{report.charges_checked} charges checked against {report.events_read} archived events: "
                  f"{report.matches} match, {len(report.mismatches)} mismatches, "
                  f"{len(report.missing_in_ledger)} missing from the ledger")
        for m in report.mismatches[:20]:
            out.print(f"  {m.job_id}#{m.revision} {m.field}: ledger {m.ledger!r} != recomputed {m.recomputed!r}")
        out.print("hash chain: " + ("intact" if report.chain_ok else f"[red]broken[/red]: {report.chain_error}"))
        out.print("conservation (SOP = charged + dividend, 0 <= price <= SOP): "
                  + ("holds" if report.conservation_ok else "[red]violated[/red]"))
        for v in report.conservation_violations[:20]:
            out.print(f"  {v}")
    if not report.ok:
        raise typer.Exit(1)


def _split(values: list[str] | None) -> list[str]:
    return [v for item in values or [] for v in item.split(",") if v]


def _print_machine_readable(header: Any, rows: list[Any], as_json: bool, parsable: bool,
                            noheader: bool = False) -> bool:
    """--json (a list of objects) or --parsable2 ('|'-separated, like sacct); False when neither."""
    from nodeshare.sinks.usage import parsable2

    if as_json:
        print(json.dumps([dict(zip(header, r, strict=True)) for r in rows], indent=2, default=str))
    elif parsable:
        print(parsable2(header, rows, noheader=noheader))
    return as_json or parsable


@app.command()
def charges(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    user: Annotated[list[str] | None, typer.Option("--user", "-u", help="user(s), comma-separated")] = None,
    account: Annotated[list[str] | None, typer.Option("--account", "-A", help="account(s), comma-separated")] = None,
    starttime: Annotated[str | None, typer.Option("--starttime", "-S", help="YYYY-MM-DD[THH:MM[:SS]] (UTC)")] = None,
    endtime: Annotated[str | None, typer.Option("--endtime", "-E", help="YYYY-MM-DD[THH:MM[:SS]] (UTC)")] = None,
    fmt: Annotated[str, typer.Option("--format", "-o", help="comma-separated columns")] = "",
    parsable: Annotated[bool, typer.Option("--parsable2", "-P", help="'|'-separated, no trailing delimiter")] = False,
    noheader: Annotated[bool, typer.Option("--noheader", "-n", help="no header line")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON list of objects")] = False,
    all_revisions: Annotated[bool, typer.Option(help="include superseded revisions")] = False,
) -> None:
    """Charged jobs, like sacct: jobs that ran at any moment between --starttime and --endtime."""
    from nodeshare.sinks.usage import CHARGE_COLUMNS, DEFAULT_FORMAT, QueryError, parse_time, render_value
    from nodeshare.sinks.usage import charges as query

    try:
        header, rows = query(
            ledger, users=_split(user), accounts=_split(account),
            start=parse_time(starttime) if starttime else None, end=parse_time(endtime) if endtime else None,
            fmt=fmt or DEFAULT_FORMAT, all_revisions=all_revisions)
    except (QueryError, FileNotFoundError) as exc:
        err.print(f"[red]charges[/red]: {exc}  (columns: {', '.join(CHARGE_COLUMNS)})")
        raise typer.Exit(2) from None
    if not _print_machine_readable(header, rows, as_json, parsable, noheader):
        table = Table(show_header=not noheader, box=None)
        for c in header:
            table.add_column(c, justify="left" if c in ("JobID", "User", "Account", "Program", "State") else "right")
        for r in rows:
            table.add_row(*(render_value(c, v) for c, v in zip(header, r, strict=True)))
        out.print(table)


@app.command("report-usage")
def report_usage(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
    starttime: Annotated[str | None, typer.Option("--starttime", "-S", help="jobs that ended from (UTC)")] = None,
    endtime: Annotated[str | None, typer.Option("--endtime", "-E", help="jobs that ended before (UTC)")] = None,
    parsable: Annotated[bool, typer.Option("--parsable2", "-P", help="'|'-separated, no trailing delimiter")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON list of objects")] = False,
) -> None:
    """Standard price, charged and dividend by account and user, like
    `sreport cluster AccountUtilizationByUser` (an account's total first, then its users)."""
    from nodeshare.sinks.usage import USAGE_COLUMNS, QueryError, parse_time, usage_by_account

    try:
        rows = usage_by_account(ledger, parse_time(starttime) if starttime else None,
                                parse_time(endtime) if endtime else None)
    except (QueryError, FileNotFoundError) as exc:
        err.print(f"[red]report-usage[/red]: {exc}")
        raise typer.Exit(2) from None
    if not _print_machine_readable(USAGE_COLUMNS, rows, as_json, parsable):
        table = Table(title="Usage by account and user (SU)", box=None)
        for c in USAGE_COLUMNS:
            table.add_column(c, justify="left" if c in ("Account", "Login") else "right")
        for r in rows:
            table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r))
        out.print(table)


@app.command()
def report(
    ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory for the PNG files and index.html")],
    archive: Annotated[Path | None, typer.Option(help="archive root (for the program-pair heatmap)")] = None,
    truth: Annotated[Path | None, typer.Option(help="ground-truth parquet of a simulation (oracle prices)")] = None,
) -> None:
    """PNG plots and one HTML page: prices per program (with the oracle when truth exists),
    degradation by program pair, dividend per account over time, estimator confidence."""
    from nodeshare.sinks.report import build_report

    try:
        files = build_report(ledger, archive, out_dir, truth)
    except (FileNotFoundError, ValueError) as exc:
        err.print(f"[red]report failed[/red]: {exc}")
        raise typer.Exit(2) from None
    for p in (files.html, *files.pngs):
        out.print(f"wrote {p}")


@archive_app.command("compact")
def archive_compact(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    min_rows: Annotated[int, typer.Option(min=1, help="merge until a file holds this many rows")] = 100_000,
) -> None:
    """Merge small archive files into large ones with scan-sized row groups (safe while the sink runs)."""
    from nodeshare.sinks.archive import ParquetArchive

    before, after = ParquetArchive(archive).compact(min_rows=min_rows)
    out.print(f"{before} files -> {after} files")


@archive_app.command("prune")
def archive_prune(
    archive: Annotated[Path, typer.Option(help="archive root directory")],
    before: Annotated[str, typer.Option(help="remove the events of every date before this one (YYYY-MM-DD, UTC)")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go, remove nothing")] = False,
) -> None:
    """Retention: remove archived events of whole dates. Charges computed from removed events stay
    in the ledger; the audit then checks their hash chain and conservation, and counts them as
    beyond retention instead of recomputing them."""
    from datetime import date

    from nodeshare.sinks.archive import ParquetArchive

    try:
        cutoff = date.fromisoformat(before)
    except ValueError:
        err.print(f"[red]--before[/red]: {before!r} is not a date (YYYY-MM-DD)")
        raise typer.Exit(2) from None
    if not archive.is_dir():
        err.print(f"[red]no archive at[/red] {archive}")
        raise typer.Exit(2)
    pruned = ParquetArchive(archive).prune(cutoff, dry_run=dry_run)
    span = f"{pruned.dates[0]} .. {pruned.dates[-1]}" if pruned.dates else "none"
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {pruned.events:,} events in {pruned.files} files (dates {span})")


@bench_app.command("audit")
def bench_audit(
    blocks: Annotated[int, typer.Option(min=1000, help="about this many shutter blocks in the simulated archive")
                      ] = 1_000_000,
    workdir: Annotated[Path, typer.Option(help="where the simulated archive is written")] = Path("bench"),
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/audit.json"),
    rounds: Annotated[int, typer.Option(min=1, help="alternating rounds of scan and audit (about 1.2 s each at "
                                                    "1 M blocks; the noisier the machine, the more)")] = 11,
    workers: Annotated[str, typer.Option(
        help="also time the audit as one Dask task per partition on local clusters of these many worker "
        "processes, e.g. 1,2 ('' for none)")] = "1,2",
) -> None:
    """Samples per second the vectorized audit recomputes from a large archive made by the calibrated
    simulator, and its ratio to a plain DuckDB scan of the same files (medians over alternating rounds)."""
    from nodeshare.sinks.bench_audit import as_json, run_audit_bench

    try:
        counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        err.print(f"[red]bench audit[/red]: --workers takes numbers separated by commas, got {workers!r}")
        raise typer.Exit(2) from None
    with _progress() as bar:
        task = bar.add_task("simulating the cluster", total=blocks)
        result = run_audit_bench(workdir, blocks, rounds, progress=lambda done: bar.update(
            task, completed=min(done, blocks)), workers=counts)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(as_json(result) + "\n")
    out.print(as_json(result))
    out.print(f"wrote {out_file}")


def _experiment_out(result: dict[str, Any], as_json: bool, png: Path, plot: Any, summary: list[str]) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(result, png)
    if as_json:
        out.print_json(json.dumps(result))
    else:
        for line in summary:
            out.print(line)
    err.print(f"wrote {png}")


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
    _experiment_out(r, as_json, png, plot_ptune, [
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
    from nodeshare.streams.power.ppartition import PowerPolicy

    if admit not in ("fair", "throughput"):
        raise typer.BadParameter("must be 'fair' or 'throughput'", param_hint="--admit")
    policy = PowerPolicy(admit=cast(Literal["fair", "throughput"], admit))
    r = run(seed=seed, processors=processors, budget_w=budget_watts, policy=policy)
    gains = ", ".join(f"{s['throughput_gain_pct']:+.1f}% vs uniform {s['cap_watts']:.0f} W ({s['jobs_scheduled']} jobs)"
                      for s in r["uniform"].values())
    _experiment_out(r, as_json, png, plot_ppartition, [
        f"{r['jobs_scheduled']} of {r['queue']['jobs']} jobs started on {r['processors_used']} processors at "
        f"{r['allocated_watts']:.0f} W (admit={admit}); uniform Pm/c/Nmax: {r['jobs_scheduled_uniform']} jobs",
        f"throughput: {gains}"])


@bench_app.command("ledger")
def bench_ledger(
    windows: Annotated[int, typer.Option(min=1000, help="shutter windows to count")] = 100_000,
    nodes: Annotated[int, typer.Option(min=1, help="nodes they come from")] = 1_000,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/ledger.json"),
) -> None:
    """Shutter windows per second the ledger sink decodes and counts into its co-runner table."""
    from nodeshare.sinks.bench_ledger import run_ledger_bench

    _write_bench(run_ledger_bench(windows=windows, nodes=nodes), out_file)


@bench_app.command("power")
def bench_power(
    repeats: Annotated[int, typer.Option(min=3, help="runs per measurement (median)")] = 15,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/power.json"),
) -> None:
    """PTune over 550 processors and one PPartition dispatch across 100 running jobs (median ms)."""
    from nodeshare.experiments.power import bench_power as run

    result = run(repeats=repeats)
    _write_bench(result, out_file)


def _write_bench(result: dict[str, Any], out_file: Path) -> None:
    """A benchmark's numbers: printed, and written to its JSON file."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    out.print_json(json.dumps(result))
    out.print(f"wrote {out_file}")


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
    from nodeshare.bench_stream import as_dict, run_stream_bench

    settings = _settings(bootstrap=bootstrap)
    with _progress() as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        result = run_stream_bench(settings, workdir, blocks=blocks, rate=rate, seconds=seconds,
                                  per_message=per_message, job_ends=job_ends, progress=progress)
    _write_bench(as_dict(result), out_file)


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
    from nodeshare.deploy.broker import broker_for
    from nodeshare.producers.agent.overhead import measure

    settings = _settings(bootstrap=bootstrap)
    with broker_for(settings.bootstrap) as where, _progress() as bar:
        task = bar.add_task("slot pairs", total=slots)
        env = {**settings.model_copy(update={"bootstrap": where}).as_env(), "NODESHARE_CONFIG": ""}
        result = measure(env, jobs=jobs, seconds=seconds, slots=slots,
                         progress=lambda done, total: bar.update(task, completed=done))
    _write_bench(result, out_file)


@bench_app.command("placement")
def bench_placement(
    repeats: Annotated[int, typer.Option(min=3, help="runs per measurement (median)")] = 5,
    greedy_jobs: Annotated[int, typer.Option(min=2, help="queue size for greedy pairing")] = 1000,
    blossom_jobs: Annotated[int, typer.Option(min=2, help="queue size for blossom matching")] = 200,
    predict_jobs: Annotated[int, typer.Option(min=2, help="queue size for predicting every pair")] = 50,
    out_file: Annotated[Path, typer.Option("--out", help="JSON result file")] = Path("bench/placement.json"),
) -> None:
    """Greedy pairing of 1,000 jobs, blossom matching of 200, predicting all pairs of 50 (median ms)."""
    from nodeshare.experiments.pairing import bench_placement as run

    result = run(repeats=repeats, greedy_jobs=greedy_jobs, blossom_jobs=blossom_jobs, predict_jobs=predict_jobs)
    _write_bench(result, out_file)


def _library(profiles: Path | None) -> Any:
    from nodeshare.producers.workloads import BUILTIN, load_profiles

    if profiles is None:
        return BUILTIN
    try:
        return {**BUILTIN, **load_profiles(profiles)}
    except (OSError, ValueError) as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None


def _programs(names: str | None, library: Any, profiles: Path | None = None) -> Any:
    """The programs to pair: the names given, POPPA's twelve by default, or ``all``: every program
    of the profiles file (every program of the library without one)."""
    from nodeshare.producers.workloads import BUILTIN, PAIRWISE

    if names is not None and names.strip() == "all":
        return tuple(n for n in library if profiles is None or n not in BUILTIN or n in _profile_names(profiles))
    chosen = tuple(n.strip() for n in names.split(",") if n.strip()) if names else PAIRWISE
    unknown = [n for n in chosen if n not in library]
    if unknown or len(chosen) < 2:
        err.print(f"error: --programs needs two or more of the library's programs; unknown: {unknown}; "
                  f"known: {', '.join(sorted(library))}")
        raise typer.Exit(2)
    return chosen


def _profile_names(profiles: Path) -> set[str]:
    from nodeshare.producers.workloads import load_profiles

    return set(load_profiles(profiles))


Profiles = Annotated[Path | None, typer.Option(
    help="a CSV shaped like llc_profiles_spec.csv: its programs join the built-in library", exists=True,
    dir_okay=False)]
Programs = Annotated[str | None, typer.Option(
    help="comma-separated programs to pair, or 'all': every program of --profiles (default: POPPA's twelve)")]
SampleUs = Annotated[int, typer.Option("--sample-us", min=1, help="shutter sample length S (us)")]
PeriodMs = Annotated[int, typer.Option("--period-ms", min=0, help="shutter period P (ms)")]
EstimatorOpt = Annotated[str, typer.Option(
    "--estimator", help="the degradation estimate charges apply: refill_corrected, poppa_alg4 or unfiltered")]


def _estimator(name: str) -> str:
    from nodeshare.streams.degradation import ESTIMATORS

    if name not in ESTIMATORS:
        err.print(f"error: unknown estimator {name!r}; known: {', '.join(ESTIMATORS)}")
        raise typer.Exit(2)
    return name


@experiment_app.command("pairwise")
def experiment_pairwise(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/pairwise.png"),
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    iterations: Annotated[int, typer.Option(min=1, help="runs each program completes next to its co-runner")] = 5,
    profiles: Profiles = None,
    programs: Programs = None,
    sample_us: SampleUs = 3200,
    period_ms: PeriodMs = 200,
    estimator: EstimatorOpt = "refill_corrected",
) -> None:
    """Every pair co-located as in Seed 002 Section 7 on the calibrated simulator, charged by the
    stream worker's fold: Fig. 10 (run-time prediction error % per estimator) and Fig. 11 (degradation %)."""
    from nodeshare.experiments.poppa import experiment_pairwise as run
    from nodeshare.experiments.poppa import plot_pairwise

    lib = _library(profiles)
    with _progress() as bar:
        bar.add_task("simulating and charging", total=None)
        r = run(seed=seed, iterations=iterations, programs=_programs(programs, lib, profiles), library=lib,
                sample_us=sample_us, period_ms=period_ms, estimator=_estimator(estimator))
    est = r["estimators"]
    _experiment_out(r, as_json, png, plot_pairwise, [
        f"{r['pairs']} pairs, {r['runs']} completed runs; mean true degradation {r['mean_degradation_pct']:.1f}%",
        *(f"{name:17s} MAE {s['mae_pct']:.2f}%  max |err| {s['max_abs_err_pct']:.2f}%  bias {s['bias_pct']:+.2f}%  "
          f"pairs above 6%: {s['pairs_above_6_pct']}  worst {s['worst'][0]['job']} next to "
          f"{s['worst'][0]['co_runner']}" for name, s in est.items()),
        f"worst ten ({r['estimator']}): " + ", ".join(f"{w['job']}/{w['co_runner']} {w['err_pct']:+.1f}"
                                                      for w in est[r['estimator']]['worst']),
        f"applied estimator: {r['estimator']}"])


@experiment_app.command("pricing")
def experiment_pricing(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/pricing.png"),
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    iterations: Annotated[int, typer.Option(min=1, help="runs each program completes next to its co-runner")] = 5,
    profiles: Profiles = None,
    programs: Programs = None,
    sample_us: SampleUs = 3200,
    period_ms: PeriodMs = 200,
    estimator: EstimatorOpt = "refill_corrected",
) -> None:
    """Seed 002 Fig. 12: prices relative to the solo baseline under SOP, POPPA (the ledger's
    charge) and the oracle, for every (program, co-runner)."""
    from nodeshare.experiments.poppa import experiment_pricing as run
    from nodeshare.experiments.poppa import plot_pricing

    lib = _library(profiles)
    with _progress() as bar:
        bar.add_task("simulating and charging", total=None)
        r = run(seed=seed, iterations=iterations, programs=_programs(programs, lib, profiles), library=lib,
                sample_us=sample_us, period_ms=period_ms, estimator=_estimator(estimator))
    _experiment_out(r, as_json, png, plot_pricing, [
        f"{r['jobs']} (program, co-runner) jobs from {r['runs']} runs; price / solo baseline:",
        f"SOP    mean {r['sop_mean']:.4f}  min {r['sop_min']:.4f}  max {r['sop_max']:.4f}",
        f"POPPA  mean {r['poppa_mean']:.4f}  min {r['poppa_min']:.4f}  max {r['poppa_max']:.4f}  ({r['estimator']})",
        f"Oracle mean {r['oracle_mean']:.4f}  min {r['oracle_min']:.4f}  max {r['oracle_max']:.4f}",
        f"POPPA - oracle: {r['poppa_minus_oracle_pp']:+.2f} pp; charged above the baseline: {r['overcharged_jobs']} "
        f"jobs (mean surcharge {r['overcharge_mean_pct']:.2f}%), {r['overcharged_runs']} of {r['runs']} runs"])


@experiment_app.command("pairing")
def experiment_pairing(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/pairing.png"),
    seed: Annotated[int, typer.Option(help="seed of the train/test split and the queues")] = 7,
    queues: Annotated[int, typer.Option(min=1, help="random queues")] = 20,
    jobs: Annotated[int, typer.Option(min=2, help="jobs per queue")] = 50,
    trees: Annotated[int, typer.Option(min=1, help="trees of the Random Forest")] = 200,
    profiles: Profiles = None,
) -> None:
    """Seed 003: a Random Forest predicts pairwise degradation from solo counter profiles; queues
    paired greedily or by blossom matching, makespan against FIFO and FIFO-shared on 1-5 nodes."""
    from nodeshare.experiments.pairing import experiment_pairing as run
    from nodeshare.experiments.pairing import plot_pairing
    from nodeshare.producers.workloads import BUILTIN

    loaded = {k: w for k, w in _library(profiles).items() if k not in BUILTIN}
    with _progress() as bar:
        task = bar.add_task("scheduling queues", total=queues)
        r = run(seed=seed, queues=queues, jobs=jobs, profiles=loaded, trees=trees,
                progress=lambda done, total: bar.update(task, completed=done))
    m = r["makespan_vs_fifo_pct"]
    _experiment_out(r, as_json, png, plot_pairing, [
        f"{len(r['programs'])} programs; Random Forest R2 {r['r2']:.3f} on {r['fit']['test_pairs']} held-out pairs "
        f"(mean abs error {r['fit']['mae_pct_points']:.2f} points)",
        f"makespan vs FIFO over {queues} queues of {jobs} jobs on {r['servers'][0]}-{r['servers'][-1]} nodes: "
        + ", ".join(f"{p} {v:+.1f}%" for p, v in m.items()),
        f"rf_blossom: {r['rf_blossom_pairs']} pairs, {r['rf_blossom_serialized']} serialized (slower shared)"])


@experiment_app.command("sns")
def experiment_sns(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="job trace in Standard Workload Format")],
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/sns.png"),
    scaling_ratio: Annotated[float, typer.Option(min=0.01, max=0.99, help="chance a job runs a scaling program")] = 0.5,
    nodes: Annotated[int | None, typer.Option(min=1, help="simulated nodes (default: the trace's MaxNodes)")] = None,
    min_procs: Annotated[int, typer.Option(min=1, help="keep jobs with at least this many trace processors")] = 36,
    limit: Annotated[int | None, typer.Option(min=1, help="replay only the first N kept jobs")] = None,
    alpha: Annotated[float, typer.Option(min=0.01, max=1.0, help="every job's slowdown threshold")] = 0.9,
    age_limit_s: Annotated[float, typer.Option(min=0.0, help="wait after which a job blocks younger ones")] = 3600.0,
    bandwidth_budget: Annotated[float, typer.Option(min=0.05, max=1.0,
                                                    help="share of a node's peak bandwidth SNS hands out")] = 0.92,
    seed: Annotated[int, typer.Option(help="seed of the job-to-program mapping")] = 7,
) -> None:
    """Seed 001 Section 6.4: a real trace replayed on a simulated cluster under CE, CS and SNS:
    throughput (1 / mean turnaround), wait and run times, and alpha violations."""
    from nodeshare.experiments.sns import experiment_sns as run
    from nodeshare.experiments.sns import plot_sns

    try:
        with _progress() as bar:
            tasks: dict[str, Any] = {}

            def progress(policy: str, done: int, total: int) -> None:
                if policy not in tasks:
                    tasks[policy] = bar.add_task(f"replaying under {policy}", total=total)
                bar.update(tasks[policy], completed=done)

            r = run(trace, scaling_ratio=scaling_ratio, nodes=nodes, min_procs=min_procs, limit=limit, alpha=alpha,
                    age_limit_s=age_limit_s, seed=seed, bandwidth_budget=bandwidth_budget, progress=progress)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from None
    pol = r["policies"]
    _experiment_out(r, as_json, png, plot_sns, [
        f"{r['jobs']} jobs of {trace.name} on {r['nodes']} nodes of {r['node']['cores']} cores "
        f"(scaling ratio {scaling_ratio}: {100 * r['scaling_core_hours_share']:.0f}% of core-hours scaling)",
        *(f"{p:<4} wait {v['mean_wait_s']:>9.0f} s  run {v['mean_run_s']:>9.0f} s  turnaround "
          f"{v['mean_turnaround_s']:>9.0f} s  run/CE {v['run_vs_ce_geomean']:.3f}  "
          f"alpha violations {v['alpha_violations']}" for p, v in pol.items()),
        "throughput vs CE: " + ", ".join(f"{p} {g:+.1f}%" for p, g in r["throughput_gain_vs_ce_pct"].items())])


@experiment_app.command("shutter")
def experiment_shutter(
    as_json: FullJson = False,
    png: Annotated[Path, typer.Option(help="plot file")] = Path("experiments/shutter.png"),
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    iterations: Annotated[int, typer.Option(min=1, help="runs per pair and shutter length")] = 3,
    period_ms: Annotated[int, typer.Option(min=1, help="P")] = 200,
) -> None:
    """Seed 002 Figs. 5-9: accuracy and overhead for S from 200 us to 25.6 ms, NPB next to a
    contentious (ADVECT3D) and a moderate (Swim) co-runner, and next to NULL against Eq. 10."""
    from nodeshare.experiments.poppa import SHUTTER_US, plot_shutter
    from nodeshare.experiments.poppa import experiment_shutter as run

    with _progress() as bar:
        task = bar.add_task("shutter lengths", total=len(SHUTTER_US))
        r = run(seed=seed, iterations=iterations, period_ms=period_ms,
                progress=lambda done, _total: bar.update(task, completed=done))
    lines = ["overhead at S = 3200 us: " + ", ".join(f"{k} {v:.2f}%" for k, v in r["overhead_at_3200_pct"].items()),
             f"simulated overhead next to NULL vs Eq. 10: max difference {r['eq10_max_abs_diff_pp']:.3f} pp",
             "S (us)   " + "  ".join(f"{j}/{c[:6]:6s}" for c in r["co_runners"] for j in r["jobs"])]
    for s_us in r["shutter_us"]:
        cells = [next(x for x in r["rows"] if x["sample_us"] == s_us and x["job"] == j and x["co_runner"] == c)
                 for c in r["co_runners"] for j in r["jobs"]]
        lines.append(f"{s_us:>6}   " + "  ".join(f"{x['err_refill_corrected_pct']:+9.2f}" for x in cells))
    _experiment_out(r, as_json, png, plot_shutter, lines)


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

    with _progress() as bar:
        task = bar.add_task("simulated seconds", total=round(hours * 3600))
        result = run(nodes=nodes, hours=hours, out_dir=keep,
                     progress=lambda t, _span: bar.update(task, completed=round(t)))
    _write_bench(result, out_file)


@decisions_app.command("tail")
def decisions_tail(
    topic: Annotated[str, typer.Option(help="decisions.power or decisions.placement")] = "decisions.power",
    from_beginning: Annotated[bool, typer.Option("--from-beginning", help="also print past decisions")] = False,
    limit: Annotated[int | None, typer.Option(min=1, help="stop after this many decisions")] = None,
    idle_exit: Annotated[float | None, typer.Option(help="stop after this many seconds without a decision")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON record per line")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Print decisions as they arrive, the way a scheduler subscribes to them."""
    from nodeshare.sinks.inspect import tail_decisions

    settings = _settings(bootstrap=bootstrap)
    _require_bootstrap(settings)
    if topic not in ("decisions.power", "decisions.placement"):
        raise typer.BadParameter("must be decisions.power or decisions.placement", param_hint="--topic")
    for line in tail_decisions(settings, topic, from_beginning=from_beginning, limit=limit, idle_exit_s=idle_exit,
                               as_json=as_json):
        out.print(line, markup=False, highlight=False, soft_wrap=True)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
