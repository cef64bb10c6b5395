"""Day-two tools of the ledger file: a consistent backup while the sink writes, and the check that
the hash chain leads to a head recorded earlier.

**Backup.** The ledger sink opens the DuckDB file for each batch of charges and lets go of it
between batches (sinks/ledger.py, ``LedgerSink._open``); DuckDB lets no process write while
another holds the file, even read-only. So a backup opens the file read-only (waiting, as the sink
does, while a batch is being written), and while it holds it copies the file and its write-ahead
log byte for byte: no write can land in between, so the copy is the ledger as of one moment,
every batch whole. The copy is then opened on its own (which folds its log in), its hash chain
walked, and it is renamed into place only if intact. The sink waits for the copy (up to its 60 s
lock wait), so the copy must take less: it moves bytes at disk speed (docs/operations.md has a
measured figure).

**Chain head.** Each row stores ``sha256(prev_hash || record)``; the last row's hash (the head)
commits to the whole ledger. A ledger rewritten with a recomputed chain is intact, so only a head
recorded outside the ledger's host catches it: ``verify_head`` fails unless the intact chain passes
through that hash (the ledger may have grown since it was recorded).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from .ledger import GENESIS, Ledger


@dataclass(frozen=True)
class ChainHead:
    rows: int  # rows in the chain
    head: str  # the last row's hash (GENESIS for an empty ledger)
    ok: bool = True
    error: str | None = None
    at_row: int | None = None  # verify_head: the row (seq) whose hash is the recorded head


def _hold(path: Path, wait_s: float) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the ledger, waiting up to ``wait_s`` while a writer holds it."""
    waited, delay = 0.0, 0.01
    while True:
        try:
            return duckdb.connect(str(path), read_only=True)
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or waited >= wait_s:
                raise
        time.sleep(delay)
        waited += delay
        delay = min(2 * delay, 0.25)


def chain_head(path: Path) -> ChainHead:
    """Walk the chain of the ledger at ``path`` and name its head."""
    with Ledger(path, read_only=True) as ledger:
        check = ledger.verify_chain()
        row = ledger.con.execute("SELECT row_hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()
    return ChainHead(check.rows, row[0] if row else GENESIS, check.ok, check.error)


def backup(ledger: Path, dest: Path, *, wait_s: float = 30.0) -> ChainHead:
    """Copy the ledger to ``dest`` (a new file) consistently while the sink may be writing; the
    copy's chain is checked before it is put in place. Returns the copy's chain and head."""
    if not ledger.exists():
        raise FileNotFoundError(f"no ledger at {ledger}")
    if dest.exists():
        raise FileExistsError(f"{dest} exists: a backup never overwrites")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    wal = Path(f"{ledger}.wal")
    con = _hold(ledger, wait_s)
    try:  # while held read-only, no process can write: file and log are one moment of the ledger
        shutil.copyfile(ledger, work)
        if wal.exists():
            shutil.copyfile(wal, Path(f"{work}.wal"))
    finally:
        con.close()
    try:
        duckdb.connect(str(work)).close()  # folds the copied log into the copy (a checkpoint)
        head = chain_head(work)
        if not head.ok:
            raise RuntimeError(f"the copy's hash chain is broken ({head.error}); the ledger itself needs an audit")
        with open(work, "rb") as f:
            os.fsync(f.fileno())
        os.replace(work, dest)
    finally:
        for leftover in (work, Path(f"{work}.wal")):
            leftover.unlink(missing_ok=True)
    return head


def copy_snapshot(ledger: Path, dest: Path) -> None:
    """Copy the ledger file (and its write-ahead log, if any) to a new file and rename it over
    ``dest``. The caller (the ledger sink, between batches) guarantees no write lands meanwhile.
    Analysts who have the previous snapshot open keep reading it (the rename leaves their file as
    it was), and each snapshot is a new file, so a reader never holds a file the sink must write."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.copyfile(ledger, work)
    wal = Path(f"{ledger}.wal")
    if wal.exists():
        shutil.copyfile(wal, Path(f"{work}.wal"))
        duckdb.connect(str(work)).close()  # fold the log in: a reader opens the snapshot read-only
    os.replace(work, dest)


def verify_head(path: Path, head: str) -> ChainHead:
    """The chain of the ledger at ``path``, checked to be intact and to pass through ``head``."""
    now = chain_head(path)
    if not now.ok:
        return now
    with Ledger(path, read_only=True) as ledger:
        row = ledger.con.execute("SELECT seq FROM charges WHERE row_hash = ?", [head.lower()]).fetchone()
    if row is None and head.lower() != GENESIS:
        return ChainHead(now.rows, now.head, False,
                         f"the chain does not lead to {head}: no row has that hash (the ledger was rewritten, "
                         "or the head is of another ledger)")
    return ChainHead(now.rows, now.head, True, None, int(row[0]) if row else -1)
