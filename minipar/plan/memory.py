"""What fills a device: model states, activations and temporary buffers.

Model states (Rajbhandari et al. 2020, ZeRO, section 3; AMSP's generalisation)
------------------------------------------------------------------------------
Adam with mixed precision keeps per parameter 2 bytes of 16-bit weight, 2 bytes of 16-bit
gradient and 12 bytes of optimizer state (fp32 master weight, momentum, variance); in fp32,
4 + 4 + 8. With (s_p, s_g, s_os) shard groups, for the Phi parameters of one TP x PP shard
(about the whole model's parameters divided by tp * pp; exactly, below):

    mixed:  2 Phi / s_p + 2 Phi / s_g + 12 Phi / s_os
    fp32:   4 Phi / s_p + 4 Phi / s_g +  8 Phi / s_os

so plain DP holds 16 Phi, ZeRO-1 4 Phi + 12 Phi/d, ZeRO-2 2 Phi + 14 Phi/d, ZeRO-3 16 Phi/d.

Any spec with s_p | s_g | s_os | d is accounted (``1,2,4`` included: ``sharding`` says why
the search enumerates fewer). Shards are rounded up (a flat buffer padded to a multiple of
the group size), so the numbers are the storage a rank allocates. PyTorch's Adam also keeps
a 4-byte step counter per tensor it updates: ``step_counters`` adds them, for byte-exact
comparison with a measured run (``minipar.zero`` gives its optimizer one flat tensor per
unit, plain DP one per parameter tensor; in mixed precision these are the fp32 master
tensors, so the counts are the same); at scale they are noise. Given ``n_params`` as the
padded per-unit count Phi' that ``minipar.zero`` allocates (each unit rounded up to a
multiple of s_os), the result is the engine's measured bytes exactly, in fp32 and in mixed
precision (``--dtype bf16``; tests/test_precision.py).

Phi per device under tensor and pipeline parallelism is not quite Phi_model / (t p): as in
Megatron-LM, every TP rank keeps a full copy of the LayerNorms (RMSNorms), the row-parallel
biases (attention and MLP output projections) and the position table, and the
vocab-parallel embedding and head split a vocabulary padded to a multiple of t. One layer on
one of t ranks holds

    GPT:    (4h^2 + 2hF + b (3h + F)) / t  +  2 n  +  2 b h
    LLaMA:  (4h^2 + 3hF) / t               +  2 h

(n = 2h for GPT with biases, else h; b = 1 with biases: the column-parallel QKV and fc
biases are split, the two row biases replicated), the embedding ceil(V/t) h + s h (GPT's
positions, replicated) and the head n + ceil(V/t) h (untied; a tied head on the last of
pp > 1 stages keeps a copy of the embedding's table, as Megatron-LM does). ``stage_params``
adds them up for the heaviest stage, exactly what ``minipar.tp`` allocates;
``model_state_bytes`` uses it when given a shape, and falls back to Phi_model / (t p) when it
knows only a total count.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4)
------------------------------------------------------------------------------------
Bytes one layer keeps for the backward pass, per micro-batch of b sequences, 16-bit
activations and 1-byte dropout masks:

    no parallelism            s b h (34 + 5 a s / h)
    tensor parallel t         s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence par.    s b h (34 + 5 a s / h) / t
    selective recomputation   drop the 5 a s / h term (attention scores are recomputed)
    flash attention           drop it too (the scores are never stored)
    full recomputation        2 s b h per layer (its input), / t with sequence parallelism

The 34 is 10 s b h that TP alone cannot split (LayerNorm inputs, the inputs of the first
matmuls, dropout masks) plus 24 that it can (Q, K, V, the attention output, the MLP's two
4h-wide activations). We generalise the MLP part to any width F (GELU: 4F/h in place of 16)
and to LLaMA's SwiGLU without dropout (8 replicated, 8 + 8F/h split, 2 a s / h for the
scores); the GPT case is exactly the paper's. fp32 activations double every term.

The pipeline's first stage keeps the most (the paper's pipeline-parallel case): with layers/pp
layers per stage it holds m micro-batches (GPipe), min(m, p) (1F1B), or, interleaved with v
chunks, up to p(v+1) - 1 chunk-micro-batches of layers/(p v) layers each, which is
L (1 + (p-1)/(p v)) layers' worth.

Temporary buffers and what the engine allocates (our assumptions, said here once)
---------------------------------------------------------------------------------
* the logits of one micro-batch on the last stage: 16-bit logits plus an fp32 copy for the
  softmax and the loss, b s V / t x (2 + 4) bytes (x (4 + 4) in fp32);
* with full recomputation, one layer's complete activations while it is being recomputed;
* with sharded parameters (s_p > 1), two gathered layers (the one computing and the next,
  prefetched) and one layer's full gradient before its reduce-scatter;
* under context parallelism, the ring's blocks in flight (``minipar.cp``): the layer's K/V
  stacked into one message, the next block arriving, and in backward the travelling K/V
  gradient and its arriving copy: 4 B, B = 2 b (s/cp) (h/t) e (``kv_block_bytes``);
* gradient buckets in flight: two of the framework's buckets (Megatron-LM's 40M
  parameters, DeepSpeed's 5e8 elements; minipar and FSDP reduce one unit at a time, and
  PyTorch DDP's default 25 MiB stands in for them), or of the whole gradient, if smaller;
* the gradient buffer in the framework's precision (``frameworks``: Megatron-LM and
  DeepSpeed's BF16 optimizer accumulate into fp32, 4 bytes per parameter of the G shard,
  in place of the 2 of the 16-bit gradient).
We add the stash of the first stage and the logits of the last as if one device held both,
which is exact for pp = 1 and a little pessimistic otherwise. What the device can give to
all of this is ``Hardware.usable_bytes``: its memory less the runtime's share (context,
communication buffers, library workspaces: ``runtime_bytes``), less what the allocator holds
beyond live tensors, (reserved - allocated) / reserved: the framework profile's measured
``memory_reserve``, else the hardware's ``fragmentation`` (each cites its measurement;
``reserve`` overrides both). Layouts that public runs executed must fit
(``published.EXECUTED``, tests/test_plan_grounded.py).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .errors import PlanError
from .layout import Layout, cp_violation
from .shapes import ModelShape
from .sharding import Shard, resolve_shard

BYTES_PER_PARAM = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}   # weight, gradient, optimizer
ACTIVATION_BYTES = {"mixed": 2, "fp32": 4}
BUCKET_BYTES = 25 * 2**20
DEFAULT_RESERVE = None        # the hardware's fragmentation margin


def _check_dtype(dtype: str) -> None:
    if dtype not in BYTES_PER_PARAM:
        from .errors import PlanError
        raise PlanError(f"unknown dtype {dtype!r}; use mixed (bf16 + fp32 Adam) or fp32")


STEP_COUNTER_BYTES = 4       # torch.optim.Adam(W): one fp32 scalar "step" tensor per tensor


def padded_params(units: int | Sequence[int], multiple: int) -> int:
    """Phi': each unit's flat buffer padded up to a multiple of ``multiple``, summed.

    ``minipar.zero`` keeps every unit (the embedding, each block, the head) in one flat buffer
    padded to a multiple of s_os, so each shard is whole. An int is one buffer.
    """
    units = units if isinstance(units, (list, tuple)) else [units]
    return sum(math.ceil(n / multiple) * multiple for n in units)


def model_state_bytes(n_params: int | Sequence[int] | ModelShape, dp: int = 1,
                      shard: Shard | str | None = None, zero: int | None = None, tp: int = 1,
                      pp: int = 1, dtype: str = "mixed", step_counters: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states one device holds.

    ``n_params`` is a ``ModelShape`` or the whole model's parameter count. A shape is split
    exactly (``stage_params``: the heaviest pipeline stage, with the copies every TP rank
    keeps and the padded vocabulary); a bare count, with no shape to say what is
    replicated, is split evenly, ceil(Phi / (tp pp)). A list is the parameter counts of the
    units one rank's ``minipar.zero`` engine shards (already this rank's TP/PP part; tp and
    pp are ignored), each padded to a multiple of s_os as the engine pads it: the storage
    that engine allocates, byte for byte. ``shard`` (s_p, s_g, s_os) or
    ``zero`` (0-3) says how the dp ranks shard each part: any spec with
    1 <= s_p <= s_g <= s_os <= dp, each dividing the next and dp (not only AMSP's search
    space). ``step_counters``: how many tensors this rank's optimizer updates, each with
    Adam's 4-byte step counter (default 0: the papers' count).
    """
    _check_dtype(dtype)
    s_p, s_g, s_os = resolve_shard(dp, shard, zero)
    if isinstance(n_params, ModelShape):
        phi = stage_params(n_params, tp, pp)
    elif isinstance(n_params, (list, tuple)):
        phi = padded_params(n_params, s_os)
    else:
        phi = math.ceil(n_params / (tp * pp))
    w, g, o = BYTES_PER_PARAM[dtype]
    out = {"params": w * math.ceil(phi / s_p), "grads": g * math.ceil(phi / s_g),
           "optimizer": o * math.ceil(phi / s_os) + STEP_COUNTER_BYTES * step_counters}
    out["total"] = sum(out.values())
    return out


def tp_rank_params(shape: ModelShape, tp: int = 1) -> dict[str, int]:
    """Parameters one of ``tp`` tensor-parallel ranks holds, as ``minipar.tp`` and
    Megatron-LM split them: {"layer", "embedding", "head", "tied_copy"} (module docstring).

    Split by t: the QKV and fc/gate/up matrices by output features (with their biases), the
    output projections by input features, the token table and the untied head by rows of a
    vocabulary padded to a multiple of t. Whole on every rank: the norms, the row-parallel
    biases and the position table. Assumes t divides h and F, as the trainer checks.
    """
    h, f, t = shape.hidden, shape.ffn, tp
    vocab_rows = math.ceil(shape.vocab / t)                    # V padded to a multiple of t
    if shape.arch == "llama":
        norm = h                                               # RMSNorm: a weight only
        split = 4 * h * h + 3 * h * f                          # wq, wk, wv, wo, w1, w2, w3
        replicated = 2 * norm
        positions = 0                                          # rotary: no table
    else:
        b = 1 if shape.bias else 0
        norm = 2 * h if shape.bias else h                      # LayerNorm weight (+ bias)
        split = 4 * h * h + 2 * h * f + b * (3 * h + f)        # + the column biases
        replicated = 2 * norm + b * 2 * h                      # + the two row biases
        positions = shape.seq_len * h
    return {"layer": math.ceil(split / t) + replicated,
            "embedding": vocab_rows * h + positions,
            "head": norm + (0 if shape.tied_head else vocab_rows * h),
            "tied_copy": vocab_rows * h if shape.tied_head else 0}


def stage_params(shape: ModelShape, tp: int = 1, pp: int = 1) -> int:
    """Parameters one device holds before data-parallel sharding: one TP rank's share of the
    heaviest pipeline stage (first: embeddings; last: final norm, head, and with a tied head
    and pp > 1 a copy of the embedding, as Megatron-LM keeps), counted exactly
    (``tp_rank_params``)."""
    per_rank = tp_rank_params(shape, tp)
    layers = shape.layers // pp * per_rank["layer"]
    if pp == 1:
        return layers + per_rank["embedding"] + per_rank["head"]
    return layers + max(per_rank["embedding"], per_rank["head"] + per_rank["tied_copy"])


def activation_coefficients(shape: ModelShape) -> tuple[float, float, float]:
    """(replicated, tp-split, scores) so one layer keeps s b h (rep + split + scores a s / h)."""
    ratio = shape.ffn / shape.hidden
    if shape.arch == "llama":
        return 8.0, 8.0 + 8.0 * ratio, 2.0
    return 10.0, 8.0 + 4.0 * ratio, 5.0


def layer_activation_bytes(shape: ModelShape, micro_batch: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", flash: bool = False,
                           dtype: str = "mixed") -> float:
    """Bytes one layer keeps for backward, for one micro-batch (Korthikanti et al. 2022)."""
    _check_dtype(dtype)
    s, b, h, a = shape.seq_len, micro_batch, shape.hidden, shape.heads
    scale = ACTIVATION_BYTES[dtype] / 2          # the paper counts 16-bit activations
    sbh = s * b * h * scale
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    replicated, split, scores = activation_coefficients(shape)
    if recompute == "selective" or flash:
        scores = 0.0
    if sp:
        return sbh * (replicated + split + scores * a * s / h) / tp
    return sbh * (replicated + split / tp + scores * a * s / (h * tp))


def stash_layers(layers_per_stage: int, pp: int, microbatches: int, v: int = 1,
                 schedule: str = "1f1b") -> float:
    """Layer-micro-batches of activations the first pipeline stage holds at its peak."""
    if schedule == "gpipe":
        return layers_per_stage * microbatches
    if v == 1:
        return layers_per_stage * min(microbatches, pp)
    chunks_in_flight = min(microbatches * v, pp * (v + 1) - 1)
    return layers_per_stage / v * chunks_in_flight


def check_cp(seq_len: int, cp: int, tp: int = 1, sp: bool = False) -> None:
    """PlanError unless the sequence cuts into 2 cp equal chunks (the causal balance), and
    with sequence parallelism each rank's s/cp tokens over tp (``layout.cp_violation``)."""
    why = cp_violation(seq_len, cp, tp, sp)
    if why:
        raise PlanError(why)


def kv_block_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, tp: int = 1,
                   bytes_per_elem: int = 4) -> int:
    """B = 2 b (s/cp) (h/tp) e: one rank's K and V for one layer, the ring's message
    (``plan.cp``)."""
    return 2 * micro_batch * (seq_len // cp) * (hidden // tp) * bytes_per_elem


def cp_layer_activation_bytes(shape: ModelShape, micro_batch: int, cp: int = 1, tp: int = 1,
                              sp: bool = False, recompute: str = "none", flash: bool = False,
                              dtype: str = "mixed") -> float:
    """One layer's activations on one rank of a cp ring: the layer at s/cp tokens, the
    scores never stored at cp > 1 (ring attention computes them block by block)."""
    check_cp(shape.seq_len, cp)
    local = dataclasses.replace(shape, seq_len=shape.seq_len // cp)
    return layer_activation_bytes(local, micro_batch, tp=tp, sp=sp, recompute=recompute,
                                  flash=flash or cp > 1, dtype=dtype)


def activation_bytes(shape: ModelShape, layout: Layout, flash: bool = False,
                     dtype: str = "mixed") -> float:
    if layout.cp > 1:      # a layer of s/cp tokens, scores never stored (ring attention)
        per_layer = cp_layer_activation_bytes(shape, layout.micro_batch, layout.cp, layout.tp,
                                              layout.sp, layout.recompute, flash, dtype)
    else:
        per_layer = layer_activation_bytes(shape, layout.micro_batch, layout.tp, layout.sp,
                                           layout.recompute, flash, dtype)
    held = stash_layers(shape.layers // layout.pp, layout.pp, layout.microbatches,
                        layout.v, layout.schedule)
    return per_layer * held


def temporary_bytes(shape: ModelShape, layout: Layout, flash: bool = False,
                    dtype: str = "mixed", framework=None) -> float:
    """The transient buffers listed in the module docstring."""
    t, b, s = layout.tp, layout.micro_batch, shape.seq_len // layout.cp
    act = ACTIVATION_BYTES[dtype]
    total = b * s * shape.vocab / t * (act + 4)                   # logits + fp32 softmax
    if layout.recompute == "full":
        local = dataclasses.replace(shape, seq_len=s) if layout.cp > 1 else shape
        total += layer_activation_bytes(local, b, t, layout.sp, "none", flash or layout.cp > 1,
                                        dtype)
    if layout.cp > 1:
        total += 4 * kv_block_bytes(b, shape.seq_len, shape.hidden, layout.cp, t, act)
    total += gather_bytes(shape, t, layout.shard, dtype)
    if layout.replicas > 1:        # gradients reduce over dp x cp
        g = (framework.grad_bytes if framework and framework.grad_bytes
             else BYTES_PER_PARAM[dtype][1])
        gradient = stage_params(shape, t, layout.pp) * g
        bucket = framework.bucket_params(layout.replicas) if framework else None
        total += 2 * min(bucket * g if bucket else BUCKET_BYTES, gradient)
    return total


def gather_bytes(shape: ModelShape, tp: int, shard, dtype: str = "mixed") -> float:
    """With sharded parameters: two gathered layers and one layer's full gradient."""
    if shard[0] == 1:
        return 0.0
    return 3 * tp_rank_params(shape, tp)["layer"] * ACTIVATION_BYTES[dtype]


def grad_buffer_bytes(shape: ModelShape, layout: Layout, dtype: str, framework=None) -> float:
    """The gradient buffer in the framework's precision (4 bytes per parameter of the G
    shard for fp32 buffers)."""
    g = (framework.grad_bytes if framework and framework.grad_bytes
         else BYTES_PER_PARAM[dtype][1])
    return g * math.ceil(stage_params(shape, layout.tp, layout.pp) / layout.shard[1])


def device_memory(shape: ModelShape, layout: Layout, flash: bool = False,
                  dtype: str = "mixed", framework=None) -> dict[str, float]:
    """Everything one device holds at its peak: params, grads, optimizer, activations,
    temporary, total (bytes). ``framework`` (a ``frameworks.Framework``) sets the gradient
    buffer's precision and the bucket size."""
    states = model_state_bytes(shape, layout.replicas, shard=layout.shard, tp=layout.tp,
                               pp=layout.pp, dtype=dtype)
    out = {k: float(states[k]) for k in ("params", "grads", "optimizer")}
    if framework is not None and framework.grad_bytes:
        out["grads"] = float(grad_buffer_bytes(shape, layout, dtype, framework))
    out["activations"] = activation_bytes(shape, layout, flash, dtype)
    out["temporary"] = temporary_bytes(shape, layout, flash, dtype, framework)
    out["total"] = sum(out.values())
    return out
