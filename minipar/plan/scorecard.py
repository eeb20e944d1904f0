"""The planner held to published multi-node runs, like for like (``anchors``' rows).

For each row: the authors' model shape, hardware preset, framework profile, degrees, batch
and sequence; what the authors did not publish (the micro-batch, interleaving, the
recomputation of some rows) is left to the planner's search inside that grid (the row's
``chosen`` says what), so the prediction is the best run the planner believes the published
configuration allows. The prediction is then set against the published figure in the same
metric: MFU against MFU, HFU against HFU (recomputation counted as the authors counted it),
a published iteration time as the MFU it implies with the planner's FLOP count, and
torchtitan's tokens/s per GPU (its H100s' peak is not known) as tokens/s. Memory where the
authors published it: torchtitan's peak reserved memory against the planner's peak over
(1 - the allocator's reserve), the reserved memory that peak implies.

``rows()`` computes every row, ``rank_orders()`` compares the order of the rows of each source
that published several runs of one model or family, ``table()`` and ``ranks_table()`` print
them for docs/reference.md (tests/test_plan_scorecard.py checks the doc against them), and
``summary()`` gives the error range the docs quote. Error = predicted / published - 1.
"""
from __future__ import annotations

from dataclasses import replace

from .anchors import all_rows
from .estimate import estimate
from .frameworks import load_framework
from .hardware import load_hardware
from .layout import Layout
from .search import search
from .shapes import training_flops

# Tests hold every MFU/HFU row within 35% of its published figure. The band was set after
# the errors were seen (worst -33%, Megatron-LM's 119B on 1,536 H100): it guards against
# regressions and claims no precision; the median |error| is the figure to quote.
BAND = 0.35
TIE = 0.01            # published figures within 1% of each other are a tie, not an order


def predict(row: dict):
    """The planner's estimate for a published run (module docstring)."""
    shape, hw, fw = row["shape"], load_hardware(row["hardware"]), load_framework(row["framework"])
    if row["device_gib"]:
        hw = replace(hw, memory_bytes=row["device_gib"] * 2**30)
    if row["tp_overlap"] is not None:
        fw = replace(fw, tp_overlap=row["tp_overlap"])
    t, p, gpus = row["tp"], row["pp"], row["gpus"]
    dp = gpus // (t * p)
    sp = fw.sp and t > 1 if row["sp"] is None else row["sp"]
    if row["chosen"] == "nothing":
        b = row["micro_batch"]
        layout = Layout(tp=t, pp=p, dp=dp, micro_batch=b, microbatches=row["batch"] // (dp * b),
                        shard=row["shard"] or (1, 1, 1), recompute=row["recompute"],
                        v=row["v"] or 1, sp=sp)
        return estimate(shape, hw, layout, framework=fw, flash=row["flash"])
    return search(shape, gpus, hw, tp=t, pp=p, cp=1, framework=fw, flash=row["flash"],
                  global_batch_tokens=row["batch"] * shape.seq_len, top=1, sp=sp,
                  micro_batch=row["micro_batch"], recompute=row["recompute"], v=row["v"],
                  shard=row["shard"])[0]


def _measured(row: dict, e) -> float:
    """The published figure in the row's compared metric (an iteration time as MFU)."""
    if row["metric"] == "seconds":
        flops = training_flops(row["shape"], row["batch"], "none")
        peak = load_hardware(row["hardware"]).peak_flops
        return 100 * flops / (row["published"] * row["gpus"] * peak)
    return row["published"]


def reserved_gib(row: dict, e) -> float:
    """The planner's peak over (1 - the framework's allocator reserve): the reserved memory
    that peak implies, what torchtitan logs."""
    reserve = load_framework(row["framework"]).memory_reserve or 0.0
    return e.memory["total"] / (1 - reserve) / 2**30


def _predicted(row: dict, e) -> float:
    if row["metric"] == "HFU":
        return 100 * e.hfu
    if row["metric"] == "tokens/s per GPU":
        return e.tokens_per_s / row["gpus"]
    if row["metric"] == "memory (GiB)":
        return reserved_gib(row, e)
    return 100 * e.mfu


def rows() -> list[dict]:
    """Every row, predicted: the anchor's fields plus "compared" (MFU, HFU or tokens/s per
    GPU), "published" and "predicted" in it, "error", "layout" (the planner's), "estimate",
    and "memory_predicted" (GiB reserved) where the authors published memory."""
    out = []
    for row in all_rows():
        e = predict(row)
        compared = "MFU" if row["metric"] == "seconds" else row["metric"]
        published, predicted = _measured(row, e), _predicted(row, e)
        r = dict(row, compared=compared, published=published, predicted=predicted,
                 error=predicted / published - 1, layout=e.layout.describe(), estimate=e,
                 fits=e.fits, memory_predicted=None)
        if row["memory_gib"] is not None:
            r["memory_predicted"] = reserved_gib(row, e)
        out.append(r)
    return out


def rank_orders(computed: list[dict] | None = None) -> list[dict]:
    """For each source group with several rows: the published order of its runs (best
    first) against the predicted one. {"group", "published", "predicted" (lists of cases),
    "agrees" (same order), "pairs" (concordant pairs, of the pairs whose published figures
    differ by ``TIE`` or more)}."""
    computed = rows() if computed is None else computed
    groups: dict = {}
    for r in computed:
        groups.setdefault(r["group"], []).append(r)
    out = []
    for name, members in groups.items():
        if len(members) < 2 or members[0]["compared"] == "memory (GiB)":
            continue
        pub = sorted(members, key=lambda r: -r["published"])
        pred = sorted(members, key=lambda r: -r["predicted"])
        pairs = concordant = 0
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if abs(a["published"] / b["published"] - 1) < TIE:
                    continue
                pairs += 1
                concordant += (a["published"] > b["published"]) == (a["predicted"] > b["predicted"])
        out.append(dict(group=name, published=[r["case"] for r in pub],
                        predicted=[r["case"] for r in pred], agrees=concordant == pairs,
                        pairs=(concordant, pairs)))
    return out


def _pct(x: float, metric: str) -> str:
    if metric == "tokens/s per GPU":
        return f"{x:,.0f}"
    return f"{x:.1f}" if metric == "memory (GiB)" else f"{x:.1f}%"


def table(computed: list[dict] | None = None) -> str:
    """``rows()`` as the Markdown table docs/reference.md carries."""
    computed = rows() if computed is None else computed
    lines = ["| published run | metric | published | predicted | error | memory (GiB) "
             "published / predicted | planner's layout | planner chose |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in computed:
        mem = "-" if r["memory_gib"] is None else (f"{r['memory_gib']:.1f} / "
                                                   f"{r['memory_predicted']:.1f}")
        case = r["case"] + (" (sibling)" if r["sibling"] else "")
        fit = "" if r["fits"] else " (does not fit)"
        lines.append(f"| {case} | {r['compared']} | {_pct(r['published'], r['compared'])} | "
                     f"{_pct(r['predicted'], r['compared'])} | {r['error']:+.0%} | {mem} | "
                     f"{r['layout']}{fit} | {r['chosen']} |")
    return "\n".join(lines)


def ranks_table(orders: list[dict] | None = None) -> str:
    """``rank_orders()`` as the Markdown table docs/reference.md carries."""
    orders = rank_orders() if orders is None else orders
    lines = ["| source, model | runs | same order (ties within 1% aside) | concordant pairs |",
             "| --- | --- | --- | --- |"]
    for o in orders:
        c, n = o["pairs"]
        lines.append(f"| {o['group']} | {len(o['published'])} | "
                     f"{'yes' if o['agrees'] else 'no'} | {c} of {n} |")
    return "\n".join(lines)


def summary(computed: list[dict] | None = None) -> dict:
    """The error range over the utilisation rows (MFU and HFU), and the median |error|."""
    computed = rows() if computed is None else computed
    errors = sorted(r["error"] for r in computed if r["compared"] in ("MFU", "HFU"))
    mags = sorted(abs(x) for x in errors)
    return dict(n=len(errors), low=errors[0], high=errors[-1], median_abs=mags[len(mags) // 2],
                within_band=sum(abs(x) <= BAND for x in errors))


def summary_line(computed: list[dict] | None = None) -> str:
    """``summary()`` as the sentence docs/reference.md carries."""
    s = summary(computed)
    return (f"{s['n']} utilisation rows (MFU or HFU): errors from {s['low']:+.0%} to "
            f"{s['high']:+.0%}, median |error| {s['median_abs']:.0%}, {s['within_band']} of "
            f"{s['n']} within the tests' band of +-{BAND:.0%}.")
