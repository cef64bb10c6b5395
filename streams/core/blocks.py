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
    SAMPLE_FIELDS,
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


def _int64(values: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """The values as int64 (0 where they are not exact in float64) and the mask of those that are
    not (None when all are, the common case, found with one min and one max)."""
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:  # beyond int64: certainly not exact
        obj = np.array(values, dtype=object)
        big = (obj >= MAX_EXACT_COUNT) | (obj <= -MAX_EXACT_COUNT)
        return np.where(big, 0, obj).astype(np.int64), big
    if arr.size == 0 or (arr.max() < MAX_EXACT_COUNT and arr.min() > -MAX_EXACT_COUNT):
        return arr, None
    big = (arr >= MAX_EXACT_COUNT) | (arr <= -MAX_EXACT_COUNT)
    return np.where(big, 0, arr), big


def _columns_of_block(block: ShutterBlock) -> dict[str, SampleColumns]:
    return {region: SampleColumns(instructions=tuple(s.instructions for s in getattr(block, region)),
                                  cycles=tuple(s.cycles for s in getattr(block, region)),
                                  threads=tuple(s.threads for s in getattr(block, region)))
            for region in REGIONS}


#: The checks of a block, in the order its first problem is named: (field, reason).
CHECKS: tuple[tuple[str, str], ...] = (
    ("cycle", "must be below 2**53"), ("cycle", "must be >= 0"),
    *((f"{region}.{name}", reason) for region in REGIONS for name, reason in (
        ("instructions", "must be below 2**53"), ("cycles", "must be below 2**53"),
        ("threads", "must be below 2**53"), ("instructions", "must be >= 0"), ("cycles", "must be > 0"),
        ("threads", "must be > 0"))),
)


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
    # the nine sample columns (region x instructions, cycles, threads) converted at once
    flat, flat_big = _int64([getattr(columns[r], f) for r in REGIONS for f in SAMPLE_FIELDS])
    samples = flat.reshape(3, 3, n, k)  # (region, field, block, sample)
    ins, cyc, thr = samples[:, 0], samples[:, 1], samples[:, 2]  # (3, n, k) each
    wrong_sign = (ins < 0) | (cyc <= 0) | (thr <= 0)
    bad = wrong_sign.any(axis=(0, 2)) | (cycle < 0)
    if cycle_big is not None:
        bad |= cycle_big
    if flat_big is not None:
        bad |= flat_big.reshape(3, 3, n, k).any(axis=(0, 1, 3))
    sample_ipc = ins / np.where(cyc > 0, cyc, 1)  # (3, n, k) float64: int64 / int64 divides as floats
    problems: tuple[RowProblem, ...] = ()
    if bad.any():
        problems = _problems(cycle, cycle_big, flat_big, ins, cyc, thr, bad)
        sample_ipc = np.where(bad[None, :, None], 0.0, sample_ipc)
    means = _region_means(sample_ipc, k)
    return BlockRows(cycle, means[0], means[1], means[2], ~bad, problems, sample_ipc)


def _problems(cycle: np.ndarray, cycle_big: np.ndarray | None, flat_big: np.ndarray | None, ins: np.ndarray,
              cyc: np.ndarray, thr: np.ndarray, bad: np.ndarray) -> tuple[RowProblem, ...]:
    """Each bad block's first failed check, in ``CHECKS`` order."""
    n = len(cycle)
    no = np.zeros(n, dtype=bool)
    big = (np.zeros((3, 3, n), dtype=bool) if flat_big is None
           else flat_big.reshape(3, 3, n, -1).any(axis=3))  # (region, field, block)
    sign = np.stack([(ins < 0).any(axis=2), (cyc <= 0).any(axis=2), (thr <= 0).any(axis=2)], axis=1)
    checks = np.concatenate([np.stack([no if cycle_big is None else cycle_big, cycle < 0]),
                             np.concatenate([big, sign], axis=1).reshape(3 * 6, n)])  # CHECKS order
    first = checks.argmax(axis=0)
    return tuple(RowProblem(index=i, field=CHECKS[f][0], reason=CHECKS[f][1])
                 for i, f in zip(np.flatnonzero(bad).tolist(), first[bad].tolist(), strict=True))


def _region_means(sample_ipc: np.ndarray, k: int) -> np.ndarray:
    """Mean of each block's K sample IPCs per region, as ``math.fsum(ipcs) / k``: (3, n)."""
    if k == 1:
        return sample_ipc[:, :, 0]
    if k == 2:  # fsum of two floats is their IEEE sum
        return (sample_ipc[:, :, 0] + sample_ipc[:, :, 1]) / 2
    return np.array([[math.fsum(row) / k for row in region.tolist()] for region in sample_ipc])


def prior_max(cycle: np.ndarray, valid: np.ndarray, last_cycle: int) -> np.ndarray:
    """For each block, the highest cycle the stream has counted before it: ``last_cycle`` and the
    valid blocks ahead of it in the batch (a valid block that does not exceed it is not counted,
    so it cannot raise it either)."""
    marked = np.where(valid, cycle, np.iinfo(np.int64).min)
    return np.maximum.accumulate(np.concatenate(([last_cycle], marked[:-1])))


def counted_after(cycle: np.ndarray, valid: np.ndarray, last_cycle: int) -> np.ndarray:
    """Which valid blocks extend a stream whose last counted cycle is ``last_cycle``: a block counts
    when its cycle is above every cycle counted before it (duplicates and blocks out of order are
    not counted, as a redelivered or re-batched block must not be)."""
    return valid & (cycle > prior_max(cycle, valid, last_cycle))
