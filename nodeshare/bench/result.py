"""One result shape for every benchmark: its name, the date and machine it ran on, its targets
and whether each was met, and its figures beside them (flat, so a figure is ``result[name]``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from .machine import machine_stamp

#: Keys of the envelope; a benchmark's own figures never use them.
ENVELOPE = ("bench", "date", "machine", "targets", "met")


def met(figures: Mapping[str, Any], targets: Mapping[str, tuple[str, float]]) -> dict[str, bool | None]:
    """Whether each target (figure -> (">=" or "<=", bound)) was met; None when the run has no such figure."""
    out: dict[str, bool | None] = {}
    for key, (op, bound) in targets.items():
        value = figures.get(key)
        if not isinstance(value, int | float):
            out[key] = None
        elif op == ">=":
            out[key] = value >= bound
        elif op == "<=":
            out[key] = value <= bound
        else:
            raise ValueError(f"a target is '>=' or '<=' a bound, got {op!r} for {key}")
    return out


def bench_result(name: str, figures: Mapping[str, Any],
                 targets: Mapping[str, tuple[str, float]] | None = None) -> dict[str, Any]:
    """The envelope around a benchmark's figures (any keys of theirs named like the envelope's,
    e.g. an older ``machine`` string, are replaced by it)."""
    targets = targets or {}
    return {"bench": name, "date": datetime.now(UTC).date().isoformat(), "machine": machine_stamp(),
            "targets": {k: f"{op} {bound:g}" for k, (op, bound) in targets.items()}, "met": met(figures, targets),
            **{k: v for k, v in figures.items() if k not in (*ENVELOPE, "benchmark", "cores", "python")}}
