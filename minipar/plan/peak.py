"""What one device holds at its peak, stage by stage: model states, stashed activations,
transient buffers (``memory`` has the formulas they are built from).

Each pipeline stage is its own device (``stages``: the stages the framework builds, with
their own layers, embedding and head), so the peak is the largest of the stages' peaks, and
``device_memory`` says which stage it is. Per stage r of p:

* model states of its own parameters (``memory.stage_params`` of the stage), sharded over
  the dp x cp replicas; the gradient buffer in the framework's precision (Megatron-LM and
  DeepSpeed's BF16 optimizer accumulate into fp32: 4 bytes per parameter of the G shard);
* stashed activations (Korthikanti et al. 2022, section 4.2.3, the pipeline-parallel case):
  its layers x the micro-batches in flight, m under GPipe, min(m, p - r) under 1F1B, and
  interleaved with v chunks min(m v, 2 (p - r - 1) + (v - 1) p + 1) chunk-micro-batches of
  l/(p v) layers (Megatron-LM's warm-up count plus the one in flight; p (v + 1) - 1 on the
  first stage);
* transient buffers, our accounting (each cites the code it follows):
  - on the stage with the head, the loss over one micro-batch's logits: b s V/t logits of
    the framework's ``logit_bytes`` each at the loss's peak (Megatron-LM casts the 16-bit
    logits to fp32 once and works in place: 2 + 4; nanotron subtracts the max out of place:
    4 + 4; ``torch.nn.functional.cross_entropy`` on a ``.float()`` copy keeps the 16-bit
    logits, the fp32 copy and the fp32 log-softmax it saves: 2 + 4 + 4), 8 in fp32. On one
    H100 (torch 2.11, CUDA 13.0), 4,096 tokens x 128,256 logits, the three peak at 6.0, 8.0
    and 10.0 bytes per logit forward; the backward adds the logits' 16-bit gradient only
    while the 16-bit logits are still referenced (torch's then peaks at 12);
  - the backward's working set: the gradients a layer's backward holds at once, the MLP's
    two F-wide ones and the layer input's, (4 F/h + 2) s b h / t bytes (x2 in fp32), and
    with full recomputation the complete activations of the layer being recomputed;
  - with sharded parameters (s_p > 1), two gathered layers (the one computing and the next,
    prefetched) and one layer's full gradient before its reduce-scatter;
  - under context parallelism, the ring's blocks in flight (``minipar.cp``): the layer's K/V
    stacked into one message, the next block arriving, and in backward the travelling K/V
    gradient and its arriving copy: 4 B, B = 2 b (s/cp) (h_kv/t) e (``kv_block_bytes``);
  - gradient buckets in flight: two of the framework's buckets (Megatron-LM's 40M
    parameters, DeepSpeed's 5e8 elements; minipar and FSDP reduce one unit at a time, and
    PyTorch DDP's default 25 MiB stands in for them), or of the whole gradient, if smaller.
  - buffers each layer keeps beyond all this (the runtime's per-layer workspaces and
    bookkeeping): a fitted profile's ``layer_buffer_bytes`` per layer of the stage, 0 unless
    ``plan fit`` measured it.

What the device can give to all of this (``capacity``) is ``Hardware.usable_bytes``: its
memory less the runtime's share (``runtime_bytes``: context, the collective library's
buffers, BLAS workspaces), less what the allocator holds beyond live tensors, (reserved -
allocated) / reserved: a fitted profile's ``fragmentation``, else the framework's measured
``memory_reserve``, else the hardware's hand-set ``fragmentation``; less the margin a
fitted ``memory_sigma`` asks for. Layouts that public runs executed must fit
(``published.executed_runs()``), and published peaks are held against ``device_memory``
(``anchors``).
"""
from __future__ import annotations

import math

from .layout import Layout
from .memory import (ACTIVATION_BYTES, BYTES_PER_PARAM, GLU_SAVED, _check_dtype, kv_block_bytes,
                     cp_layer_activation_bytes, model_state_bytes, stage_params, tp_rank_params)
from .shapes import ModelShape
from .stages import Stage, distinct, stages

BUCKET_BYTES = 25 * 2**20          # PyTorch DDP's default bucket_cap_mb
FP32_LOGIT_BYTES = 8               # fp32 training: the logits and their fp32 softmax
DEFAULT_LOGIT_BYTES = 10           # F.cross_entropy on a .float() copy (module docstring)
CONFIDENCE_Z = 1.645      # one-sided 95%: a layout fits when its peak fits at this confidence


def stage_list(shape: ModelShape, layout: Layout, framework=None) -> tuple[Stage, ...]:
    """The stages ``framework`` builds for ``layout`` (``stages``; even without one)."""
    rule = framework.stage_rule if framework is not None else "even"
    return stages(shape, layout.pp, rule, layout.v)


def in_flight(stage: Stage, pp: int, microbatches: int, v: int = 1,
              schedule: str = "1f1b") -> float:
    """Layer-micro-batches of activations stage ``stage`` holds at its peak (module docstring)."""
    r, m, p = stage.index, microbatches, pp
    if schedule == "gpipe":
        return stage.layers * m
    if v == 1:
        return stage.layers * min(m, p - r)
    return stage.layers / v * min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)   # chunks held


def stash_layers(layers_per_stage: int, pp: int, microbatches: int, v: int = 1,
                 schedule: str = "1f1b") -> float:
    """Layer-micro-batches of activations the first of ``pp`` equal stages holds."""
    return in_flight(Stage(0, layers_per_stage, True, pp == 1), pp, microbatches, v, schedule)


def layer_bytes(shape: ModelShape, layout: Layout, flash: bool = False, dtype: str = "mixed",
                recompute: str | None = None, framework=None) -> float:
    """Bytes one layer keeps for one micro-batch on one rank of this layout (under cp a layer
    of s/cp tokens, the scores never stored), its SwiGLU as ``framework`` builds it."""
    recompute = layout.recompute if recompute is None else recompute
    glu = framework.glu_saved if framework is not None else GLU_SAVED
    return cp_layer_activation_bytes(shape, layout.micro_batch, layout.cp, layout.tp, layout.sp,
                                     recompute, flash, dtype, glu)


def activation_bytes(shape: ModelShape, layout: Layout, flash: bool = False,
                     dtype: str = "mixed", stage: Stage | None = None, framework=None) -> float:
    """Stashed activations of ``stage`` (default: the first of equal stages)."""
    stage = stage or stages(shape, layout.pp)[0]
    held = in_flight(stage, layout.pp, layout.microbatches, layout.v, layout.schedule)
    return layer_bytes(shape, layout, flash, dtype, framework=framework) * held


def logit_bytes(dtype: str, framework=None) -> float:
    """Bytes per logit at the loss's peak (module docstring)."""
    if dtype == "fp32":
        return FP32_LOGIT_BYTES
    return framework.logit_bytes if framework is not None else DEFAULT_LOGIT_BYTES


def gather_bytes(shape: ModelShape, tp: int, shard, dtype: str = "mixed") -> float:
    """With sharded parameters: two gathered layers and one layer's full gradient."""
    return 3 * tp_rank_params(shape, tp)["layer"] * ACTIVATION_BYTES[dtype] if shard[0] > 1 else 0.0


def temporary_bytes(shape: ModelShape, layout: Layout, flash: bool = False,
                    dtype: str = "mixed", framework=None, stage: Stage | None = None,
                    layer_buffer: float = 0.0) -> float:
    """The transient buffers of ``stage`` listed in the module docstring (default: a stage
    holding the head, as a pipeline of one does)."""
    stage = stage or stages(shape, layout.pp)[-1]
    t, b, s = layout.tp, layout.micro_batch, shape.seq_len // layout.cp
    act = ACTIVATION_BYTES[dtype]
    total = stage.layers * layer_buffer
    if stage.head:
        total += b * s * math.ceil(shape.vocab / t) * logit_bytes(dtype, framework)
    if stage.layers:       # backward's working set (module docstring)
        total += (4 * shape.ffn / shape.hidden + 2) * b * s * shape.hidden * act / 2 / t
    if stage.layers and layout.recompute == "full":
        total += layer_bytes(shape, layout, flash, dtype, "none", framework)
    if layout.cp > 1:
        total += 4 * kv_block_bytes(b, shape.seq_len, shape.kv_hidden, layout.cp, t, act)
    total += gather_bytes(shape, t, layout.shard, dtype)
    if layout.replicas > 1:        # gradients reduce over dp x cp
        g = (framework.grad_bytes if framework else None) or BYTES_PER_PARAM[dtype][1]
        gradient = stage_params(shape, t, layout.pp, stage) * g
        bucket = framework.bucket_params(layout.replicas) if framework else None
        total += 2 * min(bucket * g if bucket else BUCKET_BYTES, gradient)
    return total


def state_bytes(shape: ModelShape, layout: Layout, dtype: str = "mixed", framework=None,
                stage: Stage | None = None) -> dict[str, float]:
    """Model states of ``stage`` on one device: {"params", "grads", "optimizer"}, the gradient
    buffer in the framework's precision (fp32 buffers: 4 bytes per parameter of the G shard)."""
    phi = stage_params(shape, layout.tp, layout.pp, stage)
    states = model_state_bytes(phi, layout.replicas, shard=layout.shard, dtype=dtype)
    out = {k: float(states[k]) for k in ("params", "grads", "optimizer")}
    if framework is not None and framework.grad_bytes:
        out["grads"] = float(framework.grad_bytes * math.ceil(phi / layout.shard[1]))
    return out


def stage_memory(shape: ModelShape, layout: Layout, stage: Stage, flash: bool = False,
                 dtype: str = "mixed", framework=None, layer_buffer: float = 0.0
                 ) -> dict[str, float]:
    """Everything one device of ``stage`` holds at its peak (module docstring)."""
    _check_dtype(dtype)
    out = state_bytes(shape, layout, dtype, framework, stage)
    out["activations"] = activation_bytes(shape, layout, flash, dtype, stage, framework)
    out["temporary"] = temporary_bytes(shape, layout, flash, dtype, framework, stage, layer_buffer)
    out["total"] = sum(out.values())
    return out


def device_memory(shape: ModelShape, layout: Layout, flash: bool = False, dtype: str = "mixed",
                  framework=None, layer_buffer: float = 0.0) -> dict[str, float]:
    """The largest stage's peak: params, grads, optimizer, activations, temporary, total
    (bytes), and "stage", the index of the stage that holds it."""
    peaks = [dict(stage_memory(shape, layout, st, flash, dtype, framework, layer_buffer),
                  stage=st.index) for st in distinct(stage_list(shape, layout, framework))]
    return max(peaks, key=lambda mem: mem["total"])       # the first of equal peaks


def capacity(hw, framework, reserve: float | None = None) -> float:
    """The bytes a model may fill on ``hw`` (module docstring): ``reserve`` if given, else a
    fitted profile's own reserve, else the framework's measured one; less the margin the
    profile's measured ``memory_sigma`` asks for (``Hardware``)."""
    if reserve is None and not hw.fitted:
        reserve = framework.memory_reserve
    return hw.usable_bytes(reserve) * math.exp(-CONFIDENCE_Z * hw.memory_sigma)
