"""The strategy search: every layout that fits, ranked by predicted step time.

For a model, a number of devices and a global batch (in tokens) we enumerate

    tp   divides the heads, at most one node (unless a larger one is asked for)
    pp   divides the layers;  dp = devices / (tp pp) must divide the batch
    v    model chunks per stage (interleaved 1F1B), dividing layers/pp, at most ``max_v``
    b    micro-batch size, dividing the batch per replica, at most ``max_micro_batch``
    m    = batch / (dp b) micro-batches
    (s_p, s_g, s_os)   every AMSP spec over dp (``sharding.shard_specs``: s_g in {s_p, s_os}),
                       groups contiguous; a spec fixed with ``shard=`` may be any that
                       minipar.zero runs (s_p | s_g | s_os | dp), e.g. 1,2,4
    recomputation      none, selective, full

with sequence parallelism on whenever tp > 1 (same traffic, less memory), drop what does not
fit, and rank by step time. With tp and pp fixed to 1 this is AMSP's scale-aware
partitioner: which (s_p, s_g, s_os) minimises communication within the memory budget.

Pruning keeps 175B on 3072 devices well under a second: model-state bytes and
data-parallel traffic depend only on (tp, pp, shard), and on m linearly, so they are
computed once per (tp, pp) and spec, sorted by bytes; for each (v, b, recomputation) only
the prefix of specs that fits (found by bisection) is timed. The best candidates are then
estimated in full (``estimate.estimate``), and that is what is returned.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import replace

from .errors import PlanError
from .estimate import DEFAULT_OVERLAP, Estimate, dp_comm_time, estimate, exposed, time_parts
from .hardware import Hardware, load_hardware
from .layout import ORDERS, Layout, dp_per_node
from .memory import (DEFAULT_RESERVE, activation_bytes, gather_bytes, model_state_bytes,
                     stage_params, temporary_bytes)
from .shapes import RECOMPUTE_MODES, ModelShape, model_preset, with_seq_len
from ..sharding import Shard, divisors, parse_shard, shard_specs, shard_violation, zero_shard


def _gib(x: float) -> str:
    """Bytes in GiB, or MiB for the small models of a laptop."""
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def search(model: ModelShape | str, gpus: int, hardware: Hardware | str, *,
           tp: int | None = None, pp: int | None = None,
           global_batch_tokens: int | None = None, seq_len: int | None = None,
           micro_batch: int | None = None, shard: Shard | str | None = None,
           zero: int | None = None, recompute: str | None = None, v: int | None = None,
           top: int = 5, max_tp: int | None = None, max_v: int = 8,
           max_micro_batch: int = 16, order: str = "tp,pp,dp",
           overlap: float = DEFAULT_OVERLAP, flash: bool = False, sp: bool = True,
           dtype: str | None = None, reserve: float = DEFAULT_RESERVE,
           specs_per_layout: int = 1) -> list[Estimate]:
    """Ranked layouts (best first) of ``model`` on ``gpus`` devices of ``hardware``.

    Fixing ``tp``, ``pp``, ``micro_batch``, ``v``, ``recompute``, or the spec (``shard`` or
    ``zero``) narrows the search; ``max_tp`` lets TP span nodes. ``specs_per_layout``: how
    many shard specs to keep per parallel layout (tp, pp, v, b, recomputation); 1 lists
    different layouts, each with its best spec.
    """
    shape = model_preset(model) if isinstance(model, str) else model
    if seq_len:
        shape = with_seq_len(shape, seq_len)
    hw = load_hardware(hardware)
    dtype = dtype or hw.dtype
    if order not in ORDERS:
        raise PlanError(f"unknown order {order!r}; use {' or '.join(ORDERS)}")
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    if shard is not None and zero is not None:
        raise PlanError("give either --zero or --shard, not both (a ZeRO stage is a preset "
                        "of the shard spec)")
    if isinstance(shard, str):
        shard = parse_shard(shard)
    if recompute is not None and recompute not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recomputation {recompute!r}; use {', '.join(RECOMPUTE_MODES)}")
    tokens = global_batch_tokens or shape.global_batch_tokens
    if not tokens:
        raise PlanError(f"model {shape.name} has no default batch; give --global-batch-tokens")
    if tokens % shape.seq_len:
        raise PlanError(f"global batch of {tokens} tokens is not a whole number of "
                        f"{shape.seq_len}-token sequences; use a multiple of {shape.seq_len}")
    batch = tokens // shape.seq_len
    capacity = hw.memory_bytes * (1 - reserve)
    modes = [recompute] if recompute else list(RECOMPUTE_MODES)

    pool: list[tuple] = []                 # a bounded heap of the fastest (-step, n, layout)
    keep = max(4 * top, 20)
    arrival = itertools.count()            # breaks ties in the heap (layouts do not compare)
    leanest = (math.inf, None)             # for the "nothing fits" message
    for t, p, d in _degrees(shape, gpus, batch, tp, pp, max_tp or hw.gpus_per_node):
        per_node = dp_per_node(Layout(tp=t, pp=p, dp=d), hw.gpus_per_node, order)
        if shard is not None:
            if shard_violation(shard, d, per_node):
                continue
            specs = [tuple(shard)]
        elif zero is not None:
            specs = [zero_shard(zero, d)]
        else:
            specs = shard_specs(d, per_node)
        table = _spec_table(shape, hw, t, p, d, specs, order, dtype)
        table_bytes = [row[0] for row in table]
        for b, m, chunks in _schedules(shape, p, batch // d, micro_batch, v, max_v,
                                       max_micro_batch):
            for mode in modes:
                base = Layout(tp=t, pp=p, dp=d, micro_batch=b, microbatches=m,
                              recompute=mode, v=chunks, sp=sp and t > 1)
                held = (activation_bytes(shape, base, flash, dtype)
                        + temporary_bytes(shape, base, flash, dtype))
                leanest = min(leanest, (held + table_bytes[0], base), key=lambda x: x[0])
                fitting = bisect.bisect_right(table_bytes, capacity - held)
                if not fitting:
                    continue
                parts = time_parts(shape, hw, base, order, dtype)
                fixed = sum(parts.values())
                steps = []
                for _, spec, per_mb, per_step, per_mb_full in table[:fitting]:
                    comm = (per_mb_full if mode == "full" else per_mb) * m + per_step
                    steps.append((fixed + exposed(comm, parts["compute"], overlap), spec))
                for step, spec in heapq.nsmallest(specs_per_layout, steps):
                    item = (-step, next(arrival), replace(base, shard=spec))
                    if len(pool) < keep:
                        heapq.heappush(pool, item)
                    elif -step > pool[0][0]:
                        heapq.heapreplace(pool, item)
    if not pool:
        need, lean = leanest
        if lean is None:
            raise PlanError(f"no layout of {shape.name} on {gpus} GPUs divides a batch of "
                            f"{batch} sequences; change --gpus, --global-batch-tokens, "
                            f"--tp, --pp or --micro-batch")
        raise PlanError(f"nothing fits: the leanest layout of {shape.name} on {gpus} GPUs "
                        f"({lean.describe(shard=False)}, model states fully sharded) needs "
                        f"{_gib(need)} per device of {_gib(capacity)} usable; use more GPUs "
                        f"or a smaller micro-batch or batch")
    # the pruned scan ranked candidates; the full model has the last word
    results = [estimate(shape, hw, layout, order=order, overlap=overlap, flash=flash,
                        dtype=dtype, reserve=reserve, check=False) for *_, layout in pool]
    results = [e for e in results if e.fits]
    if not results:
        raise PlanError(f"nothing fits {shape.name} on {gpus} GPUs within {_gib(capacity)} "
                        f"usable per device; use more GPUs or a smaller micro-batch or batch")
    # ties (common: the model has no micro-batch size effect) go to the leaner layout
    results.sort(key=lambda e: (round(e.step_time, 9), e.memory["total"]))
    return results[:top]


def _degrees(shape: ModelShape, gpus: int, batch: int, tp: int | None, pp: int | None,
             max_tp: int):
    """(tp, pp, dp): tp divides the heads (at most ``max_tp``), pp the layers, dp the batch."""
    if tp is not None and (shape.heads % tp or gpus % tp):
        raise PlanError(f"tp={tp} must divide the {shape.heads} heads and the {gpus} GPUs")
    if pp is not None and (shape.layers % pp or gpus % pp):
        raise PlanError(f"pp={pp} must divide the {shape.layers} layers and the {gpus} GPUs")
    tps = [tp] if tp else [t for t in divisors(shape.heads) if t <= max_tp]
    pps = [pp] if pp else divisors(shape.layers)
    for t in tps:
        for p in pps:
            if gpus % (t * p) == 0 and batch % (gpus // (t * p)) == 0:
                yield t, p, gpus // (t * p)


def _schedules(shape: ModelShape, pp: int, per_replica: int, micro_batch: int | None,
               v: int | None, max_v: int, max_micro_batch: int):
    """(b, m, v): micro-batch size, micro-batch count, chunks per stage (Megatron-LM's rule:
    interleaving needs pp > 1 and m divisible by pp)."""
    for b in divisors(per_replica):
        if b > max_micro_batch or (micro_batch and b != micro_batch):
            continue
        m = per_replica // b
        for chunks in divisors(shape.layers // pp):
            if chunks > max_v or (v and chunks != v):
                continue
            if chunks == 1 or (pp > 1 and m % pp == 0):
                yield b, m, chunks


def _spec_table(shape, hw, t, p, d, specs, order, dtype) -> list[tuple]:
    """Per spec, sorted by bytes: (model-state and gather-buffer bytes, spec, DP seconds per
    micro-batch, DP seconds per step, DP seconds per micro-batch under full recomputation).

    DP time is linear in the micro-batch count m, so two evaluations (m = 1, 2) give it.
    """
    phi = stage_params(shape, t, p)
    rows = []
    for spec in specs:
        state = (model_state_bytes(phi, d, shard=spec, dtype=dtype)["total"]
                 + gather_bytes(shape, t, spec, dtype))
        one = Layout(tp=t, pp=p, dp=d, microbatches=1, shard=spec)
        two = replace(one, microbatches=2)
        t1, t2 = (dp_comm_time(shape, hw, x, order, dtype) for x in (one, two))
        per_mb_full = t2 - t1
        if spec[0] > 1:     # a third gather per micro-batch for the recomputed forward
            f1, f2 = (dp_comm_time(shape, hw, replace(x, recompute="full"), order, dtype)
                      for x in (one, two))
            per_mb_full = f2 - f1
        rows.append((state, spec, t2 - t1, 2 * t1 - t2, per_mb_full))
    rows.sort(key=lambda r: r[0])
    return rows


# --------------------------------------------------------------------------------------
# Explaining the result
# --------------------------------------------------------------------------------------
_PARTS = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "TP communication",
          "pp_comm": "PP communication", "dp_exposed": "exposed DP communication"}


def explain(winner: Estimate, runner_up: Estimate | None = None) -> str:
    """Why the winner wins: where its step time and memory go, and what the runner-up lost on."""
    t, mem = winner.times, winner.memory
    lines = [f"winner: {winner.layout.describe()}: step {t['step']:.3g} s, "
             f"{winner.tokens_per_s:,.0f} tokens/s, MFU {winner.mfu:.1%} (HFU {winner.hfu:.1%})",
             "  time: " + ", ".join(f"{_PARTS[k]} {t[k] / t['step']:.1%}" for k in _PARTS),
             f"  memory: {_gib(mem['total'])} of {_gib(winner.capacity)} usable "
             f"(params {_gib(mem['params'])}, grads {_gib(mem['grads'])}, optimizer "
             f"{_gib(mem['optimizer'])}, activations {_gib(mem['activations'])}, temporary "
             f"{_gib(mem['temporary'])})"]
    if runner_up is not None:
        r = runner_up.times
        deltas = {k: r[k] - t[k] for k in _PARTS}
        worse = sorted((k for k in deltas if deltas[k] > 0), key=lambda k: -deltas[k])
        better = [k for k in deltas if deltas[k] < 0]
        slower = r["step"] / t["step"] - 1
        if slower < 1e-3:
            line = (f"runner-up: {runner_up.layout.describe()}: ties within 0.1% "
                    f"(the model sees no difference in time")
            line += ("; the winner needs less memory)" if runner_up.memory["total"] >
                     mem["total"] else ")")
            lines.append(line)
            return "\n".join(lines)
        why = ", ".join(f"{_PARTS[k]} +{deltas[k]:.3g} s" for k in worse[:2])
        line = (f"runner-up: {runner_up.layout.describe()}: {slower:.2%} slower; it loses on "
                f"{why}")
        if better:
            line += " and gains on " + ", ".join(f"{_PARTS[k]} {deltas[k]:.3g} s" for k in better)
        if runner_up.memory["total"] < mem["total"]:
            line += f"; it needs less memory ({_gib(runner_up.memory['total'])})"
        lines.append(line)
    return "\n".join(lines)
