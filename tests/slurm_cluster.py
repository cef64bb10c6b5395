"""A real Slurm (Debian's 22.05) in a temporary directory, as docs/slurm.md describes: munged,
slurmctld and slurmd started by hand, stopped by PID. One node (this machine) by default; over a
``NetnsCluster``, a slurmd in each node's namespace under its own name and address, and the
controller on the host's bridge address."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nodeshare.deploy.netns import NetnsCluster

# This machine has 2 cores for everything. When the application counter's time was wall-clock
# time, a job descheduled for a window read as slowed by its co-runner: fresh-clone CI saw
# degradations of 0.91-0.99. Its time is now the job's CPU time, which stands still while it waits
# (unfiltered degradations within ±2% in three runs). 20 ms windows still span several scheduler
# slices, so a window is rarely all wait (then its rate rests on little CPU time), and the stream
# worker starts only once the jobs have ended. A node that gives each job its own cores needs neither.
SHUTTER = {"NODESHARE_SAMPLE_US": "20000", "NODESHARE_PERIOD_MS": "100", "NODESHARE_SHUTTER_SCHEDULE": "fixed"}

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo")


def missing() -> str | None:
    """Why a local Slurm cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "a local Slurm needs root (SlurmUser=root)"
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    return f"Slurm/munge not installed ({', '.join(absent)}): apt-get install slurmctld slurmd munge slurm-client" \
        if absent else None


def _conf(t: Path, host: str, hooks: Path | None, cluster: NetnsCluster | None = None) -> str:
    hook_lines = "" if hooks is None else (
        f"JobCompType=jobcomp/script\nJobCompLoc={hooks}/jobcomp.sh\n"
        f"PrologSlurmctld={hooks}/prolog_ctld.sh\nEpilogSlurmctld={hooks}/epilog_ctld.sh\n")
    if cluster is None:
        ctld, names = host, host
        node_lines = f"NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN"
    else:  # each node its own name and address; each gets the machine's CPUs (they share them)
        ctld, names = f"{host}({cluster.host_address})", ",".join(cluster.node_names())
        node_lines = "\n".join(f"NodeName={n} NodeAddr={cluster.address(n)} NodeHostname={n} CPUs={os.cpu_count()} "
                               "RealMemory=1000 State=UNKNOWN" for n in cluster.node_names())
    return f"""ClusterName=nodeshare-test
SlurmctldHost={ctld}
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={t}/run/munge.socket.2
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/slurmd-%n
SlurmctldPidFile={t}/run/slurmctld.pid
SlurmdPidFile={t}/run/slurmd-%n.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{hook_lines}MinJobAge=300
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2
"""


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f} s")
        time.sleep(0.1)


@contextmanager
def local_slurm(hooks: Path | None = None, setup: Callable[[Path], None] | None = None,
                accounting: bool = False, cluster: NetnsCluster | None = None) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd in a fresh directory; yields the environment for Slurm commands.
    The directory is short on purpose: munge's socket path must fit a sockaddr_un (108 bytes).
    ``setup`` gets the directory once ``etc/slurm.conf`` is written, before any daemon starts. With
    ``accounting``, a MariaDB server and slurmdbd too (sacct, sreport, sacctmgr)."""
    with tempfile.TemporaryDirectory(prefix="ns-slurm-") as tmp:
        Path(tmp).chmod(0o755)  # munged wants every directory above its socket searchable by all
        with _running(Path(tmp), hooks, setup, accounting, cluster) as env:
            yield env


ACCOUNTING = ("mariadb-install-db", "mariadbd", "slurmdbd", "sacctmgr", "sacct")


def accounting_missing() -> str | None:
    """Why this machine cannot run Slurm's accounting (None when it can)."""
    absent = [d for d in ACCOUNTING if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    return f"not installed: {', '.join(absent)} (apt-get install slurmdbd mariadb-server)" if absent else None


def _accounting(t: Path, env: dict[str, str], dbd_port: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """MariaDB in ``t/db`` (TCP on a free port, one user for slurmdbd) and slurmdbd on ``dbd_port``,
    added to ``procs`` as they start (stopped with the rest, also when one does not come up).
    slurm.conf must already name accounting_storage/slurmdbd on that port."""
    from nodeshare.deploy.broker import free_port

    port = free_port()
    subprocess.run(["mariadb-install-db", f"--datadir={t}/db", "--user=root", "--skip-test-db",
                    "--auth-root-authentication-method=normal"], check=True, capture_output=True)
    (t / "db.sql").write_text("CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'nodeshare';\n"
                              "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1';\nFLUSH PRIVILEGES;\n")
    procs.append(subprocess.Popen(
        ["mariadbd", "--no-defaults", f"--datadir={t}/db", "--user=root", f"--port={port}", "--bind-address=127.0.0.1",
         f"--socket={t}/run/db.sock", f"--pid-file={t}/run/db.pid", f"--init-file={t}/db.sql", "--skip-log-bin",
         "--innodb-buffer-pool-size=32M"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def answers() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    _wait(answers, 30, "MariaDB")
    conf = t / "etc" / "slurmdbd.conf"
    conf.write_text(f"AuthType=auth/munge\nAuthInfo=socket={t}/run/munge.socket.2\nDbdHost=localhost\n"
                    f"DbdPort={dbd_port}\nSlurmUser=root\nLogFile={t}/log/slurmdbd.log\nPidFile={t}/run/slurmdbd.pid\n"
                    f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={port}\n"
                    "StorageUser=slurm\nStoragePass=nodeshare\nStorageLoc=slurm_acct_db\n")
    conf.chmod(0o600)
    procs.append(subprocess.Popen(["slurmdbd", "-D"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait(lambda: subprocess.run(["sacctmgr", "-n", "list", "cluster"], env=env, capture_output=True).returncode == 0,
          60, "slurmdbd")
    subprocess.run(["sacctmgr", "-i", "add", "cluster", "nodeshare-test"], env=env, capture_output=True)


@contextmanager
def _running(t: Path, hooks: Path | None, setup: Callable[[Path], None] | None = None,
             accounting: bool = False, cluster: NetnsCluster | None = None) -> Iterator[dict[str, str]]:
    host = socket.gethostname().split(".")[0]
    for d in ("etc", "munge", "run", "state", "spool", "log"):
        (t / d).mkdir(parents=True, exist_ok=True)
    (t / "munge").chmod(0o700)
    (t / "run").chmod(0o755)  # munged refuses a socket directory of mode 700
    conf = _conf(t, host, hooks, cluster)
    dbd_port = 0
    if accounting:
        from nodeshare.deploy.broker import free_port

        dbd_port = free_port()
        conf = conf.replace("AccountingStorageType=accounting_storage/none",
                            "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
                            f"AccountingStoragePort={dbd_port}\n"
                            # the munge socket of the connection to slurmdbd (AuthInfo is not read for it)
                            f"AccountingStoragePass={t}/run/munge.socket.2")
    (t / "etc" / "slurm.conf").write_text(conf)
    if setup is not None:
        setup(t)
    env = {**os.environ, "SLURM_CONF": str(t / "etc" / "slurm.conf")}
    key = t / "munge" / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
    key.chmod(0o400)
    procs = [subprocess.Popen(
        ["munged", "-F", f"--socket={t}/run/munge.socket.2", f"--key-file={key}", f"--log-file={t}/log/munged.log",
         f"--pid-file={t}/run/munged.pid", f"--seed-file={t}/munge/munged.seed"], env=env)]
    try:
        _wait(lambda: (t / "run" / "munge.socket.2").exists(), 10, "munged")
        if accounting:
            _accounting(t, env, dbd_port, procs)
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        _DAEMONS[env["SLURM_CONF"]] = procs
        slurmds = [["slurmd", "-D"]] if cluster is None else [
            cluster.command(n, ["slurmd", "-D", "-N", n]) for n in cluster.node_names()]
        for argv in slurmds:
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and set(out.stdout.split()) == {"idle"}
        _wait(idle, 30, "idle Slurm nodes")
        yield env
    finally:
        _DAEMONS.pop(env["SLURM_CONF"], None)
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


#: each running local Slurm's daemons (munged, slurmctld, slurmd), by its SLURM_CONF
_DAEMONS: dict[str, list[subprocess.Popen[bytes]]] = {}


def restart_controller(env: dict[str, str], down_s: float = 2.0) -> None:
    """Stop this local Slurm's slurmctld (SIGTERM: it saves its state), keep it down ``down_s``, and
    start it again on its saved state (jobs keep running under slurmd meanwhile); returns once it
    answers."""
    procs = _DAEMONS[env["SLURM_CONF"]]
    ctld = next(i for i, p in enumerate(procs) if isinstance(p.args, list) and p.args[0] == "slurmctld")
    procs[ctld].send_signal(signal.SIGTERM)
    procs[ctld].wait(30)
    time.sleep(down_s)
    procs[ctld] = subprocess.Popen(["slurmctld", "-D"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(lambda: subprocess.run(["squeue", "-h"], env=env, capture_output=True).returncode == 0, 30,
          "slurmctld after its restart")


def squeue_states(env: dict[str, str], job_ids: list[str]) -> list[str]:
    """Each job's state, in the order of ``job_ids`` (squeue lists them in an order of its own; a
    job it no longer shows reads ``?``)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i %T"], env=env,
                         capture_output=True, text=True, check=True)
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return [states.get(j, "?") for j in job_ids]


def run_agent_until_idle(env: dict[str, str], settings_env: dict[str, str], spool: Path,
                         progress: Path) -> subprocess.CompletedProcess[str]:
    """The node agent on this Slurm's jobs (``--slurm``, with SHUTTER) until every job has ended."""
    agent = subprocess.run(
        [sys.executable, "-m", "nodeshare", "agent", "--slurm", "--spool", str(spool),
         "--progress-dir", str(progress), "--until-idle"],
        env={**env, "NODESHARE_CONFIG": "", **settings_env, **SHUTTER}, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stderr
    return agent


def wait_running(env: dict[str, str], job_ids: list[str], timeout_s: float = 30.0) -> None:
    """Until every job runs at once (the node is shared)."""
    deadline = time.monotonic() + timeout_s
    while squeue_states(env, job_ids) != ["RUNNING"] * len(job_ids):
        assert time.monotonic() < deadline, squeue_states(env, job_ids)
        time.sleep(0.1)


@contextmanager
def lifecycle_source(settings: object, events: Path, env: dict[str, str]) -> Iterator[list[int]]:
    """The Slurm source publishing this Slurm's lifecycle (the hooks' files in ``events``, squeue) in
    a thread until the block ends; the list it yields then holds how many events it published."""
    import threading

    from nodeshare.producers.kafka_producer import EventProducer
    from nodeshare.producers.slurm import SlurmCommands, SlurmSource, run_source

    stop = threading.Event()
    source = SlurmSource(events, SlurmCommands(env), "nodeshare-test")
    published: list[int] = []
    with EventProducer(settings, client_id="nodeshare-slurm") as producer:  # type: ignore[arg-type]
        def publish(batch: list) -> None:
            producer.send_all(batch)
            producer.flush(30)

        died: list[BaseException] = []

        def run() -> None:
            try:
                published.append(run_source(source, publish, poll_s=0.5, stop=stop.is_set))
            except BaseException as exc:  # a thread's error is only printed: the test must hear it
                died.append(exc)
                raise

        thread = threading.Thread(target=run, name="slurm-source")
        thread.start()
        try:
            yield published
        finally:
            stop.set()
            thread.join(30)
            if died:
                raise RuntimeError("the Slurm source stopped during the test") from died[0]
