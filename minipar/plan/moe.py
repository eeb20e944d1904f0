"""Mixture of experts in the planner: parameters, FLOPs, memory and all-to-all traffic.

The model is ``minipar.moe``'s: every N-th layer's MLP becomes E expert MLPs of the dense
width F and a router (an h x E matrix); each token runs k of them. With l layers there are
l_moe = floor(l / N) MoE layers, and an expert MLP has m_p = 2hF + b(F + h) parameters
(GPT; 3hF for LLaMA's SwiGLU).

Parameters::

    total   = dense + l_moe ((E - 1) m_p + h E)
    active  = dense + l_moe ((k - 1) m_p + h E)      what one token passes through

Training FLOPs: the dense count plus, per MoE layer and token, the k - 1 extra expert MLPs
and the router, 2 ((k-1) m_mm + h E) forward (m_mm = 2hF, or 3hF for LLaMA), times 3 for
forward and backward (4 with full recomputation). Compute follows the active parameters;
memory follows the total.

Model states per device, expert parallelism over ep ranks of the data-parallel group: the
experts are split over ep and kept whole (``minipar.zero`` leaves them out of its shards, so
they are sharded by ep alone) and replicated over TP (``minipar.moe``: each TP rank routes
its own s/t tokens), the rest of the model is sharded by the spec as usual::

    bytes = states(non-expert params, spec) + (w + g + o) * l_moe / pp * (E / ep) * m_p

Traffic per device and step, t tokens per device per micro-batch, m micro-batches, b bytes
per activation element (``minipar.moe``'s docstring; the trainer measures it):

    all_to_all          4 (ep-1)/ep * t k h b * l_moe * m       balanced routing, no drops
                        2 (a_out + a_in) h b per layer and micro-batch, for measured routing
    all_to_all_counts   (ep-1) E/ep * 8 * l_moe * m
    expert gradients    all-reduce over the d/ep replicas (instead of over d)

Under TP each rank routes t/tp of the tokens (t: the micro-batch's b s), so the all-to-alls
carry t/tp tokens with or without SP, and the MoE layer's TP traffic replaces the dense
MLP's (``tp_layer_comm_bytes``, per MoE layer and micro-batch)::

    all_gather   (tp-1)/tp b s k 8                  the choices, forward
                 + 2 (tp-1)/tp b s h b              without SP: output fwd, input grad bwd
    all_reduce   2 (tp-1)/tp (h E + E/ep m_p) g     router and experts' gradients (f), bwd

Under context parallelism (cp ranks share each sequence, ``minipar.moe``) a rank routes
t/(tp cp) tokens, so the all-to-alls, the TP gathers above and the MoE FLOPs per rank are those
of b s/cp tokens; the layer gathers the whole sequence's choices over cp before it fills the
capacity slots (``cp_layer_comm_bytes``, per MoE layer and micro-batch, blocking)::

    all_gather   (cp-1)/cp b s k 8                  the choices, forward

The experts are replicated over cp: their states are split by ep only, and their gradients
all-reduced over the dp/ep x cp replicas (``edp``); the rest is sharded over dp x cp.

The all-to-alls are on the critical path (each layer waits for its tokens): time = count x
((ep-1) alpha + bytes / beta), beta the slowest link the EP group crosses (``network``).
``adjust`` turns a dense estimate into the MoE's: compute grows by the extra FLOPs (and the
pipeline bubble with it), the data-parallel traffic is recomputed for the non-expert
parameters plus the experts' all-reduce over their replicas, with the dense estimate's share
of it hidden behind compute.
Not modelled: MoE activation memory beyond the dense model's (k MLP activations per token
and the dispatch buffers) and load imbalance (the busiest expert sets the pace).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from . import shapes
from .errors import PlanError, raise_if
from .estimate import STEP_PARTS, rates, tp_call_time
from .memory import BYTES_PER_PARAM, ACTIVATION_BYTES, model_state_bytes, stage_params
from .network import collective_time, placement, ring_bytes, zero_collectives
from .shapes import ModelShape
from .. import rules

COUNT_BYTES = 8     # int64 routing counts


@dataclass(frozen=True)
class MoE:
    experts: int        # E
    top_k: int = 2      # k
    every: int = 1      # N: every N-th layer is an MoE layer

    def layers(self, shape: ModelShape) -> int:
        return shape.layers // self.every


def check(moe: MoE | None, ep: int = 1, dp: int | None = None) -> None:
    """PlanError (one line) for an MoE/EP that cannot be laid out."""
    raise_if(rules.moe_violation(0, ep=ep) if moe is None else
             rules.moe_violation(moe.experts, moe.top_k, moe.every, ep, dp))


# --------------------------------------------------------------------------------------
# Parameters, FLOPs and memory
# --------------------------------------------------------------------------------------
def params(shape: ModelShape, moe: MoE) -> dict[str, int]:
    """Total and active (per token) parameters, and those of the experts."""
    l_moe, m_p, router = moe.layers(shape), shape.mlp_params, shape.hidden * moe.experts
    return dict(total=shape.params + l_moe * ((moe.experts - 1) * m_p + router),
                active=shape.params + l_moe * ((moe.top_k - 1) * m_p + router),
                experts=l_moe * moe.experts * m_p, router=l_moe * router)


def extra_flops(shape: ModelShape, moe: MoE, batch: int, recompute: str = "none") -> float:
    """Training FLOPs an MoE adds to the dense model on ``batch`` sequences (module docstring)."""
    tokens, router = batch * shape.seq_len, shape.hidden * moe.experts
    forward = 2.0 * tokens * moe.layers(shape) * ((moe.top_k - 1) * shape.mlp_weights + router)
    return (4 if recompute == "full" else 3) * forward


def training_flops(shape: ModelShape, moe: MoE, batch: int, recompute: str = "none") -> float:
    return shapes.training_flops(shape, batch, recompute) + extra_flops(shape, moe, batch,
                                                                        recompute)


def state_bytes(shape: ModelShape, moe: MoE, dp: int = 1, ep: int = 1, shard=None,
                zero: int | None = None, tp: int = 1, pp: int = 1,
                dtype: str = "mixed", cp: int = 1) -> dict[str, int]:
    """Model-state bytes per device (module docstring), and its expert_params, non_expert_params."""
    check(moe, ep, dp)
    l_stage = math.ceil(moe.layers(shape) / pp)
    m_p = shape.mlp_params                          # one expert: the dense MLP's parameters
    # the dense MLP this replaces holds 1/tp of it here, but its row-parallel bias whole
    row_bias = shape.hidden if shape.arch != "llama" and shape.bias else 0
    dense_mlp = math.ceil((m_p - row_bias) / tp) + row_bias
    non_expert = (stage_params(shape, tp, pp) - l_stage * dense_mlp
                  + l_stage * shape.hidden * moe.experts)
    out = model_state_bytes(non_expert, dp * cp, shard=shard, zero=zero, dtype=dtype)
    experts = l_stage * (moe.experts // ep) * m_p
    whole = model_state_bytes(experts, dtype=dtype)     # unsharded: minipar.zero leaves them out
    out = {key: out[key] + whole[key] for key in out}
    out["expert_params"], out["non_expert_params"] = experts, non_expert
    return out


# --------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------
def all_to_all_bytes(sent_rows: int, received_rows: int, d_model: int, elem_bytes: int) -> int:
    """One MoE layer, one micro-batch, measured routing: the dispatch and combine all-to-alls
    forward and backward send 2 (a_out + a_in) rows of d_model elements."""
    return 2 * (sent_rows + received_rows) * d_model * elem_bytes


def all_to_all_bytes_balanced(tokens: int, top_k: int, d_model: int, ep: int,
                              elem_bytes: int) -> float:
    """The same with balanced routing and no drops: 4 (ep-1)/ep t k d_model b."""
    return 4 * (ep - 1) / ep * tokens * top_k * d_model * elem_bytes


def step_comm_bytes(shape: ModelShape, moe: MoE, tokens: int, ep: int,
                    microbatches: int = 1, elem_bytes: int = 4) -> dict[str, float]:
    """MoE traffic one device sends per step (balanced routing, no drops); ``tokens`` per
    device per micro-batch."""
    calls = moe.layers(shape) * microbatches
    out = dict(all_to_all=calls * all_to_all_bytes_balanced(tokens, moe.top_k, shape.hidden,
                                                              ep, elem_bytes),
               all_to_all_counts=calls * (ep - 1) * (moe.experts // ep) * COUNT_BYTES)
    return {k: v for k, v in out.items() if v}


def choice_bytes(moe: MoE, tokens: int) -> int:
    """The expert choices of ``tokens`` tokens, k int64 indices each (gathered over tp, cp)."""
    return tokens * moe.top_k * COUNT_BYTES


def tp_replicated_params(shape: ModelShape, moe: MoE, ep: int) -> int:
    """An MoE layer's parameters every TP rank holds whole: the router and its experts."""
    return shape.hidden * moe.experts + moe.experts // ep * shape.mlp_params


def tp_layer_comm_bytes(shape: ModelShape, moe: MoE, tokens: int, tp: int, sp: bool,
                        ep: int = 1, elem_bytes: int = 4, grad_bytes: int = 4) -> dict[str, float]:
    """One MoE layer and micro-batch of ``tokens`` = b s under TP (experts replicated,
    tokens split: ``minipar.moe``): the bytes one rank sends, by op (no recomputation)."""
    if tp == 1:
        return {}
    gather = ring_bytes("all_gather", choice_bytes(moe, tokens), tp)
    if not sp:
        gather += 2 * ring_bytes("all_gather", tokens * shape.hidden * elem_bytes, tp)
    weights = tp_replicated_params(shape, moe, ep)
    return dict(all_gather=gather, all_reduce=ring_bytes("all_reduce", weights * grad_bytes, tp))


def cp_layer_comm_bytes(moe: MoE, tokens: int, cp: int) -> dict[str, float]:
    """One MoE layer and micro-batch of ``tokens`` = b s (whole sequences) under context
    parallelism: the bytes one rank sends to gather the choices over cp (forward only; a
    recomputed forward replays them), so capacity and f_e see whole sequences in order."""
    if cp == 1:
        return {}
    return dict(all_gather=ring_bytes("all_gather", choice_bytes(moe, tokens), cp))


def all_to_all_time(nbytes: float, calls: int, ep: int, stride: int, hw) -> float:
    """``calls`` all-to-alls sending ``nbytes`` in all, over ep ranks ``stride`` apart."""
    if ep <= 1 or calls == 0:
        return 0.0
    per_node, nodes = placement(ep, stride, hw.gpus_per_node)
    if nodes == 1:
        beta, alpha = hw.intra_node_bandwidth, hw.intra_node_latency
    else:
        beta = min(hw.intra_node_bandwidth, hw.inter_node_bandwidth * per_node / hw.gpus_per_node)
        alpha = hw.inter_node_latency
    return calls * (ep - 1) * alpha + nbytes / beta


# --------------------------------------------------------------------------------------
# One layout: the dense estimate, adjusted; the command line's hooks
# --------------------------------------------------------------------------------------
def edp_stride(lay, order: str, gpus_per_node: int, ep: int) -> int:
    """The distance between neighbours of an expert's replicas, as one evenly spaced group
    (what ``collective_time`` prices): the same EP position in the other dp/ep EP groups, at
    every cp index. With cp = 1 the line is even (ep x the dp stride); otherwise it is found
    by placing the group and counting how many members share the first one's node."""
    s = lay.strides(order)
    size = lay.dp // ep * lay.cp
    if lay.cp == 1 or size == lay.cp:
        return s["dp"] * ep if lay.cp == 1 else s["cp"]
    members = [c * s["cp"] + j * ep * s["dp"] for c in range(lay.cp) for j in range(lay.dp // ep)]
    per_node = sum(r < gpus_per_node for r in members)
    return max(1, gpus_per_node // per_node) if per_node < size else s["cp"]


def adjust(e, shape: ModelShape, moe: MoE, ep: int, hw, order: str = "tp,pp,dp",
           dtype: str | None = None):
    """The dense ``Estimate`` of ``shape`` turned into the MoE model's (module docstring): a
    new Estimate, ``times['ep_comm']`` added and its MoE figures in ``notes``; the share of
    data-parallel traffic hidden is the dense estimate's (its ``overlap``)."""
    lay = e.layout
    dtype = dtype or hw.dtype
    check(moe, ep, lay.dp)
    raise_if(rules.moe_tp_violation(shape.seq_len, lay.tp, lay.cp))
    memory = dict(e.memory)
    states = state_bytes(shape, moe, lay.dp, ep, shard=lay.shard, tp=lay.tp, pp=lay.pp,
                         dtype=dtype, cp=lay.cp)
    for key in ("params", "grads", "optimizer"):
        memory["total"] += states[key] - memory[key]
        memory[key] = states[key]
    times = dict(e.times)
    l_stage = math.ceil(moe.layers(shape) / lay.pp)
    calls = l_stage * lay.microbatches                  # MoE layers run per step on a stage
    extra = extra_flops(shape, moe, lay.global_batch, lay.recompute)
    extra_stage = extra * l_stage / max(1, moe.layers(shape))
    busy = times["compute"] + times["tp_comm"]
    times["compute"] += extra_stage / (lay.dp * lay.tp * lay.cp) / hw.achievable_flops
    times["bubble"] *= (times["compute"] + times["tp_comm"]) / busy    # the bubble scales with it

    strides, job = lay.strides(order), hw.nodes(lay.gpus)

    def timed(op: str, nbytes: float, size: int, stride: int) -> float:    # one call, this job
        return collective_time(op, nbytes, size, stride, hw, job)

    seq = shape.seq_len // lay.cp                       # this cp rank's tokens of a sequence
    tokens = lay.micro_batch * seq // lay.tp            # each TP rank routes its share
    elem, grad = ACTIVATION_BYTES[dtype], BYTES_PER_PARAM[dtype][1]
    a2a = calls * all_to_all_bytes_balanced(tokens, moe.top_k, shape.hidden, ep, elem)
    times["ep_comm"] = all_to_all_time(a2a, 4 * calls, ep, strides["dp"], hw)
    choices = choice_bytes(moe, lay.micro_batch * seq)           # this cp rank's
    if lay.cp > 1:      # the whole sequence's choices, gathered over cp before capacity
        gather = calls * timed("all_gather", choices * lay.cp, lay.cp, strides["cp"])
        times["cp_comm"] = times.get("cp_comm", 0.0) + gather
        times["cp_exposed"] = times.get("cp_exposed", 0.0) + gather
    if lay.tp > 1:     # the MoE layer's TP collectives in place of the dense MLP's
        t, stride = lay.tp, strides["tp"]
        act = lay.micro_batch * seq * shape.hidden * elem
        passes = 3 if lay.recompute == "full" else 2    # forward, backward (+ forward again)
        dense_mlp = passes * tp_call_time(act, lay, stride, hw)   # as estimate's
        moe_tp = (timed("all_gather", choices, t, stride)
                  + (0 if lay.sp else passes * timed("all_gather", act, t, stride))
                  + timed("all_reduce", tp_replicated_params(shape, moe, ep) * grad, t, stride))
        times["tp_comm"] += calls * (moe_tp - dense_mlp)

    collectives = zero_collectives(states["non_expert_params"], lay.replicas, lay.shard, dtype,
                                   lay.microbatches, recompute=lay.recompute == "full")
    replica = lay.replica_stride(order, hw.gpus_per_node)
    dp_comm = sum(c.count * c.calls * timed(c.op, c.nbytes / c.calls, c.size, c.stride * replica)
                  for c in collectives)
    dp_comm += timed("all_reduce", states["expert_params"] * grad, lay.dp // ep * lay.cp,
                     edp_stride(lay, order, hw.gpus_per_node, ep))
    # the same share of it hides behind compute as in the dense estimate
    hidden_share = 1 - e.times["dp_exposed"] / e.times["dp_comm"] if e.times.get("dp_comm") else 0.0
    times.update(dp_comm=dp_comm, dp_exposed=dp_comm * (1 - hidden_share))
    times["step"] = sum(times.get(k, 0.0) for k in (*STEP_PARTS, "ep_comm"))
    flops = {"model": training_flops(shape, moe, lay.global_batch, "none"),
             "hardware": training_flops(shape, moe, lay.global_batch, lay.recompute)}
    p = params(shape, moe)
    note = (f"MoE: {moe.experts} experts, top-{moe.top_k}, every {moe.every} layer(s), ep={ep}: "
            f"{p['total']:,} parameters, {p['active']:,} active per token; all-to-all "
            f"{a2a / 2**20:,.1f} MiB per device per step ({times['ep_comm'] * 1e3:.2f} ms, "
            f"blocking); activations as the dense model's")
    return dataclasses.replace(e, memory=memory, times=times, notes=[*e.notes, note],
                               **rates(shape, hw, lay, times["step"], flops))


def from_args(args) -> MoE | None:
    moe = MoE(args.moe_experts, args.moe_top_k, args.moe_every) if args.moe_experts else None
    check(moe, args.ep)
    return moe


def summary(shape: ModelShape, moe: MoE) -> dict:
    p = params(shape, moe)
    return dict(experts=moe.experts, top_k=moe.top_k, every=moe.every,
                moe_layers=moe.layers(shape), total_params=p["total"],
                active_params=p["active"], expert_params=p["experts"])


def rerank(results: list, shape: ModelShape, moe: MoE, ep: int, hw, top: int,
           order: str = "tp,pp,dp", dtype: str | None = None) -> list:
    """The dense search's candidates (``cmd_search`` asks it for many) as MoE layouts:
    adjusted, those that fit, the ``top`` fastest first. Layouts whose dp is not a multiple of
    ep, or whose TP ranks cannot split a cp rank's tokens (``moe_tp_violation``), are skipped."""
    out = [adjust(e, shape, moe, ep, hw, order, dtype) for e in results if e.layout.dp % ep == 0
           and rules.moe_tp_violation(shape.seq_len, e.layout.tp, e.layout.cp) is None]
    out = sorted((e for e in out if e.fits), key=lambda e: e.step_time)
    if not out:
        raise PlanError(f"no layout of the {len(results)} candidates fits the MoE model with "
                        f"ep={ep} (dp must be a multiple of ep); try a larger --ep or more GPUs")
    return out[:top]
