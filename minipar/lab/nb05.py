"""The code behind notebook 05_3d_parallel_trainer: from the parts to the trainer.

* the process mesh: ``grid_groups`` lists the groups of every named axis of a (dp, pp, tp)
  layout, ``ep`` carved inside ``dp`` (``minipar.mesh.axis_lines``: the same
  ``torch.arange(world).view(dp, pp, cp, tp)`` as ``minipar.mesh.Mesh``); ``mesh_table`` prints
  them; ``grid_experiment`` asks a real ``Mesh`` on every rank, so the drawing is checked
  against what the trainer builds; ``draw_grid`` draws it over nodes;
* the trainer's seams, one at a time, each on real gloo ranks with its measured bytes:
  ``seam_model`` (``train.build_model``: the TP-sliced GPT), ``seam_runner`` (+
  ``train.build_runner``: a pipeline stage around it), ``seam_step`` (+ ``train.build_engine``:
  the DP/ZeRO engine around that, and one optimizer step), all on the same batch as the
  single-process model (``serial_loss``);
* ``train_layouts``: several 3D layouts trained for a few steps, with their loss curves,
  step time, model-state memory and traffic (``draw_layouts``).

Functions documented as running "on every rank" run inside ``minipar.runtime.dist.launch`` and return
plain data; the ``draw_*`` functions import matplotlib.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from .. import comm, data, mesh, plan, train
from ..runtime import dist
from ..train import scaling
from ..model import build


# --------------------------------------------------------------------------------------
# 1. The process mesh
# --------------------------------------------------------------------------------------
def grid_groups(dp: int, pp: int, tp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every named axis of the mesh (tp, pp, dp, and ep / edp carved inside dp),
    as lists of global ranks (no processes)."""
    lines = mesh.axis_lines(dp=dp, pp=pp, tp=tp, ep=ep)
    return {axis: lines[axis].tolist() for axis in ("tp", "pp", "dp", "ep", "edp")}


def mesh_table(dp: int, pp: int, tp: int, ep: int = 1) -> str:
    """One line per named axis: its size, what it is for, and its groups."""
    what = {"tp": "tensor parallel (innermost: adjacent ranks)", "pp": "pipeline stages",
            "dp": "data parallel: dense gradients are averaged over it",
            "ep": "expert parallel: consecutive dp ranks that split the experts",
            "edp": "expert data parallel: the copies of one expert, its gradient's group"}
    groups = grid_groups(dp, pp, tp, ep)
    return "\n".join(f"{axis:>4} size {len(g[0])}  {what[axis]}\n       {g}"
                     for axis, g in groups.items())


def grid_experiment(dp: int, pp: int, tp: int, ep: int = 1) -> dict:
    """On every rank: this rank's coordinates and groups in a real ``Mesh``."""
    m = mesh.Mesh(dp=dp, pp=pp, tp=tp, ep=ep)
    return dict(rank=m.rank, coords=(m.coord("dp"), m.coord("pp"), m.coord("tp")),
                **{axis: m.ranks(axis) for axis in ("tp", "pp", "dp", "ep", "edp")})


def draw_grid(dp: int, pp: int, tp: int, per_node: int, ax=None):
    """Ranks as boxes, one row per node; colour = TP group, label = (dp, pp, tp) coordinates;
    PP neighbours joined by arrows, DP partners by dotted lines."""
    import matplotlib.pyplot as plt
    world = dp * pp * tp
    nodes = -(-world // per_node)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 * per_node + 1, 1.5 * nodes + 0.6))
    groups = grid_groups(dp, pp, tp)
    color = {r: f"C{i % 10}" for i, g in enumerate(groups["tp"]) for r in g}
    coords = torch.arange(world).view(dp, pp, tp)

    def xy(r):
        return r % per_node, nodes - 1 - r // per_node

    for n in range(nodes):
        ax.add_patch(plt.Rectangle((-0.5, nodes - 1 - n - 0.45), per_node, 0.9, fill=False,
                                   ls="--", ec="grey"))
        ax.text(per_node - 0.45, nodes - 1 - n + 0.38, f"node {n}", ha="right", va="top",
                fontsize=8, color="grey")
    for r in range(world):
        x, y = xy(r)
        d, p, t = (coords == r).nonzero()[0].tolist()
        ax.add_patch(plt.Rectangle((x - 0.38, y - 0.3), 0.76, 0.6, color=color[r], alpha=0.85))
        ax.text(x, y + 0.06, f"rank {r}", ha="center", va="center", fontsize=8, color="white",
                weight="bold")
        ax.text(x, y - 0.16, f"d{d} p{p} t{t}", ha="center", va="center", fontsize=7,
                color="white")
    for g in groups["pp"]:
        for a, b in zip(g, g[1:]):
            (xa, ya), (xb, yb) = xy(a), xy(b)
            ax.annotate("", xy=(xb, yb + 0.3), xytext=(xa, ya + 0.3),
                        arrowprops=dict(arrowstyle="->", color="black", lw=1,
                                        connectionstyle="arc3,rad=-0.3"))
    for g in groups["dp"]:
        for a, b in zip(g, g[1:]):
            (xa, ya), (xb, yb) = xy(a), xy(b)
            ax.plot([xa, xb], [ya - 0.3, yb - 0.3], ":", color="black", lw=1)
    ax.set_xlim(-0.6, per_node - 0.4)
    ax.set_ylim(-0.6, nodes - 0.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dp={dp} x pp={pp} x tp={tp} on {nodes} nodes of {per_node}: colour = TP "
                 f"group, arrow = next pipeline stage, dotted = DP partners", fontsize=9)
    return ax


def tp_inside_vs_across(model: str = "gpt-175b", hardware: str = "frontier-mi250x") -> dict:
    """The planner's TP communication time per step when the TP group fills one node (tp 8)
    and when it spans two (tp 16), on the same number of devices."""
    shape = plan.model_preset(model)
    out = {}
    for tp, pp in ((8, 16), (16, 8)):
        layout = plan.Layout(tp=tp, pp=pp, dp=8, micro_batch=1, microbatches=64,
                             shard=(1, 1, 8), recompute="full")
        e = plan.estimate(shape, hardware, layout, check=False)
        out[tp] = dict(tp_comm_s=e.times["tp_comm"], step_s=e.step_time,
                       share=e.times["tp_comm"] / e.step_time)
    return out


# --------------------------------------------------------------------------------------
# 2. The seams, one at a time (each on every rank)
# --------------------------------------------------------------------------------------
def config(argv: list[str]) -> train.RunConfig:
    """A checked RunConfig for a layout (quiet: the notebook prints what it wants)."""
    return dataclasses.replace(train.parse_config(argv), quiet=True)


def first_batch(cfg: train.RunConfig, grid: "mesh.Mesh | None" = None):
    """Step 1's batch: the whole of it (serial) or this replica's share."""
    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    batches = data.Batches(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    if grid is None:
        return batches.local_batch(1, 0, 1)
    return batches.local_batch(1, grid.coord("dp"), grid.dp)


def serial_loss(cfg: train.RunConfig) -> float:
    """The single-process model's loss on step 1's batch: what every layout must reproduce."""
    x, y = first_batch(cfg)
    with torch.no_grad():
        return build(cfg.model_cfg, seed=cfg.seed)(x, y).item()


def _traffic() -> list[dict]:
    return [dict(op=r["op"], group=r["group"], calls=r["calls"], bytes=r["bytes_sent"])
            for r in comm.stats.table() if r["calls"]]


def seam_model(cfg: train.RunConfig) -> dict:
    """On every rank: ``build_model`` (the TP slice), one forward and backward of the batch."""
    grid = mesh.Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    model = train.build_model(cfg, grid, torch.device("cpu"))
    x, y = first_batch(cfg, grid)
    comm.reset()
    loss = model(x, y)
    loss.backward()
    return dict(rank=grid.rank, params=sum(p.numel() for p in model.parameters()),
                full_params=train.serial_params(cfg), loss=loss.item(), traffic=_traffic())


def seam_runner(cfg: train.RunConfig) -> dict:
    """On every rank: ``build_runner`` around the TP model: one pipelined forward-backward."""
    grid = mesh.Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    model = train.build_model(cfg, grid, torch.device("cpu"))
    runner = train.build_runner(cfg, grid, model)
    x, y = first_batch(cfg, grid)
    comm.reset()
    loss = runner.forward_backward(x, y)
    return dict(rank=grid.rank, stage=grid.coord("pp"), loss=loss,
                params=sum(p.numel() for p in runner.module.parameters()),
                traffic=_traffic())


def seam_step(cfg: train.RunConfig) -> dict:
    """On every rank: ``build_engine`` around the runner, and one whole optimizer step,
    with the traffic of the forward-backward (TP, PP) and of the engine (DP/ZeRO) apart."""
    grid = mesh.Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    model = train.build_model(cfg, grid, torch.device("cpu"))
    runner = train.build_runner(cfg, grid, model)
    engine = train.build_engine(cfg, grid, runner.module)
    x, y = first_batch(cfg, grid)
    engine.zero_grad()
    engine.begin_step(cfg.microbatches)
    comm.reset()
    loss = runner.forward_backward(x, y)
    forward_backward = _traffic()
    comm.reset()
    engine.step()
    total, = comm.all_reduce_scalars([loss if grid.holds_loss else 0.0], comm.WORLD)
    return dict(rank=grid.rank, loss=total / grid.dp, forward_backward=forward_backward,
                engine=_traffic(), model_state_bytes=engine.model_state_bytes())


def run_on_ranks(fn, cfg: train.RunConfig, timeout: float = 120.0) -> list:
    """``fn(cfg)`` on ``cfg.world`` gloo ranks; every rank's result."""
    return dist.launch(fn, cfg.world, cfg, timeout=timeout)


def traffic_table(rows: list[dict]) -> str:
    if not rows:
        return "    (nothing sent)"
    return "\n".join(f"    {r['op']:15} over {r['group']:6} {r['calls']:3d} calls "
                     f"{r['bytes']:10,d} bytes" for r in rows)


# --------------------------------------------------------------------------------------
# 3. Layouts trained side by side
# --------------------------------------------------------------------------------------
def train_layouts(layouts: dict[str, list[str]], common: list[str], progress=None,
                  timeout: float = 300.0) -> dict[str, list[dict]]:
    """Train each layout (trainer flags with ``--nproc``) for the same steps; rank 0's metrics."""
    out = {}
    items = list(layouts.items())
    for name, flags in (progress(items, desc="layouts") if progress else items):
        cfg = config(common + flags)
        if cfg.world == 1:
            out[name] = scaling.quiet_worker(cfg, threads=1)
        else:
            out[name] = dist.launch(scaling.quiet_worker, cfg.world, cfg, timeout=timeout)[0]
    return out


def summarize(histories: dict[str, list[dict]], warmup: int = 2) -> list[dict]:
    rows = []
    for name, h in histories.items():
        timed = h[warmup:] or h
        rows.append(dict(layout=name, final_loss=h[-1]["loss"],
                         step_ms=1e3 * statistics.median(r["step_time_s"] for r in timed),
                         state_bytes=h[-1]["model_state_bytes"]["total"],
                         sent_bytes=sum(h[-1]["comm_bytes"].values()),
                         comm_ms=1e3 * statistics.median(sum(r.get("comm_seconds", {}).values())
                                                         for r in timed)))
    return rows


def max_loss_gap(histories: dict[str, list[dict]], reference: str) -> dict[str, float]:
    """Largest |loss - reference loss| over the steps, per layout."""
    ref = [r["loss"] for r in histories[reference]]
    return {name: max(abs(r["loss"] - b) for r, b in zip(h, ref))
            for name, h in histories.items() if name != reference}


def draw_layouts(histories: dict[str, list[dict]], reference: str, warmup: int = 2):
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(12, 3.8))
    grid = fig.add_gridspec(1, 4, width_ratios=[2.2, 1, 1, 1])
    ax = fig.add_subplot(grid[0])
    ref = histories[reference]
    ax.plot([r["step"] for r in ref], [r["loss"] for r in ref], color="grey", lw=6, alpha=0.4,
            label=reference)
    for i, (name, h) in enumerate((k, v) for k, v in histories.items() if k != reference):
        ax.plot([r["step"] for r in h], [r["loss"] for r in h], "--", marker=".",
                color=f"C{i}", label=name)
    ax.set(xlabel="step", ylabel="loss (mean token cross-entropy)",
           title="every layout on the serial curve")
    # below the axes: inside, it hid the curves and the y-label
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    rows = summarize(histories, warmup)
    names = [r["layout"] for r in rows]
    colors = ["grey"] + [f"C{i}" for i in range(len(rows) - 1)]
    for k, (key, label, scale) in enumerate((("step_ms", "median step time (ms)", 1),
                                             ("state_bytes", "model state per rank (MiB)", 2**20),
                                             ("sent_bytes", "sent by rank 0 per step (MiB)", 2**20))):
        a = fig.add_subplot(grid[k + 1])
        a.barh(range(len(rows)), [r[key] / scale for r in rows], color=colors)
        a.set_yticks(range(len(rows)), names if k == 0 else [""] * len(rows), fontsize=7)
        a.invert_yaxis()
        a.set_xlabel(label, fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------
# 4. A checkpoint saved in one layout, resumed in another
# --------------------------------------------------------------------------------------
def save_then_resume(common: list[str], save_layout: list[str], resume_layout: list[str],
                     root: str, save_at: int, steps: int) -> dict[str, list[dict]]:
    """Train ``save_layout`` to step ``save_at`` and save (``--save``); resume that checkpoint
    in ``resume_layout`` up to ``steps`` (``--resume``). Rank 0's metrics of both runs."""
    import os
    saved = train_layouts({"saved": save_layout + ["--steps", str(save_at), "--save", root]},
                          common)["saved"]
    checkpoint = os.path.join(root, f"step-{save_at:06d}")
    resumed = train_layouts({"resumed": resume_layout + ["--steps", str(steps), "--resume",
                                                         checkpoint]}, common)["resumed"]
    return dict(saved=saved, resumed=resumed, checkpoint=checkpoint)
