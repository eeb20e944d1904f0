"""Step time of one layout: compute, communication, bubble; tokens/s and MFU.

    step = compute + TP comm + CP comm + bubble + PP comm + exposed DP comm

* compute (``compute.compute_parts``, its module docstring): the heaviest (last) pipeline
  stage's matmuls shape by shape, attention core, memory-bound kernels and optimizer step,
  and the host's time to issue them (once stages hand off across nodes, with each TP call's
  wait: docs/decisions.md, 6-7) where the device's work does not hide it (``stage_time``).
* TP comm: the per-layer collectives of ``network``, blocking (Megatron-LM and minipar run
  them on the critical path), each a call with its base and ring-step latencies, plus
  those of the embedding, head and loss on the stage that holds them (both ends when
  pp = 1, the head's when pp > 1: the last stage also computes the loss).
* CP comm (context parallelism, ``plan.cp.ring_times``, its module docstring): every rank
  holds s/cp tokens of each sequence, so compute, TP and PP messages are those of s/cp
  tokens; what the ring's K/V sends do not hide behind the attention blocks is exposed.
* bubble: a pipeline of p stages idles (p-1)/m of the time it computes m micro-batches,
  and interleaving v chunks per stage divides that by v (Narayanan et al. 2021, section
  2.2): (p-1)/(m v) x (compute + TP comm + CP comm, without the optimizer step).
* PP comm: each micro-batch's send and receive, on the critical path.
* DP comm: the ZeRO/AMSP collectives over the dp x cp replicas as the framework's engine
  issues them (``network.engine_collectives``), each hidden behind the compute its window
  allows, never more: gradient reductions started during backward behind their
  micro-batch's backward but the last call; prefetched parameter gathers behind the unit
  before them (the first of each pass exposed); the gather after the optimizer step behind
  the next forward where the engine overlaps it. All hidden time together is capped by the
  compute time. ``overlap`` replaces the windows by a fraction: 0 hides nothing, 1 all that
  is hideable (still not the last bucket, the first gather or an exposed gather), so the
  extremes still rank specs by the traffic that cannot hide. Hidden traffic slows compute
  by the hardware's ``overlap_slowdown``; ``overlap_exposed`` of it stays exposed.

Collective times come from the hardware's measured ``collective_table`` where it covers the
group, else from the alpha-beta model; ``Estimate.unvalidated`` names every collective of
the layout that no measurement covers (``network.coverage``), and ``search`` prints it.

MFU = model FLOPs (no recomputation) / (step x devices x peak)   (Chowdhery et al. 2022)
HFU = hardware FLOPs (with recomputation) / (step x devices x peak). Under full
recomputation the hardware FLOPs of a GPT are exactly Megatron's 96 B s l h^2 (...) formula,
which Megatron-DeepSpeed reports as TFLOP/s: HFU is what the Frontier study's percent of
peak measures.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .compute import compute_parts
from .cp import cp_comm_bytes, ring_times
from .frameworks import Framework, check_framework, gather_calls, load_framework
from .hardware import Hardware, load_hardware
from .layout import Layout, check_layout, dp_per_node
from .memory import ACTIVATION_BYTES, stage_params
from .peak import capacity, device_memory, stage_list
from .stages import distinct
from .network import collective_time, coverage, engine_collectives, p2p_time, placement
from .shapes import ModelShape, training_flops

DEFAULT_FRAMEWORK = "minipar"
STEP_PARTS = ("compute", "tp_comm", "cp_exposed", "bubble", "pp_comm", "dp_exposed")  # step's sum


@dataclass
class Estimate:
    model: str
    hardware: str
    layout: Layout
    memory: dict            # bytes per device: params, grads, optimizer, activations,
                            # temporary, total
    capacity: float         # usable bytes per device
    times: dict             # seconds a step: STEP_PARTS, compute_* parts, cp_comm, dp_comm, step
    flops: dict             # per step, whole job: model, hardware
    tokens_per_s: float
    mfu: float
    hfu: float
    framework: str = DEFAULT_FRAMEWORK
    notes: list = field(default_factory=list)
    unvalidated: list = field(default_factory=list)   # collectives timed beyond measurement
    cp_bytes: int = 0       # bytes one rank sends round the cp ring per step (heaviest stage)
    stages: tuple = ()      # layers on each pipeline stage, first to last (``stages``)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    @property
    def step_time(self) -> float:
        return self.times["step"]

    def shares(self) -> dict:
        """Fraction of the step spent in each part (they sum to 1)."""
        t = self.times
        parts = {"compute": t["compute"], "bubble": t["bubble"], "tp_comm": t["tp_comm"],
                 "cp_comm": t["cp_exposed"], "pp_comm": t["pp_comm"], "dp_comm": t["dp_exposed"]}
        return {k: v / t["step"] for k, v in parts.items()}

    def to_json(self) -> dict:
        lay = self.layout
        s_p, s_g, s_os = lay.shard
        return {
            "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp": lay.dp, "micro_batch": lay.micro_batch,
            "microbatches": lay.microbatches, "shard": {"p": s_p, "g": s_g, "os": s_os},
            "recompute": lay.recompute != "none", "memory_bytes": int(self.memory["total"]),
            "step_time_s": self.step_time, "mfu": self.mfu,
            # extras
            "v": lay.v, "sp": lay.sp, "schedule": "interleaved" if lay.v > 1 else lay.schedule,
            "recompute_mode": lay.recompute, "hfu": self.hfu, "tokens_per_s": self.tokens_per_s,
            "fits": self.fits, "capacity_bytes": int(self.capacity),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "times": dict(self.times), "shares": self.shares(),
            "model": self.model, "hardware": self.hardware, "framework": self.framework,
            "unvalidated": list(self.unvalidated), "cp_bytes": self.cp_bytes,
            "notes": list(self.notes), "stages": list(self.stages)}


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of an ideal pipeline: (p-1)/(v m + p - 1) of p stages x the step time, for
    p stages, m micro-batches and v model chunks per stage (GPipe and 1F1B: v = 1)."""
    return (p - 1) / (v * m + p - 1)


def rates(shape: ModelShape, hw: Hardware, layout: Layout, step: float, flops: dict) -> dict:
    """An estimate's FLOPs per step ({"model": without recomputation, "hardware": with}) and
    what its step time makes of them: tokens/s, MFU and HFU (module docstring)."""
    peak = step * layout.gpus * hw.peak_flops
    return dict(flops=flops, tokens_per_s=layout.global_batch * shape.seq_len / step,
                mfu=flops["model"] / peak, hfu=flops["hardware"] / peak)


def tp_call_time(msg: float, layout: Layout, stride: int, hw: Hardware) -> float:
    """One of a layer's TP all-reduces of ``msg`` bytes; with sequence parallelism the
    all-gather and reduce-scatter it becomes (``moe.adjust`` prices the MLP's with it)."""
    job = hw.nodes(layout.gpus)
    if layout.sp:
        return (collective_time("all_gather", msg, layout.tp, stride, hw, job)
                + collective_time("reduce_scatter", msg, layout.tp, stride, hw, job))
    return collective_time("all_reduce", msg, layout.tp, stride, hw, job)


def stage_time(shape: ModelShape, hw: Hardware, layout: Layout, stage, order: str,
               dtype: str, flash: bool, fw: Framework) -> dict:
    """One stage's compute parts (``compute.compute_parts``; "launch", in "total" and the
    passes, becomes the host's time left unhidden), its TP traffic (hidden behind its GEMMs
    where the framework overlaps it) and its ring, per step; "per_mb": the pipelined seconds
    of one micro-batch, what the bubble is made of; "across": the pipeline spans nodes."""
    t, m = layout.tp, layout.microbatches
    b, s, h = layout.micro_batch, shape.seq_len // layout.cp, shape.hidden
    tp_stride = layout.strides(order)["tp"]
    parts = compute_parts(shape, hw, layout, dtype, flash, fw.grad_bytes, stage)
    msg = b * s * h * ACTIVATION_BYTES[dtype]
    calls = m * (stage.layers * (6 if layout.recompute == "full" else 4)
                 + stage.embedding + stage.head)       # + the embedding's g, the head's f
    tp_comm = calls * tp_call_time(msg, layout, tp_stride, hw) + (3 * m * collective_time(
        "all_reduce", b * s * 4, t, tp_stride, hw, hw.nodes(layout.gpus)) if stage.head else 0)
    hidden = min(tp_comm, parts["matmul"]) if fw.tp_overlap else 0.0
    ring = ring_times(shape, hw, layout, order, dtype, flash, layers=stage.layers)
    across = placement(layout.pp, layout.strides(order)["pp"], hw.gpus_per_node)[1] > 1
    wait = calls * t * hw.pipeline_tp_latency if across and t > 1 else 0.0   # the host's
    exposed_tp = tp_comm - hidden + hidden * hw.overlap_slowdown
    # the device's and the host's seconds per micro-batch (its launches, ``layer_overhead``,
    # and the wait): (gpu^k + host^k)^(1/k), k = ``overhead_hiding`` (1: add; large: the longer)
    k, host = hw.overhead_hiding, parts["launch"] / m
    gpu = (parts["total"] - parts["optimizer"] + exposed_tp + ring["cp_exposed"]) / m - host
    host += wait / m
    top = max(gpu, host)
    per_mb = top * (1 + (min(gpu, host) / top) ** k) ** (1 / k) if top else 0.0
    launch = m * (per_mb - gpu)                  # the host's time the device does not hide
    shift = (launch - parts["launch"]) / m / 2   # each pass held half the host's time
    parts = {**parts, "launch": launch, "total": parts["total"] - parts["launch"] + launch,
             **{name: parts[name] + shift for name in ("forward_mb", "backward_mb")}}
    return dict(parts=parts, tp_comm=exposed_tp, tp_hidden=hidden, ring=ring, per_mb=per_mb,
                across=across)


def time_parts(shape: ModelShape, hw: Hardware, layout: Layout, order: str = "tp,pp,dp",
               dtype: str = "mixed", flash: bool = False,
               framework: Framework | str = DEFAULT_FRAMEWORK) -> dict:
    """Seconds per step of everything but data-parallel traffic: compute (and its parts),
    tp_comm, cp_comm and cp_exposed, bubble, pp_comm, from the stages the framework builds
    (module docstring): the slowest stage's, and the bubble the others' micro-batches make."""
    fw = load_framework(framework)
    p, v, m = layout.pp, layout.v, layout.microbatches
    every = stage_list(shape, layout, fw)
    kind = {st.index: (st.layers, st.embedding, st.head) for st in every}
    times = {kind[st.index]: (st, stage_time(shape, hw, layout, st, order, dtype, flash, fw))
             for st in distinct(every)}
    per_mb = [times[kind[st.index]][1]["per_mb"] for st in every]
    slow, worst = max(times.values(), key=lambda x: x[1]["per_mb"])
    bubble = (sum(per_mb) - worst["per_mb"]) / v       # (p-1)/v x t with equal stages
    b, s = layout.micro_batch, shape.seq_len // layout.cp
    msg = b * s * shape.hidden * ACTIVATION_BYTES[dtype] / layout.tp     # a rank's share
    pp_comm = (2 * m * v * p2p_time(msg, worst["across"], hw, hw.nodes(layout.gpus))
               if p > 1 else 0.0)
    parts = worst["parts"]
    return {"compute": parts["total"], "tp_comm": worst["tp_comm"],
            "tp_hidden": worst["tp_hidden"], "bubble": bubble, "pp_comm": pp_comm,
            "stage": slow.index, **worst["ring"],
            **{f"compute_{k}": parts[k] for k in ("matmul", "attention", "memory_bound",
                                                  "optimizer", "forward_mb", "backward_mb")}}


def dp_collectives(shape: ModelShape, layout: Layout, framework: Framework | str,
                   dtype: str = "mixed"):
    """The data-parallel collectives of the stage with the most parameters (``peak.
    stage_list``; its traffic is the step's) as the framework's engine issues them over the
    stage's units (FSDP's wrapping, minipar's ZeRO units): its layers, embedding and head."""
    fw = load_framework(framework)
    stage = max(distinct(stage_list(shape, layout, fw)),
                key=lambda st: stage_params(shape, layout.tp, layout.pp, st))
    units = stage.layers + stage.embedding + stage.head
    return engine_collectives(stage_params(shape, layout.tp, layout.pp, stage),
                              layout.replicas, layout.shard, fw, units, dtype,
                              layout.microbatches, recompute=layout.recompute == "full",
                              reduce_bytes=fw.reduce_bytes,
                              gathers=gather_calls(fw, shape.arch, stage.layers,
                                                   units - stage.layers))


def dp_profile(shape: ModelShape, hw: Hardware, layout: Layout, order: str = "tp,pp,dp",
               dtype: str = "mixed", framework: Framework | str = DEFAULT_FRAMEWORK) -> list:
    """The data-parallel collectives of ``layout`` for one micro-batch, timed per call:
    [(count, per micro-batch?, calls, seconds per call, window)]. Independent of the
    micro-batch count and size, so the search computes it once per spec."""
    stride = layout.replica_stride(order, hw.gpus_per_node)
    return [(c.count, c.kind in ("gather", "grad"), c.calls,
             collective_time(c.op, c.nbytes / c.calls, c.size, c.stride * stride, hw,
                             hw.nodes(layout.gpus)), c.window)
            for c in dp_collectives(shape, replace(layout, microbatches=1), framework, dtype)]


def dp_exposure(profile: list, microbatches: int, parts: dict, overlap: float | None = None,
                slowdown: float = 0.0, exposed_share: float = 0.0) -> dict:
    """What of the profile's traffic hides behind ``parts``' compute (module docstring):
    {"dp_comm" (all of it), "dp_exposed", "dp_hidden", "dp_calls", "interference"};
    ``exposed_share`` of what could hide stays exposed (the hardware's ``overlap_exposed``)."""
    total = exposed = hidden_sum = 0.0
    calls = 0
    fwd, bwd = parts["compute_forward_mb"], parts["compute_backward_mb"]
    for count, per_mb, pieces, one, window in profile:
        count = count * microbatches if per_mb else count
        occurrence = pieces * one
        total += count * occurrence
        calls += count * pieces
        if window == "none":
            hideable = hide = 0.0
        elif window == "forward":
            hideable, hide = occurrence, min(occurrence, fwd)
        elif window == "backward":
            hideable, hide = occurrence - one, min(occurrence - one, bwd)
        else:            # prefetch: each gather behind the unit before it (its share of a pass)
            hideable = occurrence - one
            hide = (pieces - 1) * min(one, (fwd + bwd) / 2 / max(1, pieces))
        if overlap is not None:
            hide = overlap * hideable
        hide *= 1 - exposed_share
        exposed += count * (occurrence - hide)
        hidden_sum += count * hide
    hidden = min(hidden_sum, parts["compute"])
    exposed += hidden_sum - hidden
    return {"dp_comm": total, "dp_exposed": exposed, "dp_hidden": hidden, "dp_calls": calls,
            "interference": hidden * slowdown}


def unvalidated(shape: ModelShape, hw: Hardware, layout: Layout, order: str,
                framework: Framework | str, dtype: str) -> list[str]:
    """The collectives of ``layout`` whose times no measurement covers (``network.coverage``):
    the TP group's, and each data-parallel group's as the engine issues it."""
    strides = layout.strides(order)
    ops = ("all_gather", "reduce_scatter") if layout.sp else ("all_reduce",)
    tokens = shape.seq_len // layout.cp                                # per rank under cp
    msg = layout.micro_batch * tokens * shape.hidden * ACTIVATION_BYTES[dtype]
    groups = [(op, layout.tp, strides["tp"], msg) for op in ops]
    groups.append(("all_reduce", layout.tp, strides["tp"],            # the loss's b s values
                   layout.micro_batch * tokens * 4))
    replica = layout.replica_stride(order, hw.gpus_per_node)
    groups += [(c.op, c.size, c.stride * replica, c.nbytes / c.calls)
               for c in dp_collectives(shape, layout, framework, dtype)]
    # per call, as collective_time is given them; each reason once, in order
    whys = (coverage(op, size, stride, hw, nbytes) for op, size, stride, nbytes in groups)
    return list(dict.fromkeys(why for why in whys if why))


def estimate(shape: ModelShape, hardware: Hardware | str, layout: Layout,
             order: str | None = None, overlap: float | None = None, flash: bool = False,
             dtype: str | None = None, reserve: float | None = None, check: bool = True,
             framework: Framework | str = DEFAULT_FRAMEWORK) -> Estimate:
    """Predict memory and step time of ``shape`` trained with ``layout`` on ``hardware``
    by ``framework`` (its rank order unless ``order`` is given)."""
    hw = load_hardware(hardware)
    fw = load_framework(framework)
    order = order or fw.order
    dtype = dtype or hw.dtype
    if check:
        check_layout(shape, layout, order=order, gpus_per_node=hw.gpus_per_node,
                     stage_rule=fw.stage_rule)
        check_framework(fw, layout, dp_per_node(layout, hw.gpus_per_node, order))
    times = time_parts(shape, hw, layout, order, dtype, flash, fw)
    times.update(dp_exposure(dp_profile(shape, hw, layout, order, dtype, fw), layout.microbatches,
                             times, overlap, hw.overlap_slowdown, hw.overlap_exposed))
    times["compute"] += times.pop("interference")
    times["step"] = sum(times[k] for k in STEP_PARTS)
    held = [f"{f['band_p10']:.2f}-{f['band_p90']:.2f}x on {f['priced']} runs of {f['holdout']}"
            for f in (hw.fitted or {}).get("holdout", []) if f.get("priced") and "band_p10" in f]
    notes = [f"hardware {hw.name} is fitted to measured runs; measured / predicted tokens/s on "
             f"runs kept out of its fit, 10th-90th percentile: {'; '.join(held) or 'none recorded'}"
             if hw.fitted else f"hardware {hw.name} is unfitted: efficiencies set by hand, not "
             f"fitted to measured runs (python -m minipar.plan fit RUNS.csv --hardware {hw.name})"]
    slower = hw.oversubscription(layout.gpus)
    if slower > 1:
        notes.append(f"{min(layout.gpus, hw.gpus_per_node)} processes share {hw.cores} cores: "
                     f"compute predicted {slower:.2g}x slower per process (time-sliced)")
    flops = {"model": training_flops(shape, layout.global_batch, "none"),
             "hardware": training_flops(shape, layout.global_batch, layout.recompute)}
    return Estimate(
        model=shape.name, hardware=hw.name, layout=layout, framework=fw.name, notes=notes,
        memory=device_memory(shape, layout, flash, dtype, fw, hw.layer_buffer_bytes),
        capacity=capacity(hw, fw, reserve), times=times,
        **rates(shape, hw, layout, times["step"], flops),
        unvalidated=unvalidated(shape, hw, layout, order, fw, dtype),
        stages=tuple(st.layers for st in stage_list(shape, layout, fw)),
        cp_bytes=cp_comm_bytes(layout.micro_batch, shape.seq_len, shape.kv_hidden, layout.cp,
                               max(st.layers for st in stage_list(shape, layout, fw)),
                               layout.microbatches, layout.tp, ACTIVATION_BYTES[dtype],
                               layout.recompute))


# --------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------
def scaled_layout(layout: Layout, dp: int, weak: bool = True) -> Layout | None:
    """``layout`` with ``dp`` replicas: weak scaling keeps each replica's work (the global
    batch grows), strong scaling keeps the global batch (fewer micro-batches per replica). A
    shard factor equal to the old replica count (dp x cp, what ZeRO shards over) follows the
    new one (ZeRO-1 over d stays ZeRO-1 over d'); the others become their gcd with it. From
    a single replica (dp x cp = 1) every factor is 1 and says nothing about the stage, so the
    spec stays (1, 1, 1), plain data parallelism (scaling ZeRO from one replica needs the
    spec given at the target width). None when the batch does not divide."""
    from math import gcd
    m = layout.microbatches
    if not weak:                       # the global batch over dp replicas of micro-batches
        m, rest = divmod(layout.global_batch, dp * layout.micro_batch)
        if rest or m < 1:
            return None
    if layout.v > 1 and m % layout.pp:
        return None
    replicas = dp * layout.cp                  # ZeRO shards over dp x cp
    shard = (1, 1, 1) if layout.replicas == 1 else tuple(
        replicas if s == layout.replicas else gcd(s, replicas) for s in layout.shard)
    return replace(layout, dp=dp, microbatches=m, shard=shard)


def scaling(shape: ModelShape, hardware: Hardware | str, layout: Layout, gpus: list[int],
            weak: bool = True, **kwargs) -> list[dict]:
    """Predicted weak or strong scaling of ``layout`` over device counts ``gpus``.

    Efficiency is tokens/s per device relative to the smallest count that fits (for strong
    scaling that is T(N0) N0 / (T(N) N); for weak scaling the per-device throughput ratio)."""
    hw = load_hardware(hardware)
    rows = []
    for n in sorted(gpus):
        dp, rest = divmod(n, layout.tp * layout.pp * layout.cp)
        new = scaled_layout(layout, dp, weak) if dp and not rest else None
        if new is None:
            continue
        e = estimate(shape, hw, new, check=False, **kwargs)
        rows.append({"gpus": n, "estimate": e, "fits": e.fits, "per_gpu": e.tokens_per_s / n})
    base = next((r for r in rows if r["fits"]), None)
    for r in rows:
        r["efficiency"] = r["per_gpu"] / base["per_gpu"] if base else float("nan")
    return rows
