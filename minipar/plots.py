"""Pictures for the notebooks, drawn from the package's own data structures.

* ``pipeline_timeline``: a pipeline step as a Gantt chart, one row per stage, from an ideal
  schedule (``pp.ideal_timeline``, unit times) or a measured run (``PipelineRunner``'s
  gathered ``Timeline``, seconds). Forward boxes are blue, backward boxes orange (lighter
  for later model chunks), with the micro-batch number inside; white space is the bubble;
  grey ticks under a row are its sends and receives.
* ``bubble_vs_microbatches``: the bubble fraction (p-1)/(v m + p - 1) against m, with
  measured points on top.
* ``stash_bars``: activations held per stage, one bar group per schedule.

matplotlib is imported here only, so the training code never needs it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

FORWARD = ("#3b6fb6", "#7fa7dc", "#1f3f73", "#a9c4ea")
BACKWARD = ("#e07b39", "#f2ae7f", "#9c4a17", "#f7cfb0")
P2P_COLOR = "#8c8c8c"


def pipeline_timeline(timeline, ax=None, title: str | None = None, unit: str = "ticks",
                      labels: bool = True, p2p: bool = True):
    """Draw a ``pp.Timeline``; ``unit="ms"`` for a measured one (its times are seconds)."""
    p = len(timeline.stages)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * p))
    scale = 1e3 if unit == "ms" else 1.0
    span = timeline.makespan * scale
    chunks, has_p2p = 1, False
    for r, events in enumerate(timeline.stages):
        y = p - 1 - r
        for e in events:
            start, width = e.start * scale, (e.end - e.start) * scale
            if e.op in ("forward", "backward"):
                chunks = max(chunks, e.chunk + 1)
                color = (FORWARD if e.op == "forward" else BACKWARD)[e.chunk % len(FORWARD)]
                ax.broken_barh([(start, width)], (y - 0.38, 0.76), facecolors=color,
                               edgecolors="white", linewidth=0.6)
                if labels and width > span / 70:
                    ax.text(start + width / 2, y, str(e.mb), ha="center", va="center",
                            fontsize=7, color="white", clip_on=True)
            elif p2p:
                has_p2p = True
                ax.broken_barh([(start, max(width, span / 500))], (y - 0.48, 0.08),
                               facecolors=P2P_COLOR)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(p))])
    ax.set_xlim(0, span if span > 0 else 1)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlabel("time (ms)" if unit == "ms" else f"time ({unit})")
    ax.set_title(title if title is not None else f"bubble {timeline.bubble:.1%}", fontsize=10)
    handles = [Patch(color=FORWARD[0], label="forward"), Patch(color=BACKWARD[0], label="backward")]
    if chunks > 1:
        handles += [Patch(color=FORWARD[1], label="forward, chunk 1"),
                    Patch(color=BACKWARD[1], label="backward, chunk 1")]
    if has_p2p:
        handles.append(Patch(color=P2P_COLOR, label="send / recv"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    return ax


def bubble_vs_microbatches(ps=(2, 4, 8), max_m: int = 32, v: int = 1, measured=None, ax=None):
    """(p-1)/(v m + p - 1) against m for each p; ``measured``: [(p, m, bubble), ...] dots."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ms = list(range(1, max_m + 1))
    for p in ps:
        line, = ax.plot(ms, [(p - 1) / (v * m + p - 1) for m in ms], label=f"p = {p} (formula)")
        for q, m, b in measured or []:
            if q == p:
                ax.plot([m], [b], "o", color=line.get_color())
    if measured:
        ax.plot([], [], "ko", label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def stash_bars(stash: dict[str, list[int]], ax=None):
    """Peak stashed micro-batch activations per stage, one bar group per schedule."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    names = list(stash)
    p = max(len(v) for v in stash.values())
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([r + k * width for r in range(p)], stash[name], width, label=name)
    ax.set_xticks([r + width * (len(names) - 1) / 2 for r in range(p)])
    ax.set_xticklabels([f"stage {r}" for r in range(p)])
    ax.set_ylabel("activations held (micro-batches)")
    ax.legend(fontsize=8)
    return ax
