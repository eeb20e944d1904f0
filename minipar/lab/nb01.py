"""Notebook 01_data_parallel: where the gradient all-reduces happen in a step.

``dp_timelines`` runs on every rank inside ``minipar.runtime.dist.launch``; ``draw_buckets`` and
``draw_timelines`` draw; ``measure`` is the DP benchmark's (``python -m minipar.bench dp``):
naive, bucketed and overlapped DP against torch's DDP in one process tree.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from .. import comm, data, dp
from ..bench.dp import measure  # noqa: F401  (the notebook's DP-vs-DDP experiment)
from ..model import build, config


def dp_timelines(model_name: str = "tiny", modes=dp.MODES, bucket_mb: float = 0.5,
                 batch_per_rank: int = 8, steps: int = 3) -> list[dict]:
    """Time a DP training step phase by phase, and every all-reduce the engine issues.

    For each mode of ``minipar.dp.DataParallel`` (same model, same batches), ``steps`` steps;
    the last one is reported. A spy on ``comm.all_reduce`` notes when each call is issued and
    when it completes (for an asynchronous one, a callback on its future). Returns one dict
    per mode, times in seconds from the step's start: ``forward``, ``backward``, ``sync``
    (the engine's ``finish_grad_sync``: running, or waiting for, the all-reduces) and
    ``optimizer`` as (start, end), and ``comms``: a list of (bytes, start, end).
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    batches = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                           batch_per_rank * d, seed=0)
    real_all_reduce, comms = comm.all_reduce, []

    def spy(t, group=None, op="sum", async_op=False):
        row = [t.numel() * t.element_size(), time.perf_counter(), None]
        handle = real_all_reduce(t, group, op=op, async_op=async_op)
        if async_op and handle.work is not None:
            handle.work.get_future().then(lambda _: row.__setitem__(2, time.perf_counter()))
        else:
            row[2] = time.perf_counter()
        comms.append(row)
        return handle

    timelines = []
    comm.all_reduce = spy
    try:
        for mode in modes:
            model = build(cfg, seed=0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine = dp.DataParallel(model, group=comm.WORLD, mode=mode, bucket_mb=bucket_mb)
            for step in range(steps):
                comms.clear()
                x, y = batches.local_batch(step, r, d)
                comm.barrier(comm.WORLD)
                t0 = time.perf_counter()
                engine.zero_grad()
                engine.begin_step(1)
                loss = model(x, y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                engine.finish_grad_sync()
                t3 = time.perf_counter()
                opt.step()
                t4 = time.perf_counter()
            timelines.append(dict(mode=mode, forward=(0.0, t1 - t0), backward=(t1 - t0, t2 - t0),
                                  sync=(t2 - t0, t3 - t0), optimizer=(t3 - t0, t4 - t0),
                                  comms=[(b, s - t0, (e if e is not None else t3) - t0)
                                         for b, s, e in comms]))
    finally:
        comm.all_reduce = real_all_reduce
    return timelines


def draw_buckets(model, bucket_mb: float, ax=None):
    """Draw how ``dp.make_buckets`` packs ``model``'s gradients: one bar per bucket."""
    import matplotlib.pyplot as plt
    buckets = dp.make_buckets([p for p in model.parameters()], int(bucket_mb * 2**20))
    names = {p: name for name, p in model.named_parameters()}
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.45 * len(buckets) + 1))
    for i, b in enumerate(buckets):
        left = 0
        for p in b.params:
            kb = p.numel() * p.element_size() / 2**10
            ax.barh(i, kb, left=left, color=f"C{i % 10}", ec="white", lw=0.5)
            if kb > 60:   # label the parameters wide enough to hold text
                ax.text(left + kb / 2, i, names[p].replace("blocks.", "b").replace(".weight", ""),
                        ha="center", va="center", fontsize=7, color="white")
            left += kb
        ax.text(left + 5, i, f"{len(b.params)} tensors, {left:.0f} KiB", va="center", fontsize=8)
    ax.axvline(bucket_mb * 1024, color="k", ls="--", lw=1)
    ax.set_yticks(range(len(buckets)), [f"bucket {i}" for i in range(len(buckets))])
    ax.invert_yaxis()
    ax.set_xlabel("KiB (dashed: bucket_mb); parameters in backward order, last layer first")
    return ax


def draw_timelines(timelines: list[dict], titles: list[str] | None = None):
    """Gantt chart of ``dp_timelines`` results: compute phases above, all-reduces below."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.7 * len(timelines) + 0.4),
                             sharex=True, squeeze=False)
    colors = dict(forward="#4c72b0", backward="#55a868", sync="#dddddd", optimizer="#8172b2")
    for ax, tl, title in zip(axes[:, 0], timelines, titles or [t["mode"] for t in timelines]):
        for phase, color in colors.items():
            s, e = tl[phase]
            ax.barh(1, (e - s) * 1e3, left=s * 1e3, color=color, ec="k", lw=0.5)
            if e - s > 0.08 * tl["optimizer"][1]:   # label the phases wide enough to hold text
                ax.text((s + e) / 2 * 1e3, 1, phase if phase != "sync" else "sync / wait",
                        ha="center", va="center", fontsize=8)
        for i, (b, s, e) in enumerate(tl["comms"]):
            ax.barh(0, max(e - s, 1e-5) * 1e3, left=s * 1e3,
                    color="#c44e52" if i % 2 else "#e8a0a0", ec="k", lw=0.3)
        ax.set_yticks([0, 1], ["all-reduce", "compute"])
        ax.set_title(f"{title}: {len(tl['comms'])} all-reduces, "
                     f"step {tl['optimizer'][1] * 1e3:.0f} ms", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the start of the step (rank 0)")
    fig.tight_layout()
    return fig
