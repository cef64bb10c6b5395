"""What the experiment commands share: their Typer group, the output of a result (JSON or a summary,
and a PNG), the program library and the options with their checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import err, out

experiment_app = typer.Typer(no_args_is_help=True, help="Experiments of the source papers: JSON and a PNG plot.")


def experiment_out(result: dict[str, Any], as_json: bool, png: Path, plot: Any, summary: list[str]) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(result, png)
    if as_json:
        out.print_json(json.dumps(result))
    else:
        for line in summary:
            out.print(line)
    err.print(f"wrote {png}")


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


SampleUs = Annotated[int, typer.Option("--sample-us", min=1, help="shutter sample length S (us); the adaptive "
                                                                  "schedule's shortest")]


PeriodMs = Annotated[int, typer.Option("--period-ms", min=0, help="shutter period P (ms)")]


EstimatorOpt = Annotated[str, typer.Option(
    "--estimator", help="the degradation estimate charges apply: refill_corrected, poppa_alg4, unfiltered or mixed_s")]


#: The product's defaults (runtime.config.Settings, which a test holds these to; not imported here, so
#: the CLI starts fast): the experiments charge as a site does unless told otherwise
DEFAULT_SETTINGS: dict[str, Any] = {"estimator": "mixed_s", "shutter_schedule": "adaptive", "sample_us": 3200,
                                    "period_ms": 200}


def checked_schedule(schedule: str, sample_us: int, period_ms: int) -> Any:
    """The simulator's shutter schedule the options name (None: the fixed one), or exit 2 with why
    it cannot run: the adaptive ladder's longest sample (16 S, three windows of it) must fit in the
    simulator's cycle of 3 S + P."""
    from nodeshare.producers.calibrated import CalibratedConfig
    from nodeshare.streams.core.shutter_policy import ShutterPolicy

    if schedule not in ("fixed", "adaptive"):
        raise typer.BadParameter("fixed or adaptive", param_hint="--schedule")
    policy = ShutterPolicy.from_shortest(sample_us, period_ms=period_ms) if schedule == "adaptive" else None
    try:
        CalibratedConfig(sample_us=sample_us, period_ms=period_ms, schedule=policy)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}: under the adaptive schedule --sample-us is the shortest S of "
                                 f"S, 4 S, 16 S, and 3 x 16 S must fit in 3 S + --period-ms (S <= "
                                 f"{period_ms * 1000 // 45} us at {period_ms} ms)",
                                 param_hint="--sample-us / --period-ms") from None
    return policy


def checked_estimator(name: str) -> str:
    from nodeshare.streams.core.degradation import ESTIMATORS

    if name not in ESTIMATORS:
        err.print(f"error: unknown estimator {name!r}; known: {', '.join(ESTIMATORS)}")
        raise typer.Exit(2)
    return name
