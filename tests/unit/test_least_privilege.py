"""Issue 41, least privilege by default: the systemd units run as the `nodeshare` user where root
is not needed, the agent keeps root with only the capabilities it needs, every directory has a
tmpfiles.d line with its owner and mode, power caps and resctrl are opt-in, one metrics port per
unit, and the agent runs from a slim install (its heavy neighbours blocked)."""

from __future__ import annotations

import importlib.metadata as md
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).parents[2] / "deploy"
SYSTEMD = DEPLOY / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
ROOT_UNITS = {"nodeshare-agent.service"}  # pauses other users' jobs, writes root's kernel files
#: What the agent may keep, and why (the unit's comment says the same).
AGENT_CAPS = {"CAP_KILL", "CAP_SETUID", "CAP_SETGID", "CAP_SYS_PTRACE", "CAP_PERFMON"}
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectKernelModules": "yes",
             "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "SystemCallArchitectures": "native"}


def unit_keys(path: Path) -> dict[str, list[str]]:
    """Each key of a unit file with all its values, in order (a key may repeat)."""
    keys: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def test_there_are_units_to_check():
    assert {u.name for u in UNITS} >= ROOT_UNITS | {"nodeshare-worker.service", "nodeshare-ledger-sink.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.stem)
def test_each_unit_runs_with_least_privilege(unit):
    keys = unit_keys(unit)
    for key, value in HARDENING.items():
        assert keys.get(key) == [value], f"{unit.name}: {key}={value} expected, got {keys.get(key)}"
    if unit.name in ROOT_UNITS:
        assert "User" not in keys
        caps = set(keys["CapabilityBoundingSet"][-1].split())
        assert caps and caps <= AGENT_CAPS, f"{unit.name}: capabilities {caps - AGENT_CAPS} not justified"
        assert keys["ProtectHome"] == ["read-only"]  # it reads progress files, never writes a user's file
    else:
        assert keys["User"][0] not in ("root", "0"), unit.name
        assert keys["CapabilityBoundingSet"] == [""] and keys["ProtectHome"] == ["yes"]
        assert keys["ProtectControlGroups"] == ["yes"] and keys["ProtectKernelTunables"] == ["yes"]


def test_one_metrics_port_per_unit_and_none_in_the_shared_env_file():
    ports = {}
    for unit in UNITS:
        env = dict(v.split("=", 1) for v in unit_keys(unit).get("Environment", []))
        ports[unit.name] = env["NODESHARE_METRICS_PORT"]
    assert len(set(ports.values())) == len(ports), ports
    shared = (SYSTEMD / "nodeshare.env.example").read_text()
    assert not re.search(r"^\s*NODESHARE_METRICS_PORT=", shared, re.MULTILINE)


def test_power_caps_and_resctrl_are_opt_in_drop_ins():
    from typer.testing import CliRunner

    from nodeshare.cli import app

    exec_start = unit_keys(SYSTEMD / "nodeshare-agent.service")["ExecStart"][0]
    assert "--power-caps" not in exec_start and "--resctrl" not in exec_start
    help_text = CliRunner().invoke(app, ["agent", "--help"], terminal_width=300).output
    for drop_in, var, flag in (("power-caps", "NODESHARE_AGENT_POWER_CAPS", "--power-caps"),
                               ("resctrl", "NODESHARE_AGENT_RESCTRL", "--resctrl")):
        assert f"${var}" in exec_start.split()  # a separate word: unset, systemd drops it
        keys = unit_keys(SYSTEMD / "nodeshare-agent.service.d" / f"{drop_in}.conf.example")
        assert keys["Environment"] == [f"{var}={flag}"] and flag in help_text


def directories_the_units_use() -> set[str]:
    used = set()
    for unit in UNITS:
        keys = unit_keys(unit)
        used |= {f"/var/lib/{d}" for d in keys.get("StateDirectory", [])}
        used |= {p for v in keys.get("ReadWritePaths", []) for p in v.split()}
        words = keys["ExecStart"][0].split()
        for flag, value in itertools.pairwise(words):
            if flag in ("--progress-dir", "--events-dir", "--datadir", "--archive"):
                used.add(value)
            elif flag in ("--spool", "--ledger", "--state-file"):
                used.add(str(Path(value).parent))
    return used


def tmpfiles_lines(site_specific: bool = True) -> dict[str, tuple[str, str, str, str]]:
    """Path -> (type, mode, user, group); with ``site_specific``, the lines left commented for one
    host to enable (``#d``: the archive on the shared file system) too."""
    lines = {}
    for line in (SYSTEMD / "nodeshare.tmpfiles.conf").read_text().splitlines():
        if site_specific and line.startswith("#d "):
            line = line[1:]
        if line.strip() and not line.startswith("#"):
            kind, path, mode, user, group, _age = line.split()
            lines[path] = (kind, mode, user, group)
    return lines


def test_every_directory_a_unit_uses_has_a_tmpfiles_line_with_owner_and_mode():
    lines = tmpfiles_lines()
    missing = directories_the_units_use() - {p for p, (kind, *_rest) in lines.items() if kind == "d"}
    assert not missing, f"no tmpfiles.d line for {sorted(missing)}"
    owners = {"/var/lib/nodeshare-worker": "nodeshare", "/var/lib/nodeshare-ledger": "nodeshare",
              "/var/lib/nodeshare-slurm-scheduler": "slurm",
              "/var/spool/nodeshare/slurm-events": "slurm", "/var/lib/nodeshare": "root"}
    for path, user in owners.items():
        assert lines[path][2] == user, path
    assert lines["/var/spool/nodeshare/slurm-events"][1:] == ("2770", "slurm", "nodeshare")
    assert lines["/var/spool/nodeshare/progress"][1] == "1777"  # users create, none replaces another's


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None or shutil.which("systemd-sysusers") is None,
                    reason="systemd-tmpfiles and systemd-sysusers are not installed")
def test_tmpfiles_and_sysusers_create_the_tree(tmp_path):
    (tmp_path / "etc").mkdir()
    slurm = tmp_path / "slurm.sysusers.conf"  # Slurm's package makes its user; here, the test does
    slurm.write_text('u slurm - "Slurm" /nonexistent\n')
    for conf in (SYSTEMD / "nodeshare.sysusers.conf", slurm):
        subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(conf)], check=True, capture_output=True)
    done = subprocess.run(["systemd-tmpfiles", "--create", f"--root={tmp_path}",
                           str(SYSTEMD / "nodeshare.tmpfiles.conf")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    users = {line.split(":")[2]: line.split(":")[0] for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[2]: line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    users["0"] = groups["0"] = "root"
    for path, (_kind, mode, user, group) in tmpfiles_lines(site_specific=False).items():
        if _kind != "d":
            continue
        st = (tmp_path / path.lstrip("/")).stat()
        assert (oct(st.st_mode & 0o7777)[2:].zfill(4), users[str(st.st_uid)], groups[str(st.st_gid)]) == (
            mode.zfill(4), user, group), path


SCORE = re.compile(r"Overall exposure level for (\S+): ([0-9.]+)")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.stem)
def test_systemd_analyze_rates_each_unit_below_5(unit):
    """9.6 UNSAFE for every unit before issue 41; `--offline=yes` reads the file, no running systemd."""
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", unit.name], cwd=SYSTEMD,
                          capture_output=True, text=True)
    found = SCORE.search(done.stdout + done.stderr)
    if found is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit file offline: {done.stderr.strip()[:200]}")
    assert float(found.group(2)) < 5.0, f"{unit.name}: {found.group(0)}"


# ----------------------------------------------------------------------------- slim install

HEAVY = ("faust", "mode", "aiokafka", "dask", "distributed", "sklearn", "matplotlib", "s3fs", "fsspec", "duckdb",
         "pyarrow", "numpy", "rustworkx", "pandas")
BLOCKING_RUN = """
import importlib.abc, sys
HEAVY = set(sys.argv[1].split(","))
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{name} is not part of the agent's slim install")
sys.meta_path.insert(0, Blocked())
from nodeshare.cli import main
sys.argv = ["nodeshare", *sys.argv[2:]]
try:
    main()
finally:
    tops = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names)
    print("IMPORTED", " ".join(sorted(t for t in tops if not t.startswith("_"))), file=sys.stderr)
"""


def requirement_closure(lines: list[str]) -> set[str]:
    """The distributions the requirements name, and everything they require (installed here)."""
    todo = [re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0] for line in lines]
    seen: set[str] = set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[<>=!~;\[ (]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    return seen


def test_the_agent_runs_from_the_slim_install(tmp_path):
    """`nodeshare agent` runs a job to its end with faust, Dask, scikit-learn, matplotlib, s3fs,
    DuckDB, pyarrow and numpy unimportable, and imports only what deploy/requirements-agent.txt
    installs (and what that requires)."""
    (tmp_path / "jobs.toml").write_text('[[jobs]]\nid = "a"\ncommand = ["sleep", "1"]\n')
    env = {**os.environ, "NODESHARE_BOOTSTRAP": "127.0.0.1:9", "NODESHARE_METRICS_PORT": ""}
    env.pop("NODESHARE_METRICS_PORT")
    done = subprocess.run([sys.executable, "-c", BLOCKING_RUN, ",".join(HEAVY), "agent", "--jobs", "jobs.toml",
                           "--spool", "spool.db", "--progress-dir", "progress", "--node", "n1", "--duration", "2",
                           "--drain-timeout", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = set(done.stderr.rsplit("IMPORTED", 1)[1].split())
    assert not imported & set(HEAVY)
    lines = [line.strip() for line in (DEPLOY / "requirements-agent.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    allowed = requirement_closure(lines)
    by_module = md.packages_distributions()
    outside = {m for m in imported - {"nodeshare"}
               if not {d.lower().replace("_", "-") for d in by_module.get(m, [m])} & allowed}
    assert not outside, f"the agent imports {sorted(outside)}, not in deploy/requirements-agent.txt's closure"
