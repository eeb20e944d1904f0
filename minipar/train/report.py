"""What a run prints and records: the banner, the step line, the metrics record, the summary.

Nothing here trains or communicates; ``minipar.train`` hands it numbers already reduced over
the ranks (the largest state and step time over ranks; the loss summed over the replicas).
"""
from __future__ import annotations

import time

import torch

from .config import RunConfig


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('s', 'h')) else 's'}"


def banner(cfg: RunConfig, backend: str, device: torch.device, full_params: int,
           local_params: int) -> str:
    where = (f"{_plural(cfg.world, 'process')}, {backend} on {device.type}" if backend != "none"
             else f"1 process on {device}")
    layout = (f"dp={cfg.dp} pp={cfg.pp}{f' cp={cfg.cp}' if cfg.cp > 1 else ''} tp={cfg.tp}"
              f"{' +sp' if cfg.sp else ''}, {engine_name(cfg)}")
    held = ("" if local_params == full_params else
            f"; rank 0's {'experts and rest' if cfg.ep > 1 else 'pipeline stage and TP slice'}: "
            f"{local_params:,}")
    return (f"minipar: {where} ({layout}), model {cfg.model} ({full_params:,} parameters{held}), "
            f"global batch {cfg.batch_size} x {cfg.seq_len} tokens in "
            f"{_plural(cfg.microbatches, 'micro-batch')}"
            + (f", MoE {cfg.model_cfg.moe_experts} experts top-{cfg.model_cfg.moe_top_k} ep={cfg.ep}"
               if cfg.model_cfg.moe_experts else ""))



class Progress:
    """An ETA for the step lines, on a terminal only (logs and notebooks keep the plain line)."""

    def __init__(self, first: int, last: int, show_eta: bool):
        self.first, self.last, self.show = first, last, show_eta
        self.t0 = time.perf_counter()

    def eta(self, step: int) -> str:
        done = step - self.first
        if not self.show or done < 1 or step >= self.last:
            return ""
        left = (time.perf_counter() - self.t0) / done * (self.last - step)
        return f" | ETA {int(left // 60)}m{int(left % 60):02d}s"


def layout_words(layout: dict) -> str:
    sharding = (f", shard {layout['shard']}" if layout.get("shard") else
                f", ZeRO-{layout['zero']}" if layout.get("zero") is not None else "")
    cp = f" cp={layout['cp']}" if layout.get("cp", 1) > 1 else ""
    return (f"dp={layout['dp']} pp={layout['pp']}{cp} tp={layout['tp']}"
            f"{' +sp' if layout.get('sp') else ''}{sharding}")


def note_changed_training(log, manifest: dict, cfg: RunConfig) -> None:
    """Say in one line which training flags (and corpus) differ from the checkpoint's manifest
    (never silently)."""
    saved = manifest["training"]
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in
               ("batch_size", "seed", "lr", "lr_schedule", "warmup", "min_lr", "weight_decay",
                "clip_grad", "dtype") if k in saved and saved[k] != getattr(cfg, k)]
    source = manifest.get("data", {}).get("source")
    if source is not None and source != (cfg.data or "built-in corpus"):
        changed.append(f"data {source} -> {cfg.data or 'built-in corpus'}")
    if changed:
        log("note: continuing with other training flags than the checkpoint's: " + ", ".join(changed))



def step_line(record: dict, steps: int, progress: Progress) -> str:
    """The progress line of one step (rank 0)."""
    util = f" | MFU {record['mfu']:5.1%}" if record.get("mfu") is not None else ""
    val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    scale = (f" | scale {record['loss_scale']:g}" + (f" ({record['skipped_steps']} skipped)"
                                                    if record["skipped_steps"] else "")
             if "loss_scale" in record else "")
    moe = (f" | aux {record['aux_loss']:.3f} z {record['z_loss']:.3f} drop "
           f"{record['drop_rate']:.1%}" if "aux_loss" in record else "")
    sent = sum(record["comm_bytes"].values())
    return (f"step {record['step']:4d}/{steps} | loss {record['loss']:.4f} | "
            f"{record['tokens_per_s']:8.0f} tok/s | {record['step_time_s']*1e3:7.1f} ms"
            f" | rank 0 sent {sent / 2**20:6.2f} MiB{moe}{val}{scale}{util}"
            f"{progress.eta(record['step'])}")


def engine_name(cfg: RunConfig) -> str:
    if cfg.shard is not None:
        return f"shard {cfg.shard}"
    if cfg.zero is not None:
        return f"ZeRO-{cfg.zero}"
    return f"DP {cfg.dp_mode}" if cfg.dp * cfg.cp > 1 else "no DP"


def summary(history: list[dict]) -> str:
    if not history:
        return "no steps run"
    last, first = history[-1], history[0]
    # every record has the interval's step time; MFU and peak memory only the logging step's
    # record of its interval (--log-every K > 1: one record in K)
    logged = [h for h in history if "step_time_s" in h]
    timed = logged[1:] or logged    # the first one pays for warm-up
    tps = sum(h["tokens_per_s"] for h in timed) / len(timed)
    ms = last["model_state_bytes"]
    sent = last["comm_bytes"]
    util = ""
    if last.get("mfu") is not None:
        rated = [h for h in timed if h.get("mfu") is not None] or [last]
        mean = lambda key: sum(h[key] for h in rated) / len(rated)   # noqa: E731
        util = f", MFU {mean('mfu'):.1%} (HFU {mean('hfu'):.1%})"
    lines = [f"summary: {len(history)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
             f"{tps:,.0f} tokens/s (mean after step {logged[0]['step']}){util}",
             f"  model state per rank (the largest over ranks): params {ms['params']:,} B, "
             f"grads {ms['grads']:,} B, optimizer {ms['optimizer']:,} B, total {ms['total']:,} B",
             *([f"  held-out loss {evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}"]
               if (evals := [h for h in history if "val_loss" in h]) else []),
             "  sent by rank 0 in the last step: " +
             (", ".join(f"{op} {b:,} B" for op, b in sorted(sent.items()) if b) or "nothing")]
    if "loss_scale" in last:
        lines.append(f"  fp16 loss scale {last['loss_scale']:g} at the last step, "
                     f"{last['skipped_steps']} step(s) skipped for overflowing gradients")
    if "peak_memory_bytes" in last:
        peak = max(h["peak_memory_bytes"] for h in history if "peak_memory_bytes" in h)
        lines.append(f"  peak GPU memory (torch.cuda.max_memory_allocated, the largest over "
                     f"ranks): {peak / 2**30:.2f} GiB")
    return "\n".join(lines)
