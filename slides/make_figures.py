"""Draw the workshop deck's figures, and rerun the numbers it quotes, from the package itself.

    python slides/make_figures.py              # every figure, every measured number (1-2 min)
    python slides/make_figures.py --drawn-only # only the figures that nothing is run for

Two kinds of output:

* **drawn** figures: every number comes from ``minipar`` (the planner's closed forms, the
  pipeline schedules and their ideal timelines, the process mesh's ``minipar.mesh.axis_lines``,
  the planner's scaling at Frontier scale) or, where marked, from a published source;
* **measured** figures and numbers: short real runs with the functions the notebooks use
  (``minipar.scaling.sweep`` as notebook 06 and ``python -m minipar.scaling``; notebook 08's
  ``lab.nb08.three_runs`` and ``ep_traffic``; a checkpoint saved by one layout and resumed by
  another, read back from DCP's own metadata; notebook 09's counts). Each number a slide
  quotes from them sits in the deck between ``<!-- measured:NAME -->`` and
  ``<!-- /measured -->``, and this script rewrites those spans (``measured_runs.py``: the
  runs, ``MEASURED`` the spans; ``tests/test_slides.py`` checks that no measured number on a
  slide lies outside one).

Output: ``slides/figures/*.png`` and the spans of ``slides/minipar_workshop.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))      # run from a checkout without installing
sys.path.insert(0, str(HERE))             # measured_runs.py, beside this file

import torch  # noqa: E402

from minipar import mesh, plan, pp, schedules
from minipar.lab import plots  # noqa: E402
import measured_runs  # noqa: E402

OUT = HERE / "figures"
DECK = HERE / "minipar_workshop.md"
DPI = 90
RANKS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]     # one colour per TP rank


def save(fig, name: str) -> None:
    OUT.mkdir(exist_ok=True)
    path = OUT / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"{path.relative_to(HERE.parent)}: {os.path.getsize(path) / 1024:.0f} KiB")


# --------------------------------------------------------------------------------------
# 1. Model-state memory: ZeRO's stages and a few AMSP specs (plan.model_state_bytes)
# --------------------------------------------------------------------------------------
def memory_zero():
    """ZeRO paper's example (Rajbhandari et al. 2020, Fig. 1): 7.5B parameters, 64 DP ranks."""
    phi, d = int(7.5e9), 64
    specs = [("DP\n(1,1,1)", (1, 1, 1)), ("ZeRO-1\n(1,1,64)", (1, 1, d)),
             ("ZeRO-2\n(1,64,64)", (1, d, d)), ("ZeRO-3\n(64,64,64)", (d, d, d)),
             ("MiCS\n(8,8,8)", (8, 8, 8)), ("AMSP\n(8,64,64)", (8, d, d))]
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    for i, (label, spec) in enumerate(specs):
        b = plan.model_state_bytes(phi, dp=d, shard=spec)
        bottom = 0.0
        for part, color in (("params", "#4c72b0"), ("grads", "#55a868"), ("optimizer", "#c44e52")):
            ax.bar(i, b[part] / 1e9, bottom=bottom, color=color, label=part if i == 0 else None)
            bottom += b[part] / 1e9
        ax.text(i, bottom + 2, f"{bottom:.1f} GB", ha="center", fontsize=9)
    ax.set_xticks(range(len(specs)), [s[0] for s in specs], fontsize=8)
    ax.set_ylabel("GB per rank")
    ax.set_ylim(0, 135)
    ax.set_title("7.5B parameters, mixed-precision Adam, d = 64: 2Φ/s_p + 2Φ/s_g + 12Φ/s_os\n"
                 "(minipar.plan.model_state_bytes)", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    save(fig, "memory_zero.png")


# --------------------------------------------------------------------------------------
# 2. Pipeline schedules as ideal timelines (schedules.ideal_timeline)
# --------------------------------------------------------------------------------------
def pipeline_schedules():
    p, m = 4, 8
    rows = [("naive (m = 1)", "gpipe", 1, 1), ("GPipe, m = 8", "gpipe", m, 1),
            ("1F1B, m = 8", "1f1b", m, 1), ("interleaved 1F1B, v = 2, m = 8", "interleaved", m, 2)]
    # ideal_timeline divides t_fwd, t_bwd by v itself: a chunk of L/(p v) layers takes 1/v, 2/v
    timelines = [(label, v, schedules.ideal_timeline(name, p, mm, v)) for label, name, mm, v in rows]
    span = max(tl.makespan for _, _, tl in timelines)
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 5.0), sharex=True)
    for ax, (label, v, tl) in zip(axes, timelines):
        stash = ", ".join(str(s) for s in tl.peak_stash)
        unit = " chunk-micro-batches" if v > 1 else ""
        plots.pipeline_timeline(tl, ax=ax, title=f"{label}: bubble {tl.bubble:.1%}, makespan "
                                f"{tl.makespan:g}, peak stash per stage [{stash}]{unit}")
        ax.title.set(fontsize=8.5, ha="left", x=0.0)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("")
        ax.get_legend().remove()
    axes[-1].set_xlim(0, span)            # one time axis for all rows (sharex)
    axes[-1].set_xlabel("time (forward of one micro-batch on one stage = 1, backward = 2)",
                        fontsize=8)
    colors = [plots.FORWARD[0], plots.BACKWARD[0], plots.FORWARD[1], plots.BACKWARD[1]]
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors],
               labels=["forward (number: micro-batch)", "backward", "forward, chunk 1",
                       "backward, chunk 1"], loc="upper right",
               fontsize=8, ncol=4, frameon=False, bbox_to_anchor=(0.98, 1.02))
    fig.suptitle("p = 4 stages: schedules.ideal_timeline, drawn by plots.pipeline_timeline",
                 fontsize=9, x=0.02, ha="left", y=1.0)
    fig.tight_layout()
    save(fig, "pipeline_schedules.png")


def bubble():
    ms = list(range(1, 33))
    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    for p, color in ((2, "C0"), (4, "C1"), (8, "C2")):
        ax.plot(ms, [100 * plan.bubble_fraction(p, m) for m in ms], color=color, label=f"p = {p}")
        dots = [1, 2, 4, 8, 16, 32]
        ax.plot(dots, [100 * schedules.ideal_timeline("1f1b", p, m).bubble for m in dots], "o",
                color=color, ms=4)
    dots = [4, 8, 16, 32]
    ax.plot(dots, [100 * schedules.ideal_timeline("interleaved", 4, m, 2).bubble for m in dots],
            "s--", color="C1", ms=4, lw=1, label="p = 4, interleaved v = 2")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8, 16, 32], ["1", "2", "4", "8", "16", "32"])
    ax.set_xlabel("micro-batches per step, m")
    ax.set_ylabel("idle share of the step, %")
    ax.set_title("bubble (p-1)/(v m + p-1): lines plan.bubble_fraction, "
                 "dots schedules.ideal_timeline(...).bubble", fontsize=8.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    save(fig, "bubble.png")


# --------------------------------------------------------------------------------------
# 3. A transformer block with TP = 4 (the layout minipar.tp.parallelize_block builds)
# --------------------------------------------------------------------------------------
def tp_block():
    t = 4
    fig, ax = plt.subplots(figsize=(9, 3.4))

    def box(x, y, w, h, color, label="", fs=8, tc="white"):
        ax.add_patch(plt.Rectangle((x, y), w, h, fc=color, ec="k", lw=0.6))
        if label:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fs, color=tc)

    def op(x, y, text, color="#333333"):
        ax.text(x, y, text, ha="center", va="center", fontsize=10, fontweight="bold", color=color,
                bbox=dict(boxstyle="round,pad=0.25", fc="#f3f3f3", ec=color))

    y0, h = 0.6, 2.0
    # attention half
    box(0, y0, 0.7, h, "#bbbbbb", "X\n(b,s,h)\nevery\nrank", 7, "black")
    op(1.05, y0 + h / 2, "f")
    for r in range(t):   # qkv: column-parallel, by heads
        box(1.45 + r * 0.45, y0, 0.45, h, RANKS[r], f"qkv\nheads\n{r * 3}-{r * 3 + 2}", 6.5)
    ax.text(1.45 + t * 0.225, y0 + h + 0.18, "ColumnParallelLinear\n(h/t heads each)", ha="center", fontsize=7)
    for r in range(t):   # attention on own heads
        box(3.4, y0 + h - (r + 1) * h / t, 0.6, h / t, RANKS[r], "attn", 6.5)
    for r in range(t):   # proj: row-parallel
        box(4.2, y0 + h - (r + 1) * h / t, 1.0, h / t, RANKS[r], f"proj rows {r}", 6.5)
    ax.text(4.7, y0 + h + 0.18, "RowParallelLinear", ha="center", fontsize=7)
    op(5.55, y0 + h / 2, "g")
    ax.text(5.95, y0 + h / 2, "+x", ha="center", va="center", fontsize=9)
    # MLP half
    op(6.4, y0 + h / 2, "f")
    for r in range(t):
        box(6.8 + r * 0.45, y0, 0.45, h, RANKS[r], f"fc\n{r}", 7)
    ax.text(6.8 + t * 0.225, y0 + h + 0.18, "ColumnParallelLinear\nh x 4h/t each", ha="center", fontsize=7)
    ax.text(8.85, y0 + h / 2, "GELU", ha="center", va="center", fontsize=7, rotation=90)
    for r in range(t):
        box(9.05, y0 + h - (r + 1) * h / t, 1.0, h / t, RANKS[r], f"proj rows {r}", 6.5)
    ax.text(9.55, y0 + h + 0.18, "RowParallelLinear\n4h/t x h each", ha="center", fontsize=7)
    op(10.4, y0 + h / 2, "g")
    ax.text(10.8, y0 + h / 2, "+", ha="center", va="center", fontsize=10)
    # legend and the rule
    for r in range(t):
        box(0.2 + r * 1.3, 0.0, 0.25, 0.25, RANKS[r])
        ax.text(0.55 + r * 1.3, 0.125, f"TP rank {r}", va="center", fontsize=7.5)
    ax.text(5.6, 0.125, "f: identity fwd, all-reduce bwd    g: all-reduce fwd, identity bwd\n"
                        "per block: 2 all-reduces of (b,s,h) forward, 2 backward",
            va="center", fontsize=7.5)
    ax.set_xlim(-0.1, 11.1)
    ax.set_ylim(-0.1, 3.35)
    ax.axis("off")
    ax.set_title("one GPT block, t = 4 (12 heads shown), as minipar.tp.parallelize_block cuts it",
                 fontsize=9)
    save(fig, "tp_block.png")


# --------------------------------------------------------------------------------------
# 4. The process mesh on two 8-GCD nodes: minipar.mesh.axis_lines(dp=2, pp=2, tp=4)
# --------------------------------------------------------------------------------------
def grid():
    dp_, pp_, tp_, per_node = 2, 2, 4, 8
    lines = mesh.axis_lines(dp=dp_, pp=pp_, tp=tp_)    # what minipar.mesh.Mesh makes groups of
    world = dp_ * pp_ * tp_
    # a rank's coordinate on an axis is its index in its line of that axis
    coord = {axis: {r: line.index(r) for line in lines[axis].tolist() for r in line}
             for axis in ("dp", "pp", "tp")}
    fig, ax = plt.subplots(figsize=(10, 2.8))
    w, gap = 1.0, 0.12
    stage_colors = ["#c6dbef", "#fdd0a2"]
    for rank in range(world):
        d, p, t = coord["dp"][rank], coord["pp"][rank], coord["tp"][rank]
        node, slot = divmod(rank, per_node)
        x = node * (per_node * (w + gap) + 0.6) + slot * (w + gap)
        ax.add_patch(plt.Rectangle((x, 0.5), w, 1.0, fc=stage_colors[p], ec="k", lw=0.7))
        ax.text(x + w / 2, 1.18, f"r{rank}", ha="center", fontsize=8, fontweight="bold")
        ax.text(x + w / 2, 0.8, f"d{d} p{p}\nt{t}", ha="center", va="center", fontsize=7.5)
    tp_groups = lines["tp"].tolist()
    for node in range(world // per_node):
        x0 = node * (per_node * (w + gap) + 0.6) - 0.08
        ax.add_patch(plt.Rectangle((x0, 0.35), per_node * (w + gap) + 0.04, 1.5, fill=False,
                                   ls="--", ec="#777777"))
        ax.text(x0 + 0.05, 1.7, f"node {node} (8 GCDs, Infinity Fabric)", fontsize=8, color="#555555")
        for k, group in enumerate(g for g in tp_groups if g[0] // per_node == node):
            xs = x0 + 0.08 + k * tp_ * (w + gap)
            ax.plot([xs, xs + tp_ * (w + gap) - gap], [0.38, 0.38], color="k", lw=2)
            ax.text(xs + (tp_ * (w + gap) - gap) / 2, 0.2, f"TP group {group}", ha="center",
                    fontsize=7.5)
    ax.text(0, -0.15, f"PP groups (send/recv, inside a node here): {lines['pp'].tolist()}",
            fontsize=7.5)
    ax.text(0, -0.42, f"DP groups (gradient all-reduce, across the nodes): {lines['dp'].tolist()}",
            fontsize=7.5)
    ax.set_xlim(-0.2, 2 * per_node * (w + gap) + 0.8)
    ax.set_ylim(-0.55, 1.95)
    ax.axis("off")
    ax.set_title("minipar.mesh.axis_lines(dp=2, pp=2, tp=4), the groups of mesh.Mesh, on two "
                 "Frontier nodes: rank r at (d, p, t); colour = pipeline stage", fontsize=9)
    save(fig, "grid.png")


# --------------------------------------------------------------------------------------
# 5. Every published point against the planner, like for like (as docs/reference.md)
# --------------------------------------------------------------------------------------
def frontier():
    """Predicted against published utilisation on the authors' layouts only
    (``plan.published.points``): the planner's own pick is never set against a published
    figure, and a run whose layout was not found has no predicted bar."""
    from minipar.plan import published
    rows = published.points()
    fig, ax = plt.subplots(figsize=(7.5, 3.1))
    xs = range(len(rows))
    for x, r in zip(xs, rows):
        ax.bar(x + 0.2, r["published"], 0.4, color="#08519c",
               label="published" if x == 0 else None)
        if r["predicted"] is None:
            ax.text(x - 0.2, 2, "layout\nnot found", ha="center", fontsize=6.5, rotation=90)
        else:
            ax.bar(x - 0.2, r["predicted"], 0.4, color="#9ecae1",
                   label="predicted (authors' layout)" if x == 1 else None)
            ax.text(x - 0.2, r["predicted"] + 1, f"{r['error']:+.0%}", ha="center", fontsize=7)
    short = [r["case"].split(" (")[0].replace(", no activation checkpointing", "")
             .replace(" Frontier", "").replace(" on ", "\n") + f"\n{r['metric']}" for r in rows]
    ax.set_xticks(list(xs), short, fontsize=6)
    ax.set_ylabel("% of bf16 peak")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7.5, frameon=False, loc="upper left")
    errors = [r["error"] for r in rows if r["error"] is not None]
    low, high = min(errors), max(errors)
    ax.set_title(f"like for like: predictions off by {low:+.0%} to {high:+.0%}", fontsize=9)
    save(fig, "frontier.png")
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.1f}%"
        print(f"  {r['case']}: published {r['published']:.2f}%, predicted {pred}")
    return {"frontier_errors": f"{100 * low:+.0f} to {100 * high:+.0f} %"}


# --------------------------------------------------------------------------------------
# 6. Weak and strong scaling at Frontier scale, predicted (notebook 06)
# --------------------------------------------------------------------------------------
def scaling_frontier():
    """The planner's weak and strong scaling of GPT 22B/175B/1T on Frontier (notebook 06)."""
    from minipar.lab import nb06
    weak, strong = nb06.frontier_scaling(weak=True), nb06.frontier_scaling(weak=False)
    # what the slide says: weak scaling flat, strong scaling ~10% lost at the largest count
    assert all(rows[-1]["efficiency"] > 0.95 for rows in weak.values()), weak
    assert all(0.8 < rows[-1]["efficiency"] < 0.95 for rows in strong.values()), strong
    fig = nb06.draw_frontier_scaling(weak, strong)
    fig.suptitle("predicted by the planner (lab.nb06.frontier_scaling, frontier-mi250x); "
                 "stars: the study's measurements", fontsize=9, y=1.02)
    save(fig, "scaling_frontier.png")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python slides/make_figures.py", description=__doc__.split("\n")[0])
    ap.add_argument("--drawn-only", action="store_true",
                    help="only the figures nothing is run for (a few seconds); leaves the measured "
                         "figures and the deck's measured numbers as they are")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.monotonic()
    values = {}
    memory_zero()
    pipeline_schedules()
    bubble()
    tp_block()
    grid()
    values.update(frontier())
    scaling_frontier()
    values.update(measured_runs.cp_numbers())
    if not args.drawn_only:
        values.update(measured_runs.scaling_measured(save, OUT))
        values.update(measured_runs.moe(save))
        measured_runs.checkpoint_layouts(save)
    measured_runs.write_measured(values, DECK)
    print(f"done in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
