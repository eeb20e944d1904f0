"""Notebook 03_pipeline_parallel: timelines, bubbles and the activations a schedule holds.

``measure_pipeline`` (``minipar.bench.pp``'s, re-exported) runs on every rank inside
``minipar.runtime.dist.launch`` (one rank per stage) and returns measured timelines (``schedules.Timeline``,
seconds); ``ideal_like`` is the ideal
schedule with the measured mean forward and backward times; ``explore`` draws any schedule's
ideal timeline; ``bubble_vs_microbatches`` and ``stash_bars`` draw the rest. Timelines are
drawn by ``minipar.lab.plots.pipeline_timeline`` (shared with the slides), and
``plots.check_timeline_drawn`` asserts that a drawn figure shows its timeline. The bubble's
closed form is the planner's, ``minipar.plan.bubble_fraction``.
"""
from __future__ import annotations

import statistics

from . import plots
from .. import pp, schedules
from ..bench.pp import measure_pipeline  # noqa: F401  (the notebook calls nb03.measure_pipeline)
from ..plan import bubble_fraction


def mean_time(timeline: schedules.Timeline, op: str) -> float:
    """Mean duration of the ``op`` ("forward" or "backward") boxes of a timeline."""
    return statistics.mean(e.end - e.start for evs in timeline.stages for e in evs if e.op == op)


def ideal_like(schedule: str, measured: schedules.Timeline, m: int, v: int = 1) -> schedules.Timeline:
    """The ideal timeline of ``schedule`` on as many stages as ``measured`` has, with its
    mean forward and backward times: in the measured timeline's unit (seconds)."""
    return schedules.ideal_timeline(schedule, len(measured.stages), m, v,
                             t_fwd=mean_time(measured, "forward") * v,
                             t_bwd=mean_time(measured, "backward") * v)


def explore(schedule: str = "gpipe", p: int = 4, m: int = 8, v: int = 2):
    """Draw the ideal timeline of one schedule (the notebook's explorer calls this)."""
    import matplotlib.pyplot as plt
    if schedule == "interleaved" and (p < 2 or m % p):
        print(f"interleaved runs micro-batches in groups of p: choose m a multiple of p = {p} (p >= 2)")
        return
    v = v if schedule == "interleaved" else 1
    tl = schedules.ideal_timeline(schedule, p, m, v)
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.45 * p))
    plots.pipeline_timeline(tl, ax, labels=m * v <= 32, title=(
        f"{schedule}, p={p}, m={m}{f', v={v}' if v > 1 else ''}: bubble {tl.bubble:.1%} "
        f"(formula {bubble_fraction(p, m, v):.1%}); peak activations per stage {tl.peak_stash}"))
    plots.check_timeline_drawn(ax, tl)
    plt.show()


def bubble_vs_microbatches(ps=(2, 4, 8), max_m: int = 32, v: int = 1, measured=None, ax=None):
    """(p-1)/(v m + p - 1) against m for each p; ``measured``: [(p, m, bubble), ...] dots."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ms = list(range(1, max_m + 1))
    for p in ps:
        line, = ax.plot(ms, [bubble_fraction(p, m, v) for m in ms], label=f"p = {p} (formula)")
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
    import matplotlib.pyplot as plt
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
