"""On the nodes: the agent, the workload, and Slurm (hooks, lifecycle source, placement adapter)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    Bootstrap,
    app,
    err,
    load_settings,
    out,
    publish,
    require_bootstrap,
)


def exit_on_sigterm(signum: int, frame: Any) -> None:
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
    power_min_watts: Annotated[float | None, typer.Option(
        min=0.0, help="with --power-caps: publish this node's packages on cluster.inventory for the power manager, "
        "max from powercap, min this (the lowest cap the site allows: RAPL has no floor)")] = None,
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

    from nodeshare.producers.agent.agent import AgentOptions, build
    from nodeshare.producers.agent.jobs import JobFileError
    from nodeshare.producers.agent.processes import Refused
    from nodeshare.producers.agent.resctrl import ResctrlUnavailable
    from nodeshare.producers.agent.watchdog import WatchdogLost
    from nodeshare.runtime import logs, metrics

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    node = node or socket.gethostname().split(".")[0]
    logs.configure(settings, "agent", node=node)
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    options = AgentOptions(
        node=node, spool=spool, sample_us=settings.sample_us,
        k=settings.samples_per_region, period_ms=settings.period_ms, spool_max_bytes=int(spool_max_mb * 2**20),
        hardware_counters=hardware_counters, flush=settings.flush_policy(), power_caps=power_caps,
        powercap_root=powercap_root, power_min_watts=power_min_watts, resctrl=resctrl, resctrl_root=resctrl_root,
        mem_bandwidth_gbps=mem_bandwidth_gbps, schedule=settings.shutter_policy())
    try:
        the_agent = build(settings, options, job_file=jobs, slurm=slurm, progress_dir=progress_dir)
    except (ValueError, JobFileError, ResctrlUnavailable) as exc:
        err.print(f"[red]agent[/red]: {exc}")
        raise typer.Exit(2) from None
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # unwinds through the agent's resume-and-close paths
    try:
        stats = the_agent.run(duration_s=duration, until_idle=until_idle, drain_s=drain_timeout)
    except (Refused, WatchdogLost) as exc:  # nothing is left paused: each shutter resumes before it returns
        err.print(f"[red]agent stopped[/red]: {exc}")
        raise typer.Exit(3) from None
    out.print(f"{stats.cycles} shutter cycles (mean pause {stats.mean_shutter_ms:.2f} ms); "
              f"{stats.skipped_spool_full} skipped with a full spool"
              + (f"; {stats.blocks_dropped} blocks dropped (a progress count went back)" if stats.blocks_dropped
                 else ""))


slurm_app = typer.Typer(no_args_is_help=True, help="Job lifecycle from a real Slurm.")
nodes_app = typer.Typer(no_args_is_help=True, help="What an operator says of the cluster's nodes.")


@nodes_app.command("down")
def nodes_down(
    node: Annotated[str, typer.Argument(help="the node lost for good (as the jobs' node lists name it)")],
    job: Annotated[list[str], typer.Option("--job", "-j", help="a job whose stream on the node stays open (repeat)")],
    reason: Annotated[str, typer.Option(help="why the node is taken as lost (kept in the charge)")]
    = "declared down by an operator",
    bootstrap: Bootstrap = None,
) -> None:
    """Close the streams NODE never will: a NodeDown record per job on node.ipc. Each job is then
    charged from what the node sent before it went (estimate status node_lost); data the node
    sends later, if it comes back, makes a new revision."""
    import getpass
    import uuid
    from datetime import UTC, datetime

    from pydantic import ValidationError

    from nodeshare.schemas import NodeDown

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    now = datetime.now(UTC)
    try:
        records = [NodeDown(event_id=f"operator/{uuid.uuid4()}", source=f"operator/{getpass.getuser()}",
                            event_time=now, job_id=j, node=node, reason=reason) for j in dict.fromkeys(job)]
    except ValidationError as exc:
        err.print(f"[red]nodes down[/red]: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}")
        raise typer.Exit(2) from None
    publish(settings, records, "nodes down")
    out.print(f"{node}: {len(records)} node-down records published ({', '.join(r.job_id for r in records)})")


@slurm_app.command("install-hooks")
def slurm_install_hooks(
    hooks_dir: Annotated[Path, typer.Option(help="where the hook scripts go (readable by slurmctld)")]
    = Path("/etc/slurm/nodeshare"),
    events_dir: Annotated[Path, typer.Option(help="where the hooks drop one file per event")]
    = Path("/var/spool/nodeshare/slurm-events"),
    owner: Annotated[str | None, typer.Option(help="SlurmUser, when not root: the hooks run as it, so the events "
                                                   "directory and the hooks' log become its (mode 2770, 0640)")] = None,
    group: Annotated[str | None, typer.Option(help="their group, the Slurm source's (default: nodeshare if it "
                                                   "exists, else the owner's)")] = None,
    log_file: Annotated[Path | None, typer.Option(help="where the hooks log their own failures (also syslog); "
                                                       "default: slurm-hooks.log beside the events directory")] = None,
) -> None:
    """Write the controller hooks (PrologSlurmctld, EpilogSlurmctld, jobcomp/script) and print the
    slurm.conf lines that enable them."""
    from nodeshare.producers.slurm_hooks import install_hooks

    try:
        lines = install_hooks(hooks_dir, events_dir, owner, group, log_file)
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
    lost_node_wait: Annotated[float, typer.Option(
        min=0.0, max=86_400.0, help="seconds after a NODE_FAIL job's end to keep asking sinfo about its nodes "
                                    "that do not read lost yet (0: ask once)")] = 600.0,
    bootstrap: Bootstrap = None,
) -> None:
    """Publish Slurm job lifecycle events (hooks and squeue) to jobs.lifecycle, and a NodeDown for each
    node a job Slurm ended with NODE_FAIL lost."""
    import time

    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.producers.slurm import SlurmCommands, SlurmSource, run_source
    from nodeshare.runtime import logs, metrics

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    logs.configure(settings, "slurm-source")
    if not events_dir.is_dir():
        err.print(f"[red]slurm source[/red]: no events directory {events_dir}: run `nodeshare slurm install-hooks`")
        raise typer.Exit(2)
    commands = SlurmCommands()
    source = SlurmSource(events_dir, commands, commands.cluster_name(), terminal_from_epilog,
                         lost_wait_s=lost_node_wait)
    metrics.serve(settings.metrics_port, settings.metrics_addr)  # hook files published and refused
    end = None if duration is None else time.monotonic() + duration
    signal.signal(signal.SIGTERM, exit_on_sigterm)
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
    state_file: Annotated[Path, typer.Option(
        help="the jobs this adapter suspended (power-gated), so it resumes only those; decided.json next "
             "to it keeps the jobs the placement manager answered (fail-open): keep both across restarts "
             "(the systemd unit's StateDirectory)")]
    = Path("/var/lib/nodeshare-slurm-scheduler/suspended.json"),
    bootstrap: Bootstrap = None,
) -> None:
    """Apply decisions.placement to Slurm: held jobs are pinned to the decided nodes and released.

    Submit jobs held (sbatch --hold or a job_submit rule); publishes Slurm's nodes on
    cluster.inventory first. A job held with no decision for NODESHARE_PLACEMENT_RELEASE_AFTER_S
    (600 s) is released to Slurm's own scheduling. While it is down, jobs stay held and no
    decision is lost."""

    from nodeshare.producers.slurm_scheduler import SchedulerCommands, run_scheduler
    from nodeshare.runtime import logs, metrics

    settings = load_settings(bootstrap=bootstrap)
    require_bootstrap(settings)
    logs.configure(settings, "slurm-scheduler")
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    stop = threading.Event()
    if duration is not None:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True  # a scheduler that failed early must not wait out --duration before exiting
        timer.start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        done = run_scheduler(settings, SchedulerCommands(), stop, llc_ways=llc_ways,
                             mem_bandwidth_gbps=mem_bandwidth_gbps, state_file=state_file)
    except (RuntimeError, OSError) as exc:  # a Slurm command failed (not reachable, not allowed); the book
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
