"""The trainer's command line: flags, the checked ``RunConfig``, and every check that can be
made before a process starts (``parse_config``).

Bad input raises ``UsageError`` with one line (what is wrong, what would fix it); the
trainer exits 2 with it before any process starts. Nothing past ``parse_config`` sees
argparse: every rank receives the frozen ``RunConfig``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from ..runtime import cli, dist
from .. import data, dp
from . import optim
from .. import rules
from ..runtime.errors import UsageError
from ..model import PRESETS, RECOMPUTE, GPTConfig, config


# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------
def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m minipar.train",
                           description="Train a small GPT with any mix of DP, TP, PP and "
                                       "ZeRO/AMSP sharding (reference: docs/reference.md).")
    p.add_argument("--nproc", type=int, default=None,
                   help="start N local processes (omit under torchrun or srun)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: each sequence split over N ranks, attention "
                        "by ring attention (minipar.cp)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: world size / (tp*pp*cp))")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage over the data-parallel group (0: ZeRO's engine, nothing "
                        "sharded; without --zero/--shard: minipar.dp's DataParallel, --dp-mode)")
    p.add_argument("--shard", type=str, default=None, metavar="P,G,OS",
                   help="AMSP shard-group sizes for parameters, gradients, optimizer states")
    p.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl when every process can own a GPU, else gloo on CPU")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"],
                   help="pipeline schedule")
    p.add_argument("--chunks", type=int, default=2,
                   help="model chunks per stage for --schedule interleaved")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step per pipeline (default 1, or 2*pp with --pp)")
    p.add_argument("--dp-mode", default="overlapped", choices=list(dp.MODES),
                   help="data-parallel variant when not sharding")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DP gradient bucket size, MB")
    p.add_argument("--model", default="tiny", help=f"size preset: {', '.join(PRESETS)}")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a text file (default: built-in corpus)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16: 16-bit parameters and gradients, fp32 master weights and "
                        "Adam states (2+2+12 bytes per parameter); fp16 adds dynamic loss scaling")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="with --dtype bf16/fp16: the dtype gradients are summed in across ranks")
    p.add_argument("--loss-scale-init", type=float, default=2.0**16, metavar="S",
                   help="with --dtype fp16: the initial loss scale")
    p.add_argument("--loss-scale-window", type=int, default=2000, metavar="K",
                   help="with --dtype fp16: double the loss scale after K steps without overflow")
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE),
                   help="activation recomputation: selective = the attention core, "
                        "full = each transformer block")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block's forward")
    p.add_argument("--deterministic", action="store_true",
                   help="on a GPU: deterministic algorithms, cuBLAS's fixed workspace and math "
                        "attention, so two fresh runs give the same bits (slower; "
                        "python -m minipar.bench gpu --deterministic prints the cost); on the "
                        "CPU it changes nothing (CPU runs already repeat)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: looked up from the GPU's "
                        "name; none on a CPU)")
    p.add_argument("--metrics", default=None, help="write one JSON line per step (rank 0)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write every rank's timeline (compute spans, every collective) as a "
                        "Chrome/Perfetto trace; open it at ui.perfetto.dev")
    p.add_argument("--log-every", type=int, default=1,
                   help="progress line every K steps; the metrics' host syncs happen only then")
    p.add_argument("--quiet", action="store_true", help="no progress lines, summary only")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="with --nproc: kill every rank after this many seconds")
    # a full training run: schedule, clipping, decay, evaluation, checkpoints (minipar.train.optim,
    # minipar.checkpoint)
    p.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                   help="clip the global gradient norm (over every shard) to NORM")
    p.add_argument("--warmup", type=int, default=0, help="linear LR warm-up steps")
    p.add_argument("--lr-schedule", default="constant", choices=list(optim.SCHEDULES),
                   help="after warm-up: constant, or decay to --min-lr at the final step")
    p.add_argument("--min-lr", type=float, default=0.0, help="the LR at the final step")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="decoupled (AdamW) weight decay on matrices, not biases/norms/positions")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every K steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="global batches of the held-out split per evaluation")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write checkpoints (DCP) to DIR/step-NNNNNN at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="with --save: also every K steps")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="with --save: keep the newest N checkpoints (0: all)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint (or DIR's newest) up to --steps, in any layout")
    g = p.add_argument_group("mixture of experts (minipar.moe)")
    rules.add_moe_flags(g)
    g.add_argument("--capacity-factor", type=float, default=0.0, metavar="C",
                   help="slots per expert and sequence: ceil(C seq_len K / E); 0 = dropless")
    g.add_argument("--moe-aux-coef", type=float, default=0.01, metavar="X",
                   help="load-balancing loss coefficient")
    g.add_argument("--moe-z-coef", type=float, default=0.0, metavar="X",
                   help="router z-loss coefficient")
    return p


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, checked: what every rank receives (picklable, immutable)."""

    nproc: int | None
    tp: int
    pp: int
    dp: int                        # resolved: world size / (tp * pp * cp) unless given
    zero: int | None
    shard: str | None
    spec: tuple[int, int, int] | None   # (s_p, s_g, s_os); None = plain data parallelism
    sp: bool
    backend: str
    schedule: str
    chunks: int
    microbatches: int              # resolved: 1, or 2 * pp under a pipeline
    dp_mode: str
    bucket_mb: float
    model: str
    model_cfg: GPTConfig           # the preset with --seq-len applied
    steps: int
    batch_size: int
    lr: float
    seed: int
    data: str | None
    dtype: str
    reduce_dtype: str              # the dtype gradients are reduced in (with dtype bf16/fp16)
    recompute: str                 # none, selective, full (also in model_cfg)
    compile: bool
    peak_tflops: float | None      # None: from the device's name (minipar.train.mfu)
    metrics: str | None
    log_every: int
    quiet: bool
    timeout: float
    ep: int = 1                    # expert parallelism (MoE: model_cfg.moe_experts > 0)
    clip_grad: float | None = None
    warmup: int = 0
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    eval_every: int = 0
    eval_batches: int = 4
    save: str | None = None
    save_every: int = 0
    keep: int = 0
    resume: str | None = None      # resolved: the checkpoint folder itself
    start_step: int = 0            # the resumed checkpoint's step (0: a fresh run)
    loss_scale_init: float = 2.0**16   # fp16's dynamic loss scaler
    loss_scale_window: int = 2000
    cp: int = 1                    # context parallelism: each sequence over cp ranks
    trace: str | None = None       # --trace FILE (minipar.runtime.trace)
    deterministic: bool = False    # --deterministic (minipar.train.loop.deterministic)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def seq_len(self) -> int:
        return self.model_cfg.seq_len


def world_size_from(nproc: int | None) -> int:
    if nproc is not None:
        return nproc
    env = dist.env_from_os()
    return env.world_size if env else 1


def _positive(name: str, value, strict: bool = True) -> None:
    ok = value is not None and math.isfinite(value) and (value > 0 if strict else value >= 0)
    if not ok:
        raise UsageError(f"--{name} must be a finite number {'>' if strict else '>='} 0, got {value}")


def parse_config(argv: list[str]) -> RunConfig:
    """Parse and check the flags; every check that can be made before a process starts.

    Raises UsageError (one line: what is wrong, what would fix it).
    """
    a = parser().parse_args(argv)
    if a.nproc is not None and a.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {a.nproc}")
    for name in ("tp", "pp", "cp", "steps", "batch_size", "chunks", "log_every"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    _positive("lr", a.lr)
    _positive("bucket-mb", a.bucket_mb)
    _positive("timeout", a.timeout)
    if a.model not in PRESETS:
        raise UsageError(f"unknown --model {a.model!r}; choose one of {', '.join(PRESETS)}")
    world = world_size_from(a.nproc)
    if a.cp < 1:
        raise UsageError(f"--cp must be >= 1, got {a.cp}")
    inner = a.tp * a.pp * a.cp
    cp_words = f" x cp={a.cp}" if a.cp > 1 else ""
    if world % inner:
        raise UsageError(f"{world} processes do not divide into tp={a.tp} x pp={a.pp}{cp_words}; "
                         f"use a process count that is a multiple of {inner}")
    d = a.dp if a.dp is not None else world // inner
    if d < 1 or d * inner != world:
        raise UsageError(f"--dp {d} x --tp {a.tp} x --pp {a.pp}{cp_words.replace(' cp=', ' --cp ')}"
                         f" = {d * inner}, but there are {world} processes; omit --dp or make "
                         f"the product equal the process count")
    m = a.microbatches if a.microbatches is not None else (2 * a.pp if a.pp > 1 else 1)
    if m < 1:
        raise UsageError(f"--microbatches must be >= 1, got {m}")
    if a.batch_size % (d * m):
        raise UsageError(f"--batch-size {a.batch_size} is not divisible by dp={d} x "
                         f"microbatches={m}; use a multiple of {d * m}")
    if a.metrics:
        cli.check_output_file(a.metrics, "--metrics")   # tried, not guessed from mode bits
    if a.trace:
        cli.check_output_file(a.trace, "--trace")
    if not 0 <= a.seed < 2**32:
        raise UsageError(f"--seed must be from 0 to 2**32 - 1, got {a.seed}")
    if a.seq_len is not None and a.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {a.seq_len}")
    if a.peak_tflops is not None:
        _positive("peak-tflops", a.peak_tflops)
    if a.reduce_dtype != "fp32" and a.reduce_dtype != a.dtype:
        raise UsageError(f"--reduce-dtype {a.reduce_dtype} reduces {a.reduce_dtype} gradients; "
                         f"it needs --dtype {a.reduce_dtype} (or --reduce-dtype fp32)")
    _positive("loss-scale-init", a.loss_scale_init)
    if a.loss_scale_window < 1:
        raise UsageError(f"--loss-scale-window must be >= 1, got {a.loss_scale_window}")
    model_cfg = config(a.model, recompute=a.recompute,
                       **({} if a.seq_len is None else {"seq_len": a.seq_len}))
    model_cfg = dataclasses.replace(model_cfg, moe_experts=a.moe_experts, moe_top_k=a.moe_top_k,
                                    moe_every=a.moe_every, capacity_factor=a.capacity_factor,
                                    moe_aux_coef=a.moe_aux_coef, moe_z_coef=a.moe_z_coef)
    _check_moe(model_cfg, a.ep, d, a.tp, a.cp)
    if a.compile and model_cfg.moe_experts and a.recompute == "full":
        raise UsageError("--compile with MoE and --recompute full: the recomputed MoE layer replays "
                         "its first forward's routing through a checkpoint context, and torch.compile "
                         "accepts only TorchDispatchMode contexts there; drop --compile or use "
                         "--recompute selective")
    _refuse(rules.cp_violation(model_cfg.seq_len, a.cp, a.tp, a.sp))
    corpus = _corpus_bytes(a.data)
    if int(corpus * data.HELD_OUT) < model_cfg.seq_len + 2:   # the held-out tenth is the shorter
        raise UsageError(f"the corpus has {corpus} bytes, too few for sequences of "
                         f"{model_cfg.seq_len} tokens in its held-out tenth; use a longer --data file "
                         f"or a smaller --seq-len")
    resume, start = _check_run_flags(a, model_cfg)
    if a.backend == "nccl" or (a.backend == "auto" and a.nproc is not None):
        dist.resolve_backend(a.backend, a.nproc if a.nproc is not None else 1)
    if a.tp > 1:
        _refuse(rules.tp_violation(model_cfg.n_head, a.tp, hidden=model_cfg.d_model,
                                   ffn=model_cfg.ffn, seq_len=model_cfg.seq_len, sp=a.sp))
    elif a.sp:
        raise UsageError("--sp splits the sequence inside the tensor-parallel group; it needs --tp > 1")
    if a.pp > 1:
        v = a.chunks if a.schedule == "interleaved" else 1
        _refuse(rules.interleave_violation(a.pp, m, v) or rules.pp_violation(model_cfg.n_layer, a.pp, v))
    elif a.schedule == "interleaved":
        raise UsageError("--schedule interleaved needs --pp > 1")
    # ZeRO shards over every rank holding the same parameters: dp x cp; plain DP: no spec
    spec = (None if a.zero is None and a.shard is None else
            tuple(int(s) for s in rules.resolve_shard(d * a.cp, a.shard, a.zero)))
    return RunConfig(nproc=a.nproc, tp=a.tp, pp=a.pp, dp=d, zero=a.zero, shard=a.shard,
                     spec=spec, sp=a.sp, backend=a.backend, schedule=a.schedule,
                     chunks=a.chunks, microbatches=m, dp_mode=a.dp_mode, bucket_mb=a.bucket_mb,
                     model=a.model, model_cfg=model_cfg, steps=a.steps,
                     batch_size=a.batch_size, lr=a.lr, seed=a.seed, data=a.data,
                     dtype=a.dtype, reduce_dtype=a.reduce_dtype, recompute=a.recompute,
                     compile=a.compile, peak_tflops=a.peak_tflops, metrics=a.metrics,
                     log_every=a.log_every, quiet=a.quiet, timeout=a.timeout, clip_grad=a.clip_grad,
                     warmup=a.warmup, lr_schedule=a.lr_schedule, min_lr=a.min_lr,
                     weight_decay=a.weight_decay, eval_every=a.eval_every,
                     eval_batches=a.eval_batches, save=a.save, save_every=a.save_every,
                     keep=a.keep, resume=resume, start_step=start, ep=a.ep,
                     loss_scale_init=a.loss_scale_init, loss_scale_window=a.loss_scale_window,
                     cp=a.cp, trace=a.trace, deterministic=a.deterministic)


def _refuse(why: str | None) -> None:
    if why:
        raise UsageError(why)


def _check_moe(cfg: GPTConfig, ep: int, dp: int, tp: int = 1, cp: int = 1) -> None:
    """An MoE/EP layout minipar can run (``minipar.moe``), or UsageError (one line)."""
    E = cfg.moe_experts
    for name, value in (("capacity-factor", cfg.capacity_factor), ("moe-aux-coef", cfg.moe_aux_coef),
                        ("moe-z-coef", cfg.moe_z_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
    _refuse(rules.moe_violation(E, cfg.moe_top_k, cfg.moe_every, ep, dp, cfg.n_layer))
    if E == 0:   # an MoE flag on a dense model would be ignored: said instead
        dense = GPTConfig()
        given = [f"--{f.replace('_', '-')}" for f in ("moe_top_k", "moe_every", "capacity_factor",
                                                     "moe_aux_coef", "moe_z_coef")
                 if getattr(cfg, f) != getattr(dense, f)]
        _refuse(given and f"{given[0]} applies to an MoE model; give --moe-experts E too")
        return
    _refuse(rules.moe_tp_violation(cfg.seq_len, tp, cp))


def _check_run_flags(a, model_cfg: GPTConfig) -> tuple[str | None, int]:
    """Schedule, clipping, evaluation and checkpoint flags; returns (checkpoint, its step)."""
    if a.clip_grad is not None:
        _positive("clip-grad", a.clip_grad)
    _positive("min-lr", a.min_lr, strict=False)
    _positive("weight-decay", a.weight_decay, strict=False)
    if a.min_lr > a.lr:
        raise UsageError(f"--min-lr {a.min_lr} is above --lr {a.lr}; the schedule decays from "
                         f"--lr down to --min-lr")
    for name in ("warmup", "eval_every", "save_every", "keep"):
        if getattr(a, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.warmup >= a.steps and a.lr_schedule != "constant":
        raise UsageError(f"--warmup {a.warmup} leaves no step of --steps {a.steps} to decay "
                         f"over; use a --warmup below {a.steps}")
    if a.eval_batches < 1:
        raise UsageError(f"--eval-batches must be >= 1, got {a.eval_batches}")
    if (a.save_every or a.keep) and not a.save:
        raise UsageError("--save-every and --keep need --save DIR")
    if a.save:   # created when the first checkpoint is written
        cli.check_output_folder(a.save, "--save")
    from . import checkpoint
    path, start = None, 0
    if a.resume is not None:
        path = checkpoint.find(a.resume)
        manifest = checkpoint.check(path, model_cfg)
        if manifest["step"] >= a.steps:
            raise UsageError(f"--resume {path} is at step {manifest['step']}: --steps is the final "
                             f"step number, so give --steps above {manifest['step']}")
        start = int(manifest["step"])
    held = checkpoint.complete_checkpoints(a.save) if a.save and os.path.isdir(a.save) else []
    if held and checkpoint.step_of(held[-1]) > start:   # never overwritten, nor --keep's victim
        raise UsageError(f"--save {a.save} already holds {os.path.basename(held[-1])}, past the "
                         f"step this run starts from ({start}); continue it with --resume "
                         f"{a.save}, or give another --save folder")
    return path, start


def _corpus_bytes(path: str | None) -> int:
    if path is None:
        return len(data.load_text(None).encode("utf-8"))
    if os.path.isdir(path):
        raise UsageError(f"--data {path} is a folder; give a text file")
    if not os.path.isfile(path):
        raise UsageError(f"--data {path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    # The corpus is read as UTF-8 text; a binary or differently encoded file would be
    # trained on silently as replacement characters.
    if b"\0" in raw:
        raise UsageError(f"--data {path} looks binary (it holds NUL bytes); give a UTF-8 text file")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--data {path} is not UTF-8 text (byte {e.start}); convert it, "
                         f"e.g. iconv -t UTF-8") from None
    return len(raw)
