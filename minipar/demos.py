"""Small experiments for the workshop notebooks 00_collectives and 01_data_parallel.

The rank-side functions run on every rank inside ``minipar.dist.launch`` (that is why they
live in an importable module and not in a notebook cell) and return plain data: tensors,
numbers, lists. None of them re-implements anything: the collectives are ``minipar.comm``'s,
the ring is ``comm.ring_all_reduce``, the engine is ``minipar.dp.DataParallel``. They only
prepare inputs, time, and watch. The ``draw_*`` functions turn their results into figures
(matplotlib is imported only when drawing).

Volumes the notebooks check against ``comm.stats`` (N bytes, n ranks)::

    all_reduce 2(n-1)/n N     reduce_scatter (n-1)/n N_in     all_gather (n-1)/n N_out
    broadcast  N on the source                               send N
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as tdist

from . import comm, data, dp
from .model import build, config


# --------------------------------------------------------------------------------------
# 00_collectives: what each collective does, and what it costs
# --------------------------------------------------------------------------------------
def collectives_tour() -> dict[str, dict]:
    """Run each collective once on small, readable tensors; return before/after/bytes/time.

    Returns ``{op: dict(before=tensor, after=tensor, sent=bytes, received=bytes, seconds=s)}``
    for this rank. Inputs are chosen so the result can be checked by eye: rank r holds
    ``(r+1) * [1, 2, ...]`` for the reductions and ``10 r + [0, 1]`` for the gathers.
    """
    r, n = tdist.get_rank(), tdist.get_world_size()
    tour = {}
    with comm.untracked():   # the first call of each op sets up connections: keep it out
        comm.all_reduce(torch.zeros(2 * n), comm.WORLD)
        comm.reduce_scatter(torch.zeros(2), torch.zeros(2 * n), comm.WORLD)
        comm.all_gather(torch.zeros(2 * n), torch.zeros(2), comm.WORLD)
        comm.broadcast(torch.zeros(2), 0, comm.WORLD)

    def watch(op, before, run, after):
        comm.reset()
        comm.barrier(comm.WORLD)   # start together, so the time is the op's, not a straggler's
        run()
        row = next((row for row in comm.stats.table() if row["op"] == op),
                   dict(bytes_sent=0, bytes_received=0, seconds=0.0))
        tour[op] = dict(before=before, after=after.clone(), sent=row["bytes_sent"],
                        received=row["bytes_received"], seconds=row["seconds"])

    t = (r + 1) * torch.arange(1.0, 2 * n + 1)
    watch("all_reduce", t.clone(), lambda: comm.all_reduce(t, comm.WORLD), t)

    inp, out = (r + 1) * torch.arange(1.0, 2 * n + 1), torch.zeros(2)
    watch("reduce_scatter", inp, lambda: comm.reduce_scatter(out, inp, comm.WORLD), out)

    inp, out = 10 * r + torch.arange(2.0), torch.zeros(2 * n)
    watch("all_gather", inp, lambda: comm.all_gather(out, inp, comm.WORLD), out)

    t = 10 * r + torch.arange(1.0, 3.0)
    watch("broadcast", t.clone(), lambda: comm.broadcast(t, 0, comm.WORLD), t)

    # send/recv in pairs: even ranks send to the next odd rank, which receives
    t = 10 * r + torch.arange(1.0, 3.0) if r % 2 == 0 else torch.zeros(2)
    before = t.clone()
    if r % 2 == 0 and r + 1 < n:
        watch("send", before, lambda: comm.send(t, r + 1), t)
    elif r % 2 == 1:
        watch("recv", before, lambda: comm.recv(t, r - 1), t)
    return tour


def ring_trace() -> list[list[int]]:
    """Watch ``comm.ring_all_reduce`` work, one snapshot of this rank's chunks per step.

    Rank r starts with every element equal to 2**r, so a chunk's value, read in binary, says
    which ranks have been summed into it (0b0101: ranks 0 and 2). A spy on ``comm.recv``
    (the ring calls it once per step) photographs the chunks before each step; the last
    snapshot is the result. Returns 2(n-1)+1 lists of n integers.
    """
    r, n = tdist.get_rank(), tdist.get_world_size()
    t = torch.full((n,), float(2 ** r), dtype=torch.float64)   # one element per chunk
    snapshots = []
    real_recv = comm.recv

    def spy(buffer, src):
        snapshots.append([int(v) for v in t.tolist()])
        real_recv(buffer, src)

    comm.recv = spy
    try:
        comm.ring_all_reduce(t, comm.WORLD)
    finally:
        comm.recv = real_recv
    snapshots.append([int(v) for v in t.tolist()])
    return snapshots


def ring_vs_all_reduce(numel: int = 2**16, repeats: int = 5) -> dict:
    """The ring from send/recv against gloo's all-reduce on the same random tensor.

    Returns the largest difference between the two results, the bytes each recorded in
    ``comm.stats`` (the ring as ``send``), and the median time of each over ``repeats`` calls.
    """
    r, n = tdist.get_rank(), tdist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    out, times = {}, {"ring": [], "all_reduce": []}
    for _ in range(repeats):
        for name in times:
            y = x.clone()
            comm.reset()
            comm.barrier(comm.WORLD)
            t0 = time.perf_counter()
            if name == "ring":
                comm.ring_all_reduce(y, comm.WORLD)
            else:
                comm.all_reduce(y, comm.WORLD)
            times[name].append(time.perf_counter() - t0)
            out[name] = (y, comm.stats.bytes_by_op())
    return dict(max_diff=(out["ring"][0] - out["all_reduce"][0]).abs().max().item(),
                ring_bytes=out["ring"][1], all_reduce_bytes=out["all_reduce"][1],
                N=numel * x.element_size(), n=n,
                ring_s=statistics.median(times["ring"]),
                all_reduce_s=statistics.median(times["all_reduce"]))


def collective_sweep(sizes: list[int], repeats: int = 10) -> dict[str, list[list[float]]]:
    """Seconds per call of ``comm.all_reduce`` and ``comm.ring_all_reduce`` per message size.

    ``sizes`` are float32 element counts (each a multiple of the world size). Every call
    starts after a barrier, and the sizes take turns in each of the ``repeats`` rounds, so a
    burst of load from elsewhere on the machine hits all of them alike. Returns
    ``{"all_reduce": [[s, ...] per size], "ring": [...]}``: this rank's ``repeats`` timings
    of each size, in the order of ``sizes``.
    """
    ops = {"all_reduce": lambda y: comm.all_reduce(y, comm.WORLD),
           "ring": lambda y: comm.ring_all_reduce(y, comm.WORLD)}
    times = {(name, numel): [] for name in ops for numel in sizes}
    for round_ in range(repeats + 1):          # round 0 is a warm-up: connections, buffers
        for numel in sizes:
            for name, op in ops.items():
                y = torch.ones(numel)
                comm.barrier(comm.WORLD)
                t0 = time.perf_counter()
                op(y)
                if round_ > 0:
                    times[name, numel].append(time.perf_counter() - t0)
    return {name: [times[name, numel] for numel in sizes] for name in ops}


def draw_ring(traces: list[list[list[int]]]):
    """Draw ``ring_trace`` results (one per rank): the ring after every step.

    Each panel shows the n ranks around the ring, each with its n chunks; a chunk's colour is
    how many ranks are summed into it and its label lists them (Σ: all). Arrows are the sends
    of the step just done, labelled with the chunk sent, found from what each receiver changed.
    """
    import matplotlib.pyplot as plt
    n = len(traces)
    fig, axes = plt.subplots(2, n, figsize=(3.0 * n, 6.2))
    panels = [(0, 0, 0, "start: rank r holds its own tensor")]
    panels += [(0, k, k, f"reduce-scatter step {k}") for k in range(1, n)]
    panels += [(1, k, n - 1 + k, f"all-gather step {k}") for k in range(1, n)]
    cmap = plt.get_cmap("Blues")
    for ax in axes.flat:
        ax.set_xlim(-1.9, 1.9), ax.set_ylim(-1.7, 1.7), ax.set_aspect("equal"), ax.axis("off")
    # clockwise from the top: rank r+1 is r's right neighbour
    pos = [(1.25 * math.cos(math.pi / 2 - 2 * math.pi * r / n),
            math.sin(math.pi / 2 - 2 * math.pi * r / n)) for r in range(n)]
    w = 0.9 / n
    for row, col, s, title in panels:
        ax = axes[row, col]
        ax.set_title(title, fontsize=9)
        for r in range(n):
            x0, y0 = pos[r]
            ax.text(x0, y0 + 0.27, f"rank {r}", ha="center", va="center", fontsize=8)
            for c, v in enumerate(traces[r][s]):
                members = [str(k) for k in range(n) if v >> k & 1]
                received = s > 0 and v != traces[r][s - 1][c]
                edge = dict(ec="C3", lw=2.5, zorder=3) if received else dict(ec="k", lw=0.8)
                ax.add_patch(plt.Rectangle((x0 - 0.45 + c * w, y0 - 0.15), w, 0.3,
                                           fc=cmap(0.15 + 0.85 * len(members) / n), **edge))
                label = "Σ" if len(members) == n else "".join(members)
                ax.text(x0 - 0.45 + (c + 0.5) * w, y0, label, ha="center", va="center",
                        fontsize=7, zorder=4,
                        color="white" if len(members) > n / 2 else "black")
            if s > 0:   # the chunk that changed on my right neighbour is the one I sent
                right = (r + 1) % n
                sent = [c for c in range(n) if traces[right][s][c] != traces[right][s - 1][c]]
                x1, y1 = pos[right]
                ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=1,
                            arrowprops=dict(arrowstyle="->", color="C3", lw=1.5, shrinkA=16,
                                            shrinkB=16, connectionstyle="arc3,rad=0.3"))
                # label on the arc's side of the chord from r to its right neighbour
                ax.text((x0 + x1) / 2 + 0.25 * (y1 - y0), (y0 + y1) / 2 - 0.25 * (x1 - x0),
                        ",".join(f"c{c}" for c in sent),
                        color="C3", fontsize=9, ha="center", va="center", fontweight="bold")
    legend = axes[1, 0]
    legend.text(0, 0, f"chunk c0..c{n - 1} of each rank\nlabel: ranks summed in\n"
                      f"Σ: all {n} ranks\nred: chunk sent this step,\n"
                      f"red box: chunk just received\n\n"
                      f"every rank sends {2 * (n - 1)} chunks\nof N/{n} bytes = 2(n-1)/n N",
                ha="center", va="center", fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------
# 01_data_parallel: where the gradient all-reduces happen in a step
# --------------------------------------------------------------------------------------
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
            engine = dp.DataParallel(model, comm.WORLD, mode=mode, bucket_mb=bucket_mb,
                                     optimizer=opt)
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
