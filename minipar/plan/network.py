"""Communication: how many bytes each collective sends, and how long it takes.

Bytes (the convention of ``minipar.comm``: what one rank sends under the bandwidth-optimal
ring, for a buffer of N bytes over n ranks; Patarasuk & Yuan 2009, Thakur et al. 2005):

    all_reduce       2 (n-1)/n N        (a reduce-scatter, then an all-gather)
    reduce_scatter     (n-1)/n N        (N the full input)
    all_gather         (n-1)/n N        (N the full output)
    send               N

Time, per call: ``timing`` (NCCL's and RCCL's alpha-beta model, or a measured table, and
``coverage`` for what no measurement covers; re-exported here), charged per call as a
framework's engine issues them (``engine_collectives``: gradient buckets, one gather per
model unit), so a wide ring's latency is paid as many times as the engine pays it.

Traffic per training step, per rank:

* Tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022): every layer, per
  micro-batch, 2 all-reduces of b s h activations forward and 2 backward (+2 for the
  recomputed forward under full recomputation); with sequence parallelism each all-reduce
  becomes an all-gather plus a reduce-scatter, the same volume. Outside the layers
  (``ends=True``; ``minipar.tp`` and Megatron-LM alike): the vocab-parallel embedding's g
  (one b s h all-reduce forward; with SP an all-gather and a reduce-scatter, as is the
  head's f, one backward) and the vocab-parallel cross-entropy's 3 all-reduces of b s fp32
  values (max, sum of exponentials, target logit). Under sequence parallelism a parameter
  every TP rank keeps whole but applies to only its s/t tokens gets a partial gradient,
  which minipar sums over the TP group with one all-reduce per tensor per micro-batch
  (``minipar.tp``'s f on the parameter): per layer the norms' weights and biases and the two
  row-parallel biases (6 vectors of h for GPT with biases, 2 without, 2 RMSNorm weights for
  LLaMA), and with ``ends`` the final norm (2 or 1 vectors) and GPT's s x h position table.
  Megatron-LM sums them once per step, in one coalesced all-reduce.
* Pipeline parallelism (``pp_comm_bytes``): virtual stage k = c p + r of v p (v chunks per
  stage) sends its output activation unless it is the last, and its input gradient unless
  it is the first; each a b s h message per micro-batch, so stage r sends
  m b s h (a_r + g_r) with a_r = v - [r = p-1], g_r = v - [r = 0]. Megatron-LM splits each
  message over the t tensor-parallel ranks (its scatter/gather optimisation, which
  ``estimate`` assumes); minipar splits it only under sequence parallelism.
* Data parallelism and ZeRO/AMSP over d ranks, Psi parameters per rank before sharding,
  16-bit weights and gradients (fp32 in fp32 training), ``zero_collectives``. This is
  ``minipar.zero``'s scheme (its docstring has the mesh); the ranks of one G group are
  s_g contiguous ranks, the s_os/s_g ranks sharing a G shard's pieces are s_g apart, and the
  d/s_os replicas s_os apart:

    parameters sharded (s_p > 1): all-gather Psi over s_p before forward and before
        backward (+1 for the recomputed forward), every micro-batch;
    gradients sharded (s_g > 1): reduce-scatter Psi over s_g every micro-batch (minipar
        does it in two nested steps, over s_p then s_g/s_p: the same bytes);
    at the step: reduce-scatter the Psi/s_g gradient shard over the s_os/s_g ranks that
        share it, down to the optimizer shard (with s_g = 1: ZeRO-1's reduce-scatter of the
        whole gradient over s_os), then all-reduce the Psi/s_os shard across the d/s_os
        replicas (for s_os = 1 simply DP's all-reduce over d);
    after the optimizer step: all-gather the updated Psi/s_os shards over the s_os/s_g
        ranks into the G shard, then the G shards over the s_g/s_p ranks into the P shard:
        (s_os - s_p)/s_os Psi/s_p in all, as one gather over s_os/s_p would send.

  Reducing to the optimizer shard before crossing replicas is what keeps 1 < s_g < s_os
  cheap: ``2,2,4`` over 4 ranks sends no all-reduce at all, where all-reducing the whole
  G shard across the 2 replicas would send Psi/2. With one micro-batch this gives the ZeRO
  paper's volumes: 2 Psi for DP, ZeRO-1 and ZeRO-2, 3 Psi for ZeRO-3, each x (n-1)/n.
  Given the sizes of ``minipar.zero``'s units (embedding, blocks, head) instead of one count,
  each unit is its own buffer padded to a multiple of s_os, as the engine pads it, and the
  bytes are the engine's to the byte; ``zero_comm_bytes_by_group`` splits them over the
  engine's mesh groups (zero_p, zero_g, zero_os, zero_rep).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .memory import ACTIVATION_BYTES, BYTES_PER_PARAM, padded_params
from .timing import (collective_time, coverage, intra_bandwidth, p2p_time,  # noqa: F401
                     placement, ring_bytes, ring_time, size_factor, table_time, tree_time)
from .sharding import Shard, resolve_shard

OPS = ("all_reduce", "reduce_scatter", "all_gather")


# --------------------------------------------------------------------------------------
# Data parallelism, ZeRO and AMSP
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: ``count`` calls on ``nbytes`` buffers."""

    op: str
    what: str
    nbytes: int            # N: the full buffer (input of a reduce-scatter, output of a gather)
    size: int              # ranks in the group
    stride: int            # distance between members, in data-parallel ranks
    count: int             # times per optimizer step (each once per micro-batch, or once)
    kind: str = ""         # gather (per micro-batch), grad (per micro-batch), step_reduce,
                           # step_gather
    calls: int = 1         # separate calls the engine cuts each time into (buckets, units)
    window: str = "none"   # what it can hide behind: none, backward, prefetch, forward


def zero_collectives(n_params: int, dp: int, shard: Shard, dtype: str = "mixed",
                     microbatches: int = 1, recompute: bool = False) -> list[Collective]:
    """The data-parallel collectives of one step (module docstring); ``shard`` may be any
    spec with s_p | s_g | s_os | dp."""
    s_p, s_g, s_os = shard
    w, g, _ = BYTES_PER_PARAM[dtype]
    m = microbatches
    psi = padded_params(n_params, s_os)      # one flat buffer, padded for every group
    steps = [   # (whether it runs, op, what, nbytes, size, stride, count, kind)
        (s_p > 1, "all_gather", "parameters for forward and backward", psi * w, s_p, 1,
         m * (3 if recompute else 2), "gather"),
        (s_g > 1, "reduce_scatter", "gradients, every micro-batch", psi * g, s_g, 1, m, "grad"),
        (s_os > s_g, "reduce_scatter", "gradient shard down to the optimizer shard",
         psi // s_g * g, s_os // s_g, s_g, 1, "step_reduce"),
        (dp > s_os, "all_reduce", "optimizer-shard gradient across replicas",
         psi // s_os * g, dp // s_os, s_os, 1, "step_reduce"),
        (s_os > s_g, "all_gather", "updated optimizer shards into the G shard",
         psi // s_g * w, s_os // s_g, s_g, 1, "step_gather"),
        (s_g > s_p, "all_gather", "updated G shards into the P shard",
         psi // s_p * w, s_g // s_p, s_p, 1, "step_gather")]
    return [Collective(*fields) for runs, *fields in steps if runs]


def engine_collectives(n_params: int, dp: int, shard: Shard, framework, units: int,
                       dtype: str = "mixed", microbatches: int = 1, recompute: bool = False,
                       reduce_bytes: int | None = None,
                       gathers: int | None = None) -> list[Collective]:
    """``zero_collectives`` as ``framework``'s engine issues them, each cut into calls
    (``frameworks``) and given the compute it can hide behind (its ``window``): parameter
    gathers one call per model unit (``units``: the stage's layers and ends) or ``gathers``
    where the engine gathers module by module, prefetched behind the one before where it
    prefetches; gradient reductions, per micro-batch or at the step, in the framework's buckets
    or one call per unit, behind backward (all but the last call) where the engine starts them
    during it; the gather after the optimizer step in the same pieces, behind the next forward
    where the engine says so. Counts and bytes are ``zero_collectives``', except gradients
    reduced in another precision (``reduce_bytes`` per element: Megatron-LM's fp32 buffers)."""
    w, g16 = BYTES_PER_PARAM[dtype][:2]
    bucket = framework.bucket_params(dp)
    g = reduce_bytes or g16
    plain = tuple(shard) == (1, 1, 1)
    grad_overlap = framework.grad_overlap
    if plain and framework.dp_bucket_bytes:       # the engine's own plain-DP buckets
        bucket = framework.dp_bucket_bytes / g16
    if plain and framework.dp_overlap is not None:
        grad_overlap = framework.dp_overlap
    out = []
    for c in zero_collectives(n_params, dp, shard, dtype, microbatches, recompute):
        reduce = c.kind in ("grad", "step_reduce")
        if c.kind == "gather":
            calls = gathers or units
            window = "prefetch" if framework.param_prefetch else "none"
        elif reduce:
            calls = units if bucket is None else max(1, math.ceil(c.nbytes / g16 / bucket))
            window = "backward" if grad_overlap else "none"
        else:
            calls = units if bucket is None else max(1, math.ceil(c.nbytes / w / bucket))
            window = "forward" if framework.gather_overlaps_forward else "none"
        nbytes = c.nbytes // g16 * g if reduce else c.nbytes     # fp32 gradient buffers
        out.append(replace(c, nbytes=nbytes, calls=min(calls, max(1, nbytes)), window=window))
    return out


def zero_comm_bytes(n_params: int | list[int], dp: int, shard: Shard | str | None = None,
                    zero: int | None = None, dtype: str = "mixed", microbatches: int = 1,
                    recompute: bool = False) -> dict[str, int]:
    """Bytes one rank sends per optimizer step for data parallelism / ZeRO / AMSP, by op.

    ``n_params``: the parameters this rank's data-parallel group replicates (the whole
    model without TP/PP), as one flat buffer, or the sizes of ``minipar.zero``'s units, each
    its own buffer (module docstring). Keys: all_reduce, reduce_scatter, all_gather, total."""
    groups = zero_comm_bytes_by_group(n_params, dp, shard, zero, dtype, microbatches, recompute)
    out = {op: sum(group.get(op, 0) for group in groups.values()) for op in OPS}
    out["total"] = sum(out[op] for op in OPS)
    return out


ZERO_GROUPS = ("zero_p", "zero_g", "zero_os", "zero_rep")


def zero_comm_bytes_by_group(n_params: int | list[int], dp: int, shard: Shard | str | None = None,
                             zero: int | None = None, dtype: str = "mixed", microbatches: int = 1,
                             recompute: bool = False) -> dict[str, dict[str, int]]:
    """``zero_comm_bytes`` split over ``minipar.zero``'s mesh groups, by op.

    The d ranks are viewed as (d/s_os, s_os/s_g, s_g/s_p, s_p) = (R, O, G, P); the gradients'
    reduce-scatter over s_g runs in two nested steps, over zero_p (P ranks) and then zero_g (G
    ranks, s_p apart), the same bytes as one over s_g. Returns ``{group: {op: bytes}}`` for the
    groups in ``ZERO_GROUPS``; a group spans ``zero_group_span(group, ...)`` consecutive ranks."""
    s_p, s_g, s_os = resolve_shard(dp, shard, zero)
    w, g, _ = BYTES_PER_PARAM[dtype]
    m, gathers = microbatches, microbatches * (3 if recompute else 2)
    P, G, O, R = s_p, s_g // s_p, s_os // s_g, dp // s_os
    out = {group: {} for group in ZERO_GROUPS}

    def add(group, op, count, nbytes, n):
        sent = count * ring_bytes(op, nbytes, n)
        if sent:
            out[group][op] = out[group].get(op, 0) + sent

    for n in n_params if isinstance(n_params, (list, tuple)) else [n_params]:
        psi = padded_params(n, s_os)
        add("zero_p", "all_gather", gathers, psi * w, P)           # before forward, backward
        add("zero_p", "reduce_scatter", m, psi * g, P)             # gradients, every micro-batch
        add("zero_g", "reduce_scatter", m, psi // P * g, G)
        add("zero_os", "reduce_scatter", 1, psi // s_g * g, O)     # down to the OS shard
        add("zero_rep", "all_reduce", 1, psi // s_os * g, R)       # across the replicas
        add("zero_os", "all_gather", 1, psi // s_g * w, O)         # updated OS shards
        add("zero_g", "all_gather", 1, psi // P * w, G)            # ... into the P shard
    return out


def zero_group_span(group: str, dp: int, shard: Shard | str | None = None,
                    zero: int | None = None) -> int:
    """How many consecutive ranks one group of ``minipar.zero``'s mesh spans (it stays
    inside a node when that is at most the node's size)."""
    s_p, s_g, s_os = resolve_shard(dp, shard, zero)
    return dict(zero_p=s_p, zero_g=s_g, zero_os=s_os, zero_rep=dp)[group]


def tp_comm_bytes(micro_batch: int, seq_len: int, hidden: int, tp: int, layers: int,
                  microbatches: int = 1, recompute: bool = False, sp: bool = False,
                  dtype: str = "mixed", ends: bool = False, arch: str = "gpt",
                  bias: bool = True) -> dict[str, int]:
    """Bytes one rank sends per step for the tensor-parallel collectives of ``layers`` layers.

    ``ends=True`` adds the vocab-parallel embedding, head and loss of a whole GPT (module
    docstring); then a run of ``minipar.train`` with plain TP, or TP and ``--sp``, sends
    exactly this. With ``sp``, ``arch`` ("gpt" or "llama") and ``bias`` say which replicated
    parameters have their gradients all-reduced every micro-batch."""
    e = ACTIVATION_BYTES[dtype]
    layer = tp_block_comm_bytes(micro_batch * seq_len, hidden, tp, sp, dtype, arch, bias)
    # every layer's forward (twice under recomputation) and backward; the embedding's g and
    # the head's f, two calls of b s h outside the layers, send what a layer's forward sends
    forwards = layers * (2 if recompute else 1) + (1 if ends else 0)
    out = {op: microbatches * (forwards * layer["forward"].get(op, 0)
                               + layers * layer["backward"].get(op, 0)) for op in OPS}
    if sp and ends:   # the replicated final norm's gradients, and GPT's position table's (s x h)
        vectors = 2 if arch == "gpt" and bias else 1
        table = ring_bytes("all_reduce", seq_len * hidden * e, tp) if arch == "gpt" else 0
        out["all_reduce"] += microbatches * (vectors * ring_bytes("all_reduce", hidden * e, tp)
                                             + table)
    if ends:  # the loss: max, sum of exponentials, target logit, b s fp32 values each
        out["all_reduce"] += microbatches * 3 * ring_bytes("all_reduce", micro_batch * seq_len * 4,
                                                           tp)
    out["total"] = sum(out[op] for op in OPS)
    return out


def tp_block_comm_bytes(tokens: int, hidden: int, tp: int, sp: bool = False, dtype: str = "mixed",
                        arch: str = "gpt", bias: bool = True) -> dict[str, dict[str, int]]:
    """Bytes one rank sends for one transformer layer and a micro-batch of ``tokens`` = b s
    tokens, by pass and op: ``{"forward": {op: bytes}, "backward": {op: bytes}}`` (no
    recomputation; module docstring): what ``tp_comm_bytes`` counts per layer."""
    if tp == 1:
        return {"forward": {}, "backward": {}}
    e = ACTIVATION_BYTES[dtype]
    act = tokens * hidden * e
    if not sp:
        twice = {"all_reduce": 2 * ring_bytes("all_reduce", act, tp)}
        return {"forward": dict(twice), "backward": dict(twice)}
    # with SP each all-reduce becomes an all-gather and a reduce-scatter, and the replicated
    # parameters' partial gradients are summed, tensor by tensor
    vectors = 6 if arch == "gpt" and bias else 2        # 2 norms (weight, bias), 2 row biases
    both = {"all_gather": 2 * ring_bytes("all_gather", act, tp),
            "reduce_scatter": 2 * ring_bytes("reduce_scatter", act, tp)}
    return {"forward": dict(both),
            "backward": {**both, "all_reduce": vectors * ring_bytes("all_reduce", hidden * e, tp)}}


def pp_comm_bytes(micro_batch: int, seq_len: int, hidden: int, pp: int, microbatches: int = 1,
                  v: int = 1, stage: int = 0, tp: int = 1, split: bool = False,
                  dtype: str = "mixed") -> dict[str, int]:
    """Bytes pipeline stage ``stage`` (0 .. pp-1) sends per step, point to point: m (a_r + g_r)
    messages of b s h elements, each cut over the ``tp`` ranks when ``split`` (module
    docstring). Keys: send, total."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not one of the {pp} pipeline stages")
    if pp == 1:
        return {"send": 0, "total": 0}
    msg = micro_batch * seq_len * hidden * ACTIVATION_BYTES[dtype] // (tp if split else 1)
    messages = (v - (stage == pp - 1)) + (v - (stage == 0))
    sent = microbatches * messages * msg
    return {"send": sent, "total": sent}
