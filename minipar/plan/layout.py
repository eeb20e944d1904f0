"""One training layout: how a model is cut over devices, and whether the cut is legal.

The world is a grid of tp x cp x pp x dp devices. ``order`` says how the grid is laid over
consecutive device numbers (and so over nodes), innermost axis first:

* ``tp,pp,dp``: minipar's ``Mesh`` (``torch.arange(world).view(dp, pp, cp, tp)``);
* ``tp,dp,pp``: Megatron-LM's and DeepSpeed's default, which puts data-parallel neighbours
  in one node when tp is less than a node.

Either way tensor parallelism is innermost: its all-reduces run every layer and want the
fastest links (the Frontier study's first rule). Context parallelism (``cp``), whose ring
passes K/V blocks every layer, sits next to it in both: minipar's mesh and Megatron-LM's
order (tp-cp-ep-dp-pp) alike, so neither order string names it.

The parameters are replicated over cp as over dp, so the data-parallel side of a layout (the
gradient reduction, the ZeRO/AMSP shards) spans the dp x cp ``replicas``, as the trainer's
``dp_cp`` mesh axis does (``minipar.mesh``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError, raise_if
from .shapes import RECOMPUTE_MODES, ModelShape
from .sharding import Shard, check_shard
from .stages import split_violation       # each framework's stages (even, uneven, ...)
from .timing import placement
from ..rules import (cp_violation, interleave_violation, pp_violation,  # noqa: F401
                     tp_violation)   # one copy of each rule, shared with the trainer

ORDERS = ("tp,pp,dp", "tp,dp,pp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1       # sequences per micro-batch
    microbatches: int = 1      # per pipeline per step (gradient accumulation when pp = 1)
    shard: Shard = (1, 1, 1)   # (s_p, s_g, s_os) over the dp ranks
    recompute: str = "none"    # none | selective | full
    v: int = 1                 # model chunks per stage (interleaved 1F1B when > 1)
    sp: bool = False           # sequence parallelism inside the TP group
    schedule: str = "1f1b"     # gpipe | 1f1b  (v > 1 makes 1f1b interleaved)
    cp: int = 1                # context parallel: each sequence over cp ranks (plan.cp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: dp x cp (what gradients reduce and ZeRO shards
        over)."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch * self.microbatches

    def strides(self, order: str = "tp,pp,dp") -> dict[str, int]:
        """Distance, in device numbers, between neighbours along each axis (cp right after
        tp, module docstring)."""
        sizes = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp}
        out, stride = {}, 1
        for axis in order.replace("tp", "tp,cp").split(","):
            out[axis] = stride
            stride *= sizes[axis]
        return out

    def replica_stride(self, order: str = "tp,pp,dp", gpus_per_node: int | None = None) -> int:
        """The distance between neighbours of the dp x cp replicas, as one evenly spaced
        group (what ``network.collective_time`` prices). Exact where the line is even: cp = 1,
        dp = 1, Megatron-LM's order, or pp = 1. In minipar's order with pp > 1 the line is
        blocks of cp ranks (tp apart) pp x cp x tp apart: the stride that puts as many of
        them in a node as really share one."""
        s = self.strides(order)
        if self.cp == 1:
            return s["dp"]
        if (self.dp == 1 or s["dp"] == s["cp"] * self.cp or not gpus_per_node
                or s["cp"] >= gpus_per_node):
            return s["cp"]
        blocks = max(1, gpus_per_node // s["dp"])            # replica blocks per node
        per_node = min(self.replicas, blocks * min(self.cp, gpus_per_node // s["cp"]))
        return max(1, gpus_per_node // per_node)

    def describe(self, shard: bool = True) -> str:
        v = f" v={self.v}" if self.v > 1 else ""
        spec = " shard=({},{},{})".format(*self.shard) if shard else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"tp={self.tp} pp={self.pp}{v}{cp} dp={self.dp} b={self.micro_batch} "
                f"m={self.microbatches}{spec} recompute={self.recompute}")


def dp_per_node(layout: Layout, gpus_per_node: int, order: str = "tp,pp,dp") -> int:
    """How many ranks of one data-parallel group (the dp x cp replicas) share a node."""
    stride = layout.replica_stride(order, gpus_per_node)
    return placement(layout.replicas, stride, gpus_per_node)[0]


def shape_tp_violation(shape: ModelShape, tp: int, sp: bool = False) -> str | None:
    """``rules.tp_violation`` with every field of ``shape`` the trainer passes it (heads,
    key/value heads, hidden and MLP widths, and with sequence parallelism the sequence): the
    one place the planner asks whether tp splits a model."""
    return tp_violation(shape.heads, tp, shape.kv_heads, hidden=shape.hidden, ffn=shape.ffn,
                        seq_len=shape.seq_len, sp=sp)


def recompute_violation(modes: tuple) -> str | None:
    """The first of ``modes`` that is no activation-recomputation mode, said, or None."""
    bad = [mode for mode in modes if mode not in RECOMPUTE_MODES]
    return (f"unknown recomputation {bad[0]!r} (--recompute); use one of "
            f"{', '.join(RECOMPUTE_MODES)}") if bad else None


def schedule_violation(schedule: str | None, chunks: int) -> str | None:
    """The command line's schedule and model chunks per stage agree: interleaving needs two
    chunks or more, and more than one chunk needs interleaving (``schedule`` None: free)."""
    if schedule == "interleaved" and chunks < 2:
        return "--schedule interleaved needs --chunks of 2 or more"
    if schedule in ("gpipe", "1f1b") and chunks > 1:
        return f"--chunks > 1 needs --schedule interleaved, not {schedule}"
    return None


def layout_violation(shape: ModelShape, layout: Layout, stage_rule: str = "even",
                     hint: bool = True) -> str | None:
    """The first of the trainer's rules ``layout`` breaks for ``shape``, in the trainer's
    order (``minipar.train.config``: cp, tp, interleaving, the stage split under
    ``stage_rule``), or None. ``hint``: a pp that even stages refuse names the frameworks
    that build uneven ones (off where no framework can be chosen)."""
    t, p, v = layout.tp, layout.pp, layout.v
    stages = split_violation(shape, p, stage_rule, v)
    if stages and hint and stage_rule == "even" and v == 1 and shape.layers >= p:
        stages += " (or a framework that builds uneven stages: megatron-lm, nanotron)"
    return (cp_violation(shape.seq_len, layout.cp, t, layout.sp)   # the trainer's order
            or shape_tp_violation(shape, t, layout.sp)
            or interleave_violation(p, layout.microbatches, v) or stages)


def check_layout(shape: ModelShape, layout: Layout, order: str = "tp,pp,dp",
                 gpus_per_node: int | None = None, stage_rule: str = "even") -> Layout:
    """Raise PlanError (what is wrong, what would fix it) unless ``layout`` can run ``shape``
    with stages built by ``stage_rule`` (``plan.stages``: even unless the framework builds
    uneven ones, each rule with its own limits: nanotron's gives every stage a block)."""
    t, p, v = layout.tp, layout.pp, layout.v
    if order not in ORDERS:
        raise PlanError(f"unknown order {order!r}; use {' or '.join(ORDERS)}")
    if min(t, p, layout.cp, layout.dp, v, layout.micro_batch, layout.microbatches) < 1:
        raise PlanError(f"every degree and batch count must be >= 1: {layout.describe()}")
    raise_if(recompute_violation((layout.recompute,)))
    if layout.schedule not in ("gpipe", "1f1b"):
        raise PlanError(f"unknown schedule {layout.schedule!r}; use gpipe or 1f1b "
                        f"(v > 1 makes 1f1b interleaved)")
    if v > 1 and layout.schedule != "1f1b":
        raise PlanError(f"interleaving (v={v}) needs the 1f1b schedule")
    raise_if(layout_violation(shape, layout, stage_rule))
    per_node = dp_per_node(layout, gpus_per_node, order) if gpus_per_node else None
    check_shard(layout.shard, layout.replicas, per_node)   # ZeRO shards over dp x cp
    return layout
