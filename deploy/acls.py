"""Who may write what: one identity (Kafka principal) per role, and the ACLs that follow from it.

Every unit used to share one credential, so any node could write any topic: forge another node's
shutter batches, write ``ledger.charges`` before the worker, or ``decisions.power`` that agents
apply. With a principal per role (and per node for agents), the broker refuses a write outside the
role's topics: agents write ``node.*`` and read ``decisions.*`` and ``jobs.lifecycle``; the Slurm
source writes ``jobs.lifecycle`` and, for a NODE_FAIL job's lost node, a ``NodeDown`` on
``node.ipc``; an operator the same two (``nodes down``, ``charges void``); the Slurm adapter
writes ``cluster.inventory``; only the worker writes derived topics; sinks read. ``GRANTS`` is
that table (docs/deployment.md prints it).

What ACLs cannot say is *which node* an agent may speak for: every agent writes ``node.ipc``.
That part is not enforced yet (docs/deployment.md, "Identities and ACLs").

``create_acls`` applies the bindings through the admin API in a child process: a broker without
ACLs may answer CreateAcls in a way librdkafka cannot parse and aborts on (the bundled Tansu does),
and that must end in an error message, not in the CLI's death.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    DECISIONS_PLACEMENT,
    DECISIONS_PLACEMENT_NODES,
    DECISIONS_POWER,
    DECISIONS_POWER_NODES,
    DLQ,
    INPUT_TOPICS,
    INTERNAL_TOPICS,
    JOBS_LIFECYCLE,
    LEDGER_CHARGES,
    NODE_IPC,
    NODE_LLC,
    NODE_POWER,
    NODE_SHUTTER,
    TOPICS,
    Role,
)

ROLES = ("agent", "slurm-source", "operator", "slurm-scheduler", "worker", "ledger-sink", "archive-sink")
Operation = Literal["read", "write", "all"]


class AclsError(RuntimeError):
    """The broker did not take the ACLs (it has none, or refused them); the message says which."""


@dataclass(frozen=True)
class Grant:
    role: str
    resource: Literal["topic", "group"]
    name: str  # a catalog topic (prefixed by the deployment's prefix), a group, or a prefix of either
    operation: Operation
    prefixed: bool = False


def grants(settings: Settings) -> list[Grant]:
    """The ACL table: for each role, the topics it writes and reads and its consumer groups."""
    t, app = settings.topic, settings.app_id
    out: list[Grant] = []

    def topics(role: str, op: Operation, names: Iterable[str]) -> None:
        out.extend(Grant(role, "topic", t(n), op) for n in names)

    # agents (one principal per node): measurements out, decisions and lifecycle in
    topics("agent", "write", [NODE_IPC.name, NODE_SHUTTER.name, NODE_LLC.name, NODE_POWER.name])
    topics("agent", "read", [DECISIONS_POWER.name, DECISIONS_POWER_NODES.name, DECISIONS_PLACEMENT.name,
                             DECISIONS_PLACEMENT_NODES.name, JOBS_LIFECYCLE.name])
    out.append(Grant("agent", "group", f"{app}-agent-", "read", prefixed=True))
    # the Slurm source: lifecycle, and a NodeDown on node.ipc for each node a NODE_FAIL job lost
    topics("slurm-source", "write", [JOBS_LIFECYCLE.name, NODE_IPC.name])
    # an operator (``nodes down``, ``charges void|adjust|restore``): the same two topics, its own principal
    topics("operator", "write", [JOBS_LIFECYCLE.name, NODE_IPC.name])
    topics("slurm-scheduler", "write", [CLUSTER_INVENTORY.name, DLQ.name])
    topics("slurm-scheduler", "read", [DECISIONS_PLACEMENT.name, DECISIONS_POWER.name])  # placements, power gates
    out.append(Grant("slurm-scheduler", "group", f"{app}-slurm-scheduler-sink", "read"))
    # the worker: every input in, every derived topic out, its internal topics and faust's own
    topics("worker", "read", [s.name for s in INPUT_TOPICS] + list(INTERNAL_TOPICS))
    topics("worker", "write", [s.name for s in TOPICS if s.role is not Role.INPUT] + list(INTERNAL_TOPICS))
    out.append(Grant("worker", "topic", f"{app}-", "all", prefixed=True))  # faust's own topics (its assignor's)
    out.append(Grant("worker", "group", app, "read", prefixed=True))
    topics("ledger-sink", "read", [LEDGER_CHARGES.name, NODE_SHUTTER.name])
    topics("ledger-sink", "write", [DLQ.name])
    out.append(Grant("ledger-sink", "group", f"{app}-ledger-sink", "read"))
    topics("archive-sink", "read", [s.name for s in INPUT_TOPICS])
    out.append(Grant("archive-sink", "group", f"{app}-archive-sink", "read"))
    out.append(Grant("archive-sink", "group", f"{app}-archive-check", "read"))
    return out


def writers(settings: Settings) -> dict[str, set[str]]:
    """Topic -> the roles that may write it."""
    found: dict[str, set[str]] = {}
    for g in grants(settings):
        if g.resource == "topic" and g.operation in ("write", "all") and not g.prefixed:
            found.setdefault(g.name, set()).add(g.role)
    return found


def kafka_acls_commands(settings: Settings, principals: Mapping[str, list[str]]) -> list[str]:
    """The same ACLs as Apache Kafka's ``kafka-acls.sh`` command lines."""
    lines = []
    for g in grants(settings):
        for principal in principals.get(g.role, []):
            kind = "--topic" if g.resource == "topic" else "--group"
            pattern = " --resource-pattern-type prefixed" if g.prefixed else ""
            lines.append(f"kafka-acls.sh --bootstrap-server {settings.bootstrap or 'BROKER'} --add --allow-principal "
                         f"{principal} --operation {g.operation.capitalize()} {kind} {g.name}{pattern}")
    return lines


def parse_principals(pairs: Iterable[str]) -> dict[str, list[str]]:
    """``role=User:name`` pairs (a role may repeat: one principal per node) -> role -> principals."""
    found: dict[str, list[str]] = {}
    for pair in pairs:
        role, sep, principal = pair.partition("=")
        if not sep or role not in ROLES or ":" not in principal:
            raise ValueError(f"{pair!r}: expected ROLE=User:NAME with ROLE one of {', '.join(ROLES)}")
        found.setdefault(role, []).append(principal)
    return found


_CHILD = """
import json, sys
from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient, ResourcePatternType,
                                   ResourceType)
from nodeshare.runtime.config import Settings
wanted = json.load(sys.stdin)
admin = AdminClient(Settings().client_config())
bindings = [AclBinding(ResourceType[w["resource"].upper()], w["name"],
                       ResourcePatternType.PREFIXED if w["prefixed"] else ResourcePatternType.LITERAL,
                       w["principal"], "*", AclOperation[w["operation"].upper()], AclPermissionType.ALLOW)
            for w in wanted]
errors = []
for binding, future in admin.create_acls(bindings, request_timeout=30).items():
    try:
        future.result()
    except Exception as exc:
        errors.append(f"{binding}: {exc}")
print(json.dumps(errors))
"""


def create_acls(settings: Settings, principals: Mapping[str, list[str]], timeout_s: float = 60.0) -> int:
    """Create the ACLs of ``grants`` for the given principals; returns how many. Raises AclsError."""
    wanted = [{"resource": g.resource, "name": g.name, "prefixed": g.prefixed, "operation": g.operation,
               "principal": p} for g in grants(settings) for p in principals.get(g.role, [])]
    if not wanted:
        return 0
    env = {**os.environ, **settings.as_env()}  # the child's settings: this one's, secrets through the environment
    done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(wanted), env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AclsError("the broker's answer to CreateAcls could not be read; it has no ACLs (the bundled Tansu "
                        "has none): set them on a broker that has them (docs/deployment.md, kafka-acls.sh)")
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    if errors:
        raise AclsError("the broker refused ACLs: " + "; ".join(errors[:5]))
    return len(wanted)
