"""Mixture of experts (MoE) and expert parallelism (EP): a sparsely activated MLP.

The idea. A sparsely activated block replaces the dense MLP by E expert MLPs and a router
that sends each token to only k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2020;
Switch Transformer, Fedus et al. 2021). The parameters grow E-fold, the FLOPs per token only
k-fold: a model's *active* parameters per token are what it pays for in compute.

The router, per token x (t = b s tokens, e = E experts)::

    logits  = x W_r                                 (t e)    a Linear without bias
    probs   = softmax(logits)                       (t e)
    weights, experts = top-k of probs               (t k)    k > 1: renormalised to sum to 1
    y       = sum_j weights_j * expert[experts_j](x)

At k = 1 the weight is the raw probability p of the chosen expert, as in Switch: renormalised
it would be p / p = 1, and the task loss would never reach the router.

Load balance. Left alone, the router sends most tokens to a few experts. Switch's auxiliary
loss pushes towards balance, per MoE layer::

    aux = E * sum_e f_e * P_e        f_e: fraction of the s k assignments routed to e (counted)
                                     P_e: mean router probability of e (differentiable)

computed per sequence and averaged over the sequences (Switch and GShard compute it per
group of tokens; one sequence per group is DeepSeek-V3's sequence-wise balance loss). It is
1 when balanced and E when every token goes to one expert. The objective follows Switch and
Megatron-LM: one aux loss per MoE layer, summed over the layers::

    loss = cross-entropy + moe_aux_coef * sum_layers aux + moe_z_coef * sum_layers z

(f_e counts the s k assignments, as Megatron-LM does; Hugging Face's Mixtral counts per
token, k times more: its coefficient c is moe_aux_coef = k c. ``docs/reference.md`` gives the
whole mapping.) The metrics report the cross-entropy as ``loss`` and the two sums as
``aux_loss`` and ``z_loss``. Per sequence, the aux loss is a plain mean over sequences like
the cross-entropy, so any split of the batch over ranks and micro-batches optimises exactly
the single-process objective, with no communication. The router z-loss of ST-MoE (Zoph et
al. 2022), z = mean over tokens of logsumexp(logits)^2, keeps the logits small; its
coefficient ``moe_z_coef`` is 0 by default. Noisy top-k (``moe_noise``, Gaussian noise of
that std on the logits while training) is off by default: each rank draws its own noise, so
with it the layouts are no longer comparable with the serial run.

Capacity. With ``capacity_factor`` C > 0 each expert takes at most ceil(C s k / E)
assignments from each sequence (GShard's groups, one sequence per group): first choices
before second choices, earlier positions first. An assignment over capacity is dropped: its
share of the output is lost and the residual connection carries the token on (``drop_rate``
in the metrics). Counting per sequence makes the drop decisions independent of how the batch
is split over ranks. C = 0 (the default) is dropless: every assignment is computed.

Expert parallelism. The data-parallel group of d ranks is cut into EP groups of n
consecutive ranks; rank i of an EP group holds experts [i E/n, (i+1) E/n) of every MoE layer
and the whole rest of the model. One MoE layer's forward, on every rank::

    route its own t tokens                  -> assignments (token, expert, weight), kept ones
    all_to_all_counts   rows it will receive per local expert from each peer (E/n integers)
    all_to_all          dispatch: each kept assignment's token row to its expert's rank
    local experts       each on the rows it received
    all_to_all          combine: the output rows back to their tokens' ranks
    y = sum over a token's assignments of weight * output row

Backward runs both all-to-alls again in reverse (the combine's backward dispatches output
gradients, the dispatch's backward returns input gradients).

Gradients. Non-expert parameters (the router included) are averaged over the data-parallel
group as usual. An expert's gradient on its rank already sums the contributions of all n
ranks of its EP group (the all-to-all brought their tokens), so it is summed over its
*replicas* only (the same position in the other d/n EP groups: the ``ep_replica`` group) and,
like every gradient, divided by d. ``minipar.groups.param_groups`` hands the experts to the DP
and ZeRO engines as their own parameter group with that reduce group (``minipar.dp``,
``minipar.zero``): a value passed to the engine, not a tag on the tensors.

Bytes one rank sends per MoE layer and micro-batch (k choices, d_model features of b bytes;
a_out = its kept assignments whose expert is on another rank, a_in = rows it receives)::

    all_to_all         2 (a_out + a_in) d_model b     dispatch + combine, forward and backward
    all_to_all_counts  (n-1) E/n * 8                  forward only

With balanced routing and no drops a_out = a_in = (n-1)/n t k: four all-to-alls of
t k d_model b each, less the local share 1/n. ``minipar.plan.moe`` holds these formulas.

Tensor parallelism (``minipar.tp.parallelize_moe``). The experts are *replicated* over the t
ranks of a TP group and each TP rank routes a different s/t of every sequence, so the router
runs once per token and no token travels twice. This is the layout sequence parallelism has
already: under ``--sp`` a TP rank holds s/t tokens between blocks, and the MoE layer simply
routes those. Without SP the block's input is the same on every TP rank; the layer keeps its
rank's s/t slice (backward: all-gather of the input gradient) and all-gathers its output
(backward: keep the slice). We chose this over splitting each expert's weights over TP
(Megatron-LM's expert tensor parallelism) because it needs no variable-size all-gather of
dispatched rows, the all-to-alls and the routing stay exactly those of one rank, and a small
expert does not become t smaller matmuls. Its price: an expert's weights are held t times,
and, as for SP's LayerNorm, a replicated weight that saw only s/t tokens enters through f,
whose backward sums its gradient over TP. The aux and z losses are computed as each rank's
share (P_e and the z mean over its own tokens divided by the whole sequence's count), which
sum over the TP group to the serial values; f_e and the capacity slots need the choices of
the whole sequence, so the layer all-gathers the (t k) expert indices over TP. Per MoE layer
and micro-batch, one rank sends over TP::

    all_gather    (t-1)/t b s k 8                  the choices, forward (int64)
    all_gather    (t-1)/t b s d_model b   x2       without SP only: output fwd, input grad bwd
    all_reduce    2(t-1)/t (router + E/n experts' parameters) b    the f on the weights, bwd

At scale the replication is the limit: the planner (``minipar.plan.moe``) finds gpt-22b with 8
experts at tp=8, ep=8 needs 130.6 GiB of model states per device, and the f all-reduce, once
per micro-batch, dominates TP traffic. Megatron-Core's answer, EP groups that span the TP
ranks ("MoE parallel folding"), or one all-reduce per step of the experts' gradients, are
not built here.

Context parallelism (``minipar.cp``). A cp rank holds chunks i and 2cp-1-i of every
sequence (``cp.parallelize`` gives each MoE layer the cp group and every rank's positions). It
routes and dispatches its own tokens (EP groups are inside dp, at one cp index); capacity
slots and f_e need the whole sequence's choices in true token order, so the layer all-gathers
them over cp and puts each rank's rows back at the positions it holds. Gradients are averaged
over dp x cp (each rank's cross-entropy is the mean over its own tokens), so P_e and the z
mean are taken over the rank's own s/cp tokens: the cp mean of the aux losses is the serial
one. The experts are replicated over cp, so their gradients are summed over ``edp``, which
spans cp. Per MoE layer and micro-batch, one rank sends over cp::

    all_gather    (cp-1)/cp b s k 8                the choices, forward (int64)

Recomputation (``--recompute full``). The Block's checkpoint passes ``recompute_contexts``
as its ``context_fn``: the first forward records, per MoE layer, its routing decision, the
counts it exchanged, the rows the dispatch received and the rows the combine
returned; the recomputed forward replays them instead of routing again and communicating,
and counts nothing twice. Backward runs each all-to-all once, in the original graph. The
price is those rows kept until the Block's backward: every row the rank received and got
back, its own included (2 t k d_model b per layer with balanced routing and no drops).
``--recompute selective`` recomputes the attention core only: the MoE layer is outside it.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from . import comm
from .seqsplit import (all_gather_stacked, gather_seq, gather_seq_replicated, scatter_seq,
                       slice_seq)
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
# Recomputation: the first forward records, the recomputed one replays
# --------------------------------------------------------------------------------------
class Replay:
    """What one checkpointed forward's MoE layers decided and received, in call order."""

    _active: list[tuple["Replay", bool]] = []     # (replay, replaying) of the running forward

    def __init__(self):
        self.records: list[dict] = []
        self.cursor = 0

    @contextlib.contextmanager
    def _use(self, replaying: bool):
        self.cursor = 0
        Replay._active.append((self, replaying))
        try:
            yield
        finally:
            Replay._active.pop()

    @classmethod
    def current(cls) -> tuple["Replay | None", bool]:
        return cls._active[-1] if cls._active else (None, False)

    def next(self) -> dict:
        record = self.records[self.cursor]
        self.cursor += 1
        return record


def recompute_contexts():
    """``context_fn`` of ``torch.utils.checkpoint``: (record in the forward, replay in the
    recomputation), one fresh record list per checkpointed call."""
    replay = Replay()
    return replay._use(False), replay._use(True)


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------
class MoE(nn.Module):
    """A router and E experts in place of a block's MLP: (b s d) -> (b s d).

    ``expert(cfg)`` builds one expert (the dense MLP class). ``experts`` is keyed by the
    expert's global index, so parameter names are the serial model's on every EP rank (an
    EP rank keeps only its own keys: ``expert_parallel``). Under tensor parallelism
    (``tp.parallelize_moe``) ``tp_group`` is set and each TP rank routes s/t of each
    sequence: its input already if ``sequence_parallel``, else its slice of the input.
    """

    def __init__(self, cfg, expert):
        super().__init__()
        self.n_experts, self.k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor, self.noise = cfg.capacity_factor, cfg.moe_noise
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert(cfg) for e in range(self.n_experts)})
        self.ep_group = None    # experts split over it (None: all here)
        self.tp_group, self.sequence_parallel = None, False
        self.cp_group = None    # context parallelism: this rank holds some chunks of each sequence
        self.cp_positions = None   # (cp, s/cp): the global positions each cp rank holds, in order
        self.aux_loss = self.z_loss = None   # this forward's share, differentiable
        self.routing = None     # this forward's (experts (t k), kept (t k)), for inspection
        self.reset_stats()

    def reset_stats(self):
        self.stats = dict(forwards=0, aux=0.0, z=0.0, dropped=0, assigned=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = comm.size(self.tp_group)
        split_here = t > 1 and not self.sequence_parallel
        if split_here:                       # every TP rank holds all tokens: route s/t each
            x = scatter_seq(x, self.tp_group)
        replay, replaying = Replay.current()
        b, s_here, _ = x.shape
        c = comm.size(self.cp_group)
        s = s_here * t * c                   # the whole sequence
        tokens = rearrange(x, "b s d -> (b s) d")
        logits = self.router(tokens)
        record = replay.next() if replaying else {}
        if self.training and self.noise > 0:   # recomputed alike: checkpoint restores the RNG
            logits = logits + self.noise * torch.randn_like(logits)
        probs, weights, experts = route(logits, self.k)
        if not replaying:
            record.update(zip(("experts", "whole", "keep"), self._decide(experts, b, s)))
        experts, whole, keep = record["experts"], record["whole"], record["keep"]
        # the recomputation builds the same losses again: the original graph's backward
        # needs what they save; only the first forward keeps them and counts them
        # under cp the gradients are averaged over the cp ranks, like each rank's mean
        # cross-entropy over its own tokens: so P_e and z are means over this cp rank's s/cp
        # tokens (c times its share), f_e counts the whole sequence; the cp mean is serial
        aux, z = c * load_balancing_loss(probs, whole, s), z_loss(logits, b * s // c)
        if not replaying:
            self._count(aux, z, experts, keep)
        y = self.dispatch_and_combine(tokens, weights, experts, keep, record, replaying)
        if replay is not None and not replaying:
            replay.records.append(record)
        y = rearrange(y, "(b s) d -> b s d", b=b)
        return gather_seq_replicated(y, self.tp_group) if split_here else y

    def _decide(self, experts, b: int, s: int):
        """(experts, whole, keep): this rank's choices (t k), the choices of the whole
        sequences (b s, k) in true token order, and which of this rank's assignments fit
        their capacity (t k).

        Capacity slots and f_e count a whole sequence's choices, first come first served:
        under TP gather them over TP (this cp rank's tokens, in its local order), under cp
        over cp, and put each rank's rows back at the global positions it holds (its two
        chunks i and 2cp-1-i, ``minipar.cp``)."""
        whole = gather_seq(rearrange(experts, "(b s) k -> b s k", b=b), self.tp_group)
        c = comm.size(self.cp_group)
        if c > 1:
            where = self.cp_positions.to(whole.device)                  # (c, s/c)
            parts = all_gather_stacked(whole, self.cp_group)            # (c, b, s/c, k)
            ordered = torch.empty(b, s, whole.shape[-1], dtype=whole.dtype, device=whole.device)
            ordered[:, where.flatten()] = rearrange(parts, "c b s k -> b (c s) k")
            whole = ordered
        whole = rearrange(whole, "b s k -> (b s) k")
        keep = rearrange(capacity_mask(whole, s, self.n_experts, self.capacity_factor),
                         "(b s) k -> b s k", b=b)
        if c > 1:                                            # this cp rank's positions
            keep = keep[:, where[comm.rank(self.cp_group)]]
        if comm.size(self.tp_group) > 1:                     # this TP rank's slice of them
            keep = slice_seq(keep, self.tp_group)
        return experts, whole, rearrange(keep, "b s k -> (b s) k")

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

    def dispatch_and_combine(self, tokens, weights, experts, keep, record=None,
                             replaying=False) -> torch.Tensor:
        """Send each kept assignment's token to its expert's rank, compute, bring it back.

        ``record``: what a recomputation will replay (filled here unless ``replaying``)."""
        record = {} if record is None else record
        n = comm.size(self.ep_group)
        per_rank = self.n_experts // n
        k = experts.shape[-1]
        # kept assignments, sorted by expert (so by destination rank): a = token * k + choice
        kept = keep.flatten().nonzero().squeeze(1)
        order = torch.argsort(experts.flatten()[kept], stable=True)
        assignment = kept[order]
        token = assignment // k
        counts = torch.bincount(experts.flatten()[assignment], minlength=self.n_experts)
        send = counts.view(n, per_rank).sum(dim=1).tolist()
        if not replaying:    # each peer says how many rows it sends to each of our experts
            received = torch.empty_like(counts)
            comm.all_to_all(received, counts, group=self.ep_group, op="all_to_all_counts")
            record["received"] = received
        received = record["received"].view(n, per_rank)        # (source rank, local expert)
        recv = received.sum(dim=1).tolist()

        rows = all_to_all(tokens[token], send, recv, self.ep_group, record.get("rows"))
        # rows arrive grouped by source, then expert: regroup by expert to run each once
        local = torch.arange(per_rank, device=rows.device).repeat(n)
        by_expert = torch.argsort(local.repeat_interleave(received.flatten()), stable=True)
        chunks = rows[by_expert].split(received.sum(dim=0).tolist())
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)])
        out = out[torch.argsort(by_expert)]                                # arrival order
        back = all_to_all(out, recv, send, self.ep_group, record.get("back"))  # combine
        if not replaying and n > 1:
            record.update(rows=rows.detach(), back=back.detach())

        # under autocast the experts return bf16: combine in the residual stream's dtype
        w = weights.flatten()[assignment].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, token, (back * w).to(tokens.dtype))


# --------------------------------------------------------------------------------------
# Expert parallelism, the penalty added to the loss, and the step's statistics
# --------------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every expert's parameters (found by module structure: ``MoE.experts``), in model order.
    The router and everything else is dense. ``minipar.groups`` builds the reduce groups from it."""
    return [p for layer in moe_layers(model) for p in layer.experts.parameters()]


def expert_parallel(model: nn.Module, grid, ep: int) -> nn.Module:
    """Split every MoE layer's experts over EP groups of ``ep`` consecutive DP ranks.

    Every rank keeps experts [i E/ep, (i+1) E/ep) where i is its ``ep`` coordinate on the mesh
    (``minipar.mesh``); an expert's gradient is summed over the ``edp`` axis (the same position
    in the other EP groups), see ``minipar.groups``. ``ep`` = 1 changes nothing (every rank keeps
    every expert, reduced over the whole DP group). ``grid`` is a ``minipar.mesh.Mesh``; one
    built with another ``ep`` gets the EP groups made here (enough for a forward and backward;
    to reduce gradients, build the mesh with this ``ep``: the experts' reduce group is its
    ``edp``, ``minipar.groups``).
    """
    from .mesh import axis_lines
    if grid.ep == ep:
        ep_group = grid.group("ep")
    else:
        ep_group = grid.new_groups(axis_lines(grid.dp, grid.pp, grid.cp, grid.tp, ep)["ep"].tolist(),
                                   "ep")
    position = grid.coord("dp") % ep
    for layer in moe_layers(model):
        layer.ep_group = ep_group
        per_rank = layer.n_experts // ep
        mine = range(position * per_rank, (position + 1) * per_rank)
        for key in list(layer.experts):
            if int(key) not in mine:
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
