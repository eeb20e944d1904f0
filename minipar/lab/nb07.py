"""The code behind notebook 07_planning_at_scale: the Frontier study's comparisons.

* ``frontier_rows``: the study's runs on the layouts we take for them
  (``plan.published.STUDY_LAYOUTS``), HFU against the published percent of peak, with each
  part's share of the step (``SHARES``);
* ``planner_choice_rows``: what the planner would pick on the study's device counts, with no
  published figure beside it;
* ``ablation``: the HFU of a layout as the model's pieces are switched off one at a time.

The published figures and the layouts are the planner's data (``minipar.plan.published``);
these functions only lay them out for the notebook.
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import estimate, load_hardware, model_preset, search
from ..plan.layout import Layout
from ..plan.published import FRONTIER, STUDY_LAYOUTS, row

SHARES = {"compute": "compute", "dp_comm": "exposed DP communication",
          "tp_comm": "TP communication", "pp_comm": "PP communication",
          "bubble": "pipeline bubble"}


def frontier_rows(framework: str = "megatron-deepspeed", hardware="frontier-mi250x") -> list:
    """The study's runs on the layouts we take for them (``STUDY_LAYOUTS``), HFU against the
    published percent of peak. 22B has no layout (not found), so no row: the planner's own
    choice is not the study's run and is never held against its figure
    (``planner_choice_rows`` shows it, unpaired)."""
    return [row(f"{model}, study's layout", estimate(model_preset(model), hardware,
                                                     STUDY_LAYOUTS[model], framework=framework),
                FRONTIER[model][1])
            for model in FRONTIER if model in STUDY_LAYOUTS]


def planner_choice_rows(framework: str = "megatron-deepspeed",
                        hardware="frontier-mi250x") -> list:
    """What the planner would pick on the study's device counts: its own prediction, with no
    published figure beside it (a different layout from the one the authors ran)."""
    return [row(f"{model}, planner's choice", search(model_preset(model), gcds, hardware,
                                                     framework=framework)[0])
            for model, (gcds, _) in FRONTIER.items()]


def ablation(model: str, layout: Layout, hardware="frontier-mi250x",
             framework: str = "megatron-deepspeed",
             old_efficiency: float | None = 0.69) -> list[tuple[str, float]]:
    """HFU of ``layout`` as the model's pieces are switched off one at a time, to say which
    change moved a prediction: (what, HFU). ``old_efficiency``: the large-GEMM efficiency
    the preset used before (Frontier's HPL-MxP upper bound, 0.69), or None."""
    hw = load_hardware(hardware)
    shape = model_preset(model)
    cases = [
        ("full model", hw, {}),
        ("no per-call and per-step collective latency",
         replace(hw, collective_latency=0.0, intra_node_latency=0.0, inter_node_latency=0.0,
                 tree=None), {}),
        ("no memory-bound kernels or optimizer time", replace(hw, hbm_bandwidth=0.0), {}),
        ("everything hideable hidden (overlap 1)", hw, {"overlap": 1.0}),
        ("nothing hidden (overlap 0)", hw, {"overlap": 0.0}),
    ]
    if old_efficiency is not None:
        cases.insert(3, (f"GEMMs at the old {old_efficiency} of peak",
                         replace(hw, compute_efficiency=old_efficiency), {}))
    return [(what, estimate(shape, h, layout, framework=framework, **kw).hfu)
            for what, h, kw in cases]
