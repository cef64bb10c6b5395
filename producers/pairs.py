"""What the simulated machine says about programs in pairs: their solo counter profiles (the
input a pairing model learns from) and the true pairwise degradation (what it must predict).

Both come from the same per-socket contention model as the calibrated simulator
(:mod:`contention`), at phase granularity: a program's phases are weighted by the solo time
they take, and its co-runner's phases by their share of the co-runner's time (the two do not
line up, so every combination occurs). Micro-phases are left out: they average within a phase.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contention import Socket, Steady, equilibrium
from .workloads import Workload

CLOCK_GHZ = 2.6
#: The counters of a solo profile (Seed 003 Table 3's spirit: instructions per cycle, cache
#: references and misses, memory traffic, stalls), each summarized by mean, min, max and sd.
COUNTERS = ("ipc", "llc_refs_pki", "llc_misses_pki", "mem_bw_gbps", "stall_share")
STATS = ("mean", "min", "max", "sd")
FEATURES = tuple(f"{c}_{s}" for c in COUNTERS for s in STATS)


def _phase_rows(programs: Sequence[Workload]) -> tuple[np.ndarray, ...]:
    """Per phase of every program: owner index, time weight within its program, IPC and
    bandwidth curves, stall share and LLC references per kilo-instruction."""
    owner, weight, ipc, bw, stall, rpki = [], [], [], [], [], []
    for k, w in enumerate(programs):
        total = sum(p.duration_ms for p in w.phases)
        for p in w.phases:
            owner.append(k)
            weight.append(p.duration_ms / total)
            ipc.append(np.asarray(w.ipc) * p.ipc_factor)
            bw.append(np.asarray(w.bw_gbps) * p.bw_factor)
            stall.append(w.mem_stall)
            rpki.append(w.llc_rpki * p.bw_factor)
    return (np.array(owner), np.array(weight), np.array(ipc), np.array(bw), np.array(stall), np.array(rpki))


def _alone(ipc_t: np.ndarray, bw_t: np.ndarray, stall: np.ndarray, rpki: np.ndarray, socket: Socket) -> Steady:
    """Every phase alone on a socket: one active job per row."""
    one = np.ones((len(ipc_t), 1), bool)
    return equilibrium(ipc_t[:, None, :], bw_t[:, None, :], stall[:, None], rpki[:, None], one, socket)


def solo_profiles(programs: Sequence[Workload], socket: Socket | None = None) -> np.ndarray:
    """One row of FEATURES per program, from its phases run alone on a socket (time-weighted)."""
    socket = socket or Socket()
    owner, weight, ipc_t, bw_t, stall, rpki = _phase_rows(programs)
    st = _alone(ipc_t, bw_t, stall, rpki, socket)
    ipc, bw = st.ipc[:, 0], np.minimum(st.bw[:, 0], socket.bw_gbps * socket.max_util / socket.procs)
    misses = bw * 1e9 / 64.0 / (ipc * CLOCK_GHZ * 1e9) * 1000.0  # 64-byte lines per kilo-instruction
    series = np.stack([ipc, rpki, misses, bw * socket.procs, stall], axis=1)
    out = np.zeros((len(programs), len(FEATURES)))
    for k in range(len(programs)):
        mine, w = series[owner == k], weight[owner == k]
        mean = (mine * w[:, None]).sum(axis=0)
        sd = np.sqrt((((mine - mean) ** 2) * w[:, None]).sum(axis=0))
        out[k] = np.stack([mean, mine.min(axis=0), mine.max(axis=0), sd], axis=1).ravel()
    return out


def pair_degradation(programs: Sequence[Workload], socket: Socket | None = None) -> np.ndarray:
    """``deg[i, j]``: percent by which program i's run time grows next to program j (Seed 003
    Eq. 1), from steady co-located IPC against solo IPC over all phase combinations."""
    socket = socket or Socket()
    owner, weight, ipc_t, bw_t, stall, rpki = _phase_rows(programs)
    n = len(owner)
    x, y = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    pair = np.stack([x, y], axis=-1)
    both = np.ones((n, n, 2), bool)
    co = equilibrium(ipc_t[pair], bw_t[pair], stall[pair], rpki[pair], both, socket).ipc[..., 0]
    solo = _alone(ipc_t, bw_t, stall, rpki, socket).ipc[:, 0]
    stretch = solo[:, None] / co  # time per unit of work, relative to solo, for phase x next to phase y
    # weighted by phase: W[i, x] is phase x's weight within program i (0 for other programs' phases),
    # so W @ stretch @ W.T averages over y's phases by time share and over x's by solo time
    w = np.where(owner[None, :] == np.arange(len(programs))[:, None], weight[None, :], 0.0)
    return np.maximum(100.0 * (w @ stretch @ w.T - 1.0), 0.0)
