"""The GPT trainer: ``python -m minipar.train`` (flags and metrics: docs/reference.md).

One training step, whatever the layout::

    engine.zero_grad(); engine.begin_step(m)
    loss = runner.forward_backward(x, y)     # m micro-batches; a pipeline if --pp > 1
    engine.step()                            # gradient sync (DP, ZeRO/AMSP) + optimizer

The flags are parsed and checked once, in ``parse_config``, into a frozen ``RunConfig`` that
every rank receives; nothing below the command line sees argparse. The paradigms meet here
and nowhere else, through three seams that take values:

  * ``build_model``  the full serial GPT from the seed, then tensor-parallel (``minipar.tp``);
  * ``build_runner`` forward/backward over micro-batches: local, or a pipeline stage (``minipar.pp``);
  * ``build_engine`` the model-state engine: data parallel (``minipar.dp``) or sharded (``minipar.zero``).

Three ways to start: ``--nproc N`` (local processes), ``torchrun``, Slurm ``srun``.
Bad input exits with status 2 and one line, before any process starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from . import cli, comm, data, dist, dp, mfu, moe, optim, sharding, trace
from .errors import UsageError
from .model import PRESETS, RECOMPUTE, GPTConfig, build, config
from .precision import DTYPES, MixedPrecision


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
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: world size / (tp*pp))")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage over the data-parallel group (0 = plain DP)")
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
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: bf16 parameters and gradients, fp32 master weights and Adam "
                        "states (2+2+12 bytes per parameter)")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="with --dtype bf16: the dtype gradients are summed in across ranks")
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE),
                   help="activation recomputation: selective = the attention core, "
                        "full = each transformer block")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block's forward")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: looked up from the GPU's "
                        "name; none on a CPU)")
    p.add_argument("--metrics", default=None, help="write one JSON line per step (rank 0)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write every rank's timeline (compute spans, every collective) as a "
                        "Chrome/Perfetto trace; open it at ui.perfetto.dev")
    p.add_argument("--log-every", type=int, default=1, help="progress line every K steps")
    p.add_argument("--quiet", action="store_true", help="no progress lines, summary only")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="with --nproc: kill every rank after this many seconds")
    # a full training run: schedule, clipping, decay, evaluation, checkpoints (minipar.optim,
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
    g.add_argument("--moe-experts", type=int, default=0, metavar="E",
                   help="experts per MoE layer (0: a dense model)")
    g.add_argument("--moe-top-k", type=int, default=2, metavar="K", help="experts per token")
    g.add_argument("--moe-every", type=int, default=1, metavar="N",
                   help="every N-th block's MLP becomes an MoE layer")
    g.add_argument("--capacity-factor", type=float, default=0.0, metavar="C",
                   help="slots per expert and sequence: ceil(C seq_len K / E); 0 = dropless")
    g.add_argument("--moe-aux-coef", type=float, default=0.01, metavar="X",
                   help="load-balancing loss coefficient")
    g.add_argument("--moe-z-coef", type=float, default=0.0, metavar="X",
                   help="router z-loss coefficient")
    g.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert-parallel degree: experts split over N consecutive DP ranks")
    return p


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, checked: what every rank receives (picklable, immutable)."""

    nproc: int | None
    tp: int
    pp: int
    dp: int                        # resolved: world size / (tp * pp) unless given
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
    reduce_dtype: str              # the dtype gradients are reduced in (with dtype bf16)
    recompute: str                 # none, selective, full (also in model_cfg)
    compile: bool
    peak_tflops: float | None      # None: from the device's name (minipar.flops)
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
    trace: str | None = None       # --trace FILE (minipar.trace)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

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
        raise UsageError(f"--{name} must be a positive finite number, got {value}")


def parse_config(argv: list[str]) -> RunConfig:
    """Parse and check the flags; every check that can be made before a process starts.

    Raises UsageError (one line: what is wrong, what would fix it).
    """
    a = parser().parse_args(argv)
    if a.nproc is not None and a.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {a.nproc}")
    for name in ("tp", "pp", "steps", "batch_size", "chunks", "log_every"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    _positive("lr", a.lr)
    _positive("bucket-mb", a.bucket_mb)
    _positive("timeout", a.timeout)
    if a.model not in PRESETS:
        raise UsageError(f"unknown --model {a.model!r}; choose one of {', '.join(PRESETS)}")
    world = world_size_from(a.nproc)
    if world % (a.tp * a.pp):
        raise UsageError(f"{world} processes do not divide into tp={a.tp} x pp={a.pp}; "
                         f"use a process count that is a multiple of {a.tp * a.pp}")
    d = a.dp if a.dp is not None else world // (a.tp * a.pp)
    if d < 1 or d * a.tp * a.pp != world:
        raise UsageError(f"--dp {d} x --tp {a.tp} x --pp {a.pp} = {d * a.tp * a.pp}, but there "
                         f"are {world} processes; omit --dp or make the product equal the "
                         f"process count")
    m = a.microbatches if a.microbatches is not None else (2 * a.pp if a.pp > 1 else 1)
    if m < 1:
        raise UsageError(f"--microbatches must be >= 1, got {m}")
    if a.batch_size % (d * m):
        raise UsageError(f"--batch-size {a.batch_size} is not divisible by dp={d} x "
                         f"microbatches={m}; use a multiple of {d * m}")
    if a.zero is not None and a.shard is not None:
        raise UsageError("give --zero or --shard, not both (--zero Z is a preset of --shard)")
    if a.metrics:
        folder = os.path.dirname(os.path.abspath(a.metrics))
        if os.path.isdir(a.metrics):
            raise UsageError(f"--metrics {a.metrics} is a folder; give a file name")
        if not os.path.isdir(folder):
            raise UsageError(f"--metrics {a.metrics}: its folder does not exist; create it first")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--metrics {a.metrics}: its folder is not writable")
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
    if a.reduce_dtype == "bf16" and a.dtype == "fp32":
        raise UsageError("--reduce-dtype bf16 reduces bf16 gradients; it needs --dtype bf16")
    model_cfg = config(a.model, recompute=a.recompute,
                       **({} if a.seq_len is None else {"seq_len": a.seq_len}))
    model_cfg = dataclasses.replace(model_cfg, moe_experts=a.moe_experts, moe_top_k=a.moe_top_k,
                                    moe_every=a.moe_every, capacity_factor=a.capacity_factor,
                                    moe_aux_coef=a.moe_aux_coef, moe_z_coef=a.moe_z_coef)
    moe.validate(model_cfg, a.ep, d, a.tp, a.pp, a.recompute)
    if model_cfg.moe_experts and a.dtype != "fp32" and (a.zero is not None or a.shard is not None):
        raise UsageError("MoE under ZeRO runs in fp32 only (the experts stay outside the fp32 "
                         "master shards); use --dtype fp32, or plain DP for bf16")
    corpus = _corpus_bytes(a.data)
    if int(corpus * data.HELD_OUT) < model_cfg.seq_len + 2:   # the held-out tenth is the shorter
        raise UsageError(f"the corpus has {corpus} bytes, too few for sequences of "
                         f"{model_cfg.seq_len} tokens in its held-out tenth; use a longer --data file "
                         f"or a smaller --seq-len")
    resume, start = _check_run_flags(a, model_cfg)
    if a.backend == "nccl" or (a.backend == "auto" and a.nproc is not None):
        dist.resolve_backend(a.backend, a.nproc if a.nproc is not None else 1)
    if a.tp > 1:
        from . import tp
        tp.validate(model_cfg, a.tp, a.sp)
    elif a.sp:
        raise UsageError("--sp splits the sequence inside the tensor-parallel group; it needs --tp > 1")
    if a.pp > 1:
        from . import pp
        pp.validate(model_cfg, a.pp, m, a.chunks, a.schedule)
    elif a.schedule == "interleaved":
        raise UsageError("--schedule interleaved needs --pp > 1")
    spec = None
    if a.shard is not None:
        spec = sharding.parse_shard(a.shard)
    elif a.zero is not None:
        spec = sharding.zero_shard(a.zero, d)
    if spec is not None:
        reason = sharding.shard_violation(tuple(spec), d)
        if reason:
            raise UsageError(reason)
        spec = tuple(int(s) for s in spec)
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
                     keep=a.keep, resume=resume, start_step=start, ep=a.ep, trace=a.trace)


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
    if a.save:   # created when the first checkpoint is written; its nearest existing folder
        probe = os.path.abspath(a.save)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise UsageError(f"--save {a.save}: {probe} is a file; give a folder")
        if not os.access(probe, os.W_OK):
            raise UsageError(f"--save {a.save}: {probe} is not writable")
    if a.dtype != "fp32" and (a.weight_decay or a.save or a.resume):
        raise UsageError("--weight-decay, --save and --resume act on the fp32 parameters and do not "
                         "yet handle --dtype bf16's fp32 master copies; use --dtype fp32 for them")
    if a.resume is None:
        return None, 0
    from . import checkpoint
    path = checkpoint.find(a.resume)
    manifest = checkpoint.check(path, model_cfg)
    if manifest["step"] >= a.steps:
        raise UsageError(f"--resume {path} is at step {manifest['step']}: --steps is the final "
                         f"step number, so give --steps above {manifest['step']}")
    return path, int(manifest["step"])


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


# --------------------------------------------------------------------------------------
# The seams: what a layout is made of
# --------------------------------------------------------------------------------------
class Runner(Protocol):
    """Forward and backward of one step's micro-batches on this rank's part of the model."""

    module: torch.nn.Module

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | float:
        """The sum of the micro-batches' loss / m, as a 0-d tensor left on the device (read
        once per step, for the metrics) or 0.0 where this rank holds no loss."""

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float: ...

    def serial_name(self, local_name: str) -> str: ...


class Engine(Protocol):
    """The model states (parameters, gradients, optimizer) and their synchronisation."""

    def zero_grad(self) -> None: ...

    def begin_step(self, microbatches: int) -> None: ...

    def step(self) -> None: ...

    def model_state_bytes(self) -> dict[str, int]: ...

    def full_named_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]: ...

    # what its optimizer updates, as flat ranges of local parameters (minipar.pieces: the
    # global gradient norm, checkpoints); and re-gathering parameters set outside step()
    optimizer: torch.optim.Optimizer

    def flat_ranges(self) -> list[tuple[str, torch.Size, int, dict[str, torch.Tensor], bool]]: ...

    def sync_params(self) -> None: ...


def build_model(cfg: RunConfig, grid: dist.Grid, device) -> torch.nn.Module:
    """The full serial model from the seed (same on every rank), then the TP slice of it, in
    the run's dtype (bf16: the parameters themselves; ``build_engine`` adds fp32 masters), or
    for an MoE this rank's experts.

    ``cfg.model_cfg.recompute`` is honoured by the Blocks themselves; ``--compile`` compiles
    each Block's forward (module hooks, such as ZeRO-3's gathers, stay outside the graph)."""
    model = build(cfg.model_cfg, seed=cfg.seed)
    model.full_params = sum(p.numel() for p in model.parameters())
    if grid.tp > 1:
        from . import tp
        model = tp.parallelize(model, grid, sequence_parallel=cfg.sp)
    if cfg.model_cfg.moe_experts:
        model = moe.expert_parallel(model, grid, cfg.ep)
    model = model.to(device=device, dtype=DTYPES[cfg.dtype])
    if cfg.compile:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    return model


class LocalRunner:
    """Forward and backward of m micro-batches on one device (gradient accumulation)."""

    def __init__(self, model, microbatches: int, autocast=contextlib.nullcontext):
        self.module, self.m, self.autocast = model, microbatches, autocast

    def forward_backward(self, x, y) -> torch.Tensor:
        total = torch.zeros((), device=x.device)
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():
                loss = self.module(xb, yb) / self.m
            loss.backward()
            total += loss.detach()      # on the device: no host sync per micro-batch
        return total

    @torch.no_grad()
    def evaluate(self, x, y) -> float:
        total = 0.0
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():
                total += (self.module(xb, yb) / self.m).item()
        return total

    def serial_name(self, local_name: str) -> str:
        return local_name


def build_runner(cfg: RunConfig, grid: dist.Grid, model, autocast=contextlib.nullcontext) -> Runner:
    if grid.pp > 1:
        from . import pp
        return pp.PipelineRunner(model, grid, schedule=cfg.schedule,
                                 microbatches=cfg.microbatches, chunks=cfg.chunks,
                                 autocast=autocast)
    return LocalRunner(model, cfg.microbatches, autocast)


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW; torch's fused CUDA kernel when every parameter is on a GPU (one launch)."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             **({"fused": True} if fused else {}))


def build_engine(cfg: RunConfig, grid: dist.Grid, module) -> Engine:
    """DP or ZeRO/AMSP; with bf16, the optimizer updates fp32 masters (``minipar.precision``)
    and gradients are reduced in ``--reduce-dtype``."""
    def optimizer(params):
        if cfg.dtype == "fp32":
            return make_optimizer(params, cfg.lr)
        return MixedPrecision(params, lambda masters: make_optimizer(masters, cfg.lr))

    reduce_dtype = DTYPES[cfg.reduce_dtype] if cfg.dtype != "fp32" else None
    if cfg.spec is not None:
        from . import zero
        return zero.ShardedEngine(module, grid, cfg.spec, optimizer, reduce_dtype=reduce_dtype)
    # the grid hands out None for a data-parallel group of one; DataParallel reads None as the world
    group = comm.SOLO if grid.dp_group is None else grid.dp_group
    return dp.DataParallel(module, group, mode=cfg.dp_mode, bucket_mb=cfg.bucket_mb,
                           optimizer=optimizer(module.parameters()), reduce_dtype=reduce_dtype)


# --------------------------------------------------------------------------------------
# The loop (runs on every rank)
# --------------------------------------------------------------------------------------
def _autocast_factory(dtype: str, device: torch.device):
    """No autocast: with --dtype bf16 the parameters themselves are bf16 (``build_model``),
    so every matmul runs in bf16 without casting fp32 weights at each use. (The seam stays
    for runners that want one.)"""
    return contextlib.nullcontext


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device; on a GPU from pinned memory, without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def collect_state(grid: dist.Grid, runner: Runner, engine: Engine) -> dict:
    """This rank's parameters and gradients in the serial model's names and full shapes.

    Each paradigm undoes its own split, innermost first:
      * ``engine.full_named_parameters()`` -> {local name: (param, grad)} full local tensors
        (ZeRO gathers its shards; plain DP has them already);
      * ``tp.full_tensor(name, tensor, module, grid)`` gathers a TP-split tensor (``minipar.tp``);
      * ``runner.serial_name(local name)`` maps a stage's names to the serial ones (``minipar.pp``).
    Tests merge the dicts of all ranks and compare them with the single-process run.
    """
    params, grads = {}, {}
    for name, (p, g) in engine.full_named_parameters().items():
        if grid.tp > 1:
            from . import tp
            p = tp.full_tensor(name, p, runner.module, grid)
            g = tp.full_tensor(name, g, runner.module, grid) if g is not None else None
        serial = runner.serial_name(name)
        params[serial] = p.detach().cpu().clone()
        grads[serial] = None if g is None else g.detach().cpu().clone()
    return dict(params=params, grads=grads)


def _start(cfg: RunConfig) -> tuple[str, torch.device]:
    """Join the process group (torchrun, srun, --nproc) or pick the single process's device."""
    if dist.env_from_os():
        return dist.init(cfg.backend)
    _, device, note = dist.resolve(cfg.backend, 1)     # one process: the same device rule
    if note:
        print(note, flush=True)
    return "none", device


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('s', 'h')) else 's'}"


def banner(cfg: RunConfig, backend: str, device: torch.device, full_params: int,
           local_params: int) -> str:
    where = (f"{_plural(cfg.world, 'process')}, {backend} on {device.type}" if backend != "none"
             else f"1 process on {device}")
    layout = f"dp={cfg.dp} pp={cfg.pp} tp={cfg.tp}{' +sp' if cfg.sp else ''}, {engine_name(cfg)}"
    held = ("" if local_params == full_params else
            f"; rank 0's {'experts and rest' if cfg.ep > 1 else 'pipeline stage and TP slice'}: "
            f"{local_params:,}")
    return (f"minipar: {where} ({layout}), model {cfg.model} ({full_params:,} parameters{held}), "
            f"global batch {cfg.batch_size} x {cfg.seq_len} tokens in "
            f"{_plural(cfg.microbatches, 'micro-batch')}"
            + (f", MoE {cfg.model_cfg.moe_experts} experts top-{cfg.model_cfg.moe_top_k} ep={cfg.ep}"
               if cfg.model_cfg.moe_experts else ""))


def worker(cfg: RunConfig, return_state: bool = False):
    """One rank's training run. Returns the metrics list on rank 0, None elsewhere.

    With ``return_state`` every rank returns ``dict(history=..., params=..., grads=...)``:
    its part of the final parameters and last step's gradients (see ``collect_state``).
    """
    backend, device = _start(cfg)
    grid = dist.Grid(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    is_rank0 = grid.rank == 0
    torch.manual_seed(cfg.seed)

    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    train_tokens, val_tokens = data.split(tokens)
    batches = data.Batches(train_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    val_batches = data.Batches(val_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    autocast = _autocast_factory(cfg.dtype, device)

    model = build_model(cfg, grid, device)
    runner = build_runner(cfg, grid, model, autocast)
    engine = build_engine(cfg, grid, runner.module)

    flops = mfu.step_flops(cfg.model_cfg, cfg.batch_size, cfg.recompute)
    peak = cfg.peak_tflops or (mfu.peak_tflops(torch.cuda.get_device_name(device), cfg.dtype)
                               if device.type == "cuda" else None)
    log = print if (is_rank0 and not cfg.quiet) else (lambda *a, **k: None)
    log(banner(cfg, backend, device, model.full_params,
               sum(p.numel() for p in runner.module.parameters())))
    if cfg.resume:
        from . import checkpoint
        saved = checkpoint.load(cfg.resume, grid, runner, engine)
        log(f"resumed from {cfg.resume} (step {saved['step']}, saved as "
            f"{_layout_words(saved['layout'])})")
        _note_changed_training(log, saved["training"], cfg)
    hook = optim.install(grid, runner, engine, clip=cfg.clip_grad, weight_decay=cfg.weight_decay)
    progress = Progress(cfg.start_step, cfg.steps, show_eta=is_rank0 and sys.stdout.isatty())
    # a resumed run appends to its metrics file; a fresh one starts it
    metrics_file = (open(cfg.metrics, "a" if cfg.resume else "w")
                    if (cfg.metrics and is_rank0) else None)
    history = []
    tracer = trace.start(grid.rank) if cfg.trace else None
    if tracer:
        trace.instrument(runner.module)
    try:
        for step in range(cfg.start_step + 1, cfg.steps + 1):
            lr = optim.lr_at(step, cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule, cfg.min_lr)
            optim.set_lr(engine.optimizer, lr)
            x, y = batches.local_batch(step, grid.dp_rank, grid.dp)
            x, y = to_device(x, device), to_device(y, device)
            comm.reset()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            engine.zero_grad()
            engine.begin_step(cfg.microbatches)
            with trace.span("forward + backward"):
                local_loss = runner.forward_backward(x, y)
            routing = moe.step_stats(runner.module)   # MoE: aux loss and drops; 0 when dense
            local_loss -= routing["penalty"]          # report the cross-entropy as the loss
            _maybe_crash(grid.rank, step)
            with trace.span("optimizer step (gradient sync + update)"):
                engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            if tracer:
                tracer.complete(f"step {step}", t0, t0 + step_time, cat="step")
            sent = comm.stats.bytes_by_op()
            waited = comm.stats.seconds_by_op()
            # The loss lives on the last stage; every TP rank has the same value.
            holds_loss = grid.is_last_stage and grid.tp_rank == 0
            state = engine.model_state_bytes()
            memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            loss_sum, = comm.all_reduce_scalars([float(local_loss) if holds_loss else 0.0],
                                                comm.WORLD)
            peaks = comm.all_reduce_scalars([state["params"], state["grads"], state["optimizer"],
                                             state["total"], step_time, memory], comm.WORLD,
                                            op="max")
            record = dict(step=step, loss=loss_sum / grid.dp, step_time_s=peaks[4],
                          tokens_per_s=cfg.batch_size * cfg.seq_len / peaks[4],
                          model_state_bytes=dict(params=int(peaks[0]), grads=int(peaks[1]),
                                                 optimizer=int(peaks[2]), total=int(peaks[3])),
                          comm_bytes=sent, comm_seconds=waited, grad_norm=hook.grad_norm, lr=lr,
                          **mfu.utilisation(flops, peaks[4], peak, cfg.world))
            if device.type == "cuda":
                record["peak_memory_bytes"] = int(peaks[5])
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                record["val_loss"] = evaluate(cfg, grid, runner, val_batches, device)
                moe.step_stats(runner.module)     # MoE: forget the evaluation's routing
            if cfg.model_cfg.moe_experts:
                aux, dropped, assigned = comm.all_reduce_scalars(
                    [routing["aux_loss"], routing["dropped"], routing["assigned"]], comm.WORLD)
                record.update(aux_loss=aux / cfg.world, drop_rate=dropped / assigned)
            if is_rank0:
                history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if step % cfg.log_every == 0 or step == cfg.steps:
                    util = f" | MFU {record['mfu']:5.1%}" if record["mfu"] is not None else ""
                    val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
                    log(f"step {step:4d}/{cfg.steps} | loss {record['loss']:.4f} | "
                        f"{record['tokens_per_s']:8.0f} tok/s | {record['step_time_s']*1e3:7.1f} ms"
                        f" | rank 0 sent {sum(sent.values()) / 2**20:6.2f} MiB{val}{util}"
                        f"{progress.eta(step)}")
            if cfg.save and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
                from . import checkpoint
                manifest = checkpoint.manifest_for(cfg, step, tokens.numel())
                log(f"saved {checkpoint.save(cfg.save, step, manifest, grid, runner, engine, cfg.keep)}")
    finally:
        if metrics_file:
            metrics_file.close()
        trace.stop()
    if tracer:
        with comm.untracked():
            trace.gather_and_write(cfg.trace, tracer)
        log(f"trace of every rank written to {cfg.trace} (open it at ui.perfetto.dev)")
    if is_rank0:
        print(summary(history))
    if return_state:
        return dict(history=history, **collect_state(grid, runner, engine))
    return history if is_rank0 else None


def evaluate(cfg: RunConfig, grid: dist.Grid, runner: Runner, batches: data.Batches,
             device) -> float:
    """Mean held-out loss over ``cfg.eval_batches`` global batches (always the same ones),
    through the same runner (pipeline, TP) without gradients."""
    total = 0.0
    for i in range(1, cfg.eval_batches + 1):
        x, y = batches.local_batch(i, grid.dp_rank, grid.dp)
        total += runner.evaluate(x.to(device), y.to(device))
    holds_loss = grid.is_last_stage and grid.tp_rank == 0
    loss_sum, = comm.all_reduce_scalars([total if holds_loss else 0.0], comm.WORLD)
    return loss_sum / (grid.dp * cfg.eval_batches)


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


def _layout_words(layout: dict) -> str:
    sharding = (f", shard {layout['shard']}" if layout.get("shard") else
                f", ZeRO-{layout['zero']}" if layout.get("zero") is not None else "")
    return (f"dp={layout['dp']} pp={layout['pp']} tp={layout['tp']}"
            f"{' +sp' if layout.get('sp') else ''}{sharding}")


def _note_changed_training(log, saved: dict, cfg: RunConfig) -> None:
    """Say in one line which training flags differ from the checkpoint's (never silently)."""
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in
               ("batch_size", "seed", "lr", "lr_schedule", "warmup", "min_lr", "weight_decay",
                "clip_grad", "dtype") if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        log("note: continuing with other training flags than the checkpoint's: " + ", ".join(changed))


def _maybe_crash(rank: int, step: int) -> None:
    """Fault injection for the tests: MINIPAR_CRASH_AT="rank:step" makes that rank raise."""
    at = os.environ.get("MINIPAR_CRASH_AT")
    if at and at == f"{rank}:{step}":
        raise RuntimeError(f"injected crash on rank {rank} at step {step} (MINIPAR_CRASH_AT)")


def engine_name(cfg: RunConfig) -> str:
    if cfg.shard is not None:
        return f"shard {cfg.shard}"
    if cfg.zero is not None:
        return f"ZeRO-{cfg.zero}"
    return f"DP {cfg.dp_mode}" if cfg.dp > 1 else "no DP"


def summary(history: list[dict]) -> str:
    if not history:
        return "no steps run"
    last, first = history[-1], history[0]
    timed = history[1:] or history  # the first step pays for warm-up
    tps = sum(h["tokens_per_s"] for h in timed) / len(timed)
    ms = last["model_state_bytes"]
    sent = last["comm_bytes"]
    util = ""
    if last.get("mfu") is not None:
        mean = lambda key: sum(h[key] for h in timed) / len(timed)   # noqa: E731
        util = f", MFU {mean('mfu'):.1%} (HFU {mean('hfu'):.1%})"
    lines = [f"summary: {len(history)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
             f"{tps:,.0f} tokens/s (mean after step 1){util}",
             f"  model state per rank (the largest over ranks): params {ms['params']:,} B, "
             f"grads {ms['grads']:,} B, optimizer {ms['optimizer']:,} B, total {ms['total']:,} B",
             *([f"  held-out loss {evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}"]
               if (evals := [h for h in history if "val_loss" in h]) else []),
             "  sent by rank 0 in the last step: " +
             (", ".join(f"{op} {b:,} B" for op, b in sorted(sent.items()) if b) or "nothing")]
    if "peak_memory_bytes" in last:
        peak = max(h["peak_memory_bytes"] for h in history)
        lines.append(f"  peak GPU memory (torch.cuda.max_memory_allocated, the largest over "
                     f"ranks): {peak / 2**30:.2f} GiB")
    return "\n".join(lines)


def run(argv: list[str]) -> list[dict]:
    """Check the flags, then train (launching --nproc processes if asked); rank 0's metrics."""
    cfg = parse_config(argv)
    if cfg.nproc is not None and cfg.nproc > 1 and dist.env_from_os() is None:
        return dist.launch(worker, cfg.nproc, cfg, backend=cfg.backend, timeout=cfg.timeout)[0]
    return worker(cfg)


def run_state(argv: list[str], nproc: int, timeout: float = 240.0) -> dict:
    """For tests: train, then merge every rank's final parameters and gradients.

    Returns ``dict(losses=[...], history=[...], params={serial name: tensor}, grads={...})``.
    """
    cfg = dataclasses.replace(parse_config(argv + ["--nproc", str(nproc)]), quiet=True)
    if nproc == 1:
        results = [worker(cfg, return_state=True)]
    else:
        results = dist.launch(worker, nproc, cfg, return_state=True, timeout=timeout)
    params, grads = {}, {}
    for r in results:
        params.update(r["params"])
        grads.update(r["grads"])
    return dict(losses=[h["loss"] for h in results[0]["history"]], history=results[0]["history"],
                params=params, grads=grads)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # A torchrun/srun rank ends through dist.finish (no interpreter finalization); a
    # plain process or the --nproc launcher as any CLI does.
    dist.run_main(run, argv)


if __name__ == "__main__":
    main()
