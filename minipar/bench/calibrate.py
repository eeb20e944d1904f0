"""The planner against this machine: ``calibrate`` it, then ``validate`` the predictions.

    python -m minipar.bench calibrate [--nproc 2] [--quick] [--out FILE]
    python -m minipar.bench validate  [--layouts 1,dp2,tp2,pp2] [--hardware FILE]

This is the part of the planner that needs torch and runs the trainer, so it lives with the
benchmarks and the planner itself stays torch-free (``minipar.plan`` imports nothing from
here; ``minipar.bench.validate`` holds the comparisons).

``calibrate`` measures, all quickly:

* matmul FLOP/s (``peak_flops``): an n x n fp32 matmul (2 n^3 FLOPs) on one thread, since
  ``minipar.runtime.dist.launch`` gives each process (each "device") one thread; and the rate of
  each GEMM shape the calibration model runs at tensor-parallel degrees 1 and 2
  (``matmul_table``: the planner times each matmul of a step at its shape's rate);
* memory bandwidth (``hbm_bandwidth``): a large tensor copy, bytes read and written over
  time, what the planner charges memory-bound kernels and the optimizer step at;
* collectives (``collective_table``): all-reduce, all-gather and reduce-scatter of growing
  size between ``nprocs`` local processes over gloo, through ``minipar.comm`` as the
  trainer calls them, each issued after a short burst of compute and timed as the mean
  over repeats (``collective_times`` says why). The planner interpolates this table for
  groups of ``nprocs`` ranks; a line through the all-reduce points (alpha-beta: time =
  steps x alpha + bytes / beta, 2 (n-1) steps and 2 (n-1)/n N bytes for an N-byte
  all-reduce, fitted to *relative* residuals so the small messages set alpha) is the
  fallback for every other group;
* interference (``overlap_slowdown``): matmuls timed alone and while an asynchronous
  all-reduce runs beside them; the planner charges hidden communication this fraction of
  its time in compute;
* a real training step (``step_calibration``): ``minipar.train`` on one process and one
  thread, as every rank here runs, on a small model (the trainer's ``tiny`` preset, global
  batch 16, by default): the median of a few steps after warm-up, over what the planner
  predicts for it from the measurements above. What a first-order model leaves out
  (Python, kernel launches, the allocator) lands in this one factor, so that
  configuration is the *calibration point*: its predicted step time equals its measured
  one by construction, up to run-to-run noise, and only the *other* layouts test the model.

The file treats the machine as one node of ``os.cpu_count()`` devices, each with an equal
share of the RAM, and so assumes each process has a core to itself while it computes (true on
the 2-core VM this was written on: two one-thread matmuls at once each ran at 97-99% of the
rate of one alone; where ``os.cpu_count()`` counts hyperthreads it does not hold, and
``gpus_per_node`` should be the physical cores). There is no second node: the inter-node
fields repeat the loopback numbers (x devices per node, since a node's NICs are shared by
its devices).

``minipar.bench.validate`` holds the calibrated model against ``minipar.train`` runs.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..runtime.cli import emit, text_table

QUICK_SIZES = [2**12, 2**16, 2**20, 2**22]                 # bytes
FULL_SIZES = [2**k for k in range(10, 25, 2)]              # 1 KiB .. 16 MiB
WORK_S = 0.002    # compute before each timed all-reduce: what a TP rank of tiny computes
                  # between two of its collectives


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


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def collective_times(sizes: list[int], repeats: int, work_s: float = WORK_S,
                     ops: tuple = ("all_reduce",)) -> dict[str, list[float]]:
    """Run on every rank (by ``minipar.runtime.dist.launch``): mean seconds per call by op and
    size (bytes of the full buffer: the all-reduce's, the gather's output, the
    reduce-scatter's input), through ``minipar.comm`` as the trainer calls them.

    Each call is issued the way the trainer issues its collectives: after ``work_s``
    seconds of matmul on this rank and with no barrier, so a rank that finishes its compute
    first waits inside the collective. Timed back to back after a barrier instead, the
    collective finds both processes awake and in step, which a training step rarely gives
    it. The difference can be large on a virtual machine: a waiting core that goes idle
    may be woken only at the next scheduler tick (4 ms at HZ=250), so a collective costs
    either a fraction of a millisecond or a few (on the 2-core VM this was written on, a
    4 KiB all-reduce took 0.15-0.3 ms back to back, 1.5-2 ms on average after compute).
    A step pays the sum of many collectives, so its cost is the mean, not the median
    (which picks one of the two modes at random).
    """
    import torch
    import torch.distributed as dist
    from minipar import comm
    torch.set_num_threads(1)
    n = dist.get_world_size()
    a = torch.randn(256, 256)
    out = {}
    for op in ops:
        out[op] = []
        for nbytes in sizes:
            full = torch.zeros(max(n, nbytes // 4 // n * n))
            part = torch.zeros(full.numel() // n)

            def call():
                with comm.untracked():
                    if op == "all_reduce":
                        comm.all_reduce(full, comm.WORLD)
                    elif op == "all_gather":
                        comm.all_gather(full, part, comm.WORLD)
                    else:
                        comm.reduce_scatter(part, full, comm.WORLD)
            call()                                       # warm up this size
            dist.barrier()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < work_s:
                    a @ a
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[op].append(sum(times) / len(times))
    return out


def overlap_slowdown(nbytes: int = 16 * 2**20, matmuls: int = 40) -> float:
    """Run on every rank: how much slower compute runs while a collective runs beside it.
    Times ``matmuls`` 256 x 256 matmuls alone, then again just after starting an
    asynchronous all-reduce of ``nbytes`` (sized to last about as long); returns
    with / alone - 1."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    x = torch.zeros(nbytes // 4)

    def compute():
        t0 = time.perf_counter()
        for _ in range(matmuls):
            a @ a
        return time.perf_counter() - t0
    compute()
    alone = min(compute() for _ in range(3))
    dist.barrier()
    work = dist.all_reduce(x, async_op=True)
    beside = compute()
    work.wait()
    dist.barrier()
    return max(0.0, beside / alone - 1)


def allreduce_times(sizes: list[int], repeats: int, work_s: float = WORK_S) -> list[float]:
    """``collective_times`` of the all-reduce alone."""
    return collective_times(sizes, repeats, work_s)["all_reduce"]


def copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes read and written per second by a large tensor copy on one thread: the rate
    the planner charges memory-bound kernels at."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(nbytes // 4)
        y = torch.empty_like(x)
        y.copy_(x)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            y.copy_(x)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * nbytes / best


def gemm_rates(shapes: list[tuple[int, int, int]], repeats: int = 3) -> list[dict]:
    """Measured fp32 FLOP/s of each (m, n, k) GEMM on one thread (best of ``repeats``)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for m, n, k in sorted(set(shapes)):
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            rows.append({"m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / best})
    finally:
        torch.set_num_threads(before)
    return rows


def model_gemms(model: str, batch_size: int, tps=(1, 2)) -> list[tuple[int, int, int]]:
    """The GEMM shapes a training step of ``model`` runs at these TP degrees (forward and
    both backward products, the attention core's batched products, the logits)."""
    from minipar.plan.compute import layer_gemms
    from minipar.plan.shapes import model_preset
    shape = model_preset(model)
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    out = []
    for tp in tps:
        if a % tp:
            continue
        for tokens in {s, batch_size * s}:
            gemms = layer_gemms(shape, tokens, tp) + [(tokens, -(-shape.vocab // tp), h)]
            for m, n, k in gemms:
                out += [(m, n, k), (m, k, n), (k, n, m)]
        out += [(s, s, h // a), (s, h // a, s)]
    return out


def fit_alpha_beta(sizes: list[int], seconds: list[float], n: int) -> tuple[float, float]:
    """Fit time = 2 (n-1) alpha + (2 (n-1)/n N) / beta; returns (alpha, beta).

    Least squares on relative residuals (each point weighted by 1 / its time): a 4 KiB and
    a 4 MiB all-reduce count alike, so alpha comes from the small messages it dominates.
    """
    import numpy as np
    sent = np.array([2 * (n - 1) / n * s for s in sizes], dtype=float)
    t = np.array(seconds, dtype=float)
    slope, intercept = np.polyfit(sent, t, 1, w=1.0 / t)
    beta = 1.0 / slope if slope > 0 else float(sent.max() / t.max())
    alpha = max(intercept, 0.0) / (2 * (n - 1))
    return alpha, beta


def step_rate(model: str = "tiny", batch_size: int = 16, steps: int = 5,
              warmup: int = 2) -> dict:
    """The model FLOP/s a real training step achieves here: ``minipar.train`` on one
    process and one thread (``--nproc 1``), median of ``steps`` steps after ``warmup``.

    Returns {"model", "batch_size", "argv", "model_flops", "seconds", "flops_per_s",
    "step_times"}; ``model_flops`` is ``training_flops`` without recomputation.
    """
    from minipar.plan.shapes import model_preset, training_flops
    argv = ["--model", model, "--steps", str(warmup + steps), "--batch-size", str(batch_size),
            "--quiet", "--nproc", "1"]
    history = train_history(argv)
    times = sorted(h["step_time_s"] for h in history[warmup:])
    seconds = times[len(times) // 2]
    flops = training_flops(model_preset(model), batch_size, "none")
    return {"model": model, "batch_size": batch_size, "argv": argv, "model_flops": flops,
            "seconds": seconds, "flops_per_s": flops / seconds, "step_times": times}


def _trainer_args(argv: list[str]):
    """The trainer's checked run config (dp and micro-batches resolved)."""
    from minipar.train import parse_config
    return parse_config(argv)


def _silent_worker(argv: list[str]):
    """``minipar.train.worker`` without its summary lines (they would spoil --json)."""
    import contextlib
    import io
    from minipar.train import parse_config, worker
    with contextlib.redirect_stdout(io.StringIO()):
        return worker(parse_config(argv))


def train_history(argv: list[str], timeout: float = 300.0) -> list[dict]:
    """Rank 0's metrics of a ``minipar.train`` run, its output silenced; one rank runs in
    this process on one thread, as each launched rank does."""
    import torch
    from minipar.runtime.dist import launch
    nproc = _trainer_args(argv).nproc or 1
    if nproc == 1:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _silent_worker(argv)
        finally:
            torch.set_num_threads(before)
    return launch(_silent_worker, nproc, argv, timeout=timeout)[0]


def calibrate(nprocs: int = 2, quick: bool = False, path: str | Path | None = None,
              name: str = "calibrated", model: str = "tiny", batch_size: int = 16) -> dict:
    """Measure this machine; return the hardware dict (and write it to ``path`` if given).

    ``model`` and ``batch_size``: the training step whose measured time over the planner's
    prediction sets ``step_calibration`` (one process, one thread): the calibration point.
    """
    from minipar.runtime.dist import launch
    from minipar.plan.compute import compute_parts
    from minipar.plan.errors import PlanError
    from minipar.plan.hardware import hardware_from_dict
    from minipar.plan.layout import Layout
    from minipar.plan.shapes import model_preset
    if nprocs < 2:
        raise PlanError(f"calibrate needs at least 2 processes to time collectives, "
                        f"got --nproc {nprocs}")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    flops = matmul_flops(n=512 if quick else 1024, repeats=3 if quick else 5)
    bandwidth = copy_bandwidth(16 * 2**20 if quick else 64 * 2**20)
    table = gemm_rates(model_gemms(model, batch_size), repeats=2 if quick else 3)
    step = step_rate(model, batch_size, steps=3 if quick else 5, warmup=1 if quick else 2)
    per_rank = launch(collective_times, nprocs, sizes=sizes, repeats=10 if quick else 40,
                      ops=COLLECTIVES, backend="gloo", timeout=180.0)
    seconds = {op: [max(rank[op][i] for rank in per_rank) for i in range(len(sizes))]
               for op in COLLECTIVES}
    slowdown = min(0.95, max(launch(overlap_slowdown, nprocs, backend="gloo", timeout=120.0)))
    alpha, beta = fit_alpha_beta(sizes, seconds["all_reduce"], nprocs)
    from minipar.plan.hardware import _cpu_cores
    devices = _cpu_cores()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = {
        "name": name,
        "description": f"measured by 'python -m minipar.bench calibrate' on {os.uname().nodename}",
        "gpus_per_node": devices,
        "memory_bytes": ram // devices,
        "peak_flops": flops,
        "compute_efficiency": 1.0,
        "intra_node_bandwidth": beta,
        "intra_node_latency": alpha,
        "inter_node_bandwidth": beta * devices,
        "inter_node_latency": alpha,
        "dtype": "fp32",
        "hbm_bandwidth": bandwidth,
        "matmul_table": table,
        "collective_table": [{"op": op, "bytes": b, "per_node": nprocs, "nodes": 1,
                              "seconds": t} for op in COLLECTIVES
                             for b, t in zip(sizes, seconds[op])],
        "fragmentation": 0.1,
        "overlap_slowdown": slowdown,
        "cores": devices,
    }
    shape = model_preset(model)
    predicted = compute_parts(shape, hardware_from_dict(dict(hw), where="calibration"),
                              Layout(micro_batch=batch_size), "fp32")["total"]
    hw["step_calibration"] = step["seconds"] / predicted
    hw["sources"] = {
        "peak_flops": "measured: fp32 matmul on one thread; compute_efficiency 1 since this "
                      "is the large-GEMM rate itself",
        "matmul_table": f"measured: the GEMM shapes of '{model}' at tp 1 and 2, one thread",
        "hbm_bandwidth": "measured: a large tensor copy on one thread (bytes read + written)",
        "step_calibration": (
            f"measured: a training step of minipar.train's '{model}' (global batch "
            f"{batch_size}, one process, one thread) took {step['seconds'] * 1e3:.1f} ms, "
            f"this factor times the planner's prediction from the other measurements. "
            f"That layout is the calibration point: its prediction equals its measurement "
            f"by construction"),
        "calibration_step": step,
        "collective_table": (f"measured: gloo collectives between {nprocs} processes through "
                             f"minipar.comm, each issued after {WORK_S * 1e3:.0f} ms of "
                             f"compute, as the trainer issues them; mean over repeats"),
        "intra_node_bandwidth": "fitted to the measured all-reduces (alpha-beta fallback)",
        "fragmentation": "assumption: 10% of RAM lost to the allocator and the runtime",
        "cores": "measured: the cores this process may run on (os.sched_getaffinity); more "
                 "one-thread processes than this time-slice them",
        "overlap_slowdown": "measured: 256 x 256 matmuls while a 4 MiB gloo all-reduce runs "
                            "beside them, over the same matmuls alone, minus 1 (the slower "
                            "rank, at most 0.95)",
        "measurements": [{"bytes": s, "seconds": t}
                         for s, t in zip(sizes, seconds["all_reduce"])],
    }
    if path is not None:
        Path(path).write_text(json.dumps(hw, indent=2) + "\n")
    return hw


# --------------------------------------------------------------------------------------
# The command line: python -m minipar.bench calibrate
# --------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / 2**30:,.2f} GiB"


def cmd_calibrate(args) -> None:
    from minipar.runtime.cli import check_output_file
    check_output_file(args.out, "--out")          # before the measurements, not after them
    hw = calibrate(nprocs=args.nproc, quick=args.quick, path=args.out, model=args.model,
                   batch_size=args.batch_size)
    step = hw["sources"]["calibration_step"]
    rows = [["matmul FLOP/s (one thread)", f"{hw['peak_flops']:.3g}"],
            ["memory bandwidth, copy (bytes/s)", f"{hw['hbm_bandwidth']:.3g}"],
            ["GEMM shapes timed", len(hw["matmul_table"])],
            [f"training step of {step['model']}, batch {step['batch_size']} (s)",
             f"{step['seconds']:.3g}"],
            ["  its model FLOP/s", f"{step['flops_per_s']:.3g}"],
            ["  step_calibration (measured / predicted)", f"{hw['step_calibration']:.3f}"],
            ["all-reduce bandwidth, alpha-beta fit (bytes/s)",
             f"{hw['intra_node_bandwidth']:.3g}"],
            ["latency per ring step, alpha-beta fit (s)", f"{hw['intra_node_latency']:.3g}"],
            ["devices (cores)", hw["gpus_per_node"]],
            ["memory per device", _gib(hw["memory_bytes"])]]
    table = {}
    for row in hw["collective_table"]:
        table.setdefault(row["bytes"], {})[row["op"]] = row["seconds"]
    ops = ["all_reduce", "all_gather", "reduce_scatter"]
    # the alpha-beta fallback (fitted to the all-reduces only) beside each measurement
    from dataclasses import replace
    from minipar.plan.hardware import hardware_from_dict
    from minipar.plan.network import ring_time
    model = replace(hardware_from_dict(dict(hw), where="calibration"), collective_table=None)
    sizes = [[f"{b:,}", *(f"{table[b][op] * 1e3:.3f} / {ring_time(op, b, args.nproc, 1, model) * 1e3:.3f}"
                          for op in ops)] for b in sorted(table)]
    emit(args, hw, text_table(rows, ["measured", "value"]) + "\n\n"
          + text_table(sizes, ["bytes", *(f"{op} ms (measured / alpha-beta)" for op in ops)])
          + f"\n\nwrote {args.out}: use it as --hardware {args.out}; the calibration point "
          f"is one process of {step['model']} at global batch {step['batch_size']}")



def build_parser():
    from minipar.runtime.cli import ArgumentParser
    from minipar.runtime.cli import positive_int as positive
    p = ArgumentParser(prog="python -m minipar.bench calibrate",
                       description="measure this machine into a planner hardware file")
    p.add_argument("--nproc", type=positive, default=2, help="gloo processes for the collective measurements")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (tests)")
    p.add_argument("--out", default="calibrated-hardware.json", help="the hardware file to write")
    p.add_argument("--model", default="tiny",
                   help="the minipar.model preset whose training step (one process, one "
                        "thread) sets step_calibration: the calibration point (default tiny)")
    p.add_argument("--batch-size", type=positive, default=16,
                   help="its global batch, in sequences (default 16)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p



def main(argv=None) -> int:
    """``python -m minipar.bench calibrate``."""
    import sys
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd_calibrate(args)
    return 0
