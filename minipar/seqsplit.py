"""A sequence split over a group of ranks, and gathered back.

Rank r of a group of t holds tokens [r s/t, (r+1) s/t) of every sequence: sequence
parallelism does this between the blocks (``minipar.tp``), and an MoE layer under tensor
parallelism routes each rank's share (``minipar.moe``). Here: the shape helpers, and the two
autograd operators for a tensor that every rank of the group holds whole and alike (Megatron-
LM's scatter_to_sequence_parallel_region, and gather_from_sequence_parallel_region without the
sum of the gradient). Volumes per call, N the whole (b, s, ...) tensor's bytes, per rank::

    scatter_seq            forward: none            backward: all-gather (t-1)/t N
    gather_seq_replicated  forward: all-gather (t-1)/t N     backward: none
"""
from __future__ import annotations

import torch
from einops import rearrange

from . import comm


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: (t, *x.shape). comm's collectives are flat."""
    t = comm.size(group)
    out = x.new_empty(t * x.numel())
    comm.all_gather(out, x.contiguous().view(-1), group)
    return out.view(t, *x.shape)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/t, ...) on each rank -> (b, s, ...), rank r's tokens at [r s/t, (r+1) s/t).

    No autograd (the operators below and ``minipar.tp``'s wrap it)."""
    if comm.size(group) == 1:
        return x
    return rearrange(all_gather_stacked(x, group), "t b s ... -> b (t s) ...")


def slice_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's (b, s/t, ...) of a (b, s, ...) tensor."""
    t = comm.size(group)
    return rearrange(x, "b (t s) ... -> t b s ...", t=t)[comm.rank(group)].contiguous()


class ScatterToSeq(torch.autograd.Function):
    """Keep this rank's s/t of a sequence every rank holds whole; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return slice_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


class GatherSeqReplicated(torch.autograd.Function):
    """All-gather along the sequence into a tensor every rank then uses whole and alike;
    backward: keep this rank's slice (no sum: the copies' gradients are the same)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return slice_seq(grad, ctx.group), None


def scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    return ScatterToSeq.apply(x, group) if comm.size(group) > 1 else x


def gather_seq_replicated(x: torch.Tensor, group) -> torch.Tensor:
    return GatherSeqReplicated.apply(x, group) if comm.size(group) > 1 else x
