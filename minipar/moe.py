"""Mixture of experts (MoE) and expert parallelism (EP): a sparsely activated MLP.

The idea. A sparsely activated block replaces the dense MLP by E expert MLPs and a router
that sends each token to only k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2020;
Switch Transformer, Fedus et al. 2021). The parameters grow E-fold, the FLOPs per token only
k-fold: a model's *active* parameters per token are what it pays for in compute.

The router, per token x (t = b s tokens, e = E experts)::

    logits  = x W_r                                 (t e)    a Linear without bias
    probs   = softmax(logits)                       (t e)
    weights, experts = top-k of probs               (t k)    renormalised to sum to 1
    y       = sum_j weights_j * expert[experts_j](x)

Load balance. Left alone, the router sends most tokens to a few experts. Switch's auxiliary
loss pushes towards balance::

    aux = E * sum_e f_e * P_e        f_e: fraction of the s k assignments routed to e (counted)
                                     P_e: mean router probability of e (differentiable)

computed per sequence and averaged over the sequences (Switch and GShard compute it per
group of tokens; one sequence per group is DeepSeek-V3's sequence-wise balance loss). It is
1 when balanced and E when every token goes to one expert. The training loss is the
cross-entropy plus ``moe_aux_coef`` times aux (averaged over the MoE layers); the metrics
report the cross-entropy as ``loss`` and aux as ``aux_loss``. Per sequence, the loss is a
plain mean over sequences like the cross-entropy, so any split of the batch over ranks and
micro-batches optimises exactly the single-process objective, with no communication. The
router z-loss of ST-MoE (Zoph et al. 2022), mean(logsumexp(logits)^2), keeps the logits
small; its coefficient ``moe_z_coef`` is 0 by default. Noisy top-k (``moe_noise``, Gaussian
noise of that std on the logits while training) is off by default: each rank draws its own
noise, so with it the layouts are no longer comparable with the serial run.

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
like every gradient, divided by d. Expert parameters carry that group as ``p.grad_group``;
the DP and ZeRO engines reduce such parameters over it (``minipar.dp``, ``minipar.zero``).

Bytes one rank sends per MoE layer and micro-batch (k choices, d_model features of b bytes;
a_out = its kept assignments whose expert is on another rank, a_in = rows it receives)::

    all_to_all         2 (a_out + a_in) d_model b     dispatch + combine, forward and backward
    all_to_all_counts  (n-1) E/n * 8                  forward only

With balanced routing and no drops a_out = a_in = (n-1)/n t k: four all-to-alls of
t k d_model b each, less the local share 1/n. ``minipar.plan.moe`` holds these formulas.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from . import comm
from .errors import UsageError


# --------------------------------------------------------------------------------------
# The router: top-k of a softmax, and the load-balancing loss
# --------------------------------------------------------------------------------------
def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t e) router logits -> probs (t e), weights (t k) summing to 1, experts (t k) indices."""
    # EXERCISE ex08 begin
    # softmax over the experts (in fp32), take the k largest, renormalise their probabilities
    probs = F.softmax(logits.float(), dim=-1)
    top_probs, experts = torch.topk(probs, k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    # EXERCISE ex08 end
    return probs, weights, experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Switch's aux loss E * sum_e f_e P_e of each sequence, mean over the sequences.

    ``probs`` (t e) the router's probabilities, ``experts`` (t k) its choices, t = b s.
    """
    n_experts = probs.shape[-1]
    # EXERCISE ex08 begin
    # per sequence: f (b e) = share of its s k choices that went to e (counted, no gradient),
    # P (b e) = mean of probs over its tokens; then E * sum_e f P, mean over the sequences
    chosen = F.one_hot(rearrange(experts, "(b s) k -> b (s k)", s=seq_len), n_experts)
    f = chosen.float().mean(dim=1)
    P = rearrange(probs, "(b s) e -> b s e", s=seq_len).mean(dim=1)
    return n_experts * (f * P).sum(dim=-1).mean()
    # EXERCISE ex08 end


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
    """Rows ``send[j]`` go to rank j, ``recv[j]`` rows arrive from rank j; backward swaps them."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        comm.all_to_all(out, x, recv, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        comm.all_to_all(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    return x if comm.size(group) == 1 else AllToAll.apply(x, send, recv, group)


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------
class MoE(nn.Module):
    """A router and E experts in place of a block's MLP: (b s d) -> (b s d).

    ``expert(cfg)`` builds one expert (the dense MLP class). ``experts`` is keyed by the
    expert's global index, so parameter names are the serial model's on every EP rank (an
    EP rank keeps only its own keys: ``expert_parallel``).
    """

    def __init__(self, cfg, expert):
        super().__init__()
        self.n_experts, self.k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor, self.noise = cfg.capacity_factor, cfg.moe_noise
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert(cfg) for e in range(self.n_experts)})
        self.ep_group = None    # experts split over it (None: all here)
        self.aux_loss = self.z_loss = None   # this forward's, differentiable
        self.routing = None     # this forward's (experts (t k), kept (t k)), for inspection
        self.reset_stats()

    def reset_stats(self):
        self.stats = dict(forwards=0, aux=0.0, z=0.0, dropped=0, assigned=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        tokens = rearrange(x, "b s d -> (b s) d")
        logits = self.router(tokens)
        if self.training and self.noise > 0:
            logits = logits + self.noise * torch.randn_like(logits)
        probs, weights, experts = route(logits, self.k)
        keep = capacity_mask(experts, s, self.n_experts, self.capacity_factor)
        self.aux_loss = load_balancing_loss(probs, experts, s)
        self.z_loss = torch.logsumexp(logits.float(), dim=-1).square().mean()
        self.routing = (experts.detach(), keep)
        st = self.stats
        st["forwards"] += 1
        st["aux"] += self.aux_loss.item()
        st["z"] += self.z_loss.item()
        st["dropped"] += int((~keep).sum())
        st["assigned"] += keep.numel()
        y = self.dispatch_and_combine(tokens, weights, experts, keep)
        return rearrange(y, "(b s) d -> b s d", b=b)

    def dispatch_and_combine(self, tokens, weights, experts, keep) -> torch.Tensor:
        """Send each kept assignment's token to its expert's rank, compute, bring it back."""
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
        # each peer says how many rows it sends to each of our experts
        received = torch.empty_like(counts)
        comm.all_to_all(received, counts, group=self.ep_group, op="all_to_all_counts")
        received = received.view(n, per_rank)          # (source rank, local expert)
        recv = received.sum(dim=1).tolist()

        rows = all_to_all(tokens[token], send, recv, self.ep_group)       # dispatch
        # rows arrive grouped by source, then expert: regroup by expert to run each once
        local = torch.arange(per_rank, device=rows.device).repeat(n)
        by_expert = torch.argsort(local.repeat_interleave(received.flatten()), stable=True)
        chunks = rows[by_expert].split(received.sum(dim=0).tolist())
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)])
        out = out[torch.argsort(by_expert)]                                # arrival order
        back = all_to_all(out, recv, send, self.ep_group)                  # combine

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
    built with another ``ep`` gets the EP groups made here.
    """
    from .mesh import axis_lines
    if grid.ep == ep:
        ep_group, replicas = grid.group("ep"), grid.group("edp")
    else:
        lines = axis_lines(grid.dp, grid.pp, grid.cp, grid.tp, ep)
        ep_group = grid.new_groups(lines["ep"].tolist(), "ep")
        replicas = grid.new_groups(lines["edp"].tolist(), "edp")
    position = grid.dp_rank % ep
    for layer in moe_layers(model):
        layer.ep_group = ep_group
        per_rank = layer.n_experts // ep
        mine = range(position * per_rank, (position + 1) * per_rank)
        for key in list(layer.experts):
            if int(key) not in mine:
                del layer.experts[key]
        if ep > 1:
            for p in layer.experts.parameters():
                p.grad_group = replicas
    return model


def penalty(model: nn.Module) -> torch.Tensor | float:
    """What the MoE layers add to the loss: coefficients times aux and z, mean over layers."""
    layers = moe_layers(model)
    if not layers:
        return 0.0
    aux = torch.stack([m.aux_loss for m in layers]).mean()
    z = torch.stack([m.z_loss for m in layers]).mean()
    return layers[0].aux_coef * aux + layers[0].z_coef * z


def step_stats(model: nn.Module) -> dict:
    """This rank's MoE statistics since the last call (then reset): aux and z loss (mean over
    layers and micro-batches), assignments dropped and made, and ``penalty``, the mean over
    micro-batches of what was added to the loss (so cross-entropy = loss - penalty)."""
    layers = moe_layers(model)
    if not layers or not layers[0].stats["forwards"]:
        return dict(aux_loss=0.0, z_loss=0.0, dropped=0, assigned=0, penalty=0.0)
    calls = sum(m.stats["forwards"] for m in layers)
    aux = sum(m.stats["aux"] for m in layers) / calls
    z = sum(m.stats["z"] for m in layers) / calls
    out = dict(aux_loss=aux, z_loss=z, dropped=sum(m.stats["dropped"] for m in layers),
               assigned=sum(m.stats["assigned"] for m in layers),
               penalty=layers[0].aux_coef * aux + layers[0].z_coef * z)
    for m in layers:
        m.reset_stats()
    return out


# --------------------------------------------------------------------------------------
# What composes (checked before any process starts)
# --------------------------------------------------------------------------------------
def validate(cfg, ep: int, dp: int, tp: int = 1, pp: int = 1, recompute: str = "none") -> None:
    """Raise UsageError (one line) for an MoE/EP layout minipar cannot run."""
    E = cfg.moe_experts
    if E < 0:
        raise UsageError(f"--moe-experts must be >= 0, got {E}")
    if ep < 1:
        raise UsageError(f"--ep must be >= 1, got {ep}")
    if E == 0:
        if ep > 1:
            raise UsageError("--ep splits the experts of an MoE model; give --moe-experts E too")
        return
    if not 1 <= cfg.moe_top_k <= E:
        raise UsageError(f"--moe-top-k must be between 1 and --moe-experts {E}, got {cfg.moe_top_k}")
    if not 1 <= cfg.moe_every <= cfg.n_layer:
        raise UsageError(f"--moe-every must be between 1 and the model's {cfg.n_layer} layers, "
                         f"got {cfg.moe_every}")
    for name, value in (("capacity-factor", cfg.capacity_factor), ("moe-aux-coef", cfg.moe_aux_coef),
                        ("moe-z-coef", cfg.moe_z_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
    if tp > 1 or pp > 1:
        raise UsageError(f"MoE runs with data parallelism, expert parallelism and ZeRO only; "
                         f"use --tp 1 --pp 1 (got tp={tp} pp={pp})")
    if recompute != "none":
        raise UsageError("MoE layers are not recomputed (the recomputed forward would run the "
                         "all-to-alls and count the routing again); use --recompute none")
    if dp % ep:
        raise UsageError(f"--ep {ep} must divide the data-parallel degree {dp} (EP groups are "
                         f"consecutive data-parallel ranks); use an --ep that divides {dp}")
    if E % ep:
        raise UsageError(f"--moe-experts {E} must be a multiple of --ep {ep} (each EP rank holds "
                         f"E/ep experts)")
