"""Mixture of experts (MoE) and expert parallelism (EP): a sparsely activated MLP.

A router sends each token to k of E expert MLPs (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021): the parameters grow E-fold, the FLOPs per token only k-fold.
Per token x (t = b s tokens, e = E experts)::

    logits = x W_r                        (t e)     a Linear without bias
    probs = softmax(logits)               (t e)
    weights, experts = top-k of probs     (t k)     k > 1: renormalised (Mixtral); k = 1: the
    y = sum_j weights_j expert[experts_j](x)        raw probability (Switch), so the task loss
                                                    reaches the router

Load balance: Switch's auxiliary loss per MoE layer, aux = E sum_e f_e P_e (f_e the share of
the s k assignments routed to e, counted; P_e the mean router probability of e), per sequence
and averaged over the sequences; 1 when balanced, E when collapsed. The objective is
cross-entropy + moe_aux_coef sum_layers aux + moe_z_coef sum_layers z, z the router z-loss of
ST-MoE (mean logsumexp(logits)^2). Capacity: with capacity_factor C > 0 an expert takes at most
ceil(C s k / E) assignments per sequence (first choices first, then by position); the rest are
dropped and the residual carries the token on. C = 0 is dropless.

Expert parallelism: EP groups of n consecutive data-parallel ranks; rank i of a group holds
experts [i E/n, (i+1) E/n). One layer's forward on every rank::

    route its own tokens; all_to_all_counts (how many rows each peer sends each local expert);
    all_to_all dispatch (each kept assignment's row to its expert's rank); the local experts;
    all_to_all combine (the outputs back); y = sum of weight x output row per token

Backward runs both all-to-alls again in reverse. An expert's gradient on its rank already sums
its EP group's tokens, so it is summed over its replicas only (the ``edp`` axis) and divided by
dp x cp (``minipar.mesh.param_groups``). Sent per layer and micro-batch, one rank (a_out rows
to other ranks, a_in received, d_model features of w bytes)::

    all_to_all          2 (a_out + a_in) d_model w       dispatch + combine, fwd and bwd
    all_to_all_counts   (n-1) E/n 8                      forward only

The layer knows nothing of the other paradigms. It routes the tokens it is given, and two
values let a layout change that (``minipar.parallelize`` sets them):

* ``tokens`` (``Sequences``): this rank's share of each sequence. Capacity and f_e need whole
  sequences in true order, so the share gathers the choices (TP, CP: each rank routes a part).
* ``memo`` (``Memo``): where the decisions and the exchanged rows are kept, so that a
  recomputed forward (activation checkpointing) replays them instead of routing and
  communicating again, and counts nothing twice.

Derivations, the TP and CP layouts and their volumes: ``docs/reference.md`` (MoE).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from . import comm, rules
from .runtime.errors import UsageError


# --------------------------------------------------------------------------------------
# The router: top-k of a softmax, and the load-balancing loss
# --------------------------------------------------------------------------------------
def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t e) router logits -> probs (t e), weights (t k), experts (t k) indices.

    k > 1: the weights are the top-k probabilities renormalised to sum to 1 (Mixtral);
    k = 1: the raw probability (Switch), so the task loss's gradient reaches the router."""
    # EXERCISE ex08 begin
    # softmax over the experts (in fp32), take the k largest; renormalise them when k > 1
    probs = F.softmax(logits.float(), dim=-1)
    top_probs, experts = torch.topk(probs, k, dim=-1)
    weights = top_probs if k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)
    # EXERCISE ex08 end
    return probs, weights, experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Switch's aux loss E * sum_e f_e P_e of each sequence, mean over the sequences.

    ``experts`` (b s, k) the choices of whole sequences of ``seq_len`` tokens; ``probs``
    (b s', e) the router's probabilities of s' of each sequence's tokens: all of them (s' =
    s), or under tensor parallelism this rank's s/t, and then the result is this rank's
    share of the aux loss (P_e is a sum over the tokens divided by s).
    """
    n_experts = probs.shape[-1]
    # EXERCISE ex08 begin
    # per sequence: f (b e) = share of its s k choices that went to e (counted, no gradient),
    # P (b e) = sum of probs over its tokens / s; then E * sum_e f P, mean over the sequences
    chosen = F.one_hot(rearrange(experts, "(b s) k -> b (s k)", s=seq_len), n_experts)
    f = chosen.float().mean(dim=1)
    P = rearrange(probs, "(b s) e -> b s e", b=f.shape[0]).sum(dim=1) / seq_len
    return n_experts * (f * P).sum(dim=-1).mean()
    # EXERCISE ex08 end


def z_loss(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """ST-MoE's router z-loss, sum over these logits' tokens of logsumexp^2 / ``tokens``
    (all of the batch's: the mean; under TP this rank's share)."""
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / tokens


def capacity_mask(experts: torch.Tensor, seq_len: int, n_experts: int,
                  capacity_factor: float) -> torch.Tensor:
    """(t k) bool: which assignments fit their expert's capacity in their own sequence.

    Capacity per expert and sequence: ceil(C s k / E). Slots go to first choices before
    second choices, then by position (GShard's priority). C = 0 keeps everything (dropless).
    """
    if capacity_factor <= 0:
        return torch.ones_like(experts, dtype=torch.bool)
    k = experts.shape[-1]
    capacity = math.ceil(capacity_factor * seq_len * k / n_experts)
    onehot = F.one_hot(rearrange(experts, "(b s) k -> b (k s)", s=seq_len), n_experts)
    slot = onehot.cumsum(dim=1) * onehot - 1            # 0, 1, 2... per expert, in priority order
    keep = (slot < capacity) & (onehot > 0)
    return rearrange(keep.any(dim=-1), "b (k s) -> (b s) k", k=k)


# --------------------------------------------------------------------------------------
# The all-to-all as an autograd op: forward sends rows out, backward sends their grads back
# --------------------------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """Rows ``send[j]`` go to rank j, ``recv[j]`` rows arrive from rank j; backward swaps them.

    ``replay``: a recomputed forward's output, recorded by the first forward; the forward
    then returns it without communicating (the backward is the original graph's anyway).
    """

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, replay=None):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        if replay is not None:
            return replay.clone()
        out = x.new_empty(sum(recv), *x.shape[1:])
        comm.all_to_all(out, x, recv, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        comm.all_to_all(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group,
               replay: torch.Tensor | None = None) -> torch.Tensor:
    return x if comm.size(group) == 1 else AllToAll.apply(x, send, recv, group, replay)


# --------------------------------------------------------------------------------------
# The two values a layout sets: this rank's share of the sequences, and a memo of decisions
# --------------------------------------------------------------------------------------
class Sequences:
    """This rank holds whole sequences: the identity share (a layout's subclass splits them).

    ``take(x)``/``give_back(y)``: the layer's input and output (b, s', d) to the tokens it
    routes and back; ``length(s_here)``: a whole sequence's length; ``gather(c)``: the routed
    tokens' (b, s_here, k) choices to whole sequences (b, s, k) in true order; ``mine(m)``:
    this rank's rows of a whole-sequence (b, s, k) mask; ``replicas``: ranks whose mean loss
    is the objective while each holds part of a sequence (P_e and z are their means)."""

    replicas = 1

    def take(self, x):
        return x

    def give_back(self, y):
        return y

    def length(self, s_here: int) -> int:
        return s_here

    def gather(self, choices):
        return choices

    def mine(self, mask):
        return mask


class Memo:
    """Decisions and exchanged rows are made afresh (the default: nothing is kept).

    A recording memo stores what ``record`` and ``keep`` are given; a replaying one returns it
    (``recorded``; ``keep(name, make)`` without calling ``make``) and counts nothing."""

    replaying = False

    def recorded(self, name: str):
        return None

    def record(self, name: str, value) -> None:
        pass

    def keep(self, name: str, make):
        value = self.recorded(name)
        if value is None:
            value = make()
            self.record(name, value)
        return value


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------
class MoE(nn.Module):
    """A router and E experts in place of a block's MLP: (b s d) -> (b s d).

    ``expert(cfg)`` builds one expert (the dense MLP class). ``experts`` is keyed by the
    expert's global index, so parameter names are the serial model's on every EP rank (an EP
    rank keeps only its own: ``expert_parallel``)."""

    def __init__(self, cfg, expert):
        super().__init__()
        self.n_experts, self.k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor, self.noise = cfg.capacity_factor, cfg.moe_noise
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert(cfg) for e in range(self.n_experts)})
        self.ep_group = None       # experts split over it (None: all here)
        self.tokens = Sequences()  # this rank's share of each sequence (a layout may split it)
        self.memo = Memo()         # decisions kept for a recomputed forward (a layout may set it)
        self.aux_loss = self.z_loss = None   # this forward's share, differentiable
        self.routing = None        # this forward's (experts (t k), kept (t k)), for inspection
        self.reset_stats()

    def reset_stats(self):
        self.stats = dict(forwards=0, aux=0.0, z=0.0, dropped=0, assigned=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tokens.take(x)
        b, s_here, _ = x.shape
        s = self.tokens.length(s_here)                  # the whole sequence
        tokens = rearrange(x, "b s d -> (b s) d")
        logits = self.router(tokens)
        if self.training and self.noise > 0:   # recomputed alike: checkpoint restores the RNG
            logits = logits + self.noise * torch.randn_like(logits)
        probs, weights, experts = route(logits, self.k)
        experts, whole, keep = self.memo.keep("decision", lambda: self._decide(experts, b, s))
        # P_e and z are means over this rank's tokens while its mean loss is one of
        # ``replicas`` averaged (context parallelism): scaled back; f_e counts whole sequences
        c = self.tokens.replicas
        aux, z = c * load_balancing_loss(probs, whole, s), z_loss(logits, b * s // c)
        if not self.memo.replaying:           # a recomputed forward counts nothing twice
            self._count(aux, z, experts, keep)
        y = self.dispatch_and_combine(tokens, weights, experts, keep)
        return self.tokens.give_back(rearrange(y, "(b s) d -> b s d", b=b))

    def _decide(self, experts, b: int, s: int):
        """(experts, whole, keep): this rank's choices (t k), the whole sequences' (b s, k) in
        true order, and which of this rank's assignments fit their expert's capacity (t k)."""
        whole = self.tokens.gather(rearrange(experts, "(b s) k -> b s k", b=b))
        whole = rearrange(whole, "b s k -> (b s) k")
        keep = rearrange(capacity_mask(whole, s, self.n_experts, self.capacity_factor),
                         "(b s) k -> b s k", b=b)
        return experts, whole, rearrange(self.tokens.mine(keep), "b s k -> (b s) k")

    def _count(self, aux, z, experts, keep):
        """Keep this forward's losses for ``penalty`` and add them to the step's statistics."""
        self.aux_loss, self.z_loss = aux, z
        self.routing = (experts.detach(), keep)
        st = self.stats
        st["forwards"] += 1
        st["aux"] += aux.item()
        st["z"] += z.item()
        st["dropped"] += int((~keep).sum())
        st["assigned"] += keep.numel()

    def dispatch_and_combine(self, tokens, weights, experts, keep) -> torch.Tensor:
        """Send each kept assignment's token to its expert's rank, compute, bring it back."""
        n = comm.size(self.ep_group)
        per_rank = self.n_experts // n
        k = experts.shape[-1]
        # kept assignments, sorted by expert (so by destination rank): a = token * k + choice
        kept = keep.flatten().nonzero().squeeze(1)
        assignment = kept[torch.argsort(experts.flatten()[kept], stable=True)]
        token = assignment // k
        counts = torch.bincount(experts.flatten()[assignment], minlength=self.n_experts)
        send = counts.view(n, per_rank).sum(dim=1).tolist()

        def exchange_counts():      # each peer says how many rows it sends to each of our experts
            received = torch.empty_like(counts)
            comm.all_to_all(received, counts, group=self.ep_group, op="all_to_all_counts")
            return received

        received = self.memo.keep("received", exchange_counts).view(n, per_rank)
        recv = received.sum(dim=1).tolist()
        # the all-to-alls' results are replayed through the same autograd op, so a recomputed
        # forward saves the same tensors as the first one
        rows = all_to_all(tokens[token], send, recv, self.ep_group, self.memo.recorded("rows"))
        # rows arrive grouped by source, then expert: regroup by expert to run each once
        local = torch.arange(per_rank, device=rows.device).repeat(n)
        by_expert = torch.argsort(local.repeat_interleave(received.flatten()), stable=True)
        chunks = rows[by_expert].split(received.sum(dim=0).tolist())
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)])
        out = out[torch.argsort(by_expert)]                                # arrival order
        back = all_to_all(out, recv, send, self.ep_group, self.memo.recorded("back"))
        if n > 1:
            self.memo.record("rows", rows.detach())
            self.memo.record("back", back.detach())
        w = weights.flatten()[assignment].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, token, (back * w).to(tokens.dtype))


# --------------------------------------------------------------------------------------
# Expert parallelism, the penalty added to the loss, and the step's statistics
# --------------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every expert's parameters (found by module structure: ``MoE.experts``), in model order.
    The router and everything else is dense. ``minipar.mesh`` builds the reduce groups from it."""
    return [p for layer in moe_layers(model) for p in layer.experts.parameters()]


def expert_parallel(model: nn.Module, group) -> nn.Module:
    """Split every MoE layer's experts over ``group``, an EP group of n ranks: rank i keeps
    experts [i E/n, (i+1) E/n) and exchanges tokens with the others (``group`` None: n = 1,
    every rank keeps every expert)."""
    n, i = comm.size(group), comm.rank(group)
    for layer in moe_layers(model):
        why = rules.moe_violation(layer.n_experts, ep=n)    # whole experts on every rank
        if why:
            raise UsageError(why)
        layer.ep_group = group
        per_rank = layer.n_experts // n
        for key in list(layer.experts):
            if not i * per_rank <= int(key) < (i + 1) * per_rank:
                del layer.experts[key]
    return model


def penalty(model: nn.Module) -> torch.Tensor | float:
    """What the MoE layers of ``model`` (a GPT, or a pipeline stage's chunk) add to the loss
    for their last forward: sum over the layers of aux_coef aux + z_coef z (this rank's
    share under TP)."""
    layers = moe_layers(model)
    if not layers:
        return 0.0
    return sum(m.aux_coef * m.aux_loss + m.z_coef * m.z_loss for m in layers)


def step_stats(model: nn.Module) -> dict:
    """This rank's MoE statistics since the last call (then reset): per layer the mean over
    micro-batches of its aux and z loss, summed over the layers (this rank's share: summed
    over TP and pipeline ranks and averaged over dp x cp ranks they are the serial run's),
    assignments dropped and made, and ``penalty``, what was added to the loss (the mean over
    micro-batches, so cross-entropy = loss - penalty)."""
    layers = [m for m in moe_layers(model) if m.stats["forwards"]]
    out = dict(aux_loss=0.0, z_loss=0.0, dropped=0, assigned=0, penalty=0.0)
    for m in layers:
        st = m.stats
        aux, z = st["aux"] / st["forwards"], st["z"] / st["forwards"]
        out["aux_loss"] += aux
        out["z_loss"] += z
        out["penalty"] += m.aux_coef * aux + m.z_coef * z
        out["dropped"] += st["dropped"]
        out["assigned"] += st["assigned"]
    for m in moe_layers(model):
        m.reset_stats()
    return out
