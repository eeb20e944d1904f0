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

from . import cli, comm, data, dist, dp, moe, sharding
from .errors import UsageError
from .model import PRESETS, GPTConfig, build, config


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
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--metrics", default=None, help="write one JSON line per step (rank 0)")
    p.add_argument("--log-every", type=int, default=1, help="progress line every K steps")
    p.add_argument("--quiet", action="store_true", help="no progress lines, summary only")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="with --nproc: kill every rank after this many seconds")
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
    metrics: str | None
    log_every: int
    quiet: bool
    timeout: float
    ep: int = 1                    # expert parallelism (MoE: model_cfg.moe_experts > 0)

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
    if a.seq_len is not None and a.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {a.seq_len}")
    model_cfg = config(a.model, **({} if a.seq_len is None else {"seq_len": a.seq_len}))
    model_cfg = dataclasses.replace(model_cfg, moe_experts=a.moe_experts, moe_top_k=a.moe_top_k,
                                    moe_every=a.moe_every, capacity_factor=a.capacity_factor,
                                    moe_aux_coef=a.moe_aux_coef, moe_z_coef=a.moe_z_coef)
    moe.validate(model_cfg, a.ep, d, a.tp, a.pp)
    corpus = _corpus_bytes(a.data)
    if corpus < model_cfg.seq_len + 2:
        raise UsageError(f"the corpus has {corpus} bytes, too few for sequences of "
                         f"{model_cfg.seq_len} tokens; use a longer --data file or a smaller "
                         f"--seq-len")
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
                     dtype=a.dtype, metrics=a.metrics, log_every=a.log_every, quiet=a.quiet,
                     timeout=a.timeout, ep=a.ep)


def _corpus_bytes(path: str | None) -> int:
    if path is None:
        return len(data.load_text(None).encode("utf-8"))
    if os.path.isdir(path):
        raise UsageError(f"--data {path} is a folder; give a text file")
    if not os.path.isfile(path):
        raise UsageError(f"--data {path}: no such file")
    return os.path.getsize(path)


# --------------------------------------------------------------------------------------
# The seams: what a layout is made of
# --------------------------------------------------------------------------------------
class Runner(Protocol):
    """Forward and backward of one step's micro-batches on this rank's part of the model."""

    module: torch.nn.Module

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float: ...

    def serial_name(self, local_name: str) -> str: ...


class Engine(Protocol):
    """The model states (parameters, gradients, optimizer) and their synchronisation."""

    def zero_grad(self) -> None: ...

    def begin_step(self, microbatches: int) -> None: ...

    def step(self) -> None: ...

    def model_state_bytes(self) -> dict[str, int]: ...

    def full_named_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]: ...


def build_model(cfg: RunConfig, grid: dist.Grid, device) -> torch.nn.Module:
    """The full serial model from the seed (same on every rank), then the TP slice of it
    (or, for an MoE, this rank's experts)."""
    model = build(cfg.model_cfg, seed=cfg.seed)
    model.full_params = sum(p.numel() for p in model.parameters())
    if grid.tp > 1:
        from . import tp
        model = tp.parallelize(model, grid, sequence_parallel=cfg.sp)
    if cfg.model_cfg.moe_experts:
        model = moe.expert_parallel(model, grid, cfg.ep)
    return model.to(device)


class LocalRunner:
    """Forward and backward of m micro-batches on one device (gradient accumulation)."""

    def __init__(self, model, microbatches: int, autocast=contextlib.nullcontext):
        self.module, self.m, self.autocast = model, microbatches, autocast

    def forward_backward(self, x, y) -> float:
        total = 0.0
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():
                loss = self.module(xb, yb) / self.m
            loss.backward()
            total += loss.item()
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
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def build_engine(cfg: RunConfig, grid: dist.Grid, module) -> Engine:
    if cfg.spec is not None:
        from . import zero
        return zero.ShardedEngine(module, grid, cfg.spec,
                                  lambda params: make_optimizer(params, cfg.lr))
    # the grid hands out None for a data-parallel group of one; DataParallel reads None as the world
    group = comm.SOLO if grid.dp_group is None else grid.dp_group
    return dp.DataParallel(module, group, mode=cfg.dp_mode, bucket_mb=cfg.bucket_mb,
                           optimizer=make_optimizer(module.parameters(), cfg.lr))


# --------------------------------------------------------------------------------------
# The loop (runs on every rank)
# --------------------------------------------------------------------------------------
def _autocast_factory(dtype: str, device: torch.device):
    if dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


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
    if cfg.backend != "gloo" and torch.cuda.is_available():
        return "none", torch.device("cuda", 0)
    return "none", torch.device("cpu")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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
            f"{_plural(cfg.microbatches, 'micro-batch')}".replace("micro-batchs", "micro-batches")
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
    batches = data.Batches(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    autocast = _autocast_factory(cfg.dtype, device)

    model = build_model(cfg, grid, device)
    runner = build_runner(cfg, grid, model, autocast)
    engine = build_engine(cfg, grid, runner.module)

    log = print if (is_rank0 and not cfg.quiet) else (lambda *a, **k: None)
    log(banner(cfg, backend, device, model.full_params,
               sum(p.numel() for p in runner.module.parameters())))
    metrics_file = open(cfg.metrics, "w") if (cfg.metrics and is_rank0) else None
    history = []
    try:
        for step in range(1, cfg.steps + 1):
            x, y = batches.local_batch(step, grid.dp_rank, grid.dp)
            x, y = x.to(device), y.to(device)
            comm.reset()
            t0 = time.perf_counter()
            engine.zero_grad()
            engine.begin_step(cfg.microbatches)
            local_loss = runner.forward_backward(x, y)
            routing = moe.step_stats(runner.module)   # MoE: aux loss and drops; 0 when dense
            local_loss -= routing["penalty"]          # report the cross-entropy as the loss
            _maybe_crash(grid.rank, step)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            sent = comm.stats.bytes_by_op()
            # The loss lives on the last stage; every TP rank has the same value.
            holds_loss = grid.is_last_stage and grid.tp_rank == 0
            state = engine.model_state_bytes()
            loss_sum, = comm.all_reduce_scalars([local_loss if holds_loss else 0.0], comm.WORLD)
            peaks = comm.all_reduce_scalars([state["params"], state["grads"], state["optimizer"],
                                             state["total"], step_time], comm.WORLD, op="max")
            record = dict(step=step, loss=loss_sum / grid.dp, step_time_s=peaks[4],
                          tokens_per_s=cfg.batch_size * cfg.seq_len / peaks[4],
                          model_state_bytes=dict(params=int(peaks[0]), grads=int(peaks[1]),
                                                 optimizer=int(peaks[2]), total=int(peaks[3])),
                          comm_bytes=sent)
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
                    log(f"step {step:4d}/{cfg.steps} | loss {record['loss']:.4f} | "
                        f"{record['tokens_per_s']:8.0f} tok/s | {record['step_time_s']*1e3:7.1f} ms"
                        f" | rank 0 sent {sum(sent.values()) / 2**20:6.2f} MiB")
    finally:
        if metrics_file:
            metrics_file.close()
    if is_rank0:
        print(summary(history))
    if return_state:
        return dict(history=history, **collect_state(grid, runner, engine))
    return history if is_rank0 else None


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
    lines = [f"summary: {len(history)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
             f"{tps:,.0f} tokens/s (mean after step 1)",
             f"  model state per rank (the largest over ranks): params {ms['params']:,} B, "
             f"grads {ms['grads']:,} B, optimizer {ms['optimizer']:,} B, total {ms['total']:,} B",
             "  sent by rank 0 in the last step: " +
             (", ".join(f"{op} {b:,} B" for op, b in sorted(sent.items()) if b) or "nothing")]
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
    cli.main_guard(run, argv)


if __name__ == "__main__":
    main()
