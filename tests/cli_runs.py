"""Running the CLI in tests: the exit status must be 0 and the JSON it prints is returned."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nodeshare.cli import app


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):result.stdout.rindex("}") + 1])
