"""How the paradigms are applied to the GPT: one place, in a fixed order (torchtitan's
``parallelize_llama``). Each lesson knows only its own paradigm; where two meet, it is here.

    the serial GPT, built from the seed (the same on every rank), then in place:
    1. tensor parallelism      ``tp.parallelize``; an MoE layer is not split by weights: its
                               router and experts are replicated over TP, each TP rank routes
                               its own s/t tokens, and their weights enter through ``tp.f``
    2. expert parallelism      ``moe.expert_parallel`` over the mesh's ``ep`` axis
    3. precision               the parameters in the policy's dtype, on the device
    4. context parallelism     ``cp.parallelize``: ring attention; an MoE layer gathers its
                               routing choices over cp (capacity and f_e count whole sequences)
    5. recomputation           a recomputed MoE block replays its routing and all-to-alls
    6. ``torch.compile``       each block's forward (module hooks stay outside the graph)

Then ``build_runner``: one device, or a pipeline stage (``minipar.pp``); both backpropagate
MoE's auxiliary losses and fp16's loss scale, given as values. The engines (DP or ZeRO over
dp x cp, MoE experts over ``edp``) are ``minipar.train.engines``.

Why MoE under TP replicates the experts rather than splitting them (Megatron's expert tensor
parallelism): no variable-size all-gather of dispatched rows, the all-to-alls and routing stay
those of one rank, and a small expert does not become t smaller matmuls; the price is the
experts held t times and their gradients summed over TP (``docs/reference.md``, MoE).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from . import comm, cp, data, moe, pp, tp
from .mesh import Mesh
from .precision import PrecisionPolicy
from .runtime.errors import UsageError


def parallelize(model, mesh: Mesh, sp: bool = False, policy: PrecisionPolicy | None = None,
                device=None, compile: bool = False):
    """Apply this rank's layout to the serial ``model`` (see the module's docstring)."""
    policy = policy or PrecisionPolicy()
    layers = moe.moe_layers(model)
    if mesh.tp > 1:                                                    # 1
        tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp, other_mlp=replicate_over_tp)
    if layers:                                                         # 2
        moe.expert_parallel(model, mesh.group("ep"))
    model = model.to(device=device, dtype=policy.param_dtype)          # 3
    if mesh.cp > 1:                                                    # 4
        cp.parallelize(model, mesh.group("cp"), model.cfg.seq_len)
    if layers and (mesh.tp > 1 or mesh.cp > 1):
        share = TokenShare(mesh.group("tp"), sp, mesh.group("cp"), model.cfg.seq_len)
        for layer in layers:
            layer.tokens = share
    for block in model.blocks:                                         # 5
        block_layers = moe.moe_layers(block)
        if block_layers:
            block.recompute_context = replay_contexts(block_layers)
    if compile:                                                        # 6
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    return model


# --------------------------------------------------------------------------------------
# MoE under tensor and context parallelism: each rank routes a share of each sequence
# --------------------------------------------------------------------------------------
class TokenSplitLinear(nn.Linear):
    """A Linear replicated over the TP group while each rank feeds it different tokens: weight
    and bias enter through f, so their gradients are summed over the group (2(t-1)/t x their
    bytes per micro-batch), as sequence parallelism's LayerNorm's are."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.group = group
        self.load_state_dict(linear.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else tp.f(self.bias, self.group)
        return F.linear(x, tp.f(self.weight, self.group), bias)


def replicate_over_tp(layer: moe.MoE, group) -> None:
    """The router and every expert's Linear layers become ``TokenSplitLinear``s."""
    layer.router = TokenSplitLinear(layer.router, group)
    for expert in layer.experts.values():
        for name, child in list(expert.named_children()):
            if isinstance(child, nn.Linear):
                setattr(expert, name, TokenSplitLinear(child, group))
        if any(not isinstance(m, TokenSplitLinear) for m in _holders(expert)):  # not silently
            raise UsageError("MoE under TP: an expert holds parameters outside its direct "
                             "nn.Linear children; their gradients would miss TP's sum")


def _holders(module):
    """The modules under ``module`` (itself included) that hold parameters of their own."""
    return [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]


class TokenShare(moe.Sequences):
    """This rank's share of each sequence: 1/t of its cp chunks under TP (without SP the layer
    keeps its slice of the input, whose gradient is then all-gathered, and all-gathers its
    output), and chunks i and 2cp-1-i under CP (``minipar.cp``). Per MoE layer and micro-batch
    one rank sends (k choices of int64, b s tokens, d_model features of w bytes)::

        all_gather  (t-1)/t b s/cp k 8 over TP, (cp-1)/cp b s k 8 over cp    the choices
        all_gather  (t-1)/t b s d_model w, twice                             without SP
    """

    def __init__(self, tp_group, sp: bool, cp_group, seq_len: int):
        self.tp_group, self.split_here = tp_group, comm.size(tp_group) > 1 and not sp
        self.cp_group, c = cp_group, comm.size(cp_group)
        self.t, self.replicas = comm.size(tp_group), c
        self.where = torch.stack([cp.local_positions(seq_len, c, r) for r in range(c)])  # (c, s/c)

    def take(self, x):
        return tp.scatter_seq(x, self.tp_group) if self.split_here else x

    def give_back(self, y):
        return tp.gather_seq_replicated(y, self.tp_group) if self.split_here else y

    def length(self, s_here: int) -> int:
        return s_here * self.t * self.replicas

    def gather(self, choices):
        """(b, s_here, k) -> (b, s, k): over TP (this cp rank's tokens, in its local order),
        then over cp, each rank's rows put back at the positions it holds."""
        whole = tp.gather_seq(choices, self.tp_group)
        if self.replicas == 1:
            return whole
        parts = comm.all_gather_stacked(whole, self.cp_group)                  # (c, b, s/c, k)
        ordered = torch.empty(whole.shape[0], self.where.numel(), whole.shape[-1],
                              dtype=whole.dtype, device=whole.device)
        ordered[:, self.where.flatten().to(whole.device)] = rearrange(parts, "c b s k -> b (c s) k")
        return ordered

    def mine(self, mask):
        if self.replicas > 1:
            mask = mask[:, self.where[comm.rank(self.cp_group)].to(mask.device)]
        return tp.slice_seq(mask, self.tp_group) if self.t > 1 else mask


# --------------------------------------------------------------------------------------
# MoE under recomputation: the recomputed forward replays the first one's decisions
# --------------------------------------------------------------------------------------
class _Recording(moe.Memo):
    def __init__(self, store: dict):
        self.store = store

    def record(self, name, value):
        self.store[name] = value


class _Replaying(moe.Memo):
    replaying = True

    def __init__(self, store: dict):
        self.store = store

    def recorded(self, name):
        return self.store.get(name)    # rows are kept only when an all-to-all ran


@contextlib.contextmanager
def _memos(layers, memos):
    old = [layer.memo for layer in layers]
    for layer, memo in zip(layers, memos):
        layer.memo = memo
    try:
        yield
    finally:
        for layer, memo in zip(layers, old):
            layer.memo = memo


def replay_contexts(layers):
    """Checkpoint's ``context_fn`` for a block holding MoE ``layers``: its first forward records
    each layer's routing decision, the counts it exchanged and the rows the all-to-alls
    returned; its recomputation replays them (no routing counted twice, no all-to-all run
    again; backward runs each all-to-all once, in the first forward's graph). The price: those
    rows are kept until the block's backward (2 t k d_model w per layer, balanced)."""
    def context_fn():
        stores = [{} for _ in layers]
        return (_memos(layers, [_Recording(s) for s in stores]),
                _memos(layers, [_Replaying(s) for s in stores]))
    return context_fn


# --------------------------------------------------------------------------------------
# The runner: forward and backward of one step's micro-batches on this rank's part
# --------------------------------------------------------------------------------------
class LocalRunner:
    """m micro-batches on one device, their gradients accumulated (``forward_backward``)."""

    def __init__(self, model, microbatches: int, scale=lambda: 1.0):
        self.module, self.m, self.scale = model, microbatches, scale

    def forward_backward(self, x, y) -> torch.Tensor:
        """The mean cross-entropy over the micro-batches, left on the device (no host sync):
        the model's loss less what MoE's auxiliary losses added (0.0 when dense)."""
        total = torch.zeros((), device=x.device)
        for xb, yb in data.microbatches(x, y, self.m):
            loss = self.module(xb, yb) / self.m
            (loss * self.scale()).backward()
            total += (loss - moe.penalty(self.module) / self.m).detach()
        return total

    @torch.no_grad()
    def evaluate(self, x, y) -> float:
        total = 0.0
        for xb, yb in data.microbatches(x, y, self.m):
            total += ((self.module(xb, yb) - moe.penalty(self.module)) / self.m).item()
        return total

    def serial_name(self, local_name: str) -> str:
        return local_name


def build_runner(model, mesh: Mesh, microbatches: int, schedule: str = "1f1b", chunks: int = 1,
                 sp: bool = False, policy: PrecisionPolicy | None = None):
    """A pipeline stage (``pp > 1``; between stages (b, s/t, h) under SP), or one device. Both
    start backward from the loss times fp16's scale; a stage adds its MoE layers' losses."""
    scaler = (policy or PrecisionPolicy()).loss_scaler
    scale = (lambda: scaler.scale) if scaler is not None else (lambda: 1.0)
    if mesh.pp > 1:
        return pp.PipelineRunner(model, mesh.group("pp"), schedule, microbatches, chunks,
                                 seq_split=mesh.tp if sp else 1, extra_loss=moe.penalty,
                                 scale=scale)
    return LocalRunner(model, microbatches, scale)
