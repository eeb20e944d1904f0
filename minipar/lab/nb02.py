"""Notebook 02_tensor_parallel: splits, bytes, memory and time of Megatron's TP.

The ``*_experiment`` functions run on every rank inside ``minipar.runtime.dist.launch`` (or alone, as
one rank, for ``memory_experiment``) and return plain data; the formulas they are held
against are the planner's (``minipar.plan.tp_block_comm_bytes``). ``draw_splits`` and
``tp_cost`` draw the notebook's figures.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from .. import comm, plan, tp
from ..runtime import dist
from ..bench import median
from ..mesh import Mesh
from ..precision import PrecisionPolicy
from ..model import Block, GPTConfig, build, config
from ..plan import ring_bytes, tp_block_comm_bytes


def draw_splits():
    """The two ways to cut ``Y = X A`` over two ranks: by columns and by rows."""
    import matplotlib.pyplot as plt

    def box(ax, x, y, w, h, color, label=""):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="k", alpha=0.75))
        if label:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10)

    r0, r1, both = "#4c72b0", "#dd8452", "#cccccc"
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.2))
    ax = axes[0]
    ax.set_title("column split: $Y_r = X A_r$ (no communication)")
    box(ax, 0, 0, 2, 3, both, "X\n(all ranks)")
    ax.text(2.4, 1.5, "x", fontsize=16, va="center")
    box(ax, 3, 0, 1.5, 3, r0, "$A_0$"); box(ax, 4.5, 0, 1.5, 3, r1, "$A_1$")
    ax.text(6.4, 1.5, "=", fontsize=16, va="center")
    box(ax, 7, 0, 1.5, 3, r0, "$Y_0$"); box(ax, 8.5, 0, 1.5, 3, r1, "$Y_1$")
    ax = axes[1]
    ax.set_title("row split: $Y = X_0 A_0 + X_1 A_1$ (an all-reduce)")
    box(ax, 0, 0, 1, 3, r0, "$X_0$"); box(ax, 1, 0, 1, 3, r1, "$X_1$")
    ax.text(2.4, 1.5, "x", fontsize=16, va="center")
    box(ax, 3, 1.5, 3, 1.5, r0, "$A_0$"); box(ax, 3, 0, 3, 1.5, r1, "$A_1$")
    ax.text(6.4, 1.5, "=", fontsize=16, va="center")
    box(ax, 7, 0, 1.5, 3, r0, "$X_0A_0$"); ax.text(8.75, 1.5, "+", fontsize=16, va="center")
    box(ax, 9.2, 0, 1.5, 3, r1, "$X_1A_1$")
    for ax in axes:
        ax.set_xlim(-0.3, 11); ax.set_ylim(-0.3, 3.3); ax.axis("off")
    fig.tight_layout()
    return fig


def block_bytes_experiment(shapes: list[tuple[int, int, int]]):
    """For each (b, s, h), without and with SP: bytes and calls of one block's collectives."""
    t = tdist.get_world_size()
    grid = Mesh(1, 1, t)
    rows = []
    for sp in (False, True):
        for b, s, h in shapes:
            cfg = GPTConfig(d_model=h, n_head=t, seq_len=s)
            torch.manual_seed(0)
            block = tp.parallelize_block(Block(cfg), grid.group("tp"), sequence_parallel=sp)
            x = torch.randn(b, s // t if sp else s, h, requires_grad=True)
            comm.reset()
            y = block(x)
            forward = comm.stats.table()
            comm.reset()
            y.sum().backward()
            backward = comm.stats.table()
            rows.append(dict(b=b, s=s, h=h, t=t, sp=sp, forward=forward, backward=backward,
                             formula=tp_block_comm_bytes(b * s, h, t, sp, dtype="fp32", bias=cfg.bias),
                             block=repr(block)))
    return rows


def memory_experiment(model_name: str = "tiny", batch: int = 8, sps=(False, True)):
    """Per rank, measured: parameter, gradient and Adam state bytes after one step, and the
    bytes of activations saved for backward during one forward.

    Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``, each
    storage once, parameters excluded.
    """
    t = tdist.get_world_size() if tdist.is_initialized() else 1
    grid = Mesh(1, 1, t)
    cfg = config(model_name)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len),
                      generator=torch.Generator().manual_seed(0))
    rows = []
    for sp in sps if t > 1 else (False,):
        model = build(cfg, seed=0)
        if t > 1:
            model = tp.parallelize(model, grid.group("tp"), sequence_parallel=sp)
        params = set(map(id, model.parameters()))
        seen, saved = set(), [0]

        def pack(tensor):
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if key not in seen and id(tensor) not in params:
                seen.add(key)
                saved[0] += tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(x, x)
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        nbytes = lambda ts: sum(x.numel() * x.element_size() for x in ts)   # noqa: E731
        rows.append(dict(t=t, sp=sp, params=nbytes(model.parameters()),
                         grads=nbytes(p.grad for p in model.parameters()),
                         optimizer=PrecisionPolicy().state_bytes(opt), activations=saved[0]))
    return rows


def step_time_experiment(model_name: str = "tiny", batch: int = 8, reps: int = 5,
                         sequence_parallel: bool = False):
    """Median training-step time (forward + backward) and the part spent in TP collectives."""
    t = tdist.get_world_size()
    grid = Mesh(1, 1, t)
    cfg = config(model_name)
    model = tp.parallelize(build(cfg, seed=0), grid.group("tp"), sequence_parallel=sequence_parallel)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len),
                      generator=torch.Generator().manual_seed(0))
    steps, comm_s = [], []
    for i in range(reps + 1):
        model.zero_grad(set_to_none=True)
        comm.reset()
        tdist.barrier()
        t0 = time.perf_counter()
        model(x, x).backward()
        elapsed = time.perf_counter() - t0
        if i:
            steps.append(elapsed)
            comm_s.append(sum(comm.stats.seconds.values()))
    return dict(t=t, step_s=median(steps), comm_s=median(comm_s),
                sent=sum(comm.stats.bytes_by_op().values()))


def allreduce_bandwidth_experiment(sizes_bytes: list[int], reps: int = 5):
    """Median seconds of one all-reduce of each size over the world, and bus bandwidth."""
    n = tdist.get_world_size()
    rows = []
    for nbytes in sizes_bytes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for i in range(reps + 1):
            tdist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(buf, comm.WORLD)
            if i:
                times.append(time.perf_counter() - t0)
        s = median(times)
        rows.append(dict(bytes=nbytes, seconds=s, busbw=ring_bytes("all_reduce", nbytes, n) / s))
    return rows


def tp_cost_table(model: str = "gpt-22b", hardware: str = "frontier-mi250x", micro_batch: int = 1):
    """Predicted, per TP degree (2, 4, 8 where the heads divide): one layer's matmul time per
    device against its 4 TP all-reduces inside a node and across nodes, in ms (the planner's
    compute and alpha-beta models). Rows: dict(t, compute, inside, across)."""
    shape, hw = plan.model_preset(model), plan.load_hardware(hardware)
    flops = plan.forward_flops(shape, micro_batch)                           # one layer's forward
    layer_flops = 3 * (flops["dense"] + flops["attention"])                  # forward + backward
    act = micro_batch * shape.seq_len * shape.hidden * 2                     # bf16 activation
    return [dict(t=t, compute=layer_flops / t / hw.achievable_flops * 1e3,
                 inside=4 * plan.collective_time("all_reduce", act, t, 1, hw) * 1e3,
                 across=4 * plan.collective_time("all_reduce", act, t, hw.gpus_per_node, hw) * 1e3)
            for t in (2, 4, 8) if shape.heads % t == 0]


def tp_cost(model: str = "gpt-22b", hardware: str = "frontier-mi250x", micro_batch: int = 1):
    """Draw and print ``tp_cost_table`` (the notebook's explorer calls this)."""
    import matplotlib.pyplot as plt
    rows = tp_cost_table(model, hardware, micro_batch)
    fig, ax = plt.subplots(figsize=(7, 3.3))
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [r["compute"] for r in rows], 0.27, label="matmuls per GCD")
    ax.bar(list(xs), [r["inside"] for r in rows], 0.27, label="4 TP all-reduces, inside a node")
    ax.bar([x + 0.27 for x in xs], [r["across"] for r in rows], 0.27, label="4 TP all-reduces, across nodes")
    ax.set_xticks(list(xs)); ax.set_xticklabels([f"TP={r['t']}" for r in rows])
    ax.set_ylabel("ms per layer (fwd + bwd)")
    ax.set_title(f"{model}, one layer, micro-batch {micro_batch}, {hardware} (predicted)")
    ax.legend(fontsize=8); fig.tight_layout(); plt.show()
    for r in rows:
        c, i, a = r["compute"], r["inside"], r["across"]
        print(f"TP={r['t']}: compute {c:6.2f} ms | TP comm inside a node {i:6.2f} ms ({i / c:4.0%} of compute)"
              f" | across nodes {a:6.2f} ms ({a / c:4.0%})")
