"""Model and hardware FLOPs utilisation (MFU, HFU) of a training step.

    MFU = model FLOPs of the step / (step time x peak FLOP/s of one device x devices)
    HFU = the same with the FLOPs the hardware actually ran, recomputation included

Model FLOPs are the planner's exact matmul count (``minipar.plan.training_flops``: forward,
and backward twice the forward; Chowdhery et al. 2022 define MFU with them); hardware FLOPs
add the recomputed forward (full: every layer; selective: the attention core). The peak is the
vendor's dense (no sparsity) figure for the run's dtype, looked up from the device's name
(``torch.cuda.get_device_name()``) in the table below, or given (``--peak-tflops``). There is
no peak for a CPU: MFU is then unknown (None) unless one is given.
"""
from __future__ import annotations

from ..plan.shapes import ModelShape, training_flops

# Dense TFLOP/s per device (one GCD for the MI250X, which shows up as two devices), from the
# vendors' datasheets: (name fragments that must all appear, upper case), {dtype: TFLOP/s}.
# fp32 is the plain (non-TF32) rate, which is what torch's fp32 matmuls use by default.
PEAK_TFLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H100", "PCIE"), {"bf16": 756.0, "fp32": 51.2}),
    (("H100", "NVL"), {"bf16": 835.0, "fp32": 60.0}),
    (("GH200",), {"bf16": 989.4, "fp32": 66.9}),
    (("H200",), {"bf16": 989.4, "fp32": 66.9}),
    (("H100",), {"bf16": 989.4, "fp32": 66.9}),             # SXM
    (("H800",), {"bf16": 989.4, "fp32": 66.9}),
    (("B200",), {"bf16": 2250.0, "fp32": 80.0}),
    (("A100",), {"bf16": 312.0, "fp32": 19.5}),
    (("A800",), {"bf16": 312.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.1, "fp32": 91.6}),
    (("A10G",), {"bf16": 70.0, "fp32": 31.2}),
    (("MI250",), {"bf16": 191.5, "fp32": 47.9}),             # one GCD (half an MI250X)
    (("MI300X",), {"bf16": 1307.4, "fp32": 163.4}),
    (("MI325X",), {"bf16": 1307.4, "fp32": 163.4}),
    (("MI300A",), {"bf16": 980.6, "fp32": 122.6}),
]


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """The table's dense peak for a device name and "bf16" or "fp32"; None if not listed."""
    if not device_name:
        return None
    name = device_name.upper()
    for fragments, peaks in PEAK_TFLOPS:
        if all(f in name for f in fragments):
            return peaks.get(dtype)
    return None


def shape_of(cfg) -> ModelShape:
    """A ``minipar.model.GPTConfig`` as the planner's shape (untied head, as minipar's GPT)."""
    return ModelShape("run", "gpt", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size,
                      cfg.seq_len, cfg.ffn, tied_head=False, bias=cfg.bias)


def step_flops(cfg, batch: int, recompute: str = "none") -> dict[str, float]:
    """{"model": FLOPs MFU counts, "hardware": FLOPs HFU counts} for ``batch`` sequences."""
    shape = shape_of(cfg)
    if getattr(cfg, "moe_experts", 0):       # MoE: only the k chosen experts per token count
        from ..plan import moe
        spec = moe.MoE(cfg.moe_experts, cfg.moe_top_k, cfg.moe_every)
        return {"model": moe.training_flops(shape, spec, batch, "none"),
                "hardware": moe.training_flops(shape, spec, batch, recompute)}
    return {"model": training_flops(shape, batch, "none"),
            "hardware": training_flops(shape, batch, recompute)}


def utilisation(flops: dict[str, float], step_time_s: float, peak_tflops_per_device: float | None,
                devices: int) -> dict[str, float | None]:
    """{"mfu", "hfu"} as fractions of the peak (None when no peak is known)."""
    if not peak_tflops_per_device or step_time_s <= 0:
        return {"mfu": None, "hfu": None}
    peak = peak_tflops_per_device * 1e12 * devices * step_time_s
    return {"mfu": flops["model"] / peak, "hfu": flops["hardware"] / peak}
