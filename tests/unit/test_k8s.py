"""The Kubernetes manifests cannot be applied here (no cluster): check them against the code."""

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.runtime.config import Settings

MANIFEST = Path(__file__).parents[2] / "deploy" / "k8s" / "nodeshare.yaml"
DOCKERFILE = Path(__file__).parents[2] / "deploy" / "Dockerfile"


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


@pytest.fixture(scope="module")
def config(docs, tmp_path_factory) -> Settings:
    toml = docs[("ConfigMap", "nodeshare-config")]["data"]["nodeshare.toml"]
    path = tmp_path_factory.mktemp("k8s") / "nodeshare.toml"
    path.write_text(toml)
    from nodeshare.runtime.config import CONFIG_FILE

    token = CONFIG_FILE.set(path)
    try:
        return Settings()  # validates every key of the ConfigMap
    finally:
        CONFIG_FILE.reset(token)


def workloads(docs):
    return [d for (kind, _), d in docs.items() if kind in ("Deployment", "StatefulSet", "DaemonSet")]


def test_every_piece_is_deployed(docs):
    assert {(k, n) for k, n in docs if k not in ("ConfigMap", "Secret")} == {
        ("Deployment", "nodeshare-worker"), ("StatefulSet", "nodeshare-ledger-sink"),
        ("StatefulSet", "nodeshare-archive-sink"), ("DaemonSet", "nodeshare-agent")}


def test_the_config_map_is_a_valid_configuration_that_exposes_metrics(config):
    assert config.metrics_port == 9464 and config.metrics_addr == "0.0.0.0"  # scrapeable inside the cluster


def test_every_container_runs_a_real_command_with_the_mounted_config(docs, config):
    runner = CliRunner()
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        mounts = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            cmd = c["command"]
            assert cmd[:2] == ["nodeshare", "--config"]
            config_path = Path(cmd[2])
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(config_path.parent))
            assert mounts[mount["name"]]["configMap"]["name"] in {n for k, n in docs if k == "ConfigMap"}
            first_option = next(i for i, x in enumerate([*cmd[3:], "--"]) if x.startswith("-"))
            words = cmd[3:3 + first_option]  # the subcommand, e.g. ["sink", "ledger"]
            result = runner.invoke(app, [*words, "--help"])
            assert result.exit_code == 0, f"{w['metadata']['name']}: nodeshare {' '.join(words)}"
            for flag in (x for x in cmd[3:] if x.startswith("--")):
                assert flag in result.output, f"{flag} is not an option of {words}"
            env = {e["name"]: e["valueFrom"] for e in c.get("env", [])}
            for ref in re.findall(r"\$\((\w+)\)", " ".join(cmd)):  # $(VAR) must be defined in the container
                assert ref in env, f"{w['metadata']['name']}: $({ref}) is not in env"
            ref = env["NODESHARE_KAFKA"]["secretKeyRef"]
            assert ref["key"] in docs[("Secret", ref["name"])]["stringData"]


def test_ports_probes_and_images_agree(docs, config):
    images = set()
    for w in workloads(docs):
        pod = w["spec"]["template"]
        for c in pod["spec"]["containers"]:
            images.add(c["image"])
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["metrics"] == config.metrics_port
            assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(config.metrics_port)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # one image for the services, one with the Slurm client for the agent, both built by the Dockerfile
    assert images == {"nodeshare:0.1.0", "nodeshare-agent:0.1.0"}
    dockerfile = DOCKERFILE.read_text()
    for image, target in (("nodeshare:0.1.0", "service"), ("nodeshare-agent:0.1.0", "agent")):
        assert f"AS {target}\n" in dockerfile and f"-t {image} ." in dockerfile
    assert dockerfile.rstrip().rsplit("\nFROM ", 1)[1].startswith("base AS service")  # the default target


def test_the_agent_gets_what_it_needs_and_no_more(docs):
    ds = docs[("DaemonSet", "nodeshare-agent")]["spec"]["template"]["spec"]
    [agent] = ds["containers"]
    assert ds["hostPID"] is True and not ds.get("hostNetwork")  # sees the jobs; keeps its own network
    sc = agent["securityContext"]
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "PERFMON", "SYS_PTRACE", "SETUID", "SETGID"]}
    assert agent["command"][3:5] == ["agent", "--slurm"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v}
    assert host[mounts["/sys/fs/cgroup"]["name"]] == "/sys/fs/cgroup"  # the jobs' freezer cgroups
    spool = Path(agent["command"][agent["command"].index("--spool") + 1])
    assert host[mounts[str(spool.parent)]["name"]] == "/var/lib/nodeshare"  # the spool outlives the pod
    assert all(m.get("readOnly") for p, m in mounts.items() if p in ("/etc/slurm", "/run/munge", "/etc/nodeshare"))


def test_replicas_fit_the_design(docs, config):
    assert docs[("Deployment", "nodeshare-worker")]["spec"]["replicas"] <= config.partitions
    for name in ("nodeshare-ledger-sink", "nodeshare-archive-sink"):
        assert docs[("StatefulSet", name)]["spec"]["replicas"] == 1  # single writer (hash chain, file names)
