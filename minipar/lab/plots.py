"""Pictures shared by several notebooks and the slides, drawn from the package's own data.

* ``pipeline_timeline``: a pipeline step as a Gantt chart, one row per stage, from an ideal
  schedule (``schedules.ideal_timeline``, unit times) or a measured run (``PipelineRunner``'s
  gathered ``Timeline``, seconds). Forward boxes are blue, backward boxes orange (lighter
  for later model chunks), with the micro-batch number inside; white space is the bubble;
  grey ticks under a row are its sends and receives.
* ``check_timeline_drawn``: asserts that an axis shows a timeline's boxes where they belong,
  all of them visible (nbval runs a notebook but cannot look at its figures).

A notebook's own figures live in its module under ``minipar.lab``. matplotlib is imported
here and there only, so the training code never needs it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

FORWARD = ("#3b6fb6", "#7fa7dc", "#1f3f73", "#a9c4ea")
BACKWARD = ("#e07b39", "#f2ae7f", "#9c4a17", "#f7cfb0")
P2P_COLOR = "#8c8c8c"


def pipeline_timeline(timeline, ax=None, title: str | None = None, unit: str = "ticks",
                      labels: bool = True, p2p: bool = True):
    """Draw a ``schedules.Timeline``; ``unit="ms"`` for a measured one (its times are seconds)."""
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
                               edgecolors="white", linewidth=0.6, gid=f"{e.op} {r}")
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


def drawn_boxes(ax) -> list[tuple[str, float, float]]:
    """(gid, start, end) in the axis' units of each forward/backward box
    ``pipeline_timeline`` drew on ``ax`` (gid: "forward 0" = a forward of stage 0)."""
    out = []
    for artist in ax.collections:
        gid = artist.get_gid() or ""
        if gid.split(" ")[0] in ("forward", "backward"):
            xs = [x for path in artist.get_paths() for x, _ in path.vertices]
            out.append((gid, min(xs), max(xs)))
    return out


def check_timeline_drawn(ax, timeline, unit: str = "ticks", rel: float = 1e-6,
                         min_fill: float = 0.1) -> None:
    """Assert that ``ax`` shows ``timeline`` as ``pipeline_timeline(timeline, ax, unit=unit)``
    should: one box per compute event at its scaled start and end, every box inside the
    visible x range, and the boxes reaching at least ``min_fill`` of it. A timeline
    converted twice (off by 1000 either way) fails one of these."""
    scale = 1e3 if unit == "ms" else 1.0
    want = sorted((f"{e.op} {r}", e.start * scale, e.end * scale)
                  for r, events in enumerate(timeline.stages) for e in events
                  if e.op in ("forward", "backward"))
    got = sorted(drawn_boxes(ax))
    lo, hi = ax.get_xlim()
    tol = rel * max(hi - lo, 1e-12)
    assert len(got) == len(want), f"{len(got)} boxes drawn, the timeline has {len(want)}"
    for (g, s, e), (w, ws, we) in zip(got, want):
        assert g == w and abs(s - ws) <= tol and abs(e - we) <= tol, (
            f"box {g} drawn at [{s:.4g}, {e:.4g}], the timeline says {w} at [{ws:.4g}, {we:.4g}]")
    if got:
        first, last = min(s for _, s, _ in got), max(e for _, _, e in got)
        assert lo - tol <= first and last <= hi + tol, (
            f"boxes span [{first:.4g}, {last:.4g}] {unit}, the axis shows [{lo:.4g}, {hi:.4g}]: "
            f"part of the timeline is cut off (a unit converted twice?)")
        assert last - lo >= min_fill * (hi - lo), (
            f"the boxes end at {last:.4g} {unit}, before {min_fill:.0%} of [{lo:.4g}, {hi:.4g}]: "
            f"the timeline is squeezed (a unit converted twice?)")
