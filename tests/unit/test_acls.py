"""Issue 41: one identity per role, and the ACLs that follow from it (deploy/acls.py): only the
worker writes derived topics (charges, decisions), only agents write node.*, only the Slurm source
writes jobs.lifecycle, sinks write nothing but dead letters; printed for Apache Kafka's
kafka-acls.sh, and applied by `topics create --principal` where the broker has ACLs."""

from __future__ import annotations

from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.deploy.acls import ROLES, grants, kafka_acls_commands, parse_principals, writers
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import INPUT_TOPICS, INTERNAL_TOPICS, TOPICS, Role

S = Settings(topic_prefix="p.", app_id="ns")


def test_who_may_write_each_topic():
    w = writers(S)
    assert w["p.ledger.charges"] == {"worker"}  # nobody writes a charge before the worker does
    assert w["p.decisions.power"] == w["p.decisions.placement"] == {"worker"}  # nor a decision agents apply
    for topic in ("node.shutter", "node.power", "node.llc"):
        assert w[f"p.{topic}"] == {"agent"}
    # the source's NodeDown for a NODE_FAIL job's lost node; an operator's `nodes down` and `charges void`
    assert w["p.node.ipc"] == {"agent", "slurm-source", "operator"}
    assert w["p.jobs.lifecycle"] == {"slurm-source", "operator"}
    assert w["p.cluster.inventory"] == {"slurm-scheduler"}
    assert w["p.dlq"] == {"worker", "ledger-sink", "slurm-scheduler"}
    assert {t.name for t in TOPICS} | set(INTERNAL_TOPICS) == {name.removeprefix("p.") for name in w}  # all written
    for sink in ("ledger-sink", "archive-sink"):
        assert {t for t, roles in w.items() if sink in roles} <= {"p.dlq"}


def test_every_input_is_read_by_the_worker_and_the_archive():
    read = {(g.role, g.name) for g in grants(S) if g.resource == "topic" and g.operation == "read"}
    for spec in INPUT_TOPICS:
        assert ("worker", f"p.{spec.name}") in read and ("archive-sink", f"p.{spec.name}") in read
    outputs = {f"p.{t.name}" for t in TOPICS if t.role is Role.OUTPUT}
    assert not {name for role, name in read if role == "agent"} & (outputs - {
        "p.decisions.power", "p.decisions.power.nodes", "p.decisions.placement", "p.decisions.placement.nodes"})
    assert {name for role, name in read if role == "slurm-scheduler"} == {"p.decisions.placement",
                                                                          "p.decisions.power"}


def test_groups_are_the_ones_the_code_joins():
    groups = {(g.role, g.name, g.prefixed) for g in grants(S) if g.resource == "group"}
    # producers/agent/follower.py: <app>-agent-<node>-<purpose>; runtime/consumer.py: <app>-<name>-sink
    assert ("agent", "ns-agent-", True) in groups
    assert ("ledger-sink", "ns-ledger-sink", False) in groups and ("archive-sink", "ns-archive-sink", False) in groups
    assert ("slurm-scheduler", "ns-slurm-scheduler-sink", False) in groups
    assert {g[0] for g in groups} == set(ROLES) - {"slurm-source", "operator"}  # both consume nothing


def test_the_acls_print_as_kafka_acls_commands():
    principals = parse_principals(["agent=User:agent-n1", "agent=User:agent-n2", "worker=User:worker"])
    lines = kafka_acls_commands(S, principals)
    assert ("kafka-acls.sh --bootstrap-server BROKER --add --allow-principal User:agent-n2 --operation Write "
            "--topic p.node.ipc") in lines
    assert any("User:worker --operation Write --topic p.ledger.charges" in line for line in lines)
    assert not any("User:agent" in line and "ledger.charges" in line for line in lines)
    result = CliRunner().invoke(app, ["topics", "create", "--print-acls", "--principal", "slurm-source=User:slurm"])
    assert result.exit_code == 0 and "--topic p.jobs.lifecycle" not in result.output  # no prefix set here
    assert "--operation Write --topic jobs.lifecycle" in result.output
    bad = CliRunner().invoke(app, ["topics", "create", "--print-acls", "--principal", "root=User:x"])
    assert bad.exit_code == 2 and "ROLE=User:NAME" in bad.output
