"""What more than one group of commands uses: the root app, the consoles, settings, the broker and
--json options, progress bars. A helper of one group lives in that group's module."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="nodeshare: fair, measured and safe node sharing for HPC clusters.")

out = Console()
if not out.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    out = Console(width=140)
err = Console(stderr=True, soft_wrap=True)  # one line per message: greppable


@app.callback()
def _global_options(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(
        "--config", help="TOML configuration file (default: NODESHARE_CONFIG); environment variables win over it",
        dir_okay=False)] = None,
) -> None:
    from nodeshare.runtime.config import CONFIG_FILE

    CONFIG_FILE.set(config)  # None: fall back to NODESHARE_CONFIG
    # The choice lasts for this command only: a process that runs several (tests, an embedding
    # program) must not read one command's file in the next.
    ctx.call_on_close(lambda: CONFIG_FILE.set(None))


def load_settings(**overrides: Any) -> Any:
    from nodeshare.runtime.config import Settings, config_file

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
    """A command that talks to the broker: one is configured, and so are its signing files (a
    missing, unreadable or world-readable secret or key is one line and exit 2, not a traceback
    from inside a consumer)."""
    if not settings.bootstrap:
        err.print("[red]no broker[/red]: pass --bootstrap or set NODESHARE_BOOTSTRAP "
                  "(or run `nodeshare broker` to start the bundled one)")
        raise typer.Exit(2)
    check_signing(settings)


def check_signing(settings: Any) -> None:
    """Exit 2 with one line when the configured site secret or signing key cannot be used."""
    from nodeshare.runtime.identity import read_key
    from nodeshare.schemas.signing import SigningError

    try:
        settings.verifier()
        if settings.signing_key_file is not None:
            read_key(settings.signing_key_file)
    except SigningError as exc:
        err.print(f"[red]signing configuration[/red]: {exc}")
        raise typer.Exit(2) from None


#: How long a command waits for the broker to answer before it says it cannot reach it.
BROKER_PROBE_S = 10.0


def require_broker(settings: Any, command: str) -> None:
    """``require_bootstrap``, then ask the broker for its metadata: a command that needs it exits 2
    with one line when it does not answer, instead of reading nothing and reporting nothing."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    require_bootstrap(settings)
    try:
        AdminClient(settings.client_config()).list_topics(timeout=BROKER_PROBE_S)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        err.print(f"[red]nodeshare {command}[/red]: the broker at {settings.bootstrap} cannot be reached "
                  f"({reason}; waited {BROKER_PROBE_S:g} s)", highlight=False)
        raise typer.Exit(2) from None


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


def comma_numbers(text: str, kind: type, hint: str, allow_empty: bool = False) -> list[Any]:
    """A comma-separated list of numbers from an option, or a clear error naming the option."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"takes numbers separated by commas, got {text!r}", param_hint=hint) from None
    if not values and not allow_empty:
        raise typer.BadParameter("needs at least one number", param_hint=hint)
    return values


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False)


def publish(settings: Any, records: list[Any], what: str, timeout_s: float = 30.0) -> list[tuple[int, int]]:
    """An operator's records sent and acknowledged (``nodes down``, ``charges void``): where each
    landed, (partition, offset), in order; one line and exit 1 when the broker did not take them
    within ``timeout_s`` (the client gives up on them then: none is sent later). The client's own
    complaints about an unreachable broker are kept out of the terminal (that one line says it)."""
    import logging

    from nodeshare.producers.kafka_producer import DeliveryError, EventProducer
    from nodeshare.runtime.config import KAFKA_LOG

    where: list[tuple[int, int] | None] = [None] * len(records)
    refused: list[str] = []

    def delivered(i: int) -> Callable[[Any, Any], None]:
        def report(error: Any, msg: Any) -> None:
            if error is not None:
                refused.append(error.str())
            else:
                where[i] = (msg.partition(), msg.offset())
        return report

    level = KAFKA_LOG.level
    KAFKA_LOG.setLevel(logging.CRITICAL)
    try:
        with EventProducer(settings, client_id="nodeshare-operator",
                           **{"message.timeout.ms": int(timeout_s * 1000)}) as producer:
            for i, record in enumerate(records):
                producer.send(record, on_delivery=delivered(i))
            producer.flush(timeout_s + 5.0)  # the client fails what it could not send by then
    except DeliveryError as exc:
        err.print(f"[red]{what}[/red]: the broker at {settings.bootstrap} did not take the records: {exc}")
        raise typer.Exit(1) from None
    finally:
        KAFKA_LOG.setLevel(level)
    if refused or any(w is None for w in where):
        err.print(f"[red]{what}[/red]: the broker at {settings.bootstrap} refused "
                  f"{len(refused) or where.count(None)} of {len(records)} records"
                  + (f": {refused[0]}" if refused else ""))
        raise typer.Exit(1)
    return [w for w in where if w is not None]
