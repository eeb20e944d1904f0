"""Notebook 00_collectives: what each collective does, and what it sends.

The rank-side functions run on every rank inside ``minipar.runtime.dist.launch`` and return plain
data. None of them re-implements anything: the collectives are ``minipar.comm``'s and the
ring is ``p2p_order.ring_all_reduce``; they only prepare inputs, time, and watch. The notebook
holds the bytes each rank recorded against ``minipar.plan.ring_bytes`` (N bytes, n ranks)::

    all_reduce 2(n-1)/n N     reduce_scatter (n-1)/n N_in     all_gather (n-1)/n N_out
    broadcast  N on the source                               send N
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as tdist

from .. import comm, p2p_order


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
    """Watch ``p2p_order.ring_all_reduce`` work, one snapshot of this rank's chunks per step.

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
        p2p_order.ring_all_reduce(t, comm.WORLD)
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
                p2p_order.ring_all_reduce(y, comm.WORLD)
            else:
                comm.all_reduce(y, comm.WORLD)
            times[name].append(time.perf_counter() - t0)
            out[name] = (y, comm.stats.bytes_by_op())
    return dict(max_diff=(out["ring"][0] - out["all_reduce"][0]).abs().max().item(),
                ring_bytes=out["ring"][1], all_reduce_bytes=out["all_reduce"][1],
                N=numel * x.element_size(), n=n,
                ring_s=statistics.median(times["ring"]),
                all_reduce_s=statistics.median(times["all_reduce"]))


def ring_orders() -> dict[str, list]:
    """One step of a ring (send right, receive from the left) in three orders, recorded.

    ``"everyone receives first"`` and ``"everyone sends first"`` are the two obvious orders
    (each rank posts both ops, then waits for both: ``isend``/``irecv``, which gloo finishes in
    any order); ``"ring_all_reduce"`` is ``p2p_order.ring_all_reduce`` itself (even ranks send
    first, odd ranks receive first). Returns this rank's recording of each
    (``minipar.p2p_order``), for the notebook to replay under NCCL's rule.
    """
    r, n = tdist.get_rank(), tdist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    out = {}
    for name in ("everyone receives first", "everyone sends first"):
        mine, theirs = torch.full((4,), float(r)), torch.empty(4)
        with p2p_order.record() as log:
            send = lambda: comm.isend(mine, right)      # noqa: E731
            recv = lambda: comm.irecv(theirs, left)     # noqa: E731
            handles = [recv(), send()] if "receives" in name else [send(), recv()]
            for h in handles:
                h.wait()
        assert theirs[0].item() == left                 # gloo delivered it either way
        out[name] = log.events
    with p2p_order.record() as log:
        p2p_order.ring_all_reduce(torch.ones(4 * n), comm.WORLD)
    out["ring_all_reduce"] = log.events
    return out


def collective_sweep(sizes: list[int], repeats: int = 10) -> dict[str, list[list[float]]]:
    """Seconds per call of ``comm.all_reduce`` and ``p2p_order.ring_all_reduce`` per message size.

    ``sizes`` are float32 element counts (each a multiple of the world size). Every call
    starts after a barrier, and the sizes take turns in each of the ``repeats`` rounds, so a
    burst of load from elsewhere on the machine hits all of them alike. Returns
    ``{"all_reduce": [[s, ...] per size], "ring": [...]}``: this rank's ``repeats`` timings
    of each size, in the order of ``sizes``.
    """
    ops = {"all_reduce": lambda y: comm.all_reduce(y, comm.WORLD),
           "ring": lambda y: p2p_order.ring_all_reduce(y, comm.WORLD)}
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
