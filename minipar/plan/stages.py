"""Pipeline stages as frameworks build them: which layers, embedding and head each stage holds.

A pipeline of p stages is only as fast as its slowest stage, and its first stage holds the
most activations, so the planner prices the stages a framework really builds, not an ideal
l/p each. Four rules, each a framework's:

* ``even`` (minipar's trainer, Megatron-LM's default, FSDP, AMSP): l/p layers a stage, p
  must divide l (with interleaving, p v must divide l: v chunks of l/(p v) layers); the
  embedding on the first stage, the final norm, head and loss on the last.
* ``megatron`` (Megatron-LM with ``--decoder-first-pipeline-num-layers`` and
  ``--decoder-last-pipeline-num-layers``): where p does not divide l, the first and the last
  stage take their own layer counts and the p - 2 middle stages share the rest equally
  (``megatron/core/transformer/transformer_block.py``, ``get_num_layers_to_build``). The
  planner picks the two counts that make the slowest stage fastest, the head's logits
  counted as the work they are (what a user tunes those flags for); where p divides l it
  keeps Megatron-LM's even default. Interleaved (v chunks a stage), every stage's count is a
  multiple of v and its v chunks are equal (``TransformerConfig``'s checks), so the first and
  last stages may hold fewer layers than the middle ones; the bubble and each stage's
  activations follow from its own chunk size.
* ``uniform`` (DeepSpeed's ``PipelineModule(partition_method="type:transformer")``, which
  Megatron-DeepSpeed uses): the layers as evenly as whole layers allow, the first
  l mod p stages one more (``deepspeed/runtime/utils.py``, ``partition_uniform``).
* ``balanced`` (nanotron, ``models/base.py``, ``build_model``): blocks in order (embedding,
  layers, final norm, head, loss) with nanotron's costs, a layer 4 h^2 + k F h (k = 3 for
  SwiGLU, 2 for a GELU MLP; nanotron counts the attention as 4 h^2 whatever the key/value
  heads) and the head V h, the embedding and norms 0; a block goes to the current stage, and
  the next block to the next stage once the running cost passes (r + 1)/p of the total.
  Any p that gives every stage a block runs (the Ultra-Scale Playbook's sweep kept exactly
  those: ``bench_cluster/create_configs.py``, ``is_enough_layers_for_pp``).

``layout.pp_violation`` is the rule for a framework that builds only even stages (minipar's
trainer: ``minipar.pp.split`` refuses the rest), ``split_violation`` the one for any rule.
The bubble and each stage's memory follow from the split (``estimate``, ``memory``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..rules import pp_violation
from .errors import raise_if

RULES = ("even", "megatron", "uniform", "balanced")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index, its layers, and whether it holds the embedding (the
    first) and the final norm, head and loss (the last)."""

    index: int
    layers: int
    embedding: bool
    head: bool


def layer_cost(shape) -> float:
    """nanotron's cost of one transformer layer (``get_block_compute_costs``)."""
    return 4 * shape.hidden * shape.hidden + shape.mlp_weights


def head_cost(shape) -> float:
    """nanotron's cost of the LM head, V h, in the same units as ``layer_cost``."""
    return shape.vocab * shape.hidden


def _balanced(shape, pp: int) -> tuple[tuple[int, ...], int] | None:
    """nanotron's threshold rule (module docstring): (layers per stage, the head's stage), or
    None where a stage gets no block at all."""
    blocks = ["embedding"] + ["layer"] * shape.layers + ["norm", "head", "cast", "loss"]
    cost = {"layer": layer_cost(shape), "head": head_cost(shape)}
    total = sum(cost.get(b, 0.0) for b in blocks)
    counts, held, rank, running, head_stage = [0] * pp, [0] * pp, 0, 0.0, 0
    for block in blocks:
        running += cost.get(block, 0.0)
        held[rank] += 1
        counts[rank] += block == "layer"
        head_stage = rank if block == "head" else head_stage
        if running > total * (rank + 1) / pp and rank < pp - 1:
            rank += 1
    return None if min(held) == 0 else (tuple(counts), head_stage)


def _megatron(shape, pp: int, v: int = 1) -> tuple[int, ...] | None:
    """First and last stages' layer counts that make the slowest stage fastest, the p - 2
    middle stages equal, every count a multiple of the ``v`` chunks per stage (Megatron-LM's
    ``TransformerConfig.__post_init__``), or None where no counts do; the head counted on the
    last stage in layers' worth of work (``head_cost`` / ``layer_cost``). Ties go to a
    lighter first stage, then to a lighter last one.

    For each first count f the middle stages take k layers each and the last the rest, so
    the slowest stage is max(f, k, l - f - (p - 2) k + head): the best k is where the middle
    and the last cross, the multiples of v either side of (l - f + head) / (p - 1), or an end
    of k's range, or, where the first stage is the slowest anyway, the largest k it still
    leaves slowest. Only those few k per f are tried: O(l), not O(l^2)."""
    l, head = shape.layers, head_cost(shape) / layer_cost(shape)
    splits = []                                 # layer counts: (first, the middle ones..., last)
    for first in range(v, l, v):
        if pp == 2:
            ks = [0]                                  # no middle stage: the last takes the rest
        else:
            top = (l - first - v) // (pp - 2) // v * v          # the last keeps v layers
            cross = (l - first + head) / (pp - 1) / v
            ks = {v, top, math.floor(cross) * v, math.ceil(cross) * v, min(first, top)}
            ks = [k for k in sorted(ks, reverse=True) if v <= k <= top]
        splits += [(first, *(k,) * (pp - 2), l - first - (pp - 2) * k) for k in ks]
    runs = [x for x in splits if x[-1] >= v and x[-1] % v == 0]     # the last too: v or more
    # the slowest stage, then the lighter first; of equal keys min keeps the lighter last
    return min(runs, key=lambda x: (max(*x[:-1], x[-1] + head), x[0]), default=None)


@lru_cache(maxsize=4096)
def stages(shape, pp: int, rule: str = "even", chunks: int = 1) -> tuple[Stage, ...]:
    """The ``pp`` stages (``Stage``) ``rule`` builds for ``shape`` (module docstring), or
    ``split_violation``'s PlanError; interleaving (chunks > 1) is even but for Megatron-LM's."""
    raise_if(split_violation(shape, pp, rule, chunks))
    l, head = shape.layers, pp - 1
    if (pp == 1 or rule == "even" or chunks > 1 and rule != "megatron"
            or l % (pp * chunks) == 0 and rule != "balanced"):
        counts = (l // pp,) * pp
    elif rule == "uniform":
        base, extra = divmod(l, pp)
        counts = tuple(base + (r < extra) for r in range(pp))
    elif rule == "megatron":
        counts = _megatron(shape, pp, chunks)
    elif rule == "balanced":
        counts, head = _balanced(shape, pp)
    else:
        raise ValueError(f"unknown stage rule {rule!r}")
    return tuple(Stage(r, n, embedding=r == 0, head=r == head) for r, n in enumerate(counts))


def split_violation(shape, pp: int, rule: str = "even", chunks: int = 1) -> str | None:
    """Why ``rule`` cannot build ``pp`` stages of ``shape`` (None if it can)."""
    if rule not in RULES:
        return f"unknown stage rule {rule!r}; use one of {', '.join(RULES)}"
    if rule == "megatron" and chunks > 1 and pp > 1 and shape.layers % (pp * chunks):
        return None if _megatron(shape, pp, chunks) else (
            f"Megatron-LM interleaves uneven stages only where the first, the last and each "
            f"middle stage hold a multiple of chunks={chunks} layers; {shape.layers} layers "
            f"over pp={pp} do not split so; use --chunks that divides {shape.layers}")
    why = pp_violation(shape.layers, pp, chunks, uneven=rule != "even")
    if why or rule != "balanced" or pp == 1 or chunks > 1:   # balanced: before any pp stages
        return why
    if _balanced(shape, pp) is None:       # nanotron's own test: every stage gets a block
        return (f"nanotron's cost balance leaves a stage of pp={pp} without a block for "
                f"{shape.layers} layers (its head weighs "
                f"{head_cost(shape) / layer_cost(shape):.1f} layers); use a smaller --pp")
    return None


def distinct(stage_list) -> list[Stage]:
    """The stages that can differ in time or memory: the first, the last, and the first
    stage of each other layer count (a later stage with the same layers holds fewer
    micro-batches in 1F1B, so it is never the peak)."""
    first = {}
    for st in stage_list:
        first.setdefault((st.layers, st.embedding, st.head), st)
    return list(first.values())
