"""Shutter blocks as arrays: one decoded ``node.ipc`` message (a schema-3 ``ShutterBatch``, or a
version-1/2 ``ShutterBlock`` read as a batch of one) turned into the per-block numbers the fold
needs, with every block's values checked on their own.

The checks are the ones the single-block schema made (cycle >= 0, cycles > 0, instructions >= 0,
threads > 0) plus one: a count must be below 2**53, where float64 stops being exact, so an IPC is
the same number in every implementation (Python, numpy, DuckDB). A block that fails is named in
``problems`` with its index, field and reason, and left out; the other blocks of its batch count.

IPCs are ``instructions / cycles`` in float64 and a region's mean is ``math.fsum`` of its K IPCs
over K: for K <= 2 that is one IEEE operation, which numpy performs identically, so the vectorized
numbers are bit for bit those of the per-block reference (``degradation.block_means``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from nodeshare.schemas.events import (
    MAX_EXACT_COUNT,
    REGIONS,
    RowProblem,
    SampleColumns,
    ShutterBatch,
    ShutterBlock,
)


@dataclass(frozen=True)
class BlockRows:
    """The blocks of one message: cycles, per-region mean IPCs, and which blocks are valid."""

    cycle: np.ndarray  # int64 (n,)
    before: np.ndarray  # float64 (n,), mean IPC of the block's K samples; 0 where not valid
    during: np.ndarray
    after: np.ndarray
    valid: np.ndarray  # bool (n,)
    problems: tuple[RowProblem, ...]
    sample_ipc: np.ndarray  # float64 (3, n, k): every sample's IPC by region; 0 where not valid

    @property
    def n(self) -> int:
        return len(self.cycle)


def _int64(values: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The values as int64 (0 where they are not exact in float64) and the mask of those that are not."""
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:  # beyond int64: certainly not exact
        obj = np.array(values, dtype=object)
        big = (obj >= MAX_EXACT_COUNT) | (obj <= -MAX_EXACT_COUNT)
        return np.where(big, 0, obj).astype(np.int64), big
    big = (arr >= MAX_EXACT_COUNT) | (arr <= -MAX_EXACT_COUNT)
    return (np.where(big, 0, arr) if big.any() else arr), big


def _columns_of_block(block: ShutterBlock) -> dict[str, SampleColumns]:
    return {region: SampleColumns(instructions=tuple(s.instructions for s in getattr(block, region)),
                                  cycles=tuple(s.cycles for s in getattr(block, region)),
                                  threads=tuple(s.threads for s in getattr(block, region)))
            for region in REGIONS}


def block_rows(record: ShutterBatch | ShutterBlock) -> BlockRows:
    """The blocks of a batch (or of one block) as arrays, each block checked on its own."""
    if isinstance(record, ShutterBatch):
        cycles: tuple[int, ...] = record.cycle
        columns = {region: getattr(record, region) for region in REGIONS}
    else:
        cycles = (record.cycle,)
        columns = _columns_of_block(record)
    n, k = len(cycles), record.k
    cycle, cycle_big = _int64(cycles)
    # the first problem of each block, in field order: (index, field, reason)
    found: dict[int, tuple[str, str]] = {}

    def flag(mask: Any, field: str, reason: str) -> None:
        for i in np.flatnonzero(mask).tolist():
            found.setdefault(i, (field, reason))

    flag(cycle_big, "cycle", "must be below 2**53")
    flag(cycle < 0, "cycle", "must be >= 0")
    ipcs = []
    for region in REGIONS:
        cols: SampleColumns = columns[region]
        ins, ins_big = _int64(cols.instructions)
        cyc, cyc_big = _int64(cols.cycles)
        thr, thr_big = _int64(cols.threads)
        ins, cyc, thr = ins.reshape(n, k), cyc.reshape(n, k), thr.reshape(n, k)
        for name, big in (("instructions", ins_big), ("cycles", cyc_big), ("threads", thr_big)):
            flag(big.reshape(n, k).any(axis=1), f"{region}.{name}", "must be below 2**53")
        flag((ins < 0).any(axis=1), f"{region}.instructions", "must be >= 0")
        flag((cyc <= 0).any(axis=1), f"{region}.cycles", "must be > 0")
        flag((thr <= 0).any(axis=1), f"{region}.threads", "must be > 0")
        ipcs.append(ins.astype(np.float64) / np.where(cyc > 0, cyc, 1).astype(np.float64))
    valid = np.ones(n, dtype=bool)
    if found:
        valid[list(found)] = False
    sample_ipc = np.stack(ipcs)  # (3, n, k)
    if not valid.all():
        sample_ipc = np.where(valid[None, :, None], sample_ipc, 0.0)
    means = _region_means(sample_ipc, k)
    problems = tuple(RowProblem(index=i, field=f, reason=r) for i, (f, r) in sorted(found.items()))
    return BlockRows(cycle, means[0], means[1], means[2], valid, problems, sample_ipc)


def _region_means(sample_ipc: np.ndarray, k: int) -> np.ndarray:
    """Mean of each block's K sample IPCs per region, as ``math.fsum(ipcs) / k``: (3, n)."""
    if k == 1:
        return sample_ipc[:, :, 0]
    if k == 2:  # fsum of two floats is their IEEE sum
        return (sample_ipc[:, :, 0] + sample_ipc[:, :, 1]) / 2
    return np.array([[math.fsum(row) / k for row in region.tolist()] for region in sample_ipc])


def counted_after(cycle: np.ndarray, valid: np.ndarray, last_cycle: int) -> np.ndarray:
    """Which valid blocks extend a stream whose last counted cycle is ``last_cycle``: a block counts
    when its cycle is above every cycle counted before it (duplicates and blocks out of order are
    not counted, as a redelivered or re-batched block must not be)."""
    if not valid.any():
        return valid
    marked = np.where(valid, cycle, np.iinfo(np.int64).min)
    before = np.maximum.accumulate(np.concatenate(([last_cycle], marked[:-1])))
    return valid & (cycle > before)
