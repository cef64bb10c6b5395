"""The Kubernetes manifests cannot be applied here (no cluster): check them against the code."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.config import Settings

MANIFEST = Path(__file__).parents[2] / "deploy" / "k8s" / "nodeshare.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


@pytest.fixture(scope="module")
def config(docs, tmp_path_factory) -> Settings:
    toml = docs[("ConfigMap", "nodeshare-config")]["data"]["nodeshare.toml"]
    path = tmp_path_factory.mktemp("k8s") / "nodeshare.toml"
    path.write_text(toml)
    from nodeshare.config import CONFIG_FILE

    token = CONFIG_FILE.set(path)
    try:
        return Settings()  # validates every key of the ConfigMap
    finally:
        CONFIG_FILE.reset(token)


def workloads(docs):
    return [d for (kind, _), d in docs.items() if kind in ("Deployment", "StatefulSet")]


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
            words = [x for x in cmd[3:] if not x.startswith("-") and not x.startswith("/")][:2]
            result = runner.invoke(app, [*words, "--help"])
            assert result.exit_code == 0, f"{w['metadata']['name']}: nodeshare {' '.join(words)}"
            for flag in (x for x in cmd[3:] if x.startswith("--")):
                assert flag in result.output, f"{flag} is not an option of {words}"
            for env in c.get("env", []):
                ref = env["valueFrom"]["secretKeyRef"]
                secret = docs[("Secret", ref["name"])]
                assert ref["key"] in secret["stringData"] and env["name"] == "NODESHARE_KAFKA"


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
    assert len(images) == 1


def test_replicas_fit_the_design(docs, config):
    assert docs[("Deployment", "nodeshare-worker")]["spec"]["replicas"] <= config.partitions
    for name in ("nodeshare-ledger-sink", "nodeshare-archive-sink"):
        assert docs[("StatefulSet", name)]["spec"]["replicas"] == 1  # single writer (hash chain, file names)
