"""docs/architecture.md: ruff and mypy clean. Enforced here so CI keeps it so."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ["nodeshare", "schemas", "producers", "streams", "sinks", "deploy"]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    result = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_relative_link_of_the_docs_resolves_inside_the_repository():
    """A person who clones the repository follows these links: each must name a file or folder in it."""
    import re

    root = Path(__file__).parents[2]
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists() or root.resolve() not in [resolved, *resolved.parents]:
                broken.append(f"{page.relative_to(root)}: {target}")
    assert not broken, broken
