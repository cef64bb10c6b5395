"""Running the pipeline: demo, broker, topics, schemas, worker, sinks, simulation, replay, decisions."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from nodeshare import __version__

from .common import (
    Bootstrap,
    app,
    check_signing,
    err,
    load_settings,
    out,
    progress_bar,
    require_bootstrap,
    require_broker,
    staged_progress,
)

topics_app = typer.Typer(no_args_is_help=True, help="The topic catalog on the broker.")


schemas_app = typer.Typer(no_args_is_help=True, help="The record contract as JSON Schema.")


sink_app = typer.Typer(no_args_is_help=True, help="Run a sink in the foreground.")


config_app = typer.Typer(no_args_is_help=True, help="The effective configuration.")


decisions_app = typer.Typer(no_args_is_help=True, help="Decision topics, as a scheduler sees them.")


EngineOpt = Annotated[str, typer.Option(
    "--engine", help="calibrated: the workload library with per-socket contention; simple: four toy programs")]


TraceOpt = Annotated[Path | None, typer.Option(
    "--trace", help="Standard Workload Format trace: the first --jobs usable jobs arrive as it says",
    exists=True, dir_okay=False)]


JobProfiles = Annotated[Path | None, typer.Option(
    "--profiles", help="CSV shaped like llc_profiles_spec.csv: jobs run these programs", exists=True,
    dir_okay=False)]


TimeScaleOpt = Annotated[float, typer.Option("--time-scale", min=1e-6,
                                             help="multiply the trace's run and submit times by this")]


def cluster_choice(settings: Any, **choice: Any) -> Any:
    from nodeshare.scenarios import ClusterChoice, ScenarioError

    try:
        picked = ClusterChoice.from_settings(settings, **choice)
        if picked.engine == "calibrated":
            _ = picked.calibrated  # a bad trace or profile file fails here, before any broker starts
        return picked
    except ScenarioError as exc:
        err.print(f"[red]bad simulation choice[/red]: {exc}")
        raise typer.Exit(2) from None


def interval_text(c: Any) -> str:
    """A charge's interval as printed: [low, high] at its confidence, and the method when not t."""
    if c.degradation_low is None:
        return "-"  # a charge made before intervals (schema < 6)
    method = "" if c.interval_method == "t_ratio" else f" {c.interval_method}"
    return f"[{c.degradation_low:.3f}, {c.degradation_high:.3f}] {c.confidence:.0%}{method}"


def print_charges(charges: list[Any]) -> None:
    table = Table(title="Charges (service units; L = rate per core-hour)")
    for col in ("job", "user", "account", "program", "cores", "T_co s", "paused s", "D", "interval", "priced D",
                "blocks used/all", "SOP", "price", "dividend"):
        table.add_column(col, justify="left" if col in ("job", "user", "account", "program") else "right")
    for c in sorted(charges, key=lambda c: (c.job_id, c.revision)):
        d = f"{c.degradation_point if c.degradation_point is not None else c.degradation:.3f}"
        if c.estimate_status.value != "ok":
            d = f"0 ({c.estimate_status.value})"
        table.add_row(c.job_id, c.user, c.account, c.program, str(c.cores), f"{c.run_time_s:.1f}",
                      f"{c.pause_credit_s:.2f}", d, interval_text(c), f"{c.degradation:.3f}",
                      f"{c.blocks_used}/{c.blocks_used + c.blocks_rejected}",
                      f"{c.standard_price:.4f}", f"{c.price:.4f}", f"{c.dividend:.4f}")
    out.print(table)


@config_app.command("show")
def config_show(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """Print the effective configuration (defaults < config file < environment), secrets masked."""
    from nodeshare.runtime.config import config_file

    data = load_settings().masked()
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


@app.command()
def demo(
    nodes: Annotated[int, typer.Option(min=1, help="simulated nodes")] = 6,
    jobs: Annotated[int, typer.Option(min=1, help="simulated jobs")] = 12,
    seed: Annotated[int, typer.Option(help="simulation seed")] = 7,
    engine: EngineOpt = "calibrated",
    trace: TraceOpt = None,
    profiles: JobProfiles = None,
    time_scale: TimeScaleOpt = 1.0,
    out_dir: Annotated[Path, typer.Option("--out", help="where the ledger, archive and logs go")] = Path(
        "nodeshare-demo"),
    timeout: Annotated[float, typer.Option(help="seconds to wait for every charge")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Run the whole pipeline locally: simulator -> broker -> stream worker -> ledger + archive -> audit.

    Uses the bundled Tansu broker unless a bootstrap server is configured. Every input record is
    signed: with the configured site secret, else with one the demo makes in its directory.
    """
    from nodeshare.demo import DemoError, run_demo
    from nodeshare.runtime.identity import new_secret
    from nodeshare.scenarios import source

    settings = load_settings(bootstrap=bootstrap)
    choice = cluster_choice(settings, engine=engine, nodes=nodes, jobs=jobs, seed=seed, trace=trace,
                             profiles=profiles, time_scale=time_scale)
    # after the choice is checked: a refused one makes no directory
    if settings.site_secret_file is None and settings.signing_key_file is None:
        secret = out_dir / "site.secret"
        out_dir.mkdir(parents=True, exist_ok=True)
        if not secret.exists():
            new_secret(secret)
        settings = settings.model_copy(update={"site_secret_file": secret.resolve()})
    check_signing(settings)
    with progress_bar() as bar:
        try:
            result = run_demo(settings, source(choice), out_dir, timeout_s=timeout, progress=staged_progress(bar))
        except DemoError as exc:
            err.print(f"[red]demo failed[/red]: {exc}")
            raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        print_charges(result.charges)
        d = result.as_dict()
        out.print(f"\n{d['jobs_ended']} jobs ended, {d['charges']} charges; "
                  f"standard price {d['total_standard_price']:.4f} SU, charged {d['total_price']:.4f} SU, "
                  f"co-location dividend {d['total_dividend']:.4f} SU")
        verdict = "[green]0 mismatches[/green]" if result.audit.ok else (
            f"[red]{d['audit_mismatches']} mismatches[/red]")
        out.print(f"audit: {result.audit.charges_checked} charges recomputed from "
                  f"{result.audit.events_read} archived events, {verdict}"
                  + (f"; every record's signature checked ({len(result.audit.refused_jobs)} jobs with refused "
                     "records)" if result.audit.identities_checked else "; signatures not checked"))
        out.print(f"ledger:  {result.ledger}\narchive: {result.archive}\nsecret:  {settings.site_secret_file}  "
                  f"(the site secret the records were signed with)\ntruth:   {result.truth}  "
                  f"(ground truth, never read by pricing)\nbroker:  {result.broker} at {result.bootstrap}; "
                  f"{result.elapsed_s:.1f} s")
    if not result.audit.ok:
        raise typer.Exit(1)


@app.command()
def broker(port: Annotated[int | None, typer.Option(
               help="port (default: a free one; with --data, the one it had last time)")] = None,
           host: Annotated[str, typer.Option(help="address to listen on and give clients (e.g. the bridge "
                                                  "address of namespace nodes: docs/deployment.md)")] = "127.0.0.1",
           data: Annotated[Path | None, typer.Option(
               help="keep topics, records and committed offsets in this directory across restarts (Tansu's S3 "
                    "engine on a local s3rver, installed with npm on first use); default: in memory, lost at exit")]
           = None,
           ) -> None:
    """Run the bundled Tansu broker in the foreground until Ctrl-C."""
    from nodeshare.deploy.broker import BrokerError, BundledBroker
    from nodeshare.runtime.files import atomic_write_bytes

    saved = data / "port" if data is not None else None
    from_file = False
    try:
        if port is None and saved is not None and saved.exists():
            port, from_file = int(saved.read_text()), True  # the address clients were given last time
        b = BundledBroker(port=port, data_dir=data, host=host).start()
        if saved is not None:
            atomic_write_bytes(f"{b.port}\n".encode(), saved)
    except (BrokerError, OSError, ValueError) as exc:
        in_use = from_file and "in use" in str(exc)
        hint = f" (the port from {saved}: pass --port, or delete the file)" if in_use else ""
        err.print(f"[red]broker[/red]: {exc}{hint}")
        raise typer.Exit(2) from exc
    try:
        where = "in memory" if data is None else (
            f"stored in {data}: kept across a restart, but a crash while records are written loses acknowledged "
            "ones (docs/broker.md)")
        out.print(f"Tansu broker on {b.bootstrap} (pid {b.pid}, {where}); export NODESHARE_BOOTSTRAP={b.bootstrap}")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(1.0):
                if not b.alive():
                    err.print(f"[red]broker[/red]: it stopped (Tansu or its storage server); see {b.log_path}")
                    raise typer.Exit(1)
    finally:
        b.stop()


@topics_app.command("create")
def topics_create(
    bootstrap: Bootstrap = None,
    grow_inputs_to: Annotated[int | None, typer.Option(
        "--grow-inputs-to", min=1,
        help="grow node.ipc and jobs.lifecycle together to N partitions (only after the steps of "
             "deploy/SCALING.md, 'Adding partitions')")] = None,
    principal: Annotated[list[str] | None, typer.Option(
        help="ROLE=User:NAME, repeated (agent once per node): grant each role's ACLs (docs/deployment.md, "
             "'Identities and ACLs') after creating the topics")] = None,
    print_acls: Annotated[bool, typer.Option(help="only print those ACLs as kafka-acls.sh commands")] = False,
) -> None:
    """Create every catalog topic that is missing (safe to run again); refuses input topics that are
    not co-partitioned."""
    from nodeshare.deploy.acls import AclsError, create_acls, kafka_acls_commands, parse_principals
    from nodeshare.deploy.topics import TopicsError, create_topics

    settings = load_settings(bootstrap=bootstrap)
    try:
        principals = parse_principals(principal or [])
    except ValueError as exc:
        err.print(f"nodeshare topics create: {exc}")
        raise typer.Exit(2) from None
    if print_acls:
        for line in kafka_acls_commands(settings, principals):
            print(line)
        return
    require_broker(settings, "topics create")
    try:
        created = create_topics(settings, grow_inputs_to=grow_inputs_to)
    except TopicsError as exc:
        err.print(f"nodeshare topics create: {exc}")
        raise typer.Exit(1) from None
    for name, status in sorted(created.items()):
        out.print(f"{status:8} {name}")
    try:
        if principals:
            out.print(f"{create_acls(settings, principals)} ACLs created")
    except AclsError as exc:
        err.print(f"nodeshare topics create: {exc}")
        raise typer.Exit(1) from None


@topics_app.command("describe")
def topics_describe(bootstrap: Bootstrap = None) -> None:
    """The catalog's topics as the broker has them: present, partitions, cleanup policy."""
    from nodeshare.sinks.analysis.inspect import describe_topics

    settings = load_settings(bootstrap=bootstrap)
    require_broker(settings, "topics describe")
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


@dlq_app.command("show")
def dlq_show(
    first: Annotated[int, typer.Option(min=0, help="how many records to show")] = 10,
    idle: Annotated[float, typer.Option(help="stop after the topic has been quiet this many seconds")] = 3.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    bootstrap: Bootstrap = None,
) -> None:
    """Dead letters by reason and origin, and the first records with their bytes."""
    from nodeshare.sinks.analysis.inspect import preview, read_dead_letters

    settings = load_settings(bootstrap=bootstrap)
    require_broker(settings, "dlq show")
    summary = read_dead_letters(settings, first=first, idle_s=idle)
    if as_json:
        print(json.dumps(summary.as_dict(), indent=2))
        return
    out.print(f"{summary.total} dead letters on {settings.topic('dlq')}"
              + (f" ({summary.undecodable} not readable as dead letters)" if summary.undecodable else "")
              + (f"; {summary.resent} copies re-sent after a worker restart, counted once" if summary.resent
                 else ""))
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

    settings = load_settings()
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
    from nodeshare.streams.worker.app import run_worker
    from nodeshare.streams.worker.kafka_security import SecurityConfigError, faust_credentials

    settings = load_settings()
    require_bootstrap(settings)
    try:
        faust_credentials(settings.kafka)  # refuse settings faust cannot honour before connecting at all
    except SecurityConfigError as exc:
        err.print(f"[red]configuration error[/red]: kafka: {exc}")
        raise typer.Exit(2) from None
    run_worker(settings, datadir, loglevel, count_only)


def _run_sink(sink: Any) -> None:
    from nodeshare.runtime import logs, metrics

    logs.configure(sink.settings, f"{sink.name}-sink")
    metrics.serve(sink.settings.metrics_port, sink.settings.metrics_addr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sink.run(stop)


@sink_app.command("ledger")
def sink_ledger(ledger: Annotated[Path, typer.Option(help="DuckDB ledger file")] = Path("ledger.duckdb"),
                bootstrap: Bootstrap = None,
                snapshot: Annotated[Path | None, typer.Option(
                    help="also keep a read-only copy here for analysts, rewritten after a batch once "
                    "--snapshot-every seconds have passed (a reader of it never holds up the sink)")] = None,
                snapshot_every: Annotated[float, typer.Option(min=0.0, help="seconds between snapshots")] = 60.0,
                ) -> None:
    """Consume ledger.charges into the DuckDB ledger (idempotent on job id and revision)."""
    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.sinks.ledger import LedgerSink

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    with EventProducer(settings, client_id="nodeshare-ledger-dlq") as dlq:
        sink = LedgerSink(settings, ledger, dead_letters=dlq)
        sink.snapshot, sink.snapshot_every_s = snapshot, snapshot_every
        _run_sink(sink)


@sink_app.command("archive")
def sink_archive(archive: Annotated[Path, typer.Option(help="archive root directory")] = Path("archive"),
                 bootstrap: Bootstrap = None) -> None:
    """Consume every input topic into the Parquet archive."""
    from nodeshare.sinks.archive import ArchiveSink

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    _run_sink(ArchiveSink(settings, archive))


@app.command()
def simulate(
    nodes: Annotated[int, typer.Option(min=1)] = 6,
    jobs: Annotated[int, typer.Option(min=1, help="jobs (with --trace: the first this many of the trace)")] = 12,
    seed: int = 7,
    engine: EngineOpt = "calibrated",
    trace: TraceOpt = None,
    profiles: JobProfiles = None,
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

    settings = load_settings(bootstrap=bootstrap)
    choice = cluster_choice(settings, engine=engine, nodes=nodes, jobs=jobs, seed=seed, trace=trace,
                             profiles=profiles, time_scale=time_scale)  # a bad choice fails before the broker
    require_broker(settings, "simulate")
    until = hours * 3600.0 if hours is not None else None
    with progress_bar() as bar, EventProducer(settings, client_id="nodeshare-simulator") as producer:
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

    settings = load_settings(bootstrap=bootstrap, topic_prefix=topic_prefix)
    require_broker(settings, "replay")
    create_topics(settings)
    with progress_bar() as bar:
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
    from nodeshare.sinks.analysis.inspect import tail_decisions

    settings = load_settings(bootstrap=bootstrap)
    require_broker(settings, "decisions tail")
    if topic not in ("decisions.power", "decisions.placement"):
        raise typer.BadParameter("must be decisions.power or decisions.placement", param_hint="--topic")
    for line in tail_decisions(settings, topic, from_beginning=from_beginning, limit=limit, idle_exit_s=idle_exit,
                               as_json=as_json):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
