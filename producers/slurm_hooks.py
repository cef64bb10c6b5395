"""The controller-side hooks of the Slurm source: three shell scripts (PrologSlurmctld,
EpilogSlurmctld, jobcomp/script) that drop one file per event, the hook's whole environment,
into an events directory the source reads (``producers.slurm``). No Python, no network, always
exit 0 (a failing PrologSlurmctld would hold the job)."""

from __future__ import annotations

import os
from pathlib import Path

HOOKS = ("prolog_ctld", "epilog_ctld", "jobcomp")

HOOK_SCRIPT = """#!/bin/sh
# Written by `nodeshare slurm install-hooks`: records one Slurm {hook} event for nodeshare.
# Always exits 0: a failing controller hook would hold or requeue the job. A failure is never
# discarded: it goes to syslog (tag nodeshare-slurm-hook), to the log file below and to stderr.
d='{events}'
log='{log}'
umask 027
n=$(date +%s%N)
f="$d/.$n-{hook}-$$"
if ! why=$( {{ env -0 > "$f" && mv "$f" "$d/$n-{hook}-$$"; }} 2>&1 ); then
  rm -f "$f" 2>/dev/null
  who=$(id -un 2>/dev/null || id -u)
  msg="{hook} hook: the event of job ${{SLURM_JOB_ID:-${{JOBID:-unknown}}}} is lost (running as $who): $why"
  logger -t nodeshare-slurm-hook -p daemon.err -- "$msg" 2>/dev/null
  printf '%s %s\\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$msg" >> "$log" 2>/dev/null
  printf 'nodeshare: %s\\n' "$msg" >&2
fi
exit 0
"""
#: Where the hooks log their own failures (beside the events directory) unless told otherwise.
HOOK_LOG = "slurm-hooks.log"


def install_hooks(hooks_dir: Path, events_dir: Path, owner: str | None = None, group: str | None = None,
                  log_file: Path | None = None) -> dict[str, Path]:
    """Write the three hook scripts; returns slurm.conf's lines to add, by key.

    The hooks run as SlurmUser. With ``owner`` (SlurmUser when it is not root) the events directory
    becomes ``owner``'s, group ``group`` (default: ``nodeshare`` when that group exists, else the
    owner's), mode 2770: the hooks write, the Slurm source (in the group) reads and deletes, and
    files inherit the group. The hooks' own log file (``log_file``, default beside the events
    directory) is made appendable by ``owner`` the same way."""
    log_file = log_file or events_dir.parent / HOOK_LOG
    for path in (events_dir, log_file):
        if "'" in str(path):
            raise ValueError(f"the path may not contain a quote: {path}")
    ids = None
    if owner is not None:
        import grp
        import pwd

        try:
            user = pwd.getpwnam(owner)
        except KeyError:
            raise ValueError(f"no user {owner!r} (--owner: the SlurmUser the hooks run as)") from None
        if group is None:
            try:
                gid = grp.getgrnam("nodeshare").gr_gid
            except KeyError:
                gid = user.pw_gid
        else:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise ValueError(f"no group {group!r}") from None
        ids = (user.pw_uid, gid)
    hooks_dir.mkdir(parents=True, exist_ok=True)
    events_dir.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.touch()
    if ids is not None:
        os.chown(events_dir, *ids)
        events_dir.chmod(0o2770)
        os.chown(log_file, *ids)
        log_file.chmod(0o640)
    paths = {}
    for hook in HOOKS:
        path = hooks_dir / f"{hook}.sh"
        path.write_text(HOOK_SCRIPT.format(hook=hook, events=events_dir.resolve(), log=log_file.resolve()))
        path.chmod(0o755)
        paths[hook] = path.resolve()
    return {"PrologSlurmctld": paths["prolog_ctld"], "EpilogSlurmctld": paths["epilog_ctld"],
            "JobCompType": Path("jobcomp/script"), "JobCompLoc": paths["jobcomp"]}
