"""The GPT trainer: ``python -m minipar.train`` (flags and metrics: CONTRACTS.md section 1).

One training step, whatever the layout::

    engine.zero_grad(); engine.begin_step(m)
    loss = runner.forward_backward(x, y)     # m micro-batches; a pipeline if --pp > 1
    engine.step()                            # gradient sync (DP, ZeRO/AMSP) + optimizer

The paradigms meet here and nowhere else:
  * ``build_model``  the full serial GPT from the seed, then tensor-parallel (``minipar.tp``);
  * ``build_runner`` forward/backward over micro-batches: local, or a pipeline stage (``minipar.pp``);
  * ``build_engine`` the model-state engine: data parallel (``minipar.dp``) or sharded (``minipar.zero``).

Three ways to start: ``--nproc N`` (local processes), ``torchrun``, Slurm ``srun``.
Bad input exits with status 2 and one line, before any process starts.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from . import comm, data, dist, dp
from .dist import UsageError
from .model import PRESETS, build, config


# --------------------------------------------------------------------------------------
# Arguments and validation
# --------------------------------------------------------------------------------------
def parser() -> dist.ArgumentParser:
    p = dist.ArgumentParser(prog="python -m minipar.train",
                                description="Train a small GPT with any mix of DP, TP, PP and "
                                            "ZeRO/AMSP sharding (CONTRACTS.md section 1).")
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
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"],
                   help="pipeline schedule")
    p.add_argument("--chunks", type=int, default=2,
                   help="model chunks per stage for --schedule interleaved")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step per pipeline (default 1, or 2*pp with --pp)")
    p.add_argument("--dp-mode", default="overlapped", choices=list(dp.MODES),
                   help="data-parallel variant when not sharding")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DP gradient bucket size")
    p.add_argument("--model", default="tiny", help=f"size preset: {', '.join(PRESETS)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a text file (default: built-in corpus)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--metrics", default=None, help="write one JSON line per step (rank 0)")
    p.add_argument("--log-every", type=int, default=1, help="progress line every K steps")
    p.add_argument("--quiet", action="store_true", help="no progress lines, summary only")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="with --nproc: kill every rank after this many seconds")
    return p


def world_size_from(args) -> int:
    if args.nproc is not None:
        return args.nproc
    env = dist.env_from_os()
    return env.world_size if env else 1


def validate(args) -> None:
    """Every check that can be made before a process starts; raises UsageError."""
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    for name in ("tp", "pp", "steps", "batch_size", "chunks"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.model not in PRESETS:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}")
    world = world_size_from(args)
    if world % (args.tp * args.pp):
        raise UsageError(f"{world} processes do not divide into tp={args.tp} x pp={args.pp}; "
                         f"use a process count that is a multiple of {args.tp * args.pp}")
    if args.dp is None:
        args.dp = world // (args.tp * args.pp)
    if args.dp < 1 or args.dp * args.tp * args.pp != world:
        raise UsageError(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = "
                         f"{args.dp * args.tp * args.pp}, but there are {world} processes; "
                         f"omit --dp or make the product equal the process count")
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    if args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.batch_size % (args.dp * args.microbatches):
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by dp={args.dp} x "
                         f"microbatches={args.microbatches}; use a multiple of "
                         f"{args.dp * args.microbatches}")
    if args.zero is not None and args.shard is not None:
        raise UsageError("give --zero or --shard, not both (--zero Z is a preset of --shard)")
    if args.log_every < 1:
        raise UsageError(f"--log-every must be >= 1, got {args.log_every}")
    if args.metrics and not os.path.isdir(os.path.dirname(os.path.abspath(args.metrics))):
        raise UsageError(f"--metrics {args.metrics}: its folder does not exist; create it first")
    if args.data is not None and not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data}: no such file")
    cfg = model_config(args)
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {args.seq_len}")
    corpus = (os.path.getsize(args.data) if args.data is not None
              else len(data.load_text(None).encode("utf-8")))
    if corpus < cfg.seq_len + 2:
        raise UsageError(f"the corpus has {corpus} bytes, too few for sequences of {cfg.seq_len} "
                         f"tokens; use a longer --data file or a smaller --seq-len")
    if args.backend == "nccl" or (args.backend == "auto" and args.nproc is not None):
        local = args.nproc if args.nproc is not None else 1
        dist.resolve_backend(args.backend, local)
    if args.tp > 1:
        from . import tp
        tp.validate(cfg, args)
    elif args.sp:
        raise UsageError("--sp splits the sequence inside the tensor-parallel group; it needs --tp > 1")
    if args.pp > 1:
        from . import pp
        pp.validate(cfg, args)
    elif args.schedule == "interleaved":
        raise UsageError("--schedule interleaved needs --pp > 1")
    if args.zero is not None or args.shard is not None:
        from . import zero
        zero.validate(cfg, args)


def model_config(args):
    overrides = {}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    return config(args.model, **overrides)


# --------------------------------------------------------------------------------------
# The three extension points
# --------------------------------------------------------------------------------------
def build_model(args, grid: dist.Grid, device):
    """The full serial model from the seed (same on every rank), then the TP slice of it."""
    model = build(model_config(args), seed=args.seed)
    model.full_params = sum(p.numel() for p in model.parameters())
    if grid.tp > 1:
        from . import tp
        model = tp.parallelize(model, grid, sequence_parallel=args.sp)
    return model.to(device)


class LocalRunner:
    """Forward and backward of m micro-batches on one device (gradient accumulation)."""

    def __init__(self, model, microbatches: int, autocast):
        self.module, self.m, self.autocast = model, microbatches, autocast

    def forward_backward(self, x, y) -> float:
        total = 0.0
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():
                loss = self.module(xb, yb) / self.m
            loss.backward()
            total += loss.item()
        return total


def build_runner(args, grid: dist.Grid, model, autocast):
    if grid.pp > 1:
        from . import pp
        return pp.PipelineRunner(model, grid, schedule=args.schedule,
                                 microbatches=args.microbatches, chunks=args.chunks,
                                 autocast=autocast)
    return LocalRunner(model, args.microbatches, autocast)


def make_optimizer(params, args):
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def build_engine(args, grid: dist.Grid, module):
    if args.zero is not None or args.shard is not None:
        from . import zero
        return zero.build_engine(module, grid, args)
    return dp.DataParallel(module, grid.dp_group, mode=args.dp_mode, bucket_mb=args.bucket_mb,
                           optimizer=make_optimizer(module.parameters(), args))


# --------------------------------------------------------------------------------------
# The loop (runs on every rank)
# --------------------------------------------------------------------------------------
def _autocast_factory(dtype: str, device: torch.device):
    import contextlib
    if dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def collect_state(grid: dist.Grid, runner, engine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameters and gradients in the serial model's names and full shapes.

    Each paradigm undoes its own split, innermost first:
      * ``engine.full_named_parameters()`` -> {local name: (param, grad)} full local tensors
        (ZeRO gathers its shards; plain DP has them already);
      * ``tp.full_tensor(name, tensor, module, grid)`` gathers a TP-split tensor (``minipar.tp``);
      * ``runner.serial_name(local name)`` maps a stage's names to the serial ones (``minipar.pp``).
    Tests merge the dicts of all ranks and compare them with the single-process run.
    """
    if hasattr(engine, "full_named_parameters"):
        named = engine.full_named_parameters()
    else:
        named = {n: (p.detach(), p.grad) for n, p in runner.module.named_parameters()}
    params, grads = {}, {}
    for name, (p, g) in named.items():
        if grid.tp > 1:
            from . import tp
            p = tp.full_tensor(name, p, runner.module, grid)
            g = tp.full_tensor(name, g, runner.module, grid) if g is not None else None
        serial = runner.serial_name(name) if hasattr(runner, "serial_name") else name
        params[serial] = p.detach().cpu().clone()
        grads[serial] = None if g is None else g.detach().cpu().clone()
    return dict(params=params, grads=grads)


def worker(argv: list[str], return_state: bool = False):
    """One rank's training run. Returns the metrics list on rank 0, None elsewhere.

    With ``return_state`` every rank returns ``dict(history=..., params=..., grads=...)``:
    its part of the final parameters and last step's gradients (see ``collect_state``).
    """
    args = parser().parse_args(argv)
    validate(args)
    backend, device = dist.init(args.backend) if dist.env_from_os() else ("none", torch.device("cpu"))
    grid = dist.Grid(dp=args.dp, pp=args.pp, tp=args.tp)
    is_rank0 = grid.rank == 0
    torch.manual_seed(args.seed)

    tokens = data.ByteTokenizer().encode(data.load_text(args.data))
    cfg = model_config(args)
    batches = data.Batches(tokens, cfg.seq_len, args.batch_size, seed=args.seed)
    autocast = _autocast_factory(args.dtype, device)

    model = build_model(args, grid, device)
    runner = build_runner(args, grid, model, autocast)
    engine = build_engine(args, grid, runner.module)

    log = print if (is_rank0 and not args.quiet) else (lambda *a, **k: None)
    log(f"minipar: {grid.dp * grid.pp * grid.tp} rank(s) on {backend} "
        f"(dp={grid.dp} pp={grid.pp} tp={grid.tp}{' sp' if args.sp else ''}"
        f"{', ' + engine_name(args)}), model {args.model} "
        f"({model.full_params:,} params; rank 0's stage and shard: "
        f"{sum(p.numel() for p in runner.module.parameters()):,}), "
        f"global batch {args.batch_size}x{cfg.seq_len} tokens, {args.microbatches} micro-batches")
    metrics_file = open(args.metrics, "w") if (args.metrics and is_rank0) else None
    history = []
    try:
        for step in range(1, args.steps + 1):
            x, y = batches.local_batch(step, grid.dp_rank, grid.dp)
            x, y = x.to(device), y.to(device)
            comm.reset()
            t0 = time.perf_counter()
            engine.zero_grad()
            engine.begin_step(args.microbatches)
            local_loss = runner.forward_backward(x, y)
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
                          tokens_per_s=args.batch_size * cfg.seq_len / peaks[4],
                          model_state_bytes=dict(params=int(peaks[0]), grads=int(peaks[1]),
                                                 optimizer=int(peaks[2]), total=int(peaks[3])),
                          comm_bytes=sent)
            if is_rank0:
                history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if step % args.log_every == 0 or step == args.steps:
                    log(f"step {step:4d}/{args.steps} | loss {record['loss']:.4f} | "
                        f"{record['tokens_per_s']:8.0f} tok/s | {record['step_time_s']*1e3:7.1f} ms | "
                        f"sent {sum(sent.values()) / 2**20:7.2f} MiB")
    finally:
        if metrics_file:
            metrics_file.close()
    if is_rank0:
        print(summary(history, args))
    if return_state:
        return dict(history=history, **collect_state(grid, runner, engine))
    return history if is_rank0 else None


def _maybe_crash(rank: int, step: int) -> None:
    """Fault injection for the tests: MINIPAR_CRASH_AT="rank:step" makes that rank raise."""
    at = os.environ.get("MINIPAR_CRASH_AT")
    if at and at == f"{rank}:{step}":
        raise RuntimeError(f"injected crash on rank {rank} at step {step} (MINIPAR_CRASH_AT)")


def engine_name(args) -> str:
    if args.shard is not None:
        return f"shard {args.shard}"
    if args.zero is not None:
        return f"ZeRO-{args.zero}"
    return f"DP {args.dp_mode}" if args.dp > 1 else "no DP"


def summary(history: list[dict], args) -> str:
    if not history:
        return "no steps run"
    last, first = history[-1], history[0]
    timed = history[1:] or history  # the first step pays for warm-up
    tps = sum(h["tokens_per_s"] for h in timed) / len(timed)
    ms = last["model_state_bytes"]
    sent = last["comm_bytes"]
    lines = [f"summary: {len(history)} steps, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
             f"{tps:,.0f} tokens/s (mean after step 1)",
             f"  model state per rank (max): params {ms['params']:,} B, grads {ms['grads']:,} B, "
             f"optimizer {ms['optimizer']:,} B, total {ms['total']:,} B",
             "  sent by rank 0 in the last step: " +
             (", ".join(f"{op} {b:,} B" for op, b in sorted(sent.items()) if b) or "nothing")]
    return "\n".join(lines)


def run(argv: list[str]) -> list[dict]:
    """Validate, then train (launching --nproc processes if asked); rank 0's metrics."""
    args = parser().parse_args(argv)
    validate(args)
    if args.nproc is not None and dist.env_from_os() is None:
        if args.nproc == 1:
            return worker(argv)
        return dist.launch(worker, args.nproc, argv, backend=args.backend,
                           timeout=args.timeout)[0]
    return worker(argv)


def run_state(argv: list[str], nproc: int, timeout: float = 240.0) -> dict:
    """For tests: train, then merge every rank's final parameters and gradients.

    Returns ``dict(losses=[...], params={serial name: tensor}, grads={...})``.
    """
    if nproc == 1:
        results = [worker(argv, True)]
    else:
        results = dist.launch(worker, nproc, argv, True, timeout=timeout)
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
