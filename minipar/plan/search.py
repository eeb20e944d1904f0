"""The strategy search: every layout that fits, ranked by predicted step time.

For a model, a number of devices, a global batch (in tokens) and a framework profile
(``frameworks``: what it can run) we enumerate

    tp   divides the heads, at most one node (unless a larger one is asked for)
    pp   divides the layers
    cp   context parallelism, where the framework has it: cuts each sequence into 2 cp
         equal chunks (and s/cp over tp with sequence parallelism); by default only where
         memory forces it (below), else up to ``max_cp``, or fixed by ``cp``
    dp   = devices / (tp pp cp) must divide the batch
    v    model chunks per stage (interleaved 1F1B), that the framework's stages split
         into (``stages``), at most ``max_v`` unless given, where the framework interleaves
    b    micro-batch size, dividing the batch per replica, at most ``max_micro_batch``
         unless given (so a batch of a billion sequences tries 16 sizes, not its divisors)
    m    = batch / (dp b) micro-batches
    (s_p, s_g, s_os)   the framework's shardings over the dp x cp replicas (minipar: every
                       AMSP spec, ``sharding.shard_specs``; Megatron-LM: DP or its
                       distributed optimizer; ...); a spec fixed with ``shard=`` may be any
                       that minipar.zero runs (s_p | s_g | s_os | dp cp), e.g. 1,2,4
    recomputation      the framework's modes

with sequence parallelism on whenever tp > 1 and the framework has it (same traffic, less
memory; ``sp`` forces it on or off), drop what does not fit, and rank. With tp and pp
fixed to 1 this is AMSP's scale-aware partitioner; ``objective="amsp"`` ranks as AMSP's
planner does (``amsp_cost``): data-parallel communication time with nothing hidden, each
group on the fastest links its size allows, under the memory limit.

Context parallelism is searched where memory forces it, as Megatron-LM's guide uses it: the
search first tries cp = 1, and if nothing fits or divides the batch (128 sequences on 8,192
GPUs), or the best layout must recompute everything where it was free to recompute less, it
searches every cp (cp = 1 included) and ranks them all. The cost model alone would trade TP
for cp at short sequences too (gpt-175b at 2048 tokens on 1024 A100s: tp=2 cp=4 5% ahead of
tp=8), but it leaves out what makes small ring blocks slow (kernel launches, (s/cp)^2 blocks'
efficiency, TP and CP sharing the links), so ``max_cp`` opens that ranking, ``cp`` fixes cp.

Ranking and ties: one key for every comparison, before and after the candidate pool is
cut: (step time to 9 significant digits, bytes per device, the layout's degrees in a fixed
order); under AMSP's objective (``amsp_key``, then step time, ...). So equal predictions go
to the leaner layout, then to the smaller degrees, whichever pass compares them.

Pruning: model-state bytes depend only on (tp, pp, cp, spec), so each (tp, pp, cp)'s specs
are sorted by bytes once; for each (v, b, recomputation) only the prefix that fits (found by
bisection) is timed. The best candidates are then estimated in full (``estimate``).
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import replace
from itertools import groupby

from .errors import PlanError, raise_if
from .estimate import (Estimate, dp_collectives, dp_exposure, dp_profile, estimate,
                       STEP_PARTS, time_parts)
from .frameworks import Framework, capability_violation, load_framework
from .hardware import Hardware, load_hardware
from .layout import (ORDERS, Layout, cp_violation, dp_per_node, interleave_violation,
                     recompute_violation, schedule_violation, shape_tp_violation)
from .peak import (activation_bytes, gather_bytes, stage_list, state_bytes, temporary_bytes,
                   capacity as device_capacity)
from .stages import distinct, split_violation
from .shapes import RECOMPUTE_MODES, ModelShape, model_preset, with_seq_len
from .sharding import (Shard, divisors, parse_shard, shard_violation, spec_flags_violation,
                       zero_shard)
from .timing import placement, ring_bytes

OBJECTIVES = ("step", "amsp")
SCHEDULES = ("1f1b", "gpipe", "interleaved")
# A bound on the GPU count, not on any machine (an assumption): the largest clusters
# reported by 2025 hold of the order of 10^5 GPUs. It bounds the work only loosely: the
# time grows with the count's divisors (tp x pp x cp x the shard specs), so on the 2-core
# VM a count with many divisors took 19 s (720,720 GPUs), 27 s (997,920) and 31 s (110,880
# with --max-cp 8); pinning --tp, --pp or --cp, or giving --zero, cuts it.
MAX_GPUS = 2**20


def human_bytes(x: float) -> str:
    """Bytes in GiB, or MiB for the small models of a laptop."""
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def rank_key(seconds: float | tuple, memory: float, layout: Layout) -> tuple:
    """The one ordering of candidates (module docstring); ``seconds`` may be a tuple
    (AMSP's objective: DP communication, then step time)."""
    seconds = seconds if isinstance(seconds, tuple) else (seconds,)
    return (*(float(f"{x:.9g}") for x in seconds), round(memory), layout.tp, layout.pp,
            layout.cp, layout.v, layout.micro_batch, layout.shard,
            RECOMPUTE_MODES.index(layout.recompute), layout.schedule)


def search(model: ModelShape | str, gpus: int, hardware: Hardware | str, *, tp: int | None = None,
           pp: int | None = None, cp: int | None = None, max_cp: int | None = None,
           global_batch_tokens: int | None = None, seq_len: int | None = None,
           micro_batch: int | None = None, shard: Shard | str | None = None,
           zero: int | None = None, recompute: str | None = None, v: int | None = None,
           top: int = 5, max_tp: int | None = None, max_v: int = 8, max_micro_batch: int = 16,
           order: str | None = None, overlap: float | None = None, flash: bool = False,
           sp: bool | None = None, dtype: str | None = None, reserve: float | None = None,
           specs_per_layout: int = 1, framework: Framework | str = "minipar",
           schedule: str | None = None, objective: str = "step") -> list[Estimate]:
    """Ranked layouts (best first) of ``model`` on ``gpus`` devices of ``hardware`` (module
    docstring), as ``framework`` runs them (its rank order unless ``order`` is given). Fixing
    an axis (``v``: chunks; ``shard`` or ``zero``: the spec) narrows the search; all but
    ``schedule``, ``sp`` and ``shard`` also take a set of allowed values (an empty one is a
    PlanError); ``max_tp`` lets TP span nodes. ``specs_per_layout``: how many shard specs to
    keep per parallel layout (1 lists different layouts, each with its best)."""
    shape = model_preset(model) if isinstance(model, str) else model
    shape = with_seq_len(shape, seq_len) if seq_len else shape
    hw = load_hardware(hardware)
    fw = load_framework(framework)
    order = order or fw.order
    dtype = dtype or hw.dtype
    if order not in ORDERS:
        raise PlanError(f"unknown order {order!r}; use {' or '.join(ORDERS)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; use {' or '.join(OBJECTIVES)}")
    if not 1 <= gpus <= MAX_GPUS:
        raise PlanError(f"--gpus must be from 1 to {MAX_GPUS:,} (the search's bound on its "
                        f"work), got {gpus:,}")
    raise_if(spec_flags_violation(shard, zero))
    if isinstance(shard, str):
        shard = parse_shard(shard)
    tps, pps, mbs, vs, zeros, recomputes, cps = (
        allowed(x, name) for x, name in ((tp, "tp"), (pp, "pp"), (micro_batch, "micro-batch"),
                                         (v, "chunks"), (zero, "zero"),
                                         (recompute, "recompute"), (cp, "cp")))
    raise_if(recompute_violation(recomputes or ()))
    if schedule is not None and schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; use {', '.join(SCHEDULES)}")
    raise_if(capability_violation(fw, bool(sp), 2 if schedule == "interleaved" else min(vs or [1]),
                                  tuple(recomputes or ()), max(*(cps or [1]), max_cp or 1)))
    # a set of chunks is refused only when none of them can run
    raise_if(vs and schedule_violation(schedule, max(vs) if schedule == "interleaved" else min(vs)))
    batch = batch_sequences(shape, global_batch_tokens)
    capacity = device_capacity(hw, fw, reserve)
    modes = [r for r in RECOMPUTE_MODES if r in fw.recompute and r in (recomputes or [r])]
    if not fw.interleaving or schedule in ("gpipe", "1f1b"):
        max_v, vs = 1, (1,)
    use_sp = sp_rule(shape, fw.sp if sp is None else sp, given=sp is not None)

    if not fw.cp:                      # the cp to scan, in turn (None: every cp)
        tries = [[1]]
    elif cps is not None:
        tries = [list(cps)]
    elif max_cp is not None:
        tries = [None]
    else:                      # cp where memory forces it (module docstring)
        tries = [[1], None]

    def seconds(step: float, layout: Layout):        # what ``rank_key`` ranks by
        if objective != "amsp":
            return step
        return (*amsp_key(amsp_cost(shape, hw, layout, fw, order, dtype), layout.shard), step)

    results: list[Estimate] = []
    rejected: list = []                # (depth, why): the deepest first refusal (``_scan``)
    for tried in tries:
        candidates, leanest = _scan(
            shape, gpus, hw, fw, batch, capacity, modes, tried, rejected, tps=tps, pps=pps,
            max_cp=max_cp, max_tp=max_tp, shard=shard, zeros=zeros, mbs=mbs, vs=vs, max_v=max_v,
            max_micro_batch=max_micro_batch, schedule=schedule, use_sp=use_sp, order=order,
            overlap=overlap, flash=flash, dtype=dtype, specs_per_layout=specs_per_layout,
            seconds=seconds)
        pool = heapq.nsmallest(max(4 * top, 20), candidates, key=lambda x: x[0])
        # the pruned scan ranked candidates; the full model has the last word, same key
        found = [e for e in (estimate(shape, hw, layout, order=order, overlap=overlap,
                                      flash=flash, dtype=dtype, reserve=reserve, check=False,
                                      framework=fw) for _, layout in pool) if e.fits]
        if found:          # the wider scan's ranking includes cp = 1's
            results = found
        # cp = 1 fits at ease (else cp may fit, or divide the batch) unless its fastest layout
        # pays for its activations with full recomputation where the search allowed less (so
        # cp, the other way to pay, is weighed against it)
        if found and (min(found, key=lambda e: e.step_time).layout.recompute != "full"
                      or modes == ["full"]):
            break
    if not results and not pool:
        need, lean = leanest
        if lean is None:         # every candidate was refused: say why (``_scan``)
            raise PlanError(f"no layout of {shape.name} on {gpus} GPUs (a batch of {batch} "
                            f"sequences of {shape.seq_len} tokens) can run: {rejected[0][1]}")
        raise PlanError(f"nothing fits: the leanest layout of {shape.name} on {gpus} GPUs "
                        f"({lean.describe(shard=False)}, model states fully sharded) needs "
                        f"{human_bytes(need)} per device of {human_bytes(capacity)} usable; use "
                        f"more GPUs or a smaller micro-batch or batch")
    if not results:
        raise PlanError(f"nothing fits {shape.name} on {gpus} GPUs within "
                        f"{human_bytes(capacity)} usable per device; use more GPUs or a smaller "
                        f"micro-batch or batch")
    results.sort(key=lambda e: rank_key(seconds(e.step_time, e.layout), e.memory["total"],
                                        e.layout))
    return results[:top]


def batch_sequences(shape: ModelShape, tokens: int | None = None,
                    flags: str = "--global-batch-tokens") -> int:
    """Sequences in a global batch of ``tokens`` (None: the model's), a whole number of them
    (search, flops, estimate); ``flags``: what to give where the model has no default."""
    s, tokens = shape.seq_len, tokens or shape.global_batch_tokens
    if not tokens:
        raise PlanError(f"model {shape.name} has no default batch; give {flags}")
    if tokens % s:
        raise PlanError(f"--global-batch-tokens {tokens} is not a whole number of {s}-token "
                        f"sequences; use a multiple of {s}")
    return tokens // s


def allowed(value, name: str) -> tuple | None:
    """A search axis's allowed values: None (free), one value, or any iterable of them, as a
    sorted tuple; an empty set is a PlanError."""
    if value is None:
        return None
    if isinstance(value, (str, int)):
        return (value,)
    values = tuple(sorted(set(value)))
    if not values:
        raise PlanError(f"the set of allowed --{name} values is empty; give at least one")
    return values


def _scan(shape, gpus, hw, fw, batch, capacity, modes, cps, rejected, *, tps, pps, max_cp,
          max_tp, shard, zeros, mbs, vs, max_v, max_micro_batch, schedule, use_sp, order,
          overlap, flash, dtype, specs_per_layout, seconds):
    """The pruned scan (module docstring) over ``cps`` (None: every cp that cuts the
    sequence, at most ``max_cp``): ([(key, layout)], the leanest (bytes, layout) seen).
    ``rejected`` holds [(depth, why)]: why the first candidate refused at the deepest step
    was refused (degrees 0, shard specs 1, schedule 2), since a candidate that passed the
    degrees and the specs shows what really stands in the way (a batch that 1024 dp ranks
    do not divide says nothing about a --shard that no layout runs)."""
    candidates: list[tuple] = []           # (key, layout), each layout's best specs
    leanest = (math.inf, None)             # for the "nothing fits" message

    def refuser(depth: int):
        def refuse(why: str) -> None:
            if not rejected or depth > rejected[0][0]:
                rejected[:] = [(depth, why)]
        return refuse

    for t, p, c, d in _degrees(shape, gpus, batch, tps, pps, max_tp or hw.gpus_per_node,
                               fw.stage_rule, cps, max_cp, use_sp, refuser(0)):
        grid = Layout(tp=t, pp=p, cp=c, dp=d)
        per_node = dp_per_node(grid, hw.gpus_per_node, order)
        specs = _specs(fw, grid.replicas, p, per_node, shard, zeros, refuser(1))   # dp x cp
        if not specs:
            continue
        states = _state_table(shape, grid, specs, dtype, fw)
        profiles: dict = {}                # (spec, full recomputation) -> dp_profile
        for b, m, chunks in _schedules(shape, p, batch // d, mbs, vs, max_v, max_micro_batch,
                                       schedule, refuser(2), fw.stage_rule):
            for mode in modes:
                base = Layout(tp=t, pp=p, cp=c, dp=d, micro_batch=b, microbatches=m,
                              recompute=mode, v=chunks, sp=use_sp(t, c),
                              schedule="gpipe" if schedule == "gpipe" else "1f1b")
                table = _memory_table(shape, base, states, flash, dtype, fw, hw.layer_buffer_bytes)
                leanest = min(leanest, (table[0][0], base), key=lambda x: x[0])
                fitting = bisect.bisect_right([row[0] for row in table], capacity)
                if not fitting:
                    continue
                parts = time_parts(shape, hw, base, order, dtype, flash, fw)
                fixed = sum(parts[k] for k in STEP_PARTS if k != "dp_exposed")
                keys = []
                for total, spec in table[:fitting]:
                    layout = replace(base, shard=spec)
                    key = (spec, mode == "full")
                    if key not in profiles:
                        profiles[key] = dp_profile(shape, hw, layout, order, dtype, fw)
                    dp = dp_exposure(profiles[key], m, parts, overlap, hw.overlap_slowdown,
                                     hw.overlap_exposed)
                    step = fixed + dp["dp_exposed"] + dp["interference"]
                    keys.append((rank_key(seconds(step, layout), total, layout), layout))
                candidates += heapq.nsmallest(specs_per_layout, keys, key=lambda x: x[0])
    return candidates, leanest


def _specs(fw, replicas: int, pp: int, per_node: int, shard, zeros, refuse) -> list:
    """The shard specs to try over ``replicas``: the one given, the ZeRO stages allowed
    (those the framework runs, unless it runs every AMSP spec), or the framework's; none,
    with the reason passed to ``refuse``, when it runs none of them."""
    if shard is not None:
        why = shard_violation(shard, replicas, per_node)
        if why:
            refuse(why)
            return []
        return [tuple(shard)]
    runs = fw.specs(replicas, pp, per_node)
    if zeros is None:
        return runs
    wanted = sorted({zero_shard(z, replicas) for z in zeros})
    if fw.spec_family == "amsp":
        return wanted
    out = [x for x in wanted if x in runs]
    if not out:
        refuse(f"{fw.name} does not run ZeRO-{' or ZeRO-'.join(map(str, zeros))} over dp x cp "
               f"= {replicas} ranks with pp={pp}; it runs the specs "
               f"{', '.join(map(str, runs))}")
    return out


def _state_table(shape, grid: Layout, specs, dtype, fw) -> dict:
    """{spec: ([(stage, model-state bytes of that stage)], the gathered layers' bytes)}, once
    per grid: what depends on the spec alone (module docstring, "Pruning")."""
    rows = distinct(stage_list(shape, grid, fw))
    return {spec: ([(st, sum(state_bytes(shape, lay, dtype, fw, st).values())) for st in rows],
                   gather_bytes(shape, grid.tp, spec, dtype))
            for spec, lay in ((spec, replace(grid, shard=spec)) for spec in specs)}


def _memory_table(shape, base: Layout, states: dict, flash, dtype, fw, layer_buffer) -> list:
    """[(bytes per device, spec)] sorted: for each spec the largest stage's peak (``peak``):
    its states (``_state_table``) and what this schedule holds on it."""
    held = {st.index: (activation_bytes(shape, base, flash, dtype, st, fw)
                       + temporary_bytes(shape, base, flash, dtype, fw, st, layer_buffer))
            for st in distinct(stage_list(shape, base, fw))}
    return sorted((max(state + held[st.index] for st, state in rows) + gather, spec)
                  for spec, (rows, gather) in states.items())


def sp_rule(shape: ModelShape, sp: bool, given: bool):
    """``sp(t, c)``: whether a layout of tp t and cp c runs sequence parallelism. Asked for
    (``given``), it is on wherever tp > 1 and the rules refuse a sequence it cannot cut; by
    default (the framework's), it is on only where it cuts each rank's s/c tokens into t
    equal pieces, and the other layouts are priced without it rather than dropped."""
    def at(t: int, c: int) -> bool:
        return sp and t > 1 and (given or (shape.seq_len % t == 0
                                           and (shape.seq_len // c) % t == 0))
    return at


def _degrees(shape: ModelShape, gpus: int, batch: int, tps, pps, max_tp: int, stage_rule: str,
             cps: list[int] | None, max_cp: int | None, sp, refuse):
    """(tp, pp, cp, dp): tp splits the model as the trainer requires (``shape_tp_violation``;
    at most ``max_tp`` unless given), pp gives the framework a stage split
    (``split_violation``), cp cuts the sequence (``cp_violation``; ``cps`` None: every such
    cp, at most ``max_cp``), dp the batch. A single value given for tp, pp or cp that cannot
    work is a PlanError; from a set such values are skipped, ``refuse`` told why. ``sp(t,
    c)``: whether that layout runs sequence parallelism (``sp_rule``)."""
    t0 = tps[0] if tps and len(tps) == 1 else 1          # the tp a single cp is checked with
    for axis, values in (("tp", tps), ("pp", pps), ("cp", cps)):
        if values is not None and len(values) == 1:
            x = values[0]
            why = (shape_tp_violation(shape, x, sp(x, 1)) if axis == "tp"
                   else split_violation(shape, x, stage_rule) if axis == "pp"
                   else cp_violation(shape.seq_len, x, t0, sp(t0, x)))
            if why or gpus % x:
                raise PlanError(why or f"{axis}={x} must divide the {gpus} GPUs")
    tps = tps or [t for t in divisors(shape.heads) if t <= max_tp]
    # assumption, a bound on the work and not a framework's rule: no framework here gives a
    # stage less than a layer, bar nanotron's balance, whose extra stages hold the blocks
    # after the layers (norm, head, cast, loss); split_violation decides which pp run
    pps = pps or [p for p in divisors(gpus) if p <= shape.layers + 4]
    for t in tps:
        why = (f"tp={t} does not divide the {gpus} GPUs" if gpus % t
               else shape_tp_violation(shape, t, sp(t, 1)))
        if why:
            refuse(why)
            continue
        for p in pps:
            why = (f"tp={t} x pp={p} = {t * p} does not divide the {gpus} GPUs"
                   if gpus % (t * p) else split_violation(shape, p, stage_rule))
            if why:
                refuse(why)
                continue
            # a cp > 1 cuts the sequence into 2 cp chunks, so it divides the sequence too
            for c in cps or divisors(math.gcd(gpus // (t * p), shape.seq_len)):
                d, rest = divmod(gpus, t * p * c)
                why = (f"cp={c} is above --max-cp {max_cp}" if max_cp and c > max_cp else
                       cp_violation(shape.seq_len, c, t, sp(t, c))
                       or (f"tp={t} x pp={p} x cp={c} = {t * p * c} does not divide the "
                           f"{gpus} GPUs" if rest else None)
                       or (f"dp={d} (the {gpus} GPUs over tp={t} x pp={p} x cp={c}) does not "
                           f"divide the batch of {batch} sequences; change --gpus, "
                           f"--global-batch-tokens, --tp, --pp or --cp" if batch % d else None))
                if why:
                    refuse(why)
                    continue
                yield t, p, c, d


def _schedules(shape: ModelShape, pp: int, per_replica: int, mbs, vs, max_v: int,
               max_micro_batch: int, schedule: str | None = None, refuse=lambda why: None,
               stage_rule: str = "even"):
    """(b, m, v): micro-batch size (those in ``mbs``, else 1 to ``max_micro_batch``) dividing
    the ``per_replica`` sequences, micro-batch count, chunks per stage (those in ``vs``, else
    those up to ``max_v`` the framework's stages split into) that ``schedule_violation`` (the
    ``schedule`` asked for), ``split_violation`` and ``interleave_violation`` allow (pp > 1, m
    divisible by pp). ``refuse`` is told why a size or a given chunk count was skipped."""
    sizes = mbs if mbs is not None else range(1, min(max_micro_batch, per_replica) + 1)
    chunk_counts = vs if vs is not None else [
        v for v in range(1, max_v + 1) if not split_violation(shape, pp, stage_rule, v)]
    for b in sizes:
        if per_replica % b:
            refuse(f"micro-batch {b} does not divide the {per_replica} sequences per replica")
            continue
        m = per_replica // b
        for chunks in chunk_counts:
            why = (schedule_violation(schedule, chunks)
                   or (chunks > 1 and split_violation(shape, pp, stage_rule, chunks))
                   or interleave_violation(pp, m, chunks))
            if why:
                refuse(why)
                continue
            yield b, m, chunks


# --------------------------------------------------------------------------------------
# AMSP's scale-aware partitioner (Chen et al. 2023, arXiv 2311.00257; objective="amsp"):
# among the specs that fit memory, the least data-parallel communication time, nothing
# hidden, each of P, G and OS on the fastest links its group allows: a group of at most a
# node's devices (contiguous) inside one node on its links, a wider one on each device's
# share of the NICs, at datasheet rates. That is AMSP's cost model, not the planner's (which
# lets a ring carry a node's shares over its boundary at once and slows as a group widens):
# it is what AMSP's partitioner picks by (``amsp_key``), and the step time ranks the rest.
# --------------------------------------------------------------------------------------
def amsp_cost(shape, hw, layout, fw, order: str, dtype: str) -> float:
    """AMSP's objective for one step of ``layout``: its data-parallel collectives
    (``estimate.dp_collectives`` of one micro-batch; gathers and gradient reductions once per
    micro-batch), each group laid out as the dp ranks are, every call's latency and bytes at
    its links' rate, nothing hidden."""
    stride = layout.replica_stride(order, hw.gpus_per_node)
    total = 0.0
    for c in dp_collectives(shape, replace(layout, microbatches=1), fw, dtype):
        inside = placement(c.size, c.stride * stride, hw.gpus_per_node)[1] == 1
        beta = hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth / hw.gpus_per_node
        count = c.count * (layout.microbatches if c.kind in ("gather", "grad") else 1)
        total += count * (c.calls * hw.collective_latency
                          + ring_bytes(c.op, c.nbytes, c.size) / beta)
    return total


def amsp_key(seconds: float, shard: Shard) -> tuple:
    """AMSP's ranking: its time to three significant digits (closer is a tie that latency
    alone decides), then the smaller groups, on the faster links."""
    return float(f"{seconds:.3g}"), sum(shard)


def amsp_reasons(shape, hw, best, fw, order: str, dtype: str, flash: bool,
                 reserve=None) -> list[str]:
    """One line per group of ``best``'s spec (P, G, OS): where it runs, and what the nearest
    smaller and larger sizes the framework runs with the other two groups kept would do
    instead: not fit, cost more AMSP time, or tie on it (then the smaller groups win)."""
    lay = best.layout
    stride = lay.replica_stride(order, hw.gpus_per_node)
    runs = fw.specs(lay.replicas, lay.pp, dp_per_node(lay, hw.gpus_per_node, order))
    base = amsp_key(amsp_cost(shape, hw, lay, fw, order, dtype), lay.shard)[0]

    def where(s):
        nodes = placement(s, stride, hw.gpus_per_node)[1]
        return f"{s} (inside a node)" if nodes == 1 else f"{s} (across {nodes} nodes)"

    def note(spec, k):
        other = replace(lay, shard=spec)
        e = estimate(shape, hw, other, order=order, flash=flash, dtype=dtype, reserve=reserve,
                     check=False, framework=fw)
        if not e.fits:
            return f"{where(k)} does not fit: {e.memory['total'] / 2**30:.1f} of " \
                   f"{e.capacity / 2**30:.1f} GiB"
        t = amsp_key(amsp_cost(shape, hw, other, fw, order, dtype), spec)[0]
        return f"{where(k)} costs {t - base:+.3g} s" if t != base else f"{where(k)} ties"

    lines = []
    for i, name in enumerate(("P", "G", "OS")):
        same = [x for x in runs if x[:i] + x[i + 1:] == lay.shard[:i] + lay.shard[i + 1:]]
        near = [max((x for x in same if x[i] < lay.shard[i]), default=None, key=lambda x: x[i]),
                min((x for x in same if x[i] > lay.shard[i]), default=None, key=lambda x: x[i])]
        notes = [note(x, x[i]) for x in near if x is not None]
        lines.append(f"{name}={where(lay.shard[i])}: "
                     + ("; ".join(notes) or "the only size the other two allow"))
    return lines


# --------------------------------------------------------------------------------------
# Explaining the result
# --------------------------------------------------------------------------------------
_PARTS = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "TP communication",
          "cp_exposed": "exposed CP ring", "pp_comm": "PP communication",
          "dp_exposed": "exposed DP communication"}
_COMPUTE = {"compute_matmul": "matmuls", "compute_attention": "attention core",
            "compute_memory_bound": "memory-bound kernels", "compute_optimizer": "optimizer"}


def explain(best: Estimate, runner_up: Estimate | None = None, label: str = "best") -> str:
    """Where the step time and memory of ``best`` go, and what the runner-up lost on."""
    t, mem = best.times, best.memory
    lines = [f"{label}: {best.layout.describe()}: step {t['step']:.3g} s, "
             f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%} (HFU {best.hfu:.1%})",
             "  time: " + ", ".join(f"{_PARTS[k]} {t[k] / t['step']:.1%}" for k in _PARTS
                                    if k != "cp_exposed" or t[k])]
    if t.get("compute"):
        lines.append("  compute: " + ", ".join(f"{v} {t[k] / t['compute']:.0%}"
                                               for k, v in _COMPUTE.items() if k in t))
    if t.get("cp_comm"):
        lines.append(f"  CP ring: {t['cp_comm']:.3g} s of K/V sends, {best.cp_bytes / 2**30:.3g} "
                     f"GiB per rank, {t['cp_comm'] - t['cp_exposed']:.3g} s hidden behind the "
                     f"attention blocks, {t['cp_exposed']:.3g} s exposed (with the K/V "
                     f"gradients' hops)")
    if t.get("dp_comm"):
        lines.append(f"  DP traffic: {t['dp_comm']:.3g} s in {t['dp_calls']:,} calls, "
                     f"{t['dp_hidden']:.3g} s hidden behind compute, "
                     f"{t['dp_exposed']:.3g} s exposed")
    parts = ", ".join(f"{k} {human_bytes(mem[k])}"
                      for k in ("params", "grads", "optimizer", "activations", "temporary"))
    lines.append(f"  memory: {human_bytes(mem['total'])} of {human_bytes(best.capacity)} usable "
                 f"({parts})")
    if best.unvalidated:
        lines.append("  unvalidated: " + "; ".join(best.unvalidated) + " (timed by the "
                     "alpha-beta model at the measured network efficiency, never faster "
                     "than the widest measured row)")
    if len(set(best.stages)) > 1:   # uneven: what Megatron-LM's first/last-stage flags say
        lines.append("  layers per pipeline stage, first to last: " + ", ".join(
            f"{k} x {n}" if (n := len(list(g))) > 1 else str(k)
            for k, g in groupby(best.stages)))
    lines += [f"  note: {n}" for n in best.notes]   # unfitted hardware, shared cores, MoE
    if runner_up is not None:
        deltas = {k: runner_up.times[k] - t[k] for k in _PARTS}
        worse = sorted((k for k in deltas if deltas[k] > 0), key=lambda k: -deltas[k])
        better = [k for k in deltas if deltas[k] < 0]
        slower = runner_up.step_time / t["step"] - 1
        if slower < 1e-3:
            leaner = "; the best needs less memory" if runner_up.memory["total"] > mem["total"] else ""
            lines.append(f"runner-up: {runner_up.layout.describe()}: ties within 0.1% (the model "
                         f"sees no difference in time{leaner})")
            return "\n".join(lines)
        line = (f"runner-up: {runner_up.layout.describe()}: {slower:.2%} slower; it loses on "
                + ", ".join(f"{_PARTS[k]} +{deltas[k]:.3g} s" for k in worse[:2]))
        if better:
            line += " and gains on " + ", ".join(f"{_PARTS[k]} {deltas[k]:.3g} s" for k in better)
        if runner_up.memory["total"] < mem["total"]:
            line += f"; it needs less memory ({human_bytes(runner_up.memory['total'])})"
        lines.append(line)
    return "\n".join(lines)
