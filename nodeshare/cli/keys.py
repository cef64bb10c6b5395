"""Record signatures: the site secret and each identity's key (``nodeshare.schemas.signing``;
docs/deployment.md, "Identities", says who holds which)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import err, out

keys_app = typer.Typer(help="Signing keys: the site secret, and a key per node and service (who may write what)",
                       no_args_is_help=True)


@keys_app.command("secret")
def secret(
    path: Annotated[Path, typer.Argument(help="where to write it (mode 600): the hosts that verify read it "
                                              "(site_secret_file)")],
    force: Annotated[bool, typer.Option(help="replace an existing file (every key derived from it then stops "
                                             "verifying: hand out new ones)")] = False,
) -> None:
    """Make a new random site secret: the worker and the audit verify every input record's signature
    with it, and every identity's key is derived from it."""
    from nodeshare.runtime.identity import new_secret
    from nodeshare.schemas.signing import SigningError

    try:
        new_secret(path, force)
    except (SigningError, OSError) as exc:
        err.print(f"[red]keys secret[/red]: {exc}")
        raise typer.Exit(2) from None
    out.print(f"wrote the site secret to {path} (mode 600); set site_secret_file to it on the worker and where "
              "the audit runs, and derive each node's and service's key from it")


@keys_app.command("derive")
def derive(
    identity: Annotated[str, typer.Argument(help="node/<name> (a node agent: its Slurm node name) or "
                                                 "service/<name> (the Slurm source, the adapter, an operator)")],
    secret_file: Annotated[Path, typer.Option("--secret", help="the site secret")],
    path: Annotated[Path, typer.Option("--out", help="the key file to write (mode 600): copy it to that "
                                                     "identity's host as its signing_key_file")],
    force: Annotated[bool, typer.Option(help="replace an existing file")] = False,
) -> None:
    """Write one identity's signing key, derived from the site secret. A node's key signs only what
    that node may write: its own blocks, markers, windows, power readings and CAT episodes."""
    from nodeshare.runtime.identity import write_key
    from nodeshare.schemas.signing import SigningError

    try:
        write_key(secret_file, identity, path, force)
    except (SigningError, OSError) as exc:
        err.print(f"[red]keys derive[/red]: {exc}")
        raise typer.Exit(2) from None
    out.print(f"wrote the key of {identity} to {path} (mode 600)")
