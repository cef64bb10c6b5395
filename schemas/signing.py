"""Who wrote an input record: per-identity HMAC signatures (issue 41, item 1).

Kafka ACLs say which *role* may write a topic, but every node agent writes ``node.ipc``, and a
record's ``node`` is its writer's word: one agent's credential could speak for any node (blocks,
``JobLeftNode``) or, through ``NodeDown``, close another node's streams. Kafka puts no
authenticated principal on a record, so the proof travels with it:

* **Identities.** ``node/<name>`` for a node agent (it may only write records about its own
  node), ``service/<name>`` for a site service (the Slurm lifecycle source and lost-node watch,
  the Slurm adapter's inventory, an operator's ``nodes down``). ``IDENTITY_RULES`` below is the
  rule of who may write which record.
* **Keys.** The site keeps one secret (``nodeshare keys secret``). Each identity's key is
  HMAC-SHA256(secret, label + identity) (``derive_key``): a node holds only its own key
  (``nodeshare keys derive node/<name>``) and cannot derive another's; the verifiers (the stream
  worker, the audit) hold the secret and derive every key they meet.
* **The signature** is a Kafka header ``nodeshare-auth: <identity> <hex HMAC-SHA256>`` over the
  catalog topic name (never the deployment's prefix, so a replay into another prefix keeps it
  valid), the message key and the value, each length-prefixed. The archive keeps the header
  (its ``auth`` column), so the audit checks the same signature the worker checked, and a replay
  re-sends it as it was.

Everything here is pure (no files, no clock): the shells read the secret and keys and call these.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from collections.abc import Mapping
from typing import Any

#: The Kafka header that carries a record's signature.
AUTH_HEADER = "nodeshare-auth"
#: The field a dead letter of a record refused for its signer names.
AUTH_FIELD = "auth"
#: The two kinds of identity.
NODE = "node/"
SERVICE = "service/"
#: An operator's service identity (``nodeshare charges``): the rest of it is the operator's name.
OPERATOR = "service/operator-"
_IDENTITY = re.compile(r"(node|service)/[A-Za-z0-9._@:+-]{1,200}")  # whole string: fullmatch
_KEY_LABEL = b"nodeshare identity key v1\x00"
_MAC_LABEL = b"nodeshare-auth v1\x00"
_ABSENT = struct.pack(">q", -1)
#: Bytes of the site secret (and of a derived key).
SECRET_BYTES = 32


class SigningError(ValueError):
    """An identity, secret or key that cannot be used (the message says which and why)."""


def check_identity(identity: str) -> str:
    """``identity`` if it is ``node/<name>`` or ``service/<name>``; else SigningError."""
    if not _IDENTITY.fullmatch(identity):
        raise SigningError(f"identity {identity!r} is neither node/<name> nor service/<name> "
                           "(letters, digits and ._@:+- only)")
    return identity


def check_secret(secret: bytes) -> bytes:
    """``secret`` if it is long enough to be a site secret; else SigningError."""
    if len(secret) < SECRET_BYTES:
        raise SigningError(f"a site secret has {len(secret)} bytes; at least {SECRET_BYTES} are needed")
    return secret


def derive_key(secret: bytes, identity: str) -> bytes:
    """The signing key of ``identity`` under the site's ``secret``."""
    return hmac.new(check_secret(secret), _KEY_LABEL + check_identity(identity).encode(), hashlib.sha256).digest()


def sign(key: bytes, identity: str, topic: str, msg_key: bytes | None, value: bytes | None) -> bytes:
    """The ``nodeshare-auth`` header value of a message ``identity`` sends to catalog ``topic``: the
    MAC of the identity, a label, then the topic, key and value, each length-prefixed (-1: None),
    fed piece by piece (a value is never copied: this runs once per message on the worker)."""
    mac = hmac.new(key, identity.encode() + b"\x00" + _MAC_LABEL, hashlib.sha256)
    for part in (topic.encode(), msg_key, value):
        if part is None:
            mac.update(_ABSENT)
        else:
            mac.update(struct.pack(">q", len(part)))
            mac.update(part)
    return f"{identity} {mac.hexdigest()}".encode()


class Verifier:
    """Checks ``nodeshare-auth`` headers against the site secret, and the ``retired`` ones a
    rotation keeps accepting (keys derived once per identity that signs)."""

    def __init__(self, secret: bytes, *retired: bytes) -> None:
        self._secret = check_secret(secret)
        self._retired = tuple(check_secret(s) for s in retired)
        self._keys: dict[str, bytes] = {}
        self._old_keys: dict[str, tuple[bytes, ...]] = {}

    def signer(self, topic: str, msg_key: bytes | None, value: bytes | None, auth: bytes | None) -> str:
        """The identity whose valid signature ``auth`` is, for this message on catalog ``topic``;
        "" when there is none (absent, malformed, or made with another key or for other bytes)."""
        if not auth:
            return ""
        identity_b = auth.partition(b" ")[0]
        try:
            identity = identity_b.decode("ascii")
        except UnicodeDecodeError:
            return ""
        if not _IDENTITY.fullmatch(identity):
            return ""
        known = identity in self._keys
        if hmac.compare_digest(sign(self.key(identity), identity, topic, msg_key, value), auth):
            return identity
        if self._retired:
            old = self._old_keys.get(identity) or tuple(derive_key(s, identity) for s in self._retired)
            if any(hmac.compare_digest(sign(k, identity, topic, msg_key, value), auth) for k in old):
                self._old_keys[identity] = old
                return identity
        if not known:  # a made-up identity is not remembered: the cache holds only real signers
            self._keys.pop(identity, None)
        return ""

    def key(self, identity: str) -> bytes:
        """``identity``'s key (derived once per identity that signs: ``signer`` forgets the others)."""
        key = self._keys.get(identity)
        if key is None:
            key = self._keys[identity] = derive_key(self._secret, identity)
        return key


def header_value(headers: Any) -> bytes | None:
    """The ``nodeshare-auth`` value among a confluent-kafka message's headers (a list of pairs, or
    None); None when absent. A header given twice is taken as absent: it proves nothing."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    found = [v for k, v in pairs if k == AUTH_HEADER]
    if len(found) != 1 or found[0] is None:
        return None
    value = found[0]
    return value if isinstance(value, bytes) else str(value).encode()


#: Who may write each input record kind (``Record.kind``): ``NODE``, the node agent of the node the
#: record is about (its ``node``), and ``SERVICE``, any site service. A job's lifecycle is a
#: service's alone: a node's word on a job's cores, account or end would re-bill any job (a job id
#: names no node). A node may describe its own processors (a processors-only inventory, for power
#: caps), never its Slurm state or size.
IDENTITY_RULES: dict[str, tuple[str, ...]] = {
    "shutter_block": (NODE,), "shutter_batch": (NODE,), "job_left_node": (NODE,),
    "shutter_window": (NODE,), "llc_sample": (NODE,), "power_reading": (NODE,),
    "node_down": (SERVICE,),  # a node that is down cannot say so; another node must not
    "job_event": (SERVICE,), "node_inventory": (SERVICE, NODE),
    # an operator's (``nodeshare charges void``), signed by service/operator-<its operator field>
    "charge_adjustment": (SERVICE,),
}


def identity_problem(record: Any, signer: str) -> str | None:
    """Why ``signer`` (a verified identity, "" for none) may not have written ``record``; None
    when it may. A record kind without a rule may be written by no one: a new kind must say."""
    kind = getattr(record, "kind", None)
    rule = IDENTITY_RULES.get(kind or "")
    if rule is None:
        return f"no identity may write a {kind!r} record"
    if not signer:
        return f"{kind} is not signed by a known identity (no valid {AUTH_HEADER} header)"
    if kind == "charge_adjustment" and signer != f"{OPERATOR}{getattr(record, 'operator', '')}":
        return (f"charge_adjustment by operator {getattr(record, 'operator', '')!r} must be signed by "
                f"{OPERATOR}{getattr(record, 'operator', '')}, not {signer}")
    if signer.startswith(SERVICE):
        return None if SERVICE in rule else f"{kind} must be written by the node it is about, not {signer}"
    if NODE not in rule:
        return f"{kind} must be written by a service, not {signer}"
    node = getattr(record, "node", None)
    if signer != f"{NODE}{node}":
        return f"{kind} names node {node!r} but is signed by {signer}"
    if kind == "node_inventory" and not getattr(record, "processors_only", False):
        return f"node_inventory from {signer} must be processors-only: a node's state and size are a service's word"
    return None


class Signer:
    """Signs the input records one process sends: with one identity's key (a node agent, a
    service), or with the site secret (a simulator of a whole cluster, tests), where each record
    is signed by the identity ``IDENTITY_RULES`` says may write it (``service`` for a service's)."""

    def __init__(self, *, identity: str | None = None, key: bytes | None = None, secret: bytes | None = None,
                 service: str = "service/nodeshare") -> None:
        if (key is None) == (secret is None):
            raise SigningError("a signer needs either an identity's key or the site secret")
        if key is not None and identity is None:
            raise SigningError("a key signs for its identity: name it")
        self.identity = check_identity(identity) if identity is not None else None
        self.service = check_identity(service)
        self._key = key
        self._verifier = Verifier(secret) if secret is not None else None

    def identity_for(self, kind: str, node: str | None, operator: str | None = None) -> str:
        """Who signs a record of ``kind`` about ``node`` (by ``operator``, for an operator's record):
        the one identity of a key, or the one the rules ask for when signing with the site secret."""
        if self.identity is not None:
            return self.identity
        if kind == "charge_adjustment" and operator:
            return f"{OPERATOR}{operator}"
        return f"{NODE}{node}" if IDENTITY_RULES.get(kind) == (NODE,) and node else self.service

    def header(self, topic: str, msg_key: bytes | None, value: bytes | None, identity: str | None = None) -> bytes:
        """The ``nodeshare-auth`` value for a message to catalog ``topic``, signed by ``identity``
        (default: this signer's own, or, with the site secret, the one the value's kind needs)."""
        if self._key is not None:
            assert self.identity is not None
            return sign(self._key, self.identity, topic, msg_key, value)
        assert self._verifier is not None
        if identity is None:
            kind, node, operator = _kind_node_operator(value)
            identity = self.identity_for(kind, node, operator)
        return sign(self._verifier.key(identity), identity, topic, msg_key, value)


def _kind_node_operator(value: bytes | None) -> tuple[str, str | None, str | None]:
    """A raw value's ``kind``, ``node`` and ``operator`` (for a site signer handed bytes, not a record)."""
    try:
        doc = json.loads(value or b"")
    except ValueError:
        return "", None, None
    if not isinstance(doc, dict):
        return "", None, None
    node, operator = doc.get("node"), doc.get("operator")
    return (str(doc.get("kind", "")), node if isinstance(node, str) else None,
            operator if isinstance(operator, str) else None)
