"""docs/architecture.md: ruff and mypy clean. Enforced here so CI keeps it so."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ["nodeshare", "runtime", "schemas", "producers", "streams", "sinks", "deploy"]


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


# ----------------------------------------------------------------------------- the architecture's rules

#: What the pure core may never import: a runtime, a store, a client, a shell of this project.
RUNTIME = ("faust", "mode", "aiokafka", "confluent_kafka", "duckdb", "pyarrow", "dask", "distributed", "fsspec",
           "s3fs", "nodeshare.streams.worker", "nodeshare.sinks", "nodeshare.runtime", "nodeshare.cli")


def _imported(path: Path, package: str) -> set[str]:
    """Every module a file imports, anywhere in it (functions too), relative imports resolved."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module or "")
                if node.module == "nodeshare":  # ``from nodeshare import cli`` imports nodeshare.cli
                    names.update(f"nodeshare.{a.name}" for a in node.names)
    return names


def _package_of(path: Path, root: Path, top: str, dotted: str) -> str:
    rel = path.relative_to(root / top).with_suffix("")
    return ".".join([dotted, *rel.parts[:-1]]) if rel.parts[:-1] else dotted


def test_the_pure_core_imports_no_runtime_and_nothing_of_the_project_but_itself_and_the_schemas():
    """(The house wart: the core imported ``nodeshare.__version__``, the package's metadata, to stamp
    charges; the shell stamps them now, through the policy.)"""
    bad = []
    for path in sorted((ROOT / "streams" / "core").rglob("*.py")):
        package = _package_of(path, ROOT, "streams/core", "nodeshare.streams.core")
        bad += [f"{path.relative_to(ROOT)}: {m}" for m in _imported(path, package)
                if any(m == r or m.startswith(r + ".") for r in RUNTIME) or m == "nodeshare"
                or (m.startswith("nodeshare.") and not m.startswith(("nodeshare.streams.core", "nodeshare.schemas")))]
    assert not bad, bad


#: The roof: what people run. The ground (``runtime/``) and the shells stand below it.
ROOF = ("nodeshare.cli", "nodeshare.bench", "nodeshare.experiments", "nodeshare.demo", "nodeshare.scenarios",
        "nodeshare.__main__")


def test_the_ground_and_the_shells_import_nothing_of_the_roof():
    """(The house wart: ``nodeshare/`` held both the settings, logs, metrics and commit loop that
    every shell uses and the command line, benchmarks and experiments; the ground is ``runtime/``.)
    Only the package's version may be read from ``nodeshare`` itself."""
    bad = []
    for top, dotted in [("runtime", "nodeshare.runtime"), ("schemas", "nodeshare.schemas"),
                        ("producers", "nodeshare.producers"), ("streams", "nodeshare.streams"),
                        ("sinks", "nodeshare.sinks"), ("deploy", "nodeshare.deploy")]:
        for path in sorted((ROOT / top).rglob("*.py")):
            package = _package_of(path, ROOT, top, dotted)
            bad += [f"{path.relative_to(ROOT)}: {m}" for m in _imported(path, package)
                    if any(m == r or m.startswith(r + ".") for r in ROOF)]
    assert not bad, bad
    assert sorted(p.name for p in (ROOT / "nodeshare").glob("*.py")) == ["__init__.py", "__main__.py", "demo.py",
                                                                       "scenarios.py"]


def test_the_schemas_import_nothing_of_the_project_but_themselves():
    bad = []
    for path in sorted((ROOT / "schemas").rglob("*.py")):
        package = _package_of(path, ROOT, "schemas", "nodeshare.schemas")
        bad += [f"{path.relative_to(ROOT)}: {m}" for m in _imported(path, package)
                if m.startswith("nodeshare") and not m.startswith("nodeshare.schemas")]
    assert not bad, bad


def test_settings_load_nothing_of_the_domain_and_default_to_its_values():
    """In a fresh process: the CLI tests leave a --config path in this one's context."""
    code = ("import sys, nodeshare.runtime.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('nodeshare.streams', 'nodeshare.producers', "
            "'nodeshare.sinks'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    defaults = (
        "from nodeshare.runtime.config import Settings\n"
        "from nodeshare.producers.batching import FlushPolicy\n"
        "from nodeshare.streams.core.accounting import PricingPolicy\n"
        "from nodeshare.streams.core.placement.sns import DEFAULT_AGE_LIMIT_S\n"
        "from nodeshare.streams.core.power.ppartition import PowerPolicy\n"
        "s = Settings(bootstrap='')\n"
        "print(s.policy() == PricingPolicy(), s.flush_policy() == FlushPolicy(), "
        "s.power_policy() == PowerPolicy(), s.placement_age_limit_s == DEFAULT_AGE_LIMIT_S)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODESHARE_")}
    assert subprocess.run([sys.executable, "-c", defaults], capture_output=True, text=True, check=True,
                          env=env).stdout.split() == ["True"] * 4


def test_a_module_over_500_lines_says_why_at_its_top():
    long = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > 500 and "Longer than 500 lines because" not in text[:3000]:
                long.append(str(path.relative_to(ROOT)))
    assert not long, long


def test_every_package_directory_is_installed():
    """A non-editable install (`pip install .`, the Dockerfile) ships only the packages pyproject
    lists: a new package missing there works in the editable checkout and nowhere else."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    missing = []
    for dotted, folder in tool["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([dotted, *rel.parts])
            if name not in listed:
                missing.append(name)
    assert not missing, missing
