"""Experiments of ``notebooks/09_long_context.ipynb`` (context parallelism, ``minipar.cp``).

* ``activation_bytes``: on every rank of ``dist.launch`` (or one process), the bytes one
  transformer layer saves for backward for one sequence of each length, with the sequence
  split over the cp ranks, against the planner's closed form;
* ``score_bytes``: the attention score matrix one rank would hold with the math (unfused)
  kernel, s^2 per head, against ring attention's largest block;
* ``imbalance``: the scores each rank computes, and each rank's measured time step by step,
  with a plain split and with the load-balanced one;
* ``at_scale``, ``search_long_context``: the planner's view of a long-context run
  (``plan.estimate`` per cp: memory per GPU, step time, the ring's exposed time, and whether
  one ring step's message hides behind its attention block; ``plan.search``, which turns to
  cp > 1 because nothing fits without it);
* the ``draw_*`` functions: the notebook's figures.
"""
from __future__ import annotations

import math
import time

import torch

from .. import comm, cp, data
from ..runtime import dist
from ..train.memory import saved_tensors_by_layer
from ..train.mfu import shape_of
from ..model import build, config
from ..plan import Layout, estimate, model_preset, search
from ..plan.cp import cp_layer_activation_bytes, kv_block_bytes, ring_step_times
from ..plan.shapes import with_seq_len


def activation_bytes(seq_lens, model: str = "tiny", batch: int = 1, group="world") -> list[dict]:
    """On every rank of a cp ring over ``group`` (default: the whole world, or one process):
    per sequence length, the bytes block 1 saves for backward on this rank, and the planner's
    formula (fp32)."""
    import torch.distributed as tdist
    if group == "world":
        group = tdist.group.WORLD if tdist.is_initialized() else None
    n = comm.size(group)
    rows = []
    for s in seq_lens:
        cfg = config(model, seq_len=s)
        net = cp.parallelize(build(cfg, seed=0), group, s)
        x = torch.randint(0, cfg.vocab_size, (batch, s), generator=torch.Generator().manual_seed(0))
        mine = cp.shard_sequence(x, n, comm.rank(group))
        with saved_tensors_by_layer(net) as saved:
            loss = net(mine, mine)
        loss.backward()
        planned = cp_layer_activation_bytes(shape_of(cfg), batch, cp=n, flash=True, dtype="fp32")
        rows.append(dict(seq_len=s, cp=n, measured=saved["blocks.1"], planned=planned))
    return rows


def score_bytes(seq_len: int, heads: int, cp_degree: int = 1, batch: int = 1,
                bytes_per_elem: int = 4) -> int:
    """b h (s/cp)^2 e: one rank's score block (what an unfused kernel holds for all of s at
    cp = 1; ring attention never holds a larger block)."""
    s = seq_len // cp_degree
    return batch * heads * s * s * bytes_per_elem


def imbalance(seq_len: int, n: int, heads: int = 4, head_dim: int = 32, repeats: int = 3,
              balanced: bool = True) -> dict:
    """Each simulated rank's block computations, step by step, timed in this process.

    Returns ``work`` (scores per rank, exact), ``seconds[t][r]`` (the best of ``repeats``
    timings of rank r's computation at step t), ``trace`` (whose block), the ring's time
    (each step waits for its slowest rank) and the ideal time (the work spread evenly).
    """
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=g) for _ in range(3))
    qs = [cp.shard_sequence(q, n, r, balanced, dim=2) for r in range(n)]
    kvs = [torch.stack([cp.shard_sequence(k, n, r, balanced, dim=2),
                        cp.shard_sequence(v, n, r, balanced, dim=2)]) for r in range(n)]
    scale = 1.0 / math.sqrt(head_dim)
    seconds = [[0.0] * n for _ in range(n)]
    trace = [[None] * n for _ in range(n)]
    for t in range(n):
        for me in range(n):
            j = (me - t) % n
            best = math.inf
            for _ in range(repeats):
                out = torch.zeros(qs[me].shape)
                lse = torch.full(qs[me].shape[:-1], float("-inf"))
                t0 = time.perf_counter()
                did = cp.forward_step(qs[me], kvs[j], out, lse, me, j, n, balanced, scale)
                best = min(best, time.perf_counter() - t0)
            seconds[t][me] = best if did else 0.0
            trace[t][me] = j if did else None
    ring = sum(max(row) for row in seconds)
    return dict(work=cp.work_per_rank(seq_len, n, balanced), seconds=seconds, trace=trace,
                ring_seconds=ring, ideal_seconds=sum(map(sum, seconds)) / n,
                busy=[sum(seconds[t][r] for t in range(n)) for r in range(n)])


def at_scale(model: str = "llama-7b", seq_len: int = 131072, cps=(1, 2, 4, 8, 16, 32, 64),
             hardware: str = "dgx-h100", tp: int = 8, micro_batch: int = 1) -> list[dict]:
    """The planner's long-context run, per cp: ``plan.estimate`` of one data-parallel replica
    (tp x cp GPUs, SP, selective recomputation, a fused kernel, bf16): one GPU's memory, whether
    it fits, the step time, what of it the ring leaves exposed, MFU; and one ring step
    (``plan.cp.ring_step_times``): the K/V message, its send time and the attention it
    overlaps with."""
    shape = with_seq_len(model_preset(model), seq_len)
    rows = []
    for n in cps:
        layout = Layout(tp=tp, cp=n, sp=tp > 1, recompute="selective", micro_batch=micro_batch)
        e = estimate(shape, hardware, layout, flash=True)
        ring = ring_step_times(shape, hardware, n, tp, micro_batch, flash=True, gpus=layout.gpus)
        rows.append(dict(cp=n, gpus=layout.gpus, estimate=e, memory=e.memory, fits=e.fits,
                         step_s=e.step_time, ring_exposed_s=e.times["cp_exposed"], mfu=e.mfu,
                         kv_block=kv_block_bytes(micro_batch, seq_len, shape.hidden, n, tp, 2)
                         if n > 1 else 0,
                         send_s=ring["send"], compute_s=ring["compute"],
                         hidden=ring["send"] <= ring["compute"]))
    return rows


def search_long_context(model: str = "llama-7b", seq_len: int = 131072, gpus: int = 64,
                        hardware: str = "dgx-h100", sequences: int = 32, top: int = 3,
                        cp: int | None = None):
    """``plan.search`` (a fused attention kernel) for ``sequences`` sequences of ``seq_len``
    tokens per step on ``gpus``; ``cp`` fixes the context-parallel degree (None: the search
    weighs cp > 1 where memory forces it)."""
    return search(model, gpus, hardware, seq_len=seq_len, flash=True, top=top, cp=cp,
                  global_batch_tokens=sequences * seq_len)


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------
def draw_ring(n: int, balanced: bool = True, axes=None, seq_chunks: int | None = None):
    """The causal attention matrix in chunks (queries down, keys across), one panel per ring
    step: each computed block coloured by the rank that computes it at that step."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    pieces = 2 * n if balanced else n
    s = seq_chunks or pieces * 2                    # 2 tokens a chunk: visible triangles
    if axes is None:
        _, axes = plt.subplots(1, n, figsize=(2.6 * n, 2.8))
    colours = ListedColormap(["#f2f2f2", *plt.get_cmap("tab10").colors[:n]])
    for t, ax in enumerate(axes):
        grid = torch.zeros(s, s)
        for me in range(n):
            j = (me - t) % n
            block = cp.visible_block(me, j, n, s // n, balanced)
            if block is None:
                continue
            qpos = cp.local_positions(s, n, me, balanced)[block[0]]
            kpos = cp.local_positions(s, n, j, balanced)[block[1]]
            for a in qpos.tolist():
                for b in kpos.tolist():
                    if a >= b:
                        grid[a, b] = me + 1
        ax.imshow(grid, cmap=colours, vmin=0, vmax=n, interpolation="nearest")
        ax.set_title(f"step {t}: rank r uses\nrank {'r' if t == 0 else f'r-{t}'}'s K/V",
                     fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        for c in range(1, pieces):
            ax.axhline(c * s / pieces - .5, color="white", lw=.8)
            ax.axvline(c * s / pieces - .5, color="white", lw=.8)
    axes[0].set_ylabel("queries (position)")
    axes[0].set_xlabel("keys (position)")
    return axes


def draw_imbalance(plain: dict, balanced: dict, ax=None):
    """Each rank's busy time per ring step, plain split vs balanced (stacked by step)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    n = len(plain["busy"])
    width = 0.38
    for k, (name, res) in enumerate((("plain split", plain), ("load-balanced", balanced))):
        bottom = [0.0] * n
        for t, row in enumerate(res["seconds"]):
            ax.bar([r + (k - .5) * width for r in range(n)], [x * 1e3 for x in row], width,
                   bottom=[b * 1e3 for b in bottom], color=plt.get_cmap("tab10")(t),
                   edgecolor="black" if k else "white", alpha=0.55 if k == 0 else 1.0,
                   label=f"step {t}" if k == 1 else None)
            bottom = [b + x for b, x in zip(bottom, row)]
    ax.set_xticks(range(n), [f"rank {r}\nplain | bal." for r in range(n)])
    ax.set_ylabel("attention compute (ms)")
    ax.legend(fontsize=8)
    return ax
