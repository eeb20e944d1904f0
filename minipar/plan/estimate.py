"""Step time of one layout: compute, communication, bubble; tokens/s and MFU.

    step = compute + TP comm + bubble + PP comm + exposed DP comm

* compute = hardware FLOPs of the heaviest pipeline stage per device / (peak x
  compute_efficiency); hardware FLOPs count the recomputation (``shapes.stage_flops``).
  The heaviest stage is the last: it also computes the logits, and a pipeline runs at its
  slowest stage's pace (with pp = 1 this is simply the step's FLOPs over the devices).
  ``compute_efficiency`` is where everything that is not a large matmul goes (attention's
  small batched matmuls, element-wise kernels, the optimizer, the framework): in a preset
  it is an assumption, ``calibrate`` measures it from a real training step. It is one
  factor for every layout: replicated work (a TP rank's LayerNorms and residuals, every
  rank's per-kernel overhead) is divided by the devices like the matmuls, so a layout that
  splits a small model finely is predicted somewhat fast.
* TP comm: the per-layer collectives of ``network``, blocking (Megatron-LM and minipar run
  them on the critical path), each paying its ring steps' latency, plus those of the
  embedding, head and loss on the stage that holds them (both ends when pp = 1, the head's
  when pp > 1: the last stage also computes the loss).
* bubble: a pipeline of p stages idles (p-1)/m of the time it computes m micro-batches,
  and interleaving v chunks per stage divides that by v (Narayanan et al. 2021, section
  2.2): (p-1)/(m v) x (compute + TP comm).
* PP comm: each micro-batch's send and receive, on the critical path.
* DP comm: the ZeRO/AMSP collectives; a fraction ``overlap`` of them hides behind compute
  (never more than the compute time). 0 is a blocking implementation, 1 perfect overlap;
  the default 0.5 is our assumption (``measure.minipar_overlap`` says what minipar's own
  engine allows).

MFU = model FLOPs (no recomputation) / (step x devices x peak)   (Chowdhery et al. 2022)
HFU = hardware FLOPs (with recomputation) / (step x devices x peak). Under full
recomputation the hardware FLOPs of a GPT are exactly Megatron's 96 B s l h^2 (...) formula,
which is what Megatron-DeepSpeed reports as TFLOP/s, so HFU is the figure to hold against
the Frontier study's percent of peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import Hardware, load_hardware
from .layout import Layout, check_layout
from .memory import ACTIVATION_BYTES, DEFAULT_RESERVE, device_memory, stage_params
from .network import collective_time, p2p_time, placement, zero_collectives
from .shapes import ModelShape, stage_flops, training_flops

DEFAULT_OVERLAP = 0.5


@dataclass
class Estimate:
    model: str
    hardware: str
    layout: Layout
    memory: dict            # bytes per device: params, grads, optimizer, activations,
                            # temporary, total
    capacity: float         # usable bytes per device
    times: dict             # seconds per step: compute, tp_comm, bubble, pp_comm,
                            # dp_comm, dp_exposed, step
    flops: dict             # per step, whole job: model, hardware
    tokens_per_s: float
    mfu: float
    hfu: float
    notes: list = field(default_factory=list)

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
                 "pp_comm": t["pp_comm"], "dp_comm": t["dp_exposed"]}
        return {k: v / t["step"] for k, v in parts.items()}

    def to_json(self) -> dict:
        lay = self.layout
        s_p, s_g, s_os = lay.shard
        return {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch": lay.micro_batch,
            "microbatches": lay.microbatches, "shard": {"p": s_p, "g": s_g, "os": s_os},
            "recompute": lay.recompute != "none", "memory_bytes": int(self.memory["total"]),
            "step_time_s": self.step_time, "mfu": self.mfu,
            # extras
            "v": lay.v, "sp": lay.sp, "schedule": "interleaved" if lay.v > 1 else lay.schedule,
            "recompute_mode": lay.recompute, "hfu": self.hfu, "tokens_per_s": self.tokens_per_s,
            "fits": self.fits, "capacity_bytes": int(self.capacity),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "times": dict(self.times), "shares": self.shares(),
            "model": self.model, "hardware": self.hardware,
        }


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of an ideal pipeline: (p-1)/(v m + p - 1) of p stages x the step time, for
    p stages, m micro-batches and v model chunks per stage (GPipe and 1F1B: v = 1)."""
    return (p - 1) / (v * m + p - 1)


def time_parts(shape: ModelShape, hw: Hardware, layout: Layout, order: str = "tp,pp,dp",
               dtype: str = "mixed") -> dict:
    """Seconds per step of everything but data-parallel traffic: compute, tp_comm, bubble,
    pp_comm."""
    t, p, v = layout.tp, layout.pp, layout.v
    b, m, s, h = layout.micro_batch, layout.microbatches, shape.seq_len, shape.hidden
    strides = layout.strides(order)
    flops = stage_flops(shape, layout.global_batch, p, layout.recompute)   # heaviest stage
    compute = flops / (layout.dp * t) / hw.achievable_flops

    activation_msg = b * s * h * ACTIVATION_BYTES[dtype]
    tp_calls = m * ((shape.layers // p) * (6 if layout.recompute == "full" else 4)
                    + (2 if p == 1 else 1))             # + the embedding's g, the head's f
    tp_comm = (tp_calls * collective_time("all_reduce", activation_msg, t, strides["tp"], hw)
               + 3 * m * collective_time("all_reduce", b * s * 4, t, strides["tp"], hw))  # loss

    idle = bubble_fraction(p, m, v)                    # of the step: (p-1)/(m v) of the work
    bubble = idle / (1 - idle) * (compute + tp_comm)

    pp_comm = 0.0
    if p > 1:
        _, nodes = placement(p, strides["pp"], hw.gpus_per_node)
        pp_comm = 2 * m * v * p2p_time(activation_msg / t, nodes > 1, hw)
    return {"compute": compute, "tp_comm": tp_comm, "bubble": bubble, "pp_comm": pp_comm}


def dp_comm_time(shape: ModelShape, hw: Hardware, layout: Layout, order: str = "tp,pp,dp",
                 dtype: str = "mixed") -> float:
    """Seconds per step of the data-parallel (ZeRO/AMSP) collectives, before overlap."""
    stride = layout.strides(order)["dp"]
    collectives = zero_collectives(stage_params(shape, layout.tp, layout.pp), layout.dp,
                                   layout.shard, dtype, layout.microbatches,
                                   recompute=layout.recompute == "full")
    return sum(c.count * collective_time(c.op, c.nbytes, c.size, c.stride * stride, hw)
               for c in collectives)


def exposed(dp_comm: float, compute: float, overlap: float) -> float:
    """What of the data-parallel traffic is not hidden behind compute."""
    return dp_comm - min(overlap * dp_comm, compute)


def estimate(shape: ModelShape, hardware: Hardware | str, layout: Layout,
             order: str = "tp,pp,dp", overlap: float = DEFAULT_OVERLAP, flash: bool = False,
             dtype: str | None = None, reserve: float = DEFAULT_RESERVE,
             check: bool = True) -> Estimate:
    """Predict memory and step time of ``shape`` trained with ``layout`` on ``hardware``."""
    hw = load_hardware(hardware)
    dtype = dtype or hw.dtype
    if check:
        check_layout(shape, layout, order=order, gpus_per_node=hw.gpus_per_node)
    times = time_parts(shape, hw, layout, order, dtype)
    times["dp_comm"] = dp_comm_time(shape, hw, layout, order, dtype)
    times["dp_exposed"] = exposed(times["dp_comm"], times["compute"], overlap)
    times["step"] = sum(times[k] for k in ("compute", "tp_comm", "bubble", "pp_comm",
                                           "dp_exposed"))
    flops_model = training_flops(shape, layout.global_batch, "none")
    flops_hw = training_flops(shape, layout.global_batch, layout.recompute)
    peak = times["step"] * layout.gpus * hw.peak_flops
    return Estimate(
        model=shape.name, hardware=hw.name, layout=layout,
        memory=device_memory(shape, layout, flash, dtype),
        capacity=hw.memory_bytes * (1 - reserve), times=times,
        flops={"model": flops_model, "hardware": flops_hw},
        tokens_per_s=layout.global_batch * shape.seq_len / times["step"],
        mfu=flops_model / peak, hfu=flops_hw / peak)


# --------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------
def scaled_layout(layout: Layout, dp: int, weak: bool = True) -> Layout | None:
    """``layout`` with ``dp`` replicas: weak scaling keeps each replica's work (the global
    batch grows), strong scaling keeps the global batch (fewer micro-batches per replica).
    A shard factor equal to the old dp follows the new one (ZeRO-1 over d stays ZeRO-1 over
    d'); the others become their gcd with it. None when the batch does not divide."""
    from dataclasses import replace
    from math import gcd
    m = layout.microbatches
    if not weak:
        per_replica, rest = divmod(layout.global_batch, dp * layout.micro_batch)
        if rest or per_replica < 1:
            return None
        m = per_replica
    if layout.v > 1 and m % layout.pp:
        return None
    shard = tuple(dp if s == layout.dp else gcd(s, dp) for s in layout.shard)
    return replace(layout, dp=dp, microbatches=m, shard=shard)


def scaling(shape: ModelShape, hardware: Hardware | str, layout: Layout, gpus: list[int],
            weak: bool = True, **kwargs) -> list[dict]:
    """Predicted weak or strong scaling of ``layout`` over device counts ``gpus``.

    Efficiency is tokens/s per device relative to the smallest count that fits (for strong
    scaling that is T(N0) N0 / (T(N) N); for weak scaling the per-device throughput ratio).
    """
    hw = load_hardware(hardware)
    rows = []
    for n in sorted(gpus):
        dp, rest = divmod(n, layout.tp * layout.pp)
        new = scaled_layout(layout, dp, weak) if dp and not rest else None
        if new is None:
            continue
        e = estimate(shape, hw, new, check=False, **kwargs)
        rows.append({"gpus": n, "estimate": e, "fits": e.fits,
                     "per_gpu": e.tokens_per_s / n})
    base = next((r for r in rows if r["fits"]), None)
    for r in rows:
        r["efficiency"] = r["per_gpu"] / base["per_gpu"] if base else float("nan")
    return rows
