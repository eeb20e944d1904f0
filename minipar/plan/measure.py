"""``calibrate``: measure this machine and write a hardware file the planner accepts.

Two measurements, both quick:

* matmul FLOP/s: an n x n fp32 matmul (2 n^3 FLOPs) on one thread, since
  ``minipar.dist.launch`` gives each process (each "device") one thread;
* collective bandwidth: all-reduces of growing size between ``nprocs`` local processes over
  gloo, through ``minipar.dist.launch``. A least-squares line through (bytes sent, seconds)
  gives the alpha-beta model: time = steps x alpha + bytes / beta, with 2 (n-1) ring steps
  and 2 (n-1)/n N bytes sent for an N-byte all-reduce.

The file says ``compute_efficiency: 1.0`` because the measured rate already is the
achievable one, and treats the machine as one node of ``os.cpu_count()`` devices, each with
an equal share of the RAM. There is no second node: the inter-node fields repeat the
loopback numbers (x devices per node, since a node's NICs are shared by its devices).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

QUICK_SIZES = [2**12, 2**16, 2**20, 2**22]                 # bytes
FULL_SIZES = [2**k for k in range(10, 25, 2)]              # 1 KiB .. 16 MiB


def matmul_flops(n: int = 1024, repeats: int = 5, threads: int = 1) -> float:
    """Best-of-``repeats`` fp32 matmul rate on ``threads`` threads, in FLOP/s."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b                                            # warm up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best


def allreduce_times(sizes: list[int], repeats: int) -> list[float]:
    """Run on every rank (by ``minipar.dist.launch``): median seconds per all-reduce by size."""
    import torch
    import torch.distributed as dist
    out = []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        dist.all_reduce(x)                               # warm up this size
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out.append(sorted(times)[len(times) // 2])
    return out


def fit_alpha_beta(sizes: list[int], seconds: list[float], n: int) -> tuple[float, float]:
    """Least squares of time = 2 (n-1) alpha + (2 (n-1)/n N) / beta; returns (alpha, beta)."""
    import numpy as np
    sent = np.array([2 * (n - 1) / n * s for s in sizes], dtype=float)
    slope, intercept = np.polyfit(sent, np.array(seconds, dtype=float), 1)
    beta = 1.0 / slope if slope > 0 else float(sent.max() / max(seconds))
    alpha = max(intercept, 0.0) / (2 * (n - 1))
    return alpha, beta


def calibrate(nprocs: int = 2, quick: bool = False, path: str | Path | None = None,
              name: str = "calibrated") -> dict:
    """Measure this machine; return the hardware dict (and write it to ``path`` if given)."""
    from minipar.dist import launch
    from .errors import PlanError
    if nprocs < 2:
        raise PlanError(f"calibrate needs at least 2 processes to time collectives, "
                        f"got --nproc {nprocs}")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    flops = matmul_flops(n=512 if quick else 1024, repeats=3 if quick else 5)
    per_rank = launch(allreduce_times, nprocs, sizes, 3 if quick else 7, backend="gloo",
                      timeout=60.0)
    seconds = [max(rank[i] for rank in per_rank) for i in range(len(sizes))]
    alpha, beta = fit_alpha_beta(sizes, seconds, nprocs)
    devices = os.cpu_count() or nprocs
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = {
        "name": name,
        "description": f"measured by 'python -m minipar.plan calibrate' on {os.uname().nodename}",
        "gpus_per_node": devices,
        "memory_bytes": ram // devices,
        "peak_flops": flops,
        "compute_efficiency": 1.0,
        "intra_node_bandwidth": beta,
        "intra_node_latency": alpha,
        "inter_node_bandwidth": beta * devices,
        "inter_node_latency": alpha,
        "dtype": "fp32",
        "sources": {
            "peak_flops": "measured: fp32 matmul on one thread",
            "intra_node_bandwidth": f"measured: gloo all-reduce between {nprocs} processes",
            "measurements": [{"bytes": s, "seconds": t} for s, t in zip(sizes, seconds)],
        },
    }
    if path is not None:
        Path(path).write_text(json.dumps(hw, indent=2) + "\n")
    return hw
