"""Benchmarks: minipar against PyTorch's own implementation, measured in the same run.

    python -m minipar.bench dp      naive / bucketed / overlapped DP vs DistributedDataParallel
    python -m minipar.bench tp      minipar TP vs DTensor ColwiseParallel/RowwiseParallel
    python -m minipar.bench pp      bubble fraction vs (p-1)/(m+p-1); minipar vs torch pipelining
    python -m minipar.bench zero    ZeRO presets vs ZeroRedundancyOptimizer and FSDP2
    python -m minipar.bench moe     expert-parallel MoE layer vs one process with the same routing
    python -m minipar.bench cp      ring attention (context parallel) vs one process; torch context_parallel
    python -m minipar.bench calibrate   measure this machine into a planner hardware file
    python -m minipar.bench validate    the planner's step times against the trainer's here
    python -m minipar.bench gpu     the trainer vs a plain (nanoGPT-style) loop on one GPU: MFU

Each prints median step times, ratios to the native twin, and measured bytes next to the
formula. Timings depend on the machine and on what else runs on it: each bench names the
machine it ran on, and every ratio compares runs made in the same process tree.
"""
import platform
import statistics

import torch

BENCHES = ("dp", "tp", "pp", "zero", "moe", "cp", "gpu", "calibrate", "validate")


def machine() -> str:
    """One line naming the machine, for every printed figure."""
    import os
    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"torch {torch.__version__}, "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")


def median(xs):
    return statistics.median(xs)


def launch(path: str | None, fn, nprocs: int, *args, **kwargs) -> list:
    """``dist.launch(fn, nprocs, ...)``, every rank traced to ``path`` when it is given
    (the benches' ``--trace FILE``, ``minipar.runtime.trace``)."""
    from ..runtime import dist, trace
    if path is None:
        return dist.launch(fn, nprocs, *args, **kwargs)
    return dist.launch(trace.traced_call, nprocs, path, fn, *args, **kwargs)
