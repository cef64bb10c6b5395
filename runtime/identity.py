"""The site secret and identity keys on disk, and the signer and verifier a process's settings give
(``nodeshare.schemas.signing`` has the rules and the cryptography; docs/deployment.md how a site
hands keys out).

* The **site secret** (``site_secret_file``): 32 random bytes as hex, on the hosts that verify
  (the stream worker, the ledger sink, whoever runs the audit), readable by their user only. After
  a rotation the file holds the new secret on its first line and the retired ones below it: a
  record signed with a retired secret's keys still verifies (the archive and the worker's rebuilds
  hold such records); signers derive from the first.
* An **identity key** (``signing_key_file``): JSON ``{"identity": "node/n1", "key": "<hex>"}``, on
  the one host that is that identity, readable by its user only.

A file that others may read is refused with a clear error, as ssh refuses a private key: a key
anyone on the node can read proves nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

from nodeshare.schemas.signing import (
    SECRET_BYTES,
    Signer,
    SigningError,
    Verifier,
    check_identity,
    check_secret,
    derive_key,
)


def _read_private(path: Path, what: str) -> str:
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise SigningError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SigningError(f"the {what} {path} is not text (hex, as `nodeshare keys` writes it)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SigningError(f"the {what} {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                           f"chmod 600 it")
    return text


def read_secrets(path: Path) -> list[bytes]:
    """The site secrets in ``path`` (hex, one a line): the current one first, then retired ones."""
    lines = [line.strip() for line in _read_private(path, "site secret").splitlines() if line.strip()]
    if not lines:
        raise SigningError(f"the site secret {path} is empty (make one with `nodeshare keys secret`)")
    out = []
    for n, line in enumerate(lines, start=1):
        try:
            secret = bytes.fromhex(line)
        except ValueError:
            raise SigningError(f"line {n} of the site secret {path} is not hex "
                               "(make one with `nodeshare keys secret`)") from None
        try:
            out.append(check_secret(secret))
        except SigningError as exc:
            raise SigningError(f"line {n} of the site secret {path}: {exc}") from None
    return out


def read_secret(path: Path) -> bytes:
    """The current site secret in ``path`` (its first line)."""
    return read_secrets(path)[0]


def read_key(path: Path) -> tuple[str, bytes]:
    """(identity, key) from an identity key file."""
    text = _read_private(path, "signing key")
    try:
        doc = json.loads(text)
        identity, key = check_identity(str(doc["identity"])), bytes.fromhex(str(doc["key"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise SigningError(f"the signing key {path} is not a key file of `nodeshare keys derive` ({exc})") from None
    if len(key) != SECRET_BYTES:
        raise SigningError(f"the signing key {path} has {len(key)} bytes, not {SECRET_BYTES}: not a key of "
                           "`nodeshare keys derive`")
    return identity, key


def _write_private(path: Path, text: str, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SigningError(f"{path} exists: a new secret or key never replaces one silently (--force)") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def new_secret(path: Path, force: bool = False) -> None:
    """Write a new random site secret to ``path`` (mode 600)."""
    _write_private(path, secrets.token_hex(SECRET_BYTES) + "\n", force)


def write_key(secret_path: Path, identity: str, path: Path, force: bool = False) -> None:
    """Write ``identity``'s key, derived from the site secret, to ``path`` (mode 600)."""
    key = derive_key(read_secret(secret_path), identity)
    _write_private(path, json.dumps({"identity": identity, "key": key.hex()}) + "\n", force)


def verifier(site_secret_file: Path | None) -> Verifier | None:
    """The verifier of a process whose settings name the site secret; None when they do not (no
    identity is then checked: a site that has not handed keys out)."""
    return None if site_secret_file is None else Verifier(*read_secrets(site_secret_file))


def signer(signing_key_file: Path | None, site_secret_file: Path | None, service: str) -> Signer | None:
    """The signer of a producing process: its identity key when it has one, else the site secret
    (signing each record as the identity allowed to write it, services as ``service``), else None."""
    if signing_key_file is not None:
        identity, key = read_key(signing_key_file)
        return Signer(identity=identity, key=key)
    if site_secret_file is not None:
        return Signer(secret=read_secret(site_secret_file), service=service)
    return None
