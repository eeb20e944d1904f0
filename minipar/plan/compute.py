"""Compute time of one device's share of a step: matmuls by shape, the attention core,
memory-bound kernels and the optimizer step.

* **Matmuls**, one by one, at the shapes each tensor-parallel degree produces. For a
  micro-batch of M = b s tokens a GPT layer's forward runs QKV (M x h -> 3h/t), the output
  projection (M x h/t -> h), fc1 (M x h -> F/t) and fc2 (M x F/t -> h) (LLaMA: gate and up
  in place of fc1, down in place of fc2); backward runs each twice (input gradient
  M x N -> K and weight gradient K x M -> N). A GEMM of 2 m n k FLOPs takes the longer of
  its FLOPs at ``peak_flops x compute_efficiency`` (the large-GEMM rate) and its operands'
  bytes at ``hbm_bandwidth`` (a roofline), or, when the hardware carries a measured
  ``matmul_table``, its FLOPs at the rate measured for the nearest GEMM size (log FLOPs).
  The head's logits GEMM (M x h -> V/t) runs on the last stage.
* **Attention core**: with a fused kernel (``flash``) its 4 b s^2 h / t forward FLOPs run
  at ``attention_efficiency`` of peak (the large-GEMM rate if that is 0), backward twice;
  unfused it is b a / t batched GEMMs of s x d -> s and s x s -> d, each timed as above,
  plus the softmax as a memory-bound kernel. Like the FLOP formulas it counts the whole
  s x s square, the causally masked half too.
* **Context parallelism** (cp > 1): every rank holds s/cp tokens of each sequence, so every
  per-token part above (GEMMs, memory-bound kernels, logits) runs at M = b s / cp; the
  attention core of its s/cp queries against all s keys is cp blocks of (s/cp) x (s/cp)
  (``attention_core``, one ring step each: ``plan.cp``), 1/cp of the square. With
  selective recomputation the ring's core is recomputed, as ``minipar.cp`` does it (its
  forward runs inside the recomputed region).
* **Memory-bound kernels**, as bytes over ``hbm_bandwidth``. The tensors are those of
  Korthikanti et al. 2022 (section 4), each read and written once by the kernel that
  makes it, in the activations' precision. Per layer and micro-batch, forward, in units
  of s b h elements:
      replicated by TP (split only under sequence parallelism): two LayerNorms (read, write:
      4), two residual adds (read two, write one: 6), two dropouts after the attention and
      MLP outputs (read, write: 4) -> 14 (LLaMA: RMSNorms and residuals, no dropout: 10);
      split by TP: the GELU (read, write F/h each: 2F/h; LLaMA's SwiGLU reads two and writes
      one: 3F/h) and, unfused, the attention scores' softmax and dropout (read, write
      a s / h each: 4 a s / h; LLaMA without dropout: 2 a s / h).
  Backward moves about twice the forward's bytes (it reads the saved input and the
  incoming gradient and writes the outgoing one); recomputation adds the forward again.
  The cross-entropy over b s V / t logits reads and writes them in fp32 forward and
  backward: 16 bytes per logit on the last stage.
* **Optimizer step**: Adam reads the fp32 master weight, m, v and the gradient and writes
  the three and the 16-bit weight: 12 + 12 + 2 bytes plus the gradient's bytes (2, or 4
  for fp32 gradient buffers) per parameter of this rank's optimizer shard (Phi / s_os), over
  ``hbm_bandwidth``.

The hardware's ``step_calibration`` and ``oversubscription`` (its CPU ``cores`` shared by
more processes) multiply the sum (``hardware``'s docstring).
"""
from __future__ import annotations

import math

from .hardware import Hardware
from .layout import Layout
from .memory import ACTIVATION_BYTES, BYTES_PER_PARAM, stage_params
from .shapes import ModelShape
from .timing import log_interp

LOGIT_BYTES = 16           # cross-entropy: fp32 logits read and written, forward and backward
ADAM_BYTES = 26            # fp32 master, m, v read and written; the 16-bit weight written


def matmul_time(m: float, n: float, k: float, hw: Hardware, element_bytes: int = 2) -> float:
    """Seconds for one (m x k) @ (k x n) GEMM on ``hw``."""
    flops = 2.0 * m * n * k
    if hw.matmul_table:          # the measured rate of the GEMMs nearest in log FLOPs
        rows = sorted((2.0 * r["m"] * r["n"] * r["k"], r["flops_per_s"]) for r in hw.matmul_table)
        return flops / log_interp(rows, flops, math.log)
    t = (flops + hw.gemm_half_flops) / hw.achievable_flops
    if hw.hbm_bandwidth:
        t = max(t, element_bytes * (m * k + k * n + m * n) / hw.hbm_bandwidth)
    return t


def layer_gemms(shape: ModelShape, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of one layer's forward GEMMs on one of ``tp`` ranks (QKV is h + 2 h_kv
    wide: 3h without grouped-query attention)."""
    h, f, t = shape.hidden, shape.ffn, tp
    up = [(tokens, f // t, h)] * (2 if shape.arch == "llama" else 1)    # LLaMA: gate and up
    return [(tokens, (h + 2 * shape.kv_hidden) // t, h), (tokens, h, h // t), *up,
            (tokens, h, f // t)]


def _fwd_bwd(gemms, hw, e) -> tuple[float, float]:
    fwd = sum(matmul_time(m, n, k, hw, e) for m, n, k in gemms)
    bwd = sum(matmul_time(m, k, n, hw, e) + matmul_time(k, n, m, hw, e) for m, n, k in gemms)
    return fwd, bwd


def attention_core(shape: ModelShape, hw: Hardware, micro_batch: int, tp: int = 1, cp: int = 1,
                   dtype: str = "mixed", flash: bool = False) -> tuple[float, float]:
    """Seconds of one layer's attention core for one micro-batch on one rank, (forward,
    backward): its s/cp queries against all s keys as cp blocks of (s/cp)^2 (one block at
    cp = 1; module docstring). A ring step computes one block: 1/cp of each."""
    b, h, a, e = micro_batch, shape.hidden, shape.heads, ACTIVATION_BYTES[dtype]
    s = shape.seq_len // cp
    if flash:
        rate = hw.peak_flops * (hw.attention_efficiency or hw.compute_efficiency)
        fwd = cp * 4.0 * b * s * s * h / tp / rate
    else:
        heads, d = a / tp, h // a           # heads per rank (a fraction where tp does not divide a)
        fwd = cp * b * heads * (matmul_time(s, s, d, hw, e) + matmul_time(s, d, s, hw, e))
    return fwd, 2 * fwd


def compute_parts(shape: ModelShape, hw: Hardware, layout: Layout, dtype: str = "mixed",
                  flash: bool = False, grad_bytes: int | None = None, stage=None) -> dict:
    """Seconds per step on one device of ``stage`` (a ``stages.Stage``: its layers, and the
    head's logits if it holds them; default the last of equal stages), by part:
    {"matmul", "attention", "memory_bound", "optimizer", "total", "forward_mb",
    "backward_mb"} (the last two: one micro-batch's forward and backward, for overlap)."""
    t, p, cp = layout.tp, layout.pp, layout.cp
    b, m, h, a = layout.micro_batch, layout.microbatches, shape.hidden, shape.heads
    s = shape.seq_len // cp                      # this rank's tokens of each sequence
    e = ACTIVATION_BYTES[dtype]
    layers = -(-shape.layers // p) if stage is None else stage.layers
    head = 1 if stage is None or stage.head else 0
    tokens = b * s
    recompute = layout.recompute

    # matmuls of one micro-batch on this stage (layers, then the head's logits)
    fwd, bwd = _fwd_bwd(layer_gemms(shape, tokens, t), hw, e)
    head_f, head_b = _fwd_bwd([(tokens, -(-shape.vocab // t), h)], hw, e) if head else (0, 0)
    matmul = layers * (fwd + bwd + (fwd if recompute == "full" else 0)) + head_f + head_b

    # the attention core
    att_f, att_b = attention_core(shape, hw, b, t, cp, dtype, flash)
    again = recompute == "full" or (recompute == "selective" and (not flash or cp > 1))
    attention = layers * (att_f + att_b + (att_f if again else 0))

    # memory-bound kernels (module docstring), bytes of one micro-batch's forward
    mem_f = mem_b = 0.0
    if hw.hbm_bandwidth:
        sbh = s * b * h * e
        replicated = 14.0 if shape.has_dropout else 10.0
        split = (3.0 if shape.arch == "llama" else 2.0) * shape.ffn / h
        # scores per rank: b a (s/cp) s, i.e. a s / h per (s/cp) b h
        scores = 0.0 if flash else (4.0 if shape.has_dropout else 2.0) * a * shape.seq_len / h
        per_layer = sbh * (replicated / (t if layout.sp else 1) + (split + scores) / t)
        again_bytes = per_layer if recompute == "full" else (
            sbh * scores / t if recompute == "selective" else 0.0)
        logits = head * tokens * -(-shape.vocab // t) * LOGIT_BYTES / hw.hbm_bandwidth
        mem_f = layers * per_layer / hw.hbm_bandwidth + logits / 2
        mem_b = layers * (2 * per_layer + again_bytes) / hw.hbm_bandwidth + logits / 2
    memory_bound = mem_f + mem_b

    # the optimizer step over this rank's optimizer shard
    optimizer = 0.0
    if hw.hbm_bandwidth:
        g = grad_bytes or BYTES_PER_PARAM[dtype][1]
        per_param = (ADAM_BYTES if dtype == "mixed" else 24) + g
        phi = stage_params(shape, t, p, stage)
        optimizer = per_param * math.ceil(phi / layout.shard[2]) / hw.hbm_bandwidth
    c = hw.step_calibration * hw.oversubscription(layout.gpus)   # time-sliced CPU cores
    launch = hw.layer_overhead * layers           # per layer and micro-batch, both passes
    forward_mb = c * (layers * (fwd + att_f) + head_f + mem_f + launch / 2)
    backward_mb = c * (matmul + attention + memory_bound + launch) - forward_mb
    parts = {"matmul": c * m * matmul, "attention": c * m * attention,
             "memory_bound": c * m * memory_bound, "launch": c * m * launch,
             "optimizer": c * optimizer}
    parts["total"] = sum(parts.values())
    return {**parts, "forward_mb": forward_mb, "backward_mb": backward_mb}
