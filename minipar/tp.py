"""Tensor parallelism (Megatron-LM): every weight matrix split over the t ranks of a TP group.

A linear layer ``Y = X A`` can be cut two ways without changing its result: by columns,
``A = [A_1 | ... | A_t]`` (rank r computes its slice ``X A_r`` of the output features, no
communication, every rank needs all of X), or by rows, ``A = [A_1; ...; A_t]`` with
``X = [X_1 | ... | X_t]`` (rank r computes the partial sum ``X_r A_r``; ``Y`` is an
all-reduce). A column layer followed by a row layer needs nothing in between, so a block is::

    x -> LN -> f -> qkv (column, by heads) -> attention on h/t heads -> proj (row) -> g -> + x
      -> LN -> f -> fc (column) -> GELU -> proj (row) -> g -> + x

with the paper's conjugate operators: **f** is the identity forward and an all-reduce of the
gradient backward (every rank's branch used all of X); **g** the reverse. Per block and
micro-batch of b sequences of s tokens, width h, e bytes an element, each rank sends::

    forward   2 all-reduces (the two g)     2 x 2(t-1)/t x b s h e bytes
    backward  2 all-reduces (the two f)     2 x 2(t-1)/t x b s h e bytes

The vocab-parallel embedding ends in a g; the vocab-parallel cross-entropy all-reduces 3 b s
fp32 values forward, so the b x s x V logits never exist on one rank (the vocabulary padded
to a multiple of t with rows the loss never sees).

**Sequence parallelism** (``sp``, Korthikanti et al. 2022): the activations every rank holds
alike between a g and the next f (LayerNorm, dropout, residual) are split along the sequence
instead: f becomes an all-gather along the sequence, g a reduce-scatter, the same bytes as one
all-reduce, and those activations shrink t-fold. A replicated parameter that sees only s/t
tokens (LayerNorm, positions, a row bias) enters through f, which sums its gradient over TP.

``parallelize(model, group, sp)`` swaps these parts into the serial GPT, slicing its weights.
Closed forms: ``minipar.plan.tp_block_comm_bytes``; derivations: ``docs/reference.md`` (TP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from . import comm
from .model import MLP
from .runtime.errors import UsageError


# --------------------------------------------------------------------------------------
# Shape helpers: split and gather along the last dimension or along the sequence
# --------------------------------------------------------------------------------------
def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    t = comm.size(group)
    return rearrange(x, "... (t n) -> t ... n", t=t)[comm.rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    return rearrange(comm.all_gather_stacked(x, group), "t ... n -> ... (t n)")


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/t, ...) on each rank -> (b, s, ...), rank r's tokens at [r s/t, (r+1) s/t)."""
    if comm.size(group) == 1:
        return x
    return rearrange(comm.all_gather_stacked(x, group), "t b s ... -> b (t s) ...")


def slice_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's (b, s/t, ...) of a (b, s, ...) tensor."""
    t = comm.size(group)
    return rearrange(x, "b (t s) ... -> t b s ...", t=t)[comm.rank(group)].contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> rank r's (b, s/t, ...) slice of the sum."""
    t = comm.size(group)
    chunks = rearrange(x, "b (t s) ... -> t b s ...", t=t).contiguous()
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter(out.view(-1), chunks.view(-1), group)
    return out


# --------------------------------------------------------------------------------------
# The conjugate operators (Megatron-LM's mappings), as autograd functions
# --------------------------------------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, all-reduce (sum) of the gradient: 2(t-1)/t N bytes."""

    @staticmethod
    def forward(ctx, x, group):
        # EXERCISE ex03a begin
        # f forward is the identity: keep the group in ctx for the backward and return x
        ctx.group = group
        return x
        # EXERCISE ex03a end

    @staticmethod
    def backward(ctx, grad):
        # EXERCISE ex03a begin
        # f backward: sum the gradient over the group with comm.all_reduce (on a copy: autograd may share grad)
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, ctx.group)
        return grad, None
        # EXERCISE ex03a end


class ReduceFromTP(torch.autograd.Function):
    """g: forward, all-reduce (sum) over the TP group: 2(t-1)/t N bytes; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # EXERCISE ex03a begin
        # g forward: sum the partial results of every rank with comm.all_reduce (on a copy of x)
        x = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(x, group)
        return x
        # EXERCISE ex03a end

    @staticmethod
    def backward(ctx, grad):
        # EXERCISE ex03a begin
        # g backward is the identity (the gradient of a sum reaches every summand unchanged)
        return grad, None
        # EXERCISE ex03a end


def f(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce backward."""
    return CopyToTP.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return ReduceFromTP.apply(x, group)


class Conjugate(torch.autograd.Function):
    """``forward_fn`` forward and ``backward_fn`` backward: the gradient of a split is a gather,
    of a gather a split, of a reduce-scatter an all-gather (each (t-1)/t N bytes, N the full
    tensor)."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _conjugate(x, group, forward_fn, backward_fn):
    return Conjugate.apply(x, group, forward_fn, backward_fn) if comm.size(group) > 1 else x


def scatter_to_tp(x, group):            # keep this rank's slice of the last dim; bwd: all-gather
    return _conjugate(x, group, _split_last, _gather_last)


def gather_from_tp(x, group):           # all-gather along the last dim; bwd: keep the slice
    return _conjugate(x, group, _gather_last, _split_last)


def all_gather_seq(x, group):           # SP's f: all-gather along the sequence; bwd: r-scatter
    return _conjugate(x, group, gather_seq, _reduce_scatter_seq)


def reduce_scatter_seq(x, group):       # SP's g: reduce-scatter along the sequence; bwd: gather
    return _conjugate(x, group, _reduce_scatter_seq, gather_seq)


def scatter_seq(x, group):              # keep s/t of a sequence held alike; bwd: all-gather
    return _conjugate(x, group, slice_seq, gather_seq)


def gather_seq_replicated(x, group):    # all-gather, used alike on every rank; bwd: keep the
    return _conjugate(x, group, gather_seq, slice_seq)     # slice (the copies' grads: no sum)


# --------------------------------------------------------------------------------------
# How a parameter is cut from its serial tensor (``minipar.train.pieces`` glues it back)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Cut along ``dim`` into t parts within each of ``groups`` interleaved groups (qkv's
    "(three h d)" rows: rank r takes its heads of q, of k and of v); ``full``, the serial size
    along ``dim``, is padded with zeros to a multiple of t (only the vocabulary needs it)."""
    dim: int
    full: int
    groups: int = 1


def padded_size(n: int, t: int) -> int:
    return -(-n // t) * t


def shard(full: torch.Tensor, split: Split, rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s part of the serial tensor ``full``."""
    x = full.movedim(split.dim, 0)
    pad = padded_size(split.full, t * split.groups) - split.full
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = rearrange(x, "(g t n) ... -> t (g n) ...", g=split.groups, t=t)[rank]
    return x.movedim(0, split.dim).contiguous()


# --------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------
class SplitLinear(nn.Module):
    """What the split layers share: each is built as this rank's slice of a serial layer."""

    @classmethod
    def from_serial(cls, serial: nn.Module, group, **kwargs):
        """This rank's slice of a full ``nn.Linear`` or ``nn.Embedding`` (same seed, same model)."""
        if isinstance(serial, nn.Embedding):
            layer = cls(serial.num_embeddings, serial.embedding_dim, group, **kwargs)
        else:
            layer = cls(serial.in_features, serial.out_features, group,
                        bias=serial.bias is not None, **kwargs)
        t, r = comm.size(group), comm.rank(group)
        with torch.no_grad():
            for name, p in layer.named_parameters(recurse=False):    # a split, or a copy
                full = getattr(serial, name).detach()
                p.copy_(shard(full, layer.tp_splits[name], r, t) if name in layer.tp_splits else full)
        return layer


class ColumnParallelLinear(SplitLinear):
    """``Y = X A^T + b``, A (out, in) split by output features: this rank computes out/t. The
    input enters through f (SP: all-gather along the sequence); the output stays split unless
    ``gather_output``; the bias is split like the outputs, so it is added once."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, groups: int = 1):
        super().__init__()
        t = comm.size(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_splits = {"weight": Split(0, out_features, groups), "bias": Split(0, out_features, groups)}
        local = padded_size(out_features, t * groups) // t
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # EXERCISE ex03 begin
        # enter with f(x, group) (extension, SP: all_gather_seq), F.linear with the local rows and bias;
        # if gather_output: gather_from_tp, then keep the first out_features (padding)
        x = all_gather_seq(x, self.group) if self.sequence_parallel else f(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.group)[..., :self.out_features]
        return y
        # EXERCISE ex03 end


class RowParallelLinear(SplitLinear):
    """``Y = X A^T + b``, A (out, in) split by input features: this rank holds in/t columns.
    The input arrives split (a column layer's output; else ``input_is_parallel=False``); g sums
    the partial products (SP: reduce-scatter); the bias is replicated, added once after."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        t = comm.size(group)
        assert in_features % t == 0, f"in_features {in_features} must divide by t={t}"
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_splits = {"weight": Split(1, in_features)}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        # With SP each rank adds the bias to its own s/t tokens: f sums the bias gradient.
        summed = self.sequence_parallel and self.bias is not None
        bias = f(self.bias, self.group) if summed else self.bias
        # EXERCISE ex03 begin
        # partial product with the local columns, no bias; sum it over the group with g (extension, SP:
        # reduce_scatter_seq); then add `bias` once (the variable above, not self.bias)
        y = F.linear(x, self.weight)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else g(y, self.group)
        return y if bias is None else y + bias
        # EXERCISE ex03 end


class VocabParallelEmbedding(SplitLinear):
    """The table split by vocabulary rows: rank r holds tokens [r V'/t, (r+1) V'/t) (V' the
    padded V). Each rank looks up the tokens it owns (zeros for the others); g sums them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group,
                 sequence_parallel: bool = False):
        super().__init__()
        t = comm.size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_splits = {"weight": Split(0, num_embeddings)}
        self.per_rank = padded_size(num_embeddings, t) // t
        self.start = comm.rank(group) * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mine = (idx >= self.start) & (idx < self.start + self.per_rank)
        local = F.embedding(torch.where(mine, idx - self.start, 0), self.weight)
        local = local * rearrange(mine, "... -> ... 1")
        return reduce_scatter_seq(local, self.group) if self.sequence_parallel else g(local, self.group)


class ParallelEmbedding(nn.Module):
    """The GPT's ``embed`` with a vocab-parallel token table (same parameter names). With SP it
    adds the positions of this rank's s/t tokens; the table then enters through f."""

    def __init__(self, tok: VocabParallelEmbedding, pos: nn.Embedding, drop: nn.Module, group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tok, self.pos, self.drop = tok, pos, drop
        self.group, self.sequence_parallel = group, sequence_parallel
        self.positions: torch.Tensor | None = None   # as model.Embedding's (context parallelism)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)                                  # (b, s, h), or (b, s/t, h) with SP
        every = (torch.arange(idx.shape[1], device=idx.device) if self.positions is None
                 else self.positions)
        if not self.sequence_parallel:
            return self.drop(x + self.pos(every))
        first = comm.rank(self.group) * x.shape[1]
        positions = every[first:first + x.shape[1]]
        return self.drop(x + F.embedding(positions, f(self.pos.weight, self.group)))


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on this rank's s/t tokens: weight and bias enter through f (summed gradients)."""

    def __init__(self, ln: nn.LayerNorm, group):
        super().__init__(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine,
                         bias=ln.bias is not None)
        self.group = group
        self.load_state_dict(ln.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else f(self.weight, self.group)
        bias = None if self.bias is None else f(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


# --------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# --------------------------------------------------------------------------------------
class VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary: rank r holds entries
    [r V'/t, (r+1) V'/t), those >= ``vocab_size`` padding (probability zero). Forward: 3
    all-reduces of N fp32 values (max, sum of exp, target logit); backward: none, the gradient
    softmax - one-hot(target) of the local slice is local."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size):
        n_local = logits.shape[-1]
        start = comm.rank(group) * n_local
        ctx.dtype = logits.dtype
        # EXERCISE ex04 begin
        # mask padding (columns >= vocab_size) to -inf; all-reduce the max ("max"), the sum of exp and the target logit
        logits = logits.float()
        columns = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
        top = logits.max(dim=-1).values
        comm.all_reduce(top, group, op="max")                 # for a stable exp
        shifted = logits - rearrange(top, "n -> n 1")
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < n_local)  # the rank owning the target
        local_target = torch.where(mine, local_target, 0)
        target_logit = shifted.gather(1, rearrange(local_target, "n -> n 1"))
        target_logit = torch.where(mine, rearrange(target_logit, "n 1 -> n"), 0.0)
        comm.all_reduce(target_logit, group)
        ctx.save_for_backward(exp.div_(rearrange(sum_exp, "n -> n 1")), local_target, mine)
        return sum_exp.log() - target_logit
        # EXERCISE ex04 end

    @staticmethod
    def backward(ctx, grad_loss):
        # EXERCISE ex04 begin
        # d loss_i / d logit_ij = softmax_ij - [j is i's target]: local to this rank's columns
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= mine.to(grad.dtype)
        grad *= rearrange(grad_loss, "n -> n 1")
        return grad.to(ctx.dtype), None, None, None
        # EXERCISE ex04 end


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy; ``logits`` (..., V'/t) this rank's vocabulary slice, ``targets`` (...)."""
    per_token = VocabParallelCE.apply(rearrange(logits, "... v -> (...) v"),
                                      rearrange(targets, "... -> (...)"), group, vocab_size)
    return per_token.mean()


class VocabParallelCrossEntropy(nn.Module):
    """The head's loss for a column-parallel projection that keeps its output split."""

    def __init__(self, group, vocab_size: int):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size)


# --------------------------------------------------------------------------------------
# The serial GPT -> the tensor-parallel GPT
# --------------------------------------------------------------------------------------
def parallelize_block(block, group, sequence_parallel: bool = False, other_mlp=None):
    """One block, in place: qkv and fc column-parallel, both proj row-parallel (attention reads
    its number of heads, h/t here, from qkv's width). Another kind of MLP (a mixture of
    experts) is split by ``other_mlp(mlp, group)``, the layout's; none given: refused."""
    attn, mlp, sp = block.attn, block.mlp, sequence_parallel
    if isinstance(mlp, MLP):                         # the MLP first: a refusal swaps nothing
        mlp.fc = ColumnParallelLinear.from_serial(mlp.fc, group, sequence_parallel=sp)
        mlp.proj = RowParallelLinear.from_serial(mlp.proj, group, sequence_parallel=sp)
    elif other_mlp is None:         # left whole, its gradients would miss TP's sum: say so
        raise UsageError(f"tp splits model.MLP; for a {type(mlp).__name__} pass other_mlp=f(mlp, group)")
    else:
        other_mlp(mlp, group)
    attn.qkv = ColumnParallelLinear.from_serial(attn.qkv, group, groups=3, sequence_parallel=sp)
    attn.proj = RowParallelLinear.from_serial(attn.proj, group, sequence_parallel=sp)
    if sp:
        block.ln1 = SequenceParallelLayerNorm(block.ln1, group)
        block.ln2 = SequenceParallelLayerNorm(block.ln2, group)
    return block


def parallelize(model, group, sequence_parallel: bool = False, other_mlp=None):
    """Swap the TP parts into the serial ``model`` (every rank built it from the seed) in
    place (``other_mlp``: as ``parallelize_block``'s). Structure and names stay, so a pipeline
    can cut it; under SP the activations between blocks are (b, s/t, h)."""
    sp = sequence_parallel and comm.size(group) > 1
    for block in sorted(model.blocks, key=lambda b: isinstance(b.mlp, MLP)):  # refusals first
        parallelize_block(block, group, sequence_parallel=sp, other_mlp=other_mlp)
    embed = model.embed
    model.embed = ParallelEmbedding(
        VocabParallelEmbedding.from_serial(embed.tok, group, sequence_parallel=sp),
        embed.pos, embed.drop, group, sequence_parallel=sp)
    head = model.head
    if sp:
        head.ln = SequenceParallelLayerNorm(head.ln, group)
    head.proj = ColumnParallelLinear.from_serial(head.proj, group, sequence_parallel=sp)
    head.loss = VocabParallelCrossEntropy(group, model.cfg.vocab_size)
    return model
