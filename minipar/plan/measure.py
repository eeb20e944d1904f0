"""The planner against this machine: ``calibrate`` it, then ``validate`` the predictions.

``calibrate`` makes two measurements, both quick:

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

``validate_step_time`` (``python -m minipar.plan validate``) runs ``minipar.train`` on a few
layouts of a small model and sets each measured step time (median after the first step)
next to ``estimate``'s prediction on the calibrated hardware. Expect the prediction to be
low: it times matmuls at the rate of a large one and collectives at the fitted bandwidth,
while a small model on a CPU also spends its step in Python, element-wise kernels, the
optimizer and small, inefficient matmuls. ``model_states_vs_plan`` does the same for the
model-state bytes, which must agree exactly.
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


# --------------------------------------------------------------------------------------
# Predictions against minipar.train's measurements
# --------------------------------------------------------------------------------------
VALIDATION_LAYOUTS = {          # name -> minipar.train flags
    "1 rank": ["--nproc", "1"],
    "DP 2": ["--nproc", "2"],
    "TP 2": ["--nproc", "2", "--tp", "2"],
    "PP 2": ["--nproc", "2", "--pp", "2"],
}


def _trainer_args(argv: list[str]):
    """The trainer's parsed and validated arguments (dp and micro-batches filled in)."""
    from minipar.train import parser, validate
    args = parser().parse_args(argv)
    validate(args)
    return args


def _spec(args):
    if args.zero is None and args.shard is None:
        return (1, 1, 1)
    from minipar.zero import spec_from_args
    return tuple(spec_from_args(args))


def layout_of(argv: list[str]):
    """The planner's ``Layout`` of a ``minipar.train`` command line."""
    from .layout import Layout
    args = _trainer_args(argv)
    interleaved = args.schedule == "interleaved"
    return Layout(tp=args.tp, pp=args.pp, dp=args.dp,
                  micro_batch=args.batch_size // (args.dp * args.microbatches),
                  microbatches=args.microbatches, shard=_spec(args),
                  v=args.chunks if interleaved else 1, sp=args.sp,
                  schedule="gpipe" if args.schedule == "gpipe" else "1f1b")


def _silent_worker(argv: list[str]):
    """``minipar.train.worker`` without its summary lines (they would spoil --json)."""
    import contextlib
    import io
    from minipar.train import worker
    with contextlib.redirect_stdout(io.StringIO()):
        return worker(argv)


def train_history(argv: list[str], timeout: float = 300.0) -> list[dict]:
    """Rank 0's metrics of a ``minipar.train`` run, its output silenced; one rank runs in
    this process on one thread, as each launched rank does."""
    import torch
    from minipar.dist import launch
    nproc = _trainer_args(argv).nproc or 1
    if nproc == 1:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _silent_worker(argv)
        finally:
            torch.set_num_threads(before)
    return launch(_silent_worker, nproc, argv, timeout=timeout)[0]


def validate_step_time(model: str = "tiny", layouts: dict | None = None, steps: int = 6,
                       batch_size: int = 16, hardware=None, overlap: float | None = None,
                       quick: bool = True) -> dict:
    """Predicted against measured step time of ``minipar.train`` on this machine.

    ``hardware``: a preset, file or ``Hardware``; default: ``calibrate`` this machine now
    (``quick``). ``layouts``: {name: trainer flags}, default ``VALIDATION_LAYOUTS``.
    Returns {"machine", "hardware", "load_before", "load_after", "rows": [{"layout",
    "argv", "predicted_s", "measured_s", "ratio" (predicted / measured), "times"}]}.
    """
    from minipar.bench import machine
    from .estimate import DEFAULT_OVERLAP, estimate
    from .hardware import hardware_from_dict, load_hardware
    from .shapes import model_preset
    load_before = os.getloadavg()
    if hardware is None:
        data = calibrate(nprocs=2, quick=quick, name="laptop-cpu, calibrated here")
        hw = hardware_from_dict(data, where="calibration")
    else:
        hw = load_hardware(hardware)
    shape = model_preset(model)
    rows = []
    for name, flags in (layouts or VALIDATION_LAYOUTS).items():
        argv = ["--model", model, "--steps", str(steps), "--batch-size", str(batch_size),
                "--quiet", *flags]
        history = train_history(argv)
        timed = sorted(h["step_time_s"] for h in history[1:] or history)   # step 1 warms up
        measured = timed[len(timed) // 2]
        e = estimate(shape, hw, layout_of(argv), dtype="fp32",
                     overlap=DEFAULT_OVERLAP if overlap is None else overlap)
        rows.append({"layout": name, "argv": argv, "predicted_s": e.step_time,
                     "measured_s": measured, "ratio": e.step_time / measured,
                     "times": dict(e.times)})
    return {"machine": machine(), "hardware": hw.to_dict(), "load_before": load_before,
            "load_after": os.getloadavg(), "rows": rows}


def model_states_vs_plan(flags: list[str], model: str = "tiny", steps: int = 2,
                         batch_size: int = 16) -> dict:
    """Model-state bytes per rank: ``minipar.train``'s measurement and the planner's
    prediction (fp32 Adam, Phi = the model's parameter count) for a data-parallel or
    ZeRO/AMSP run (``flags`` such as ["--nproc", "4", "--shard", "1,2,4"]; no TP or PP).

    Returns {"measured": {...}, "predicted": {...}, "spec": (s_p, s_g, s_os), "dp": d}.
    """
    from .memory import model_state_bytes
    from .shapes import model_preset
    argv = ["--model", model, "--steps", str(steps), "--batch-size", str(batch_size),
            "--quiet", *flags]
    args = _trainer_args(argv)
    if args.tp > 1 or args.pp > 1:
        raise ValueError("model_states_vs_plan compares data-parallel runs; leave out --tp, --pp")
    shape = model_preset(model)
    spec = _spec(args)
    sharded = args.zero is not None or args.shard is not None
    # Adam's step counters: minipar.zero gives the optimizer one flat tensor per unit
    # (embedding, each block, head); plain DP one per parameter tensor
    tensors = shape.layers + 2 if sharded else _parameter_tensors(model)
    predicted = model_state_bytes(shape.params, args.dp, shard=spec, dtype="fp32",
                                  step_counters=tensors)
    measured = train_history(argv)[-1]["model_state_bytes"]
    return {"measured": measured, "predicted": predicted, "spec": spec, "dp": args.dp}


def _parameter_tensors(model: str) -> int:
    from minipar.model import build
    return len(list(build(model).parameters()))
