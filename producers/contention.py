"""Contention on one socket: co-runners share LLC ways and memory bandwidth.

Pure functions over numpy arrays whose last axis is the socket's co-runners (so many sockets,
or every combination of programs, are solved at once):

* **LLC**: ways are shared in proportion to each co-runner's LLC access rate (processes x
  references per instruction x IPC), the occupancy an LRU cache settles to; a process then
  runs at its IPC-LLC and BW-LLC curves' values for the ways it holds (Seed 001, Section 3).
* **Memory bandwidth**: the socket's load rho = demand / capacity raises loaded memory latency
  as 1 + queue * rho / (1 - rho) (or, with ``Socket.latency_curve``, as a measured curve such as
  ``MLC_LOADED_LATENCY``); a program whose CPI stack has a share ``mem_stall`` of memory
  stalls slows by 1 + mem_stall * (latency - 1); and no socket moves more than ``max_util`` of
  its bandwidth, shared in proportion to demand (streaming codes whose stalls prefetching hides
  are held back here). Demand falls with IPC, so both are solved together (a fixed point).
  With ``share`` (Intel RDT's MBA), each co-runner has a partition of the bandwidth of its own:
  the cap is its partition's, so a neighbour's streaming cannot take its bandwidth; latency
  still follows the socket's load, which the partitions bound.
* **Cache refill after a shutter** (:func:`fill_path`): when co-runners pause, every miss of
  the lone job brings a line in and evicts one of the paused job's lines (they are the least
  recently used), so its occupancy grows at its own miss bandwidth: dw/dt = bw(w) / way_mb,
  where bw(w) is the program's measured memory bandwidth at w ways (its BW-LLC curve) and
  way_mb the capacity of one way. A program that misses a lot refills fast at first and slower
  as its misses fall. When the co-runners resume, each resumed job grows back the same way at
  its own miss bandwidth, taking back from the lone job what it takes. Nothing in the model
  knows the shutter length or the estimator: the transient is whatever the curves say.

Everything is deterministic; noise belongs to the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workloads import WAYS, interp_ways

#: Loaded latency measured with Intel Memory Latency Checker 3.5 (``mlc --loaded_latency``,
#: read-only traffic, all threads; two Xeon Silver 4110 sockets, 12 x 32 GB DDR4 RDIMM), as posted
#: at https://community.intel.com/t5/Software-Tuning-Performance/Intel-Memory-Latency-Checker-v3-5-test/m-p/1126268
#: (inject delay rows 20000 .. 0): (bandwidth MB/s, latency ns).
MLC_LOADED_LATENCY_TABLE = (
    (1237.6, 81.96), (1785.2, 83.00), (2583.5, 84.20), (3354.4, 84.99), (4383.3, 85.56), (6068.3, 86.54),
    (7680.3, 87.24), (9723.8, 87.81), (13463.5, 88.79), (18355.0, 90.16), (22580.9, 90.85), (29473.3, 92.29),
    (42695.4, 94.56), (68357.8, 98.94), (131282.0, 123.71), (135655.9, 130.31),
)


def normalized_latency_curve(table: tuple[tuple[float, float], ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A loaded-latency measurement as (load, latency ratio) points: bandwidth as a share of the
    most the machine delivered, latency relative to the least loaded row (taken as idle, at load 0)."""
    bw = np.array([b for b, _ in table])
    lat = np.array([t for _, t in table])
    load = (bw - bw[0]) / (bw[-1] - bw[0])
    return tuple(load.tolist()), tuple((lat / lat[0]).tolist())


MLC_LOADED_LATENCY = normalized_latency_curve(MLC_LOADED_LATENCY_TABLE)


@dataclass(frozen=True)
class Socket:
    ways: float = float(WAYS)  # LLC ways shared by all processes on the socket
    bw_gbps: float = 38.0  # sustainable memory bandwidth
    #: Capacity of one way (MB): a 27.5 MB, 11-way LLC, as the profiles' llc_usage_kb says (27.0-27.4 MB
    #: at 11 ways in ``llc_profiles_spec.csv``; Xeon E5-2699 v4: 55 MB, 20 ways).
    way_mb: float = 2.5
    queue: float = 0.35  # loaded latency = 1 + queue * rho / (1 - rho)
    max_util: float = 0.92  # the share of bandwidth a socket can actually deliver
    procs: int = 4  # processes per job per socket (two 8-process jobs on a 2 x 8-core node)
    #: A measured loaded-latency curve, (load, latency ratio) with load 1 at the most the socket
    #: delivers (max_util of bw_gbps); None: the M/M/1 shape with ``queue``.
    latency_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None


def loaded_latency(rho: np.ndarray, queue: float) -> np.ndarray:
    """Memory latency relative to an idle socket at load rho (an M/M/1-shaped curve)."""
    r = np.clip(rho, 0.0, 0.98)
    return 1.0 + queue * r / (1.0 - r)


def socket_latency(rho: np.ndarray, socket: Socket) -> np.ndarray:
    """Loaded latency at load rho (demand / bw_gbps): the socket's measured curve, read at
    rho / max_util and held at its ends, or else the M/M/1 shape."""
    if socket.latency_curve is None:
        return loaded_latency(rho, socket.queue)
    load, ratio = socket.latency_curve
    return np.interp(np.asarray(rho) / socket.max_util, load, ratio)


def bandwidth_ipc(ipc0: np.ndarray, bw0: np.ndarray, stall: np.ndarray, active: np.ndarray, socket: Socket,
                  iters: int = 40, procs: np.ndarray | None = None,
                  share: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """IPC of each co-runner once memory bandwidth is shared, and the socket's load rho.

    ``ipc0`` and ``bw0`` are each process's IPC and bandwidth at its ways without bandwidth
    contention; inactive co-runners (paused or absent) count for nothing and get IPC 0.
    ``procs``: processes of each co-runner on the socket (default ``socket.procs`` each).
    ``share``: each co-runner's partition of the socket's bandwidth (MBA; shares sum to at most
    1): a co-runner moves at most max_util of its partition, so a streaming neighbour cannot take
    its bandwidth; the memory controller's queue stays one, so loaded latency follows the
    socket's whole load (MBA throttles requests at the core; it does not give each partition a
    queue of its own)."""
    n = socket.procs if procs is None else procs
    cap = socket.max_util * socket.bw_gbps * (1.0 if share is None else share)
    rho = np.zeros((*ipc0.shape[:-1], 1))
    ipc = ipc0
    safe0 = np.where(ipc0 > 0, ipc0, 1.0)
    for _ in range(iters):
        lat = socket_latency(rho, socket)
        ipc = ipc0 / (1.0 + stall * (lat - 1.0))
        demand = np.where(active, n * bw0 * ipc / safe0, 0.0)
        if share is None:  # one pool, shared in proportion to demand
            scale = np.minimum(1.0, cap / np.maximum(demand.sum(axis=-1, keepdims=True), 1e-12))
        else:  # each partition caps its own co-runner
            scale = np.minimum(1.0, cap / np.maximum(demand, 1e-12))
        ipc = ipc * scale
        rho = 0.5 * rho + 0.5 * ((demand * scale).sum(axis=-1, keepdims=True) / socket.bw_gbps)
    return np.where(active, ipc, 0.0), rho[..., 0]


def llc_ways(rpki: np.ndarray, ipc: np.ndarray, active: np.ndarray, socket: Socket,
             procs: np.ndarray | None = None) -> np.ndarray:
    """Ways per process: the socket's ways shared in proportion to LLC access rates."""
    n = socket.procs if procs is None else procs
    access = np.where(active, n * np.maximum(rpki, 1e-3) * np.maximum(ipc, 1e-3), 0.0)
    total = np.maximum(access.sum(axis=-1, keepdims=True), 1e-12)
    return np.where(active, socket.ways * access / total / n, 0.0)


@dataclass(frozen=True)
class Steady:
    ways: np.ndarray  # ways per process
    ipc: np.ndarray
    bw: np.ndarray  # bandwidth per process at those ways before bandwidth sharing (fills the cache)
    rho: np.ndarray


def at_ways(ipc_tab: np.ndarray, bw_tab: np.ndarray, stall: np.ndarray, ways: np.ndarray, active: np.ndarray,
            socket: Socket, procs: np.ndarray | None = None, share: np.ndarray | None = None) -> Steady:
    """IPC of co-runners holding the given ways, with bandwidth shared (or partitioned: ``share``)."""
    ipc0 = interp_ways(ipc_tab, ways)
    bw0 = interp_ways(bw_tab, ways)
    ipc, rho = bandwidth_ipc(ipc0, bw0, stall, active, socket, procs=procs, share=share)
    return Steady(ways, ipc, np.where(active, bw0, 0.0), rho)


def equilibrium(ipc_tab: np.ndarray, bw_tab: np.ndarray, stall: np.ndarray, rpki: np.ndarray, active: np.ndarray,
                socket: Socket, iters: int = 12, procs: np.ndarray | None = None) -> Steady:
    """The steady state of co-runners that have shared the socket long enough (LLC and bandwidth).
    ``procs``: processes of each co-runner on the socket (default ``socket.procs`` each)."""
    ipc = np.where(active, ipc_tab[..., -1], 0.0)
    for _ in range(iters):
        st = at_ways(ipc_tab, bw_tab, stall, llc_ways(rpki, ipc, active, socket, procs), active, socket, procs)
        ipc = st.ipc
    return st


def fill_path(bw_tab: np.ndarray, w0: np.ndarray, w1: np.ndarray, window_ms: float, socket: Socket,
              points: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """A process growing from ``w0`` ways towards ``w1`` at the rate its misses bring lines in,
    dw/dt = bw(w) / way_mb (GB/s = MB/ms), never past ``w1``, over a window of ``window_ms``:
    (ways at the midpoints of ``points`` equal slices of the window, shape (..., points); ways at
    its end). ``bw_tab`` is the process's BW-LLC curve (..., WAYS), read at fractional ways.
    Integrated with the midpoint rule in steps of half a slice."""
    w0, w1 = np.broadcast_arrays(np.asarray(w0, float), np.asarray(w1, float))
    up = w1 > w0
    w = w0.copy()
    h = window_ms / (2 * points)
    out = np.empty((*w.shape, points))

    def rate(x: np.ndarray) -> np.ndarray:
        return np.maximum(interp_ways(bw_tab, x), 0.0) / socket.way_mb

    for i in range(2 * points):
        w = np.where(up, np.minimum(w + h * rate(w + 0.5 * h * rate(w)), w1), w)
        if i % 2 == 0:
            out[..., i // 2] = w
    return out, w
