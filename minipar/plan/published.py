"""Published results the planner is held against (notebook 07 lays them out: ``minipar.lab.nb07``).

These numbers are a held-out check: nothing in the planner (no constant in a hardware preset,
no framework profile) is fitted to them.

* Dash et al., "Optimizing Distributed Training on Frontier for Large Language Models"
  (ISC 2024; arXiv 2312.12705): GPT 22B, 175B and 1T trained with Megatron-DeepSpeed on
  Frontier's MI250X GCDs reached 38.38%, 36.14% and 31.96% of the 191.5 TFLOP/s bf16
  peak (Megatron's FLOP count, recomputation included: our HFU). ``STUDY_LAYOUTS`` are
  the layouts we take for the study's runs. We could not check them against the paper's
  tables in this session: 175B as TP 4 x PP 16 x DP 16 on 1,024 GCDs and 1T as TP 8 x PP 64
  x DP 6 on 3,072 GCDs, both ZeRO-1 with full activation checkpointing, are our reading;
  for 22B we found no layout and show only the planner's choice. The global batch is
  GPT-3's 1,536 sequences of 2,048 tokens (our assumption).
* ``executed_runs``: layouts that public runs executed (llm-foundry's MPT-7B on 8 x H100 and
  on 8 x A100-80GB without activation checkpointing, torchtitan's Llama-2-13B on 64 A100-80GB): the memory
  model must fit them; the step-rate they report is listed beside the prediction.
* Chen et al., "AMSP: Reducing Communication Overhead of ZeRO for Efficient LLM Training"
  (2023): LLaMA models with data parallelism only (TP = PP = 1) on 1,024 A800 GPUs, up to
  52% MFU; we hold the planner's choice of shard spec and its MFU against that.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from . import scorecard, timing
from .estimate import Estimate, estimate
from .hardware import load_hardware
from .layout import Layout
from .search import search
from .shapes import model_from_dict, model_preset

FRONTIER = {"gpt-22b": (512, 38.38), "gpt-175b": (1024, 36.14), "gpt-1t": (3072, 31.96)}
STUDY_LAYOUTS = {
    "gpt-175b": Layout(tp=4, pp=16, dp=16, micro_batch=1, microbatches=96, shard=(1, 1, 16),
                       recompute="full"),
    "gpt-1t": Layout(tp=8, pp=64, dp=6, micro_batch=1, microbatches=256, shard=(1, 1, 6),
                     recompute="full")}
AMSP_MFU = 52.0                     # "up to 52% MFU" on 1,024 A800s (Chen et al. 2023)
LLAMAS = ("llama-7b", "llama-13b", "llama-30b")


def row(label: str, e: Estimate, published: float | None = None) -> dict:
    """One line of a comparison: the layout, the prediction, each part's share."""
    lay = e.layout
    return {"case": label, "layout": lay.describe(), "spec": lay.shard, "framework": e.framework,
            "step_s": e.step_time, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "hfu": e.hfu,
            "published": published, "shares": e.shares(), "estimate": e}


def amsp_rows(objective: str = "step", framework: str = "minipar") -> list:
    """LLaMA on 1,024 A800s, TP = PP = 1: the searched spec per model."""
    return [row(model, search(model, 1024, "a800-ib", tp=1, pp=1, objective=objective,
                              framework=framework)[0], AMSP_MFU) for model in LLAMAS]


# --------------------------------------------------------------------------------------
# Layouts that public runs executed: each must fit (tests/test_plan_grounded.py)
# --------------------------------------------------------------------------------------
EXECUTED = Path(__file__).resolve().parent / "executed.json"


def executed_runs() -> list[dict]:
    """Published runs that ran, with their layouts (module docstring); each names its source.

    They live in ``executed.json`` beside this module: each run's model is a preset's name
    (with the ``seq_len`` it ran, where that differs) or the fields of a model file
    (``shapes.model_from_dict``), its layout the fields of ``Layout``.

    AMSP's own 13B spec (Chen et al. 2023) belongs here too; its (s_p, s_g, s_os) was not
    found in the public material searched for this table (the arXiv abstract and reviews
    give only the MFU), so it is left out rather than guessed."""
    out = []
    for r in json.loads(EXECUTED.read_text()):
        model = r["model"]
        shape = (model_preset(model, r.get("seq_len")) if isinstance(model, str)
                 else model_from_dict(model))
        layout = Layout(**{**r["layout"], "shard": tuple(r["layout"]["shard"])})
        out.append(dict(name=r["name"], shape=shape, hardware=r["hardware"],
                        framework=r["framework"], flash=r["flash"], mfu=r["mfu"],
                        layout=layout, source=r["source"]))
    return out


def table_vs_model(presets=("frontier-mi250x", "a800-ib")) -> list[dict]:
    """Each preset's shipped ``collective_table`` against the alpha-beta model it replaces,
    per (op, ranks per node, nodes): the range of measured / modelled time over the sizes
    measured. {"hardware", "op", "per_node", "nodes", "sizes" (bytes, smallest and largest),
    "ratio" (min, max)}."""
    groups: dict = {}
    for name in presets:
        hw = load_hardware(name)
        model = replace(hw, collective_table=None)
        for r in hw.collective_table or []:
            t = timing.collective_time(r["op"], r["bytes"], r["per_node"] * r["nodes"], 1, model)
            groups.setdefault((name, r["op"], r["per_node"], r["nodes"]), []).append(
                (r["bytes"], r["seconds"] / t))
    return [dict(hardware=k[0], op=k[1], per_node=k[2], nodes=k[3],
                 sizes=(min(b for b, _ in v), max(b for b, _ in v)),
                 ratio=(min(x for _, x in v), max(x for _, x in v)))
            for k, v in groups.items()]


def table_vs_model_table(rows: list[dict] | None = None) -> str:
    """``table_vs_model()`` as the Markdown table docs/reference.md carries."""
    rows = table_vs_model() if rows is None else rows
    cells = []
    for r in rows:
        (lo, hi), (small, large) = r["ratio"], r["sizes"]
        cells.append([r["hardware"], r["op"], f"{r['per_node']} x {r['nodes']}",
                      timing.size_text(small)
                      + ("" if small == large else f"-{timing.size_text(large)}"),
                      f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"])
    return scorecard.markdown_table(
        ["preset", "op", "ranks per node x nodes", "sizes", "measured / modelled"], cells)


# --------------------------------------------------------------------------------------
# Every published point, like for like (docs/reference.md's table)
# --------------------------------------------------------------------------------------
def points() -> list[dict]:
    """Every published figure the planner is held against, predicted like for like where
    the authors' layout is known: the same layout, batch and sequence length, MFU against
    MFU and HFU against HFU (recomputation counted as the authors counted it). Where the
    layout was not found, ``predicted`` is None and ``layout_source`` says so.

    Each: {"case", "metric" ("MFU" or "HFU"), "published" (%), "predicted" (% or None),
    "error" (predicted / published - 1, or None), "layout_source", "source"}."""
    out = []

    def add(case, metric, published, e, layout_source, source):
        pred = None if e is None else 100 * (e.hfu if metric == "HFU" else e.mfu)
        out.append(dict(case=case, metric=metric, published=published, predicted=pred,
                        error=None if pred is None else pred / published - 1,
                        layout_source=layout_source, source=source))

    dash = ("Dash et al., ISC 2024 (arXiv 2312.12705): percent of the 191.5 TFLOP/s peak, "
            "Megatron's FLOP count with recomputation")
    for model, (gcds, pct) in FRONTIER.items():
        e = (estimate(model_preset(model), "frontier-mi250x", STUDY_LAYOUTS[model],
                      framework="megatron-deepspeed") if model in STUDY_LAYOUTS else None)
        add(f"{model} on {gcds} Frontier GCDs (Megatron-DeepSpeed)", "HFU", pct, e,
            "not found in the authors' public material searched; our reading of the paper, "
            "unverified" if e is not None else "not found", dash)
    add("LLaMA (7B-30B) on 1024 A800 (AMSP), its best model", "MFU", AMSP_MFU, None,
        "not found (which model, spec, micro-batch and sequence length gave the 52%)",
        "Chen et al. 2023, arXiv 2311.00257: 'up to 52% MFU' on 1,024 GPUs")
    for r in executed_runs():
        e = estimate(r["shape"], r["hardware"], r["layout"], framework=r["framework"],
                     flash=r["flash"])
        add(r["name"], "MFU", r["mfu"], e, "the authors' (listed with the figure)", r["source"])
    return out


def points_table(rows: list[dict] | None = None) -> str:
    """``points()`` as the Markdown table docs/reference.md carries (tests/test_docs.py
    checks that they agree)."""
    rows = points() if rows is None else rows
    return scorecard.markdown_table(       # "-" where a figure is absent
        ["published run", "metric", "published", "predicted", "error", "layout from"],
        [[r["case"], r["metric"], "-" if r["published"] is None else f"{r['published']:.2f}%",
          "-" if r["predicted"] is None else f"{r['predicted']:.1f}%",
          "-" if r["error"] is None else f"{r['error']:+.0%}", r["layout_source"]] for r in rows])
