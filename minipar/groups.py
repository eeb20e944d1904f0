"""Parameter groups: which parameters reduce their gradients over which mesh axis.

Built once from the module structure, then handed to the engines as values (no tags on
tensors). Two kinds today:

==========  =============  ==========================================================
name        reduce_axis    why
==========  =============  ==========================================================
``dense``   ``dp_cp``      every data-parallel (and context-parallel) replica holds the
                           same tensor: average over all of them
``expert``  ``edp``        an MoE expert lives on one rank of each EP group; its gradient
                           already sums the tokens of the whole EP group (the all-to-all
                           brought them), so it is summed over its replicas in the other EP
                           groups and, like every gradient, divided by the dp x cp degree
==========  =============  ==========================================================

So every group's gradient is ``sum over group`` / ``divisor``; ``divisor`` is the number of
data-parallel replicas of the loss (dp x cp) for both kinds. The decay/no-decay split for the
optimizer is another grouping and lives in ``minipar.optim``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that reduce together: over ``reduce_axis`` of the mesh, i.e. ``group``
    (None: a group of one), then divided by ``divisor``."""

    name: str
    params: tuple[nn.Parameter, ...]
    reduce_axis: str
    group: object = field(default=None, compare=False)
    divisor: int = 1

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))

    def __len__(self):
        return len(self.params)


def param_groups(model: nn.Module, mesh=None) -> list[ParamGroup]:
    """``dense`` (reduced over ``dp_cp``) and, for an MoE model, ``expert`` (over ``edp``),
    each with its process group from ``mesh`` (None: a single process). Empty groups are left
    out; every trainable parameter is in exactly one group, in ``model.parameters()`` order."""
    from . import moe
    experts = {id(p) for p in moe.expert_parameters(model)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in trainable if id(p) not in experts]
    expert = [p for p in trainable if id(p) in experts]
    divisor = mesh.size("dp_cp") if mesh is not None else 1
    out = [ParamGroup("dense", dense, "dp_cp", mesh.group("dp_cp") if mesh else None, divisor)]
    if expert:
        out.append(ParamGroup("expert", expert, "edp", mesh.group("edp") if mesh else None,
                              divisor))
    return [g for g in out if g.params]
