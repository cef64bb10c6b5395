"""Experiments and benchmarks behind ``nodeshare experiment`` and ``nodeshare bench``: each returns
a JSON-able dict of what it measured and can draw it as a PNG."""

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """Lay out, write as a 110 dpi PNG and release the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
