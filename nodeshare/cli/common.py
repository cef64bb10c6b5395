"""What every command shares: the root app, the consoles, settings, option types and output helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="nodeshare: fair, measured and safe node sharing for HPC clusters.")

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


def load_settings(**overrides: Any) -> Any:
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


def require_bootstrap(settings: Any) -> None:
    if not settings.bootstrap:
        err.print("[red]no broker[/red]: pass --bootstrap or set NODESHARE_BOOTSTRAP "
                  "(or run `nodeshare broker` to start the bundled one)")
        raise typer.Exit(2)


Bootstrap = Annotated[str | None, typer.Option(help="Kafka bootstrap servers (default: NODESHARE_BOOTSTRAP)")]


FullJson = Annotated[bool, typer.Option("--json", help="print the full result as JSON")]


def staged_progress(bar: Progress, label: str = "{}") -> Callable[[str, int, int], None]:
    """A progress callback of (stage, done, total): one bar per stage, added when it first reports."""
    tasks: dict[str, Any] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(label.format(stage), total=total)
        bar.update(tasks[stage], completed=done, total=total)
    return report


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False)


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


def print_charges(charges: list[Any]) -> None:
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


def exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def split_values(values: list[str] | None) -> list[str]:
    return [v for item in values or [] for v in item.split(",") if v]


def print_machine_readable(header: Any, rows: list[Any], as_json: bool, parsable: bool,
                            noheader: bool = False) -> bool:
    """--json (a list of objects) or --parsable2 ('|'-separated, like sacct); False when neither."""
    from nodeshare.sinks.usage import parsable2

    if as_json:
        print(json.dumps([dict(zip(header, r, strict=True)) for r in rows], indent=2, default=str))
    elif parsable:
        print(parsable2(header, rows, noheader=noheader))
    return as_json or parsable


def experiment_out(result: dict[str, Any], as_json: bool, png: Path, plot: Any, summary: list[str]) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(result, png)
    if as_json:
        out.print_json(json.dumps(result))
    else:
        for line in summary:
            out.print(line)
    err.print(f"wrote {png}")


def write_bench(result: dict[str, Any], out_file: Path) -> None:
    """A benchmark's numbers: printed, and written to its JSON file."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    out.print_json(json.dumps(result))
    out.print(f"wrote {out_file}")


def program_library(profiles: Path | None) -> Any:
    from nodeshare.producers.workloads import BUILTIN, load_profiles

    if profiles is None:
        return BUILTIN
    try:
        return {**BUILTIN, **load_profiles(profiles)}
    except (OSError, ValueError) as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None


def chosen_programs(names: str | None, library: Any, profiles: Path | None = None) -> Any:
    """The programs to pair: the names given, POPPA's twelve by default, or ``all``: every program
    of the profiles file (every program of the library without one)."""
    from nodeshare.producers.workloads import BUILTIN, PAIRWISE

    if names is not None and names.strip() == "all":
        return tuple(n for n in library if profiles is None or n not in BUILTIN or n in profile_names(profiles))
    chosen = tuple(n.strip() for n in names.split(",") if n.strip()) if names else PAIRWISE
    unknown = [n for n in chosen if n not in library]
    if unknown or len(chosen) < 2:
        err.print(f"error: --programs needs two or more of the library's programs; unknown: {unknown}; "
                  f"known: {', '.join(sorted(library))}")
        raise typer.Exit(2)
    return chosen


def profile_names(profiles: Path) -> set[str]:
    from nodeshare.producers.workloads import load_profiles

    return set(load_profiles(profiles))


LibraryProfiles = Annotated[Path | None, typer.Option(
    help="a CSV shaped like llc_profiles_spec.csv: its programs join the built-in library", exists=True,
    dir_okay=False)]


Programs = Annotated[str | None, typer.Option(
    help="comma-separated programs to pair, or 'all': every program of --profiles (default: POPPA's twelve)")]


SampleUs = Annotated[int, typer.Option("--sample-us", min=1, help="shutter sample length S (us)")]


PeriodMs = Annotated[int, typer.Option("--period-ms", min=0, help="shutter period P (ms)")]


EstimatorOpt = Annotated[str, typer.Option(
    "--estimator", help="the degradation estimate charges apply: refill_corrected, poppa_alg4 or unfiltered")]


def checked_estimator(name: str) -> str:
    from nodeshare.streams.degradation import ESTIMATORS

    if name not in ESTIMATORS:
        err.print(f"error: unknown estimator {name!r}; known: {', '.join(ESTIMATORS)}")
        raise typer.Exit(2)
    return name
