"""The ``nodeshare`` command line: one module per group of commands (faust's cli/ is the model),
what they share in ``common``, and every sub-command group mounted here, in one place."""

from __future__ import annotations

import sys

from .common import app, err

# isort: off
# Imported in the order `nodeshare --help` lists their commands: running the pipeline first.
from . import pipeline, nodes, ledger, charges, bench, experiment, experiment_shutter, keys  # noqa: F401  (registers its command)
# isort: on

app.add_typer(pipeline.config_app, name="config")
app.add_typer(pipeline.topics_app, name="topics")
app.add_typer(pipeline.schemas_app, name="schemas")
app.add_typer(pipeline.sink_app, name="sink")
app.add_typer(bench.bench_app, name="bench")
app.add_typer(ledger.archive_app, name="archive")
app.add_typer(ledger.ledger_app, name="ledger")
app.add_typer(experiment.experiment_app, name="experiment")  # with experiment_shutter's command
app.add_typer(pipeline.decisions_app, name="decisions")
app.add_typer(pipeline.dlq_app, name="dlq")
app.add_typer(nodes.slurm_app, name="slurm")
app.add_typer(nodes.nodes_app, name="nodes")
app.add_typer(keys.keys_app, name="keys")

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
