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

(n = 2h for GPT with biases, else h; b = 1 with biases: the column-parallel QKV and fc biases
are split, the two row biases replicated), the embedding ceil(V/t) h + s h (GPT's positions,
replicated) and the head n + ceil(V/t) h (untied; a tied head on the last of pp > 1 stages keeps
a copy of the embedding's table, as Megatron-LM does). ``stage_params`` adds them up for the
heaviest stage, exactly what ``minipar.tp`` allocates; ``model_state_bytes`` uses it when given
a shape, and falls back to Phi_model / (t p) when it knows only a total count.

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
and to LLaMA's SwiGLU without dropout (8 replicated, 8 + 2 g F/h split, 2 a s / h for the
scores; g = ``glu_saved`` F-wide tensors: PyTorch's ops keep 4, gate, up, silu(gate) and
their product, Megatron-LM's fused SwiGLU 3, its input gate and up and the product), and a
GPT without dropout (MPT) drops the masks (8 replicated, 4 a s / h); the GPT case with
dropout is exactly the paper's. fp32 activations double every term.

What one device holds at its peak (the activations a pipeline stage keeps, the transient
buffers, the allocator's reserve) is ``peak``'s: stage by stage, as the framework builds them.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .errors import PlanError, raise_if
from .layout import cp_violation
from .shapes import ModelShape
from .sharding import Shard, resolve_shard

BYTES_PER_PARAM = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}   # weight, gradient, optimizer
ACTIVATION_BYTES = {"mixed": 2, "fp32": 4}
GLU_SAVED = 4                # F-wide tensors PyTorch's SwiGLU keeps (module docstring)
STEP_COUNTER_BYTES = 4       # torch.optim.Adam(W): one fp32 scalar "step" tensor per tensor


def _check_dtype(dtype: str) -> None:
    if dtype not in BYTES_PER_PARAM:
        raise PlanError(f"unknown dtype {dtype!r}; use mixed (bf16 + fp32 Adam) or fp32")


def padded_params(units: int | Sequence[int], multiple: int) -> int:
    """Phi': each unit's flat buffer padded up to a multiple of ``multiple``, summed.

    ``minipar.zero`` keeps every unit (the embedding, each block, the head) in one flat buffer
    padded to a multiple of s_os, so each shard is whole. An int is one buffer."""
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
    that engine allocates, byte for byte. ``shard`` (s_p, s_g, s_os) or ``zero`` (0-3) says
    how the dp ranks shard each part (any spec with s_p | s_g | s_os | dp: module docstring).
    ``step_counters``: how many tensors this rank's optimizer updates, each with Adam's
    4-byte step counter (default 0: the papers' count)."""
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
    Megatron-LM split them: {"layer", "embedding", "head", "tied_copy"} (module docstring:
    what every rank keeps whole, the padded vocabulary). The QKV and fc/gate/up matrices are
    split by output features (with their biases), the output projections by input features;
    t must divide h and F, as the trainer checks."""
    h, t = shape.hidden, tp
    vocab_rows = math.ceil(shape.vocab / t)                    # V padded to a multiple of t
    b = 1 if shape.arch == "gpt" and shape.bias else 0         # GPT's biases
    split = (shape.attention_params + shape.mlp_weights        # wq, wk, wv, wo; the MLP's
             + b * (h + 2 * shape.kv_hidden + shape.ffn))      # + the column biases
    replicated = 2 * shape.norm_params + b * 2 * h             # + the two row biases
    positions = 0 if shape.arch == "llama" else shape.seq_len * h     # rotary: no table
    return {"layer": math.ceil(split / t) + replicated, "embedding": vocab_rows * h + positions,
            "head": shape.norm_params + (0 if shape.tied_head else vocab_rows * h),
            "tied_copy": vocab_rows * h if shape.tied_head else 0}


def stage_params(shape: ModelShape, tp: int = 1, pp: int = 1, stage=None) -> int:
    """Parameters one device holds before data-parallel sharding: one TP rank's share of
    pipeline stage ``stage`` (a ``stages.Stage``; default the heavier of the first and the
    last of equal stages: module docstring), counted exactly (``tp_rank_params``)."""
    per_rank = tp_rank_params(shape, tp)
    if stage is not None:
        ends = (per_rank["embedding"] if stage.embedding else 0) + (
            per_rank["head"] + (per_rank["tied_copy"] if pp > 1 else 0) if stage.head else 0)
        return stage.layers * per_rank["layer"] + ends
    layers = shape.layers // pp * per_rank["layer"]
    return layers + (per_rank["embedding"] + per_rank["head"] if pp == 1 else    # both ends here
                     max(per_rank["embedding"], per_rank["head"] + per_rank["tied_copy"]))


def activation_coefficients(shape: ModelShape,
                            glu_saved: int = GLU_SAVED) -> tuple[float, float, float]:
    """(replicated, tp-split, scores) so one layer keeps s b h (rep + split + scores a s / h).
    The split attention part is Q, K, V and the attention's output (2 bytes each): 8, of which
    K and V shrink to h_kv / h under grouped-query attention; ``glu_saved``: module docstring."""
    ratio = shape.ffn / shape.hidden
    attention = 4.0 + 4.0 * shape.kv_hidden / shape.hidden
    if shape.arch == "llama":
        return 8.0, attention + 2.0 * glu_saved * ratio, 2.0
    if not shape.has_dropout:      # no masks: 1 s b h each after attention and MLP, a s^2 b
        return 8.0, attention + 4.0 * ratio, 4.0
    return 10.0, attention + 4.0 * ratio, 5.0


def layer_activation_bytes(shape: ModelShape, micro_batch: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", flash: bool = False,
                           dtype: str = "mixed", glu_saved: int = GLU_SAVED) -> float:
    """Bytes one layer keeps for backward, for one micro-batch (Korthikanti et al. 2022)."""
    _check_dtype(dtype)
    s, b, h, a = shape.seq_len, micro_batch, shape.hidden, shape.heads
    scale = ACTIVATION_BYTES[dtype] / 2          # the paper counts 16-bit activations
    sbh = s * b * h * scale
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    replicated, split, scores = activation_coefficients(shape, glu_saved)
    if recompute == "selective" or flash:
        scores = 0.0
    if sp:
        return sbh * (replicated + split + scores * a * s / h) / tp
    return sbh * (replicated + split / tp + scores * a * s / (h * tp))


def kv_block_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, tp: int = 1,
                   bytes_per_elem: int = 4) -> int:
    """B = 2 b (s/cp) (h/tp) e: one rank's K and V for one layer, the ring's message
    (``plan.cp``)."""
    return 2 * micro_batch * (seq_len // cp) * (hidden // tp) * bytes_per_elem


def cp_layer_activation_bytes(shape: ModelShape, micro_batch: int, cp: int = 1, tp: int = 1,
                              sp: bool = False, recompute: str = "none", flash: bool = False,
                              dtype: str = "mixed", glu_saved: int = GLU_SAVED) -> float:
    """One layer's activations on one rank of a cp ring: the layer at s/cp tokens, the
    scores never stored at cp > 1 (ring attention computes them block by block)."""
    raise_if(cp_violation(shape.seq_len, cp))
    local = dataclasses.replace(shape, seq_len=shape.seq_len // cp)
    return layer_activation_bytes(local, micro_batch, tp=tp, sp=sp, recompute=recompute,
                                  flash=flash or cp > 1, dtype=dtype, glu_saved=glu_saved)
