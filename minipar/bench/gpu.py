"""``python -m minipar.bench gpu``: minipar's trainer against a plain PyTorch loop, one GPU.

Both train the same model (``--model``, default the gpt2-size preset) on the same batches,
one after the other in this process:

* **plain**: nanoGPT's loop: ``build(cfg)`` on the GPU, ``torch.autocast`` to bf16 over fp32
  parameters, fused AdamW, ``torch.compile(model)`` with ``--compile``; ``loss.backward()``,
  ``opt.step()``;
* **minipar**: ``minipar.train``'s own loop (``train.worker``) with the same flags: real bf16
  parameters and fp32 masters (``minipar.precision``), the DP engine of one rank, each Block
  compiled with ``--compile``, and everything the trainer does per step (metrics included).

Printed: median step time after warm-up, tokens/s, MFU (the planner's model FLOPs over the
GPU's dense peak, ``minipar.mfu``) and the ratio minipar / plain (the goal: <= 1.05). Each
step ends with ``torch.cuda.synchronize()`` in both, so the times are comparable.

Without a GPU it refuses (exit 2) rather than time a CPU; ``--device cpu`` runs it on the
CPU on purpose, as a smoke test (no MFU unless ``--peak-tflops`` is given).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import time

import torch

from .. import cli, data, dist, mfu, train
from ..train import to_device
from ..errors import UsageError
from ..model import PRESETS, build
from . import machine, median


def plain_loop(cfg: train.RunConfig, device: torch.device, steps: int) -> list[float]:
    """nanoGPT-style training of ``cfg``'s model; the time of each step (seconds)."""
    model = build(cfg.model_cfg, seed=cfg.seed).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, **fused)
    step_fn = torch.compile(model) if cfg.compile else model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
                else contextlib.nullcontext())
    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    batches = data.Batches(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    times = []
    for step in range(1, steps + 1):
        x, y = batches.local_batch(step, 0, 1)
        x, y = to_device(x, device), to_device(y, device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench gpu")
    p.add_argument("--model", default="gpt2", choices=list(PRESETS))
    p.add_argument("--batch-size", type=cli.positive_int, default=16, help="sequences")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--compile", action="store_true", help="torch.compile both")
    p.add_argument("--steps", type=cli.positive_int, default=30)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=5, help="steps left out of the medians")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test on purpose (no GPU timing)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak (default: from the GPU's name)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("python -m minipar.bench gpu needs a GPU and none is visible "
                         "(--device cpu runs it on the CPU as a smoke test)")
    if args.warmup < 0 or args.warmup >= args.steps:
        raise UsageError(f"--warmup must be between 0 and --steps - 1, got {args.warmup}")
    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--dtype", args.dtype,
             "--recompute", args.recompute, "--steps", str(args.steps), "--quiet",
             "--backend", "gloo" if args.device == "cpu" else "auto"]
    flags += ["--compile"] if args.compile else []
    flags += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    cfg = train.parse_config(flags)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    plain = plain_loop(cfg, device, args.steps)[args.warmup:]
    plain_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # what the caching allocator holds beyond the live tensors at their peak: the planner's
    # memory reserve for a PyTorch framework profile (python -m minipar.plan ... --reserve)
    plain_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    with contextlib.redirect_stdout(io.StringIO()):      # the trainer's summary: not here
        history = train.worker(dataclasses.replace(cfg, quiet=True))
    ours = [h["step_time_s"] for h in history][args.warmup:]

    peak = args.peak_tflops or (mfu.peak_tflops(torch.cuda.get_device_name(device), args.dtype)
                                if device.type == "cuda" else None)
    flops = mfu.step_flops(cfg.model_cfg, cfg.batch_size, cfg.recompute)
    tokens = cfg.batch_size * cfg.seq_len
    print(f"minipar.bench gpu: model {args.model}, {args.batch_size} x {cfg.seq_len} tokens a "
          f"step, {args.dtype}, recompute {args.recompute}, compile {args.compile}, "
          f"median of {len(ours)} steps after {args.warmup} warm-up, on {device}")
    print(f"machine: {machine()}; peak {peak or 'unknown'} TFLOP/s")
    print(f"{'loop':<10}{'median step':>14}{'tokens/s':>14}{'MFU':>8}")
    rows = [("plain", median(plain)), ("minipar", median(ours))]
    for name, t in rows:
        u = mfu.utilisation(flops, t, peak, 1)["mfu"]
        print(f"{name:<10}{t * 1e3:>11.1f} ms{tokens / t:>14,.0f}"
              f"{'' if u is None else f'{u:.1%}':>8}")
    print(f"minipar / plain step time: {rows[1][1] / rows[0][1]:.3f}x (goal <= 1.05)")
    if plain_memory is not None:
        ours_memory = max(h["peak_memory_bytes"] for h in history)
        print(f"peak GPU memory: plain {plain_memory / 2**30:.2f} GiB, minipar "
              f"{ours_memory / 2**30:.2f} GiB (torch.cuda.max_memory_allocated)")
        held = (plain_reserved - plain_memory) / plain_reserved if plain_reserved else 0.0
        print(f"allocator reserve of the plain loop: (max reserved - max allocated) / max "
              f"reserved = {held:.3f} (the planner's --reserve for this profile)")
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
