"""Notebook 04_zero_and_amsp: where the memory goes, ZeRO/AMSP measured, AMSP's space.

``census`` runs in one process; ``walkthrough`` and ``prefetch_effect`` run on every rank
inside ``minipar.runtime.dist.launch`` with the ZeRO benchmark's ``Variant`` (minipar's engine with
a spec); the formulas they are held against are the planner's (``model_state_bytes``,
``zero_comm_bytes``, ``zero_comm_bytes_by_group`` with the engine's units). ``amsp_space``,
``draw_*`` and ``explore`` draw AMSP's trade-off for models at scale.
"""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as tdist

from .. import comm, data
from ..bench import median
from ..bench.zero import Variant, _adamw, _optimizer_tensors, unique_storage_bytes
from ..model import build, config
from ..plan.memory import BYTES_PER_PARAM, model_state_bytes
from ..plan.network import zero_comm_bytes, zero_comm_bytes_by_group, zero_group_span
from ..plan.sharding import divisors, shard_violation, zero_shard


def census(model_name: str = "tiny", batch: int = 8) -> dict[str, int]:
    """Where the memory of one serial training step goes, measured (one process).

    Parameters, gradients and Adam's state are the storages of the tensors themselves;
    activations are the tensors autograd saves for backward during the forward pass (caught
    with ``saved_tensors_hooks``, parameters and shared storages counted once, not at all).
    """
    cfg = config(model_name)
    model = build(cfg, seed=0)
    x, y = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                        batch).global_batch_at(1)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    opt = _adamw(model.parameters(), 1e-3)
    opt.step()
    return dict(params=unique_storage_bytes(model.parameters()),
                grads=unique_storage_bytes(p.grad for p in model.parameters()),
                optimizer=unique_storage_bytes(_optimizer_tensors(opt)),
                activations=sum(saved.values()),
                n_params=sum(p.numel() for p in model.parameters()), tokens=batch * cfg.seq_len)


def walkthrough(names, model_name: str = "tiny", batch_per_rank: int = 4) -> list[dict]:
    """On every rank: two steps of each variant in ``names``; what the second one held and sent.

    Rows (rank 0's): ``state`` (measured bytes), ``sent`` by op, ``by_group`` (zero_p,
    zero_g, zero_os, zero_rep), and the planner's ``state_formula``, ``comm_formula`` (by op)
    and ``group_formula`` (by group and op) for the engine's ``units``; ``spec``, ``psi``.
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    batches = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                           batch_per_rank * d, seed=0)
    rows = []
    for name in names:
        v = Variant(name, model_name=model_name)
        for step in range(2):
            comm.reset()
            v.step(*batches.local_batch(step, r, d))
        units, spec = [u.numel for u in v.engine.units], tuple(v.engine.spec)
        rows.append(dict(variant=name, spec=spec, state=v.state_bytes(), units=units,
                         state_formula=model_state_bytes(units, d, spec, dtype="fp32"),
                         sent=comm.stats.bytes_by_op(), by_group=comm.stats.bytes_by_group(),
                         comm_formula=zero_comm_bytes(units, d, spec, dtype="fp32"),
                         group_formula=zero_comm_bytes_by_group(units, d, spec, dtype="fp32"),
                         psi=4 * sum(units), ranks=d))
    return rows


def prefetch_effect(model_name: str = "tiny", steps: int = 6, warmup: int = 2) -> list[dict]:
    """On every rank: ZeRO-3 with and without prefetching, interleaved step by step.

    Per variant: median step time (slowest rank) and the median time a step spends *waiting*
    in all-gathers (``Handle.wait``: with prefetching part of it overlaps computation).
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    batches = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                           8 * d, seed=0)
    runs = {name: Variant(name, model_name=model_name) for name in ("zero3", "zero3-noprefetch")}
    times = {name: [] for name in runs}
    waits = {name: [] for name in runs}
    for step in range(warmup + steps):
        x, y = batches.local_batch(step, r, d)
        for name, v in runs.items():
            comm.reset()
            tdist.barrier()
            t0 = time.perf_counter()
            v.step(x, y)
            slowest, = comm.all_reduce_scalars([time.perf_counter() - t0], comm.WORLD, op="max")
            wait = sum(sec for (op, _), sec in comm.stats.seconds.items() if op == "all_gather")
            if step >= warmup:
                times[name].append(slowest)
                waits[name].append(wait)
    return [dict(variant=name, median_s=median(times[name]), gather_wait_s=median(waits[name]),
                 peak=max(v.peak, v.state_bytes()["total"])) for name, v in runs.items()]


def amsp_space(n_params: float, d: int, gpus_per_node: int = 8, dtype: str = "mixed") -> list[dict]:
    """Every spec minipar runs over d ranks: memory per rank, and the bytes a rank sends per
    step inside its node and across nodes (a group spanning more than ``gpus_per_node``
    consecutive ranks runs at the inter-node link's speed: what AMSP minimises)."""
    n_params = int(n_params)
    psi = n_params * BYTES_PER_PARAM[dtype][0]
    points = []
    for spec in itertools.product(divisors(d), repeat=3):
        if shard_violation(spec, d):
            continue
        groups = zero_comm_bytes_by_group(n_params, d, spec, dtype=dtype)
        inter = sum(sum(ops.values()) for g, ops in groups.items()
                    if zero_group_span(g, d, spec) > gpus_per_node)
        total = sum(sum(ops.values()) for ops in groups.values())
        preset = next((f"ZeRO-{z}" for z in range(4) if zero_shard(z, d) == spec), "")
        mem = model_state_bytes(n_params, d, spec, dtype=dtype)
        points.append(dict(spec=spec, memory=mem["total"], mem=mem, groups=groups,
                           inter_psi=inter / psi, intra_psi=(total - inter) / psi,
                           amsp=spec[1] in (spec[0], spec[2]), preset=preset))
    return points


def draw_state_bars(rows, ax=None):
    """Measured model-state bytes per rank (stacked) next to the formula (black ticks)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    colors = dict(params="#3b6fb6", grads="#e07b39", optimizer="#6aa84f")
    for i, row in enumerate(rows):
        bottom = 0
        for key, color in colors.items():
            b = row["state"][key] / 2**20
            ax.bar(i, b, bottom=bottom, color=color, label=key if i == 0 else None)
            bottom += b
        ax.plot([i - 0.4, i + 0.4], [row["state_formula"]["total"] / 2**20] * 2, "k-", lw=2,
                label="formula" if i == 0 else None)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['variant']}\n{r['spec']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=8)
    return ax


def draw_comm_bars(rows, ax=None):
    """Measured bytes sent per step, by op, in units of Psi, with the formula (black ticks)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    colors = dict(all_reduce="#8e7cc3", reduce_scatter="#e07b39", all_gather="#3b6fb6")
    for i, row in enumerate(rows):
        bottom = 0.0
        for op, color in colors.items():
            b = row["sent"].get(op, 0) / row["psi"]
            ax.bar(i, b, bottom=bottom, color=color, label=op if i == 0 else None)
            bottom += b
        ax.plot([i - 0.4, i + 0.4], [row["comm_formula"]["total"] / row["psi"]] * 2, "k-",
                lw=2, label="formula" if i == 0 else None)
    d = rows[0]["ranks"]
    for k in (2, 3):
        ax.axhline(k * (d - 1) / d, color="grey", ls=":", lw=1)
        ax.text(len(rows) - 0.5, k * (d - 1) / d, f" {k}Ψ(d-1)/d", va="center", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['variant']}\n{r['spec']}" for r in rows], fontsize=8)
    ax.set_ylabel("bytes sent per step / Ψ")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def draw_amsp(points, current=None, ax=None, unit: float = 2**30):
    """AMSP's space: memory per rank against inter-node traffic, ZeRO presets named; blue
    points keep AMSP's rule s_g in {s_p, s_os}, grey ones do not; a red ring: ``current``."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for amsp, color, label in [(True, "#3b6fb6", "AMSP's space: s_g in {s_p, s_os}"),
                               (False, "#bbbbbb", "other valid specs (s_p | s_g | s_os | d)")]:
        pts = [pt for pt in points if pt["amsp"] == amsp]
        ax.scatter([pt["inter_psi"] for pt in pts], [pt["memory"] / unit for pt in pts], s=30,
                   c=color, zorder=2, label=label)
    for pt in points:
        if pt["preset"]:
            ax.annotate(pt["preset"], (pt["inter_psi"], pt["memory"] / unit), fontsize=8,
                        xytext=(4, 4), textcoords="offset points", color="#9c4a17")
    if current is not None:
        ax.scatter(current["inter_psi"], current["memory"] / unit, s=160, facecolors="none",
                   edgecolors="red", linewidths=2, zorder=3,
                   label=f"chosen spec {tuple(current['spec'])}")
    ax.set_xlabel("bytes a rank sends across nodes per step / Ψ")
    ax.set_ylabel("model states per rank (GiB)" if unit == 2**30 else "model states per rank")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return ax


MODELS = {"GPT 1.3B": 1.3e9, "LLaMA 7B": 6.7e9, "LLaMA 13B": 13e9, "GPT 175B": 175e9}


def explore(model: str = "LLaMA 13B", nodes: int = 8, log2_sp: int = 3, log2_sg: int = 3,
            log2_sos: int = 6):
    """AMSP's space for one model on ``nodes`` nodes of 8 devices, one spec circled, and what
    that spec holds and sends (the notebook's explorer calls this)."""
    import matplotlib.pyplot as plt
    d, phi = 8 * nodes, MODELS[model]
    spec = (2 ** log2_sp, 2 ** log2_sg, 2 ** log2_sos)
    points = amsp_space(phi, d, gpus_per_node=8, dtype="mixed")
    current = next((p for p in points if p["spec"] == spec), None)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    draw_amsp(points, current, ax=ax)
    ax.set_title(f"{model}, d = {d} devices ({nodes} nodes of 8), mixed precision")
    fig.tight_layout(); plt.show()
    if current is None:
        print(f"spec {spec} is not valid here: {shard_violation(spec, d)}")
        return
    m = current["mem"]
    print(f"spec {spec}: {m['total'] / 2**30:.1f} GiB per device = params {m['params'] / 2**30:.1f}"
          f" + grads {m['grads'] / 2**30:.1f} + optimizer {m['optimizer'] / 2**30:.1f} GiB")
    psi = 2 * phi
    for g, ops in current["groups"].items():
        if ops:
            where = "across nodes" if zero_group_span(g, d, spec) > 8 else "inside a node"
            print(f"  {g:8} ({where:13}): " + ", ".join(f"{op} {b / psi:.3f} Ψ" for op, b in ops.items()))
    print(f"  per step: {current['intra_psi']:.3f} Ψ inside nodes, {current['inter_psi']:.3f} Ψ across nodes")

