"""The GPT trainer: ``python -m minipar.train`` (flags and metrics: docs/reference.md).

One training step, whatever the layout::

    engine.zero_grad(); engine.begin_step(m)
    loss = runner.forward_backward(x, y)     # m micro-batches; a pipeline if --pp > 1
    engine.step()                            # gradient sync (DP, ZeRO/AMSP) + optimizer

The flags are parsed and checked once (``minipar.config.parse_config``) into a frozen
``RunConfig`` that every rank receives; what a run prints is ``minipar.report``'s. The
paradigms meet here and nowhere else, through values:

  * ``Mesh``          the named axes dp, pp, cp, tp (and ep inside dp): every process group;
  * ``PrecisionPolicy`` parameter/reduce/master dtypes and the fp16 loss scaler;
  * ``param_groups``  which parameters reduce over which axis (dense: dp_cp; experts: edp);
  * ``build_model``  the full serial GPT from the seed, then tensor-parallel (``minipar.tp``),
                     then expert-parallel (``minipar.moe``), in the policy's dtype;
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
from typing import Protocol

import torch

from . import comm, data, dist, dp, mfu, moe, optim, steplog, trace
from .config import RunConfig, parse_config, parser, world_size_from  # noqa: F401  (re-exported)
from .groups import ParamGroup, param_groups
from .mesh import Mesh
from .model import Block, build
from .precision import MixedPrecision, PrecisionPolicy
from .report import Progress, banner, engine_name, layout_words, note_changed_training, step_line, summary  # noqa: F401,E501


# --------------------------------------------------------------------------------------
# The seams: what a layout is made of
# --------------------------------------------------------------------------------------
class Runner(Protocol):
    """Forward and backward of one step's micro-batches on this rank's part of the model."""

    module: torch.nn.Module

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | float:
        """The sum of the micro-batches' loss / m, as a 0-d tensor left on the device (read
        once per step, for the metrics) or 0.0 where this rank holds no loss. Under a loss
        scaler the backward starts from loss * scale; the returned loss is unscaled."""

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


def build_mesh(cfg: RunConfig) -> Mesh:
    return Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, ep=cfg.ep)


def build_policy(cfg: RunConfig) -> PrecisionPolicy:
    return PrecisionPolicy.from_name(cfg.dtype, reduce=cfg.reduce_dtype,
                                     loss_scale_init=cfg.loss_scale_init,
                                     loss_scale_window=cfg.loss_scale_window)


def serial_params(cfg: RunConfig) -> int:
    """The serial model's parameter count (from shapes alone, nothing allocated)."""
    from .checkpoint import serial_shapes
    return sum(math.prod(shape) for shape in serial_shapes(cfg.model_cfg).values())


def build_model(cfg: RunConfig, grid: Mesh, device,
                policy: PrecisionPolicy | None = None) -> torch.nn.Module:
    """The full serial model from the seed (same on every rank), then the TP slice of it, then
    this rank's experts, in the policy's parameter dtype (16-bit: the parameters themselves;
    ``build_engine`` adds fp32 masters).

    With ``--cp`` every block's attention becomes ring attention over the cp axis and the
    embedding adds the positions of this rank's two chunks (``minipar.cp``).
    ``cfg.model_cfg.recompute`` is honoured by the Blocks themselves; ``--compile`` compiles
    each Block's forward (module hooks, such as ZeRO-3's gathers, stay outside the graph)."""
    policy = policy or build_policy(cfg)
    model = build(cfg.model_cfg, seed=cfg.seed)
    if grid.tp > 1:
        from . import tp
        model = tp.parallelize(model, grid, sequence_parallel=cfg.sp)
    if cfg.model_cfg.moe_experts:
        model = moe.expert_parallel(model, grid, cfg.ep)
    model = model.to(device=device, dtype=policy.param_dtype)
    if cfg.cp > 1:
        from . import cp
        model = cp.parallelize(model, grid.group("cp"), cfg.seq_len)
    if cfg.compile:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    return model


class LocalRunner:
    """Forward and backward of m micro-batches on one device (gradient accumulation)."""

    def __init__(self, model, microbatches: int, autocast=contextlib.nullcontext,
                 loss_scaler=None):
        self.module, self.m, self.autocast = model, microbatches, autocast
        self.loss_scaler = loss_scaler      # fp16: backward from loss * scale

    def forward_backward(self, x, y) -> torch.Tensor:
        total = torch.zeros((), device=x.device)
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():
                loss = self.module(xb, yb) / self.m
            (loss if self.loss_scaler is None else loss * self.loss_scaler.scale).backward()
            # report the cross-entropy: less what MoE's aux and z losses added (0.0 if dense);
            # on the device: no host sync per micro-batch
            total += (loss - moe.penalty(self.module) / self.m).detach()
        return total

    @torch.no_grad()
    def evaluate(self, x, y) -> float:
        total = 0.0
        for xb, yb in data.microbatches(x, y, self.m):
            with self.autocast():    # the held-out loss is the cross-entropy: MoE's losses out
                total += ((self.module(xb, yb) - moe.penalty(self.module)) / self.m).item()
        return total

    def serial_name(self, local_name: str) -> str:
        return local_name


def build_runner(cfg: RunConfig, grid: Mesh, model, autocast=contextlib.nullcontext,
                 policy: PrecisionPolicy | None = None) -> Runner:
    scaler = policy.loss_scaler if policy is not None else None
    if grid.pp > 1:
        from . import pp, tp
        return pp.PipelineRunner(model, grid, schedule=cfg.schedule,
                                 microbatches=cfg.microbatches, chunks=cfg.chunks,
                                 autocast=autocast, loss_scaler=scaler,
                                 seq_split=tp.activation_seq_split(cfg.tp, cfg.sp))
    return LocalRunner(model, cfg.microbatches, autocast, loss_scaler=scaler)


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW; torch's fused CUDA kernel when every parameter is on a GPU (one launch)."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             **({"fused": True} if fused else {}))


def DataAxis(grid: Mesh):
    """The mesh as the sharded engine sees it with ``--cp``: dp x cp (``"dp_cp"``) as its one
    data-parallel axis. Every cp rank holds the whole model, so its gradients are averaged, and
    its states sharded, over dp x cp ranks exactly as over data-parallel ones."""
    from . import zero

    class _DataAxis(zero.GroupGrid):
        def __init__(self):
            super().__init__(grid.group("dp_cp"))
            self.dp, self.dp_rank = grid.size("dp_cp"), grid.coord("dp_cp")

        def lines(self, axis: str):
            return grid.lines("dp_cp")

        def new_groups(self, rank_lists, name):
            return grid.new_groups(rank_lists, name)

    return _DataAxis()


def build_engine(cfg: RunConfig, grid: Mesh, module, policy: PrecisionPolicy | None = None,
                 groups: list[ParamGroup] | None = None) -> Engine:
    """The one place a layout becomes engines: DP (over the ``dp_cp`` axis, experts over
    ``edp``) or ZeRO/AMSP; under a 16-bit policy the optimizer updates fp32 masters
    (``minipar.precision``) and gradients are reduced in the policy's reduce dtype."""
    policy = policy or build_policy(cfg)
    groups = groups if groups is not None else param_groups(module, grid)

    def optimizer(params):
        if not policy.mixed:
            return make_optimizer(params, cfg.lr)
        return MixedPrecision(params, lambda masters: make_optimizer(masters, cfg.lr),
                              loss_scaler=policy.loss_scaler)

    reduce_dtype = policy.reduce_dtype if policy.mixed else None
    if cfg.spec is not None:
        from . import zero
        data_axis = grid if cfg.cp == 1 else DataAxis(grid)
        return zero.ShardedEngine(module, data_axis, cfg.spec, optimizer, units=module.parts(),
                                  reduce_dtype=reduce_dtype, groups=groups)
    dense = grid.group("dp_cp")
    return dp.DataParallel(module, comm.SOLO if dense is None else dense, mode=cfg.dp_mode,
                           bucket_mb=cfg.bucket_mb, optimizer=optimizer(module.parameters()),
                           reduce_dtype=reduce_dtype,
                           # experts with ep = 1 reduce over the dense group itself: no group of their own
                           own_groups=[g for g in groups if g.group is not dense])


# --------------------------------------------------------------------------------------
# The loop (runs on every rank)
# --------------------------------------------------------------------------------------
def pinned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in pinned host memory (one copy, whatever ``t``'s strides:
    ``Batches`` hands out strided views, which ``pin_memory()`` would keep strided)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device; on a GPU from contiguous pinned memory, without blocking the host."""
    if device.type == "cuda":
        return pinned(t).to(device, non_blocking=True)
    return t.to(device)


def worker(cfg: RunConfig, return_state: bool = False):
    """One rank's training run. Returns the metrics list on rank 0, None elsewhere.

    With ``return_state`` every rank returns ``dict(history=..., params=..., grads=...)``:
    its part of the final parameters and last step's gradients (see ``collect_state``).
    """
    backend, device = _start(cfg)
    mesh = build_mesh(cfg)
    policy = build_policy(cfg)
    is_rank0 = mesh.rank == 0
    torch.manual_seed(cfg.seed)

    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    train_tokens, val_tokens = data.split(tokens)
    batches = data.Batches(train_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    val_batches = data.Batches(val_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)

    model = build_model(cfg, mesh, device, policy)
    runner = build_runner(cfg, mesh, model, policy=policy)
    engine = build_engine(cfg, mesh, runner.module, policy, param_groups(runner.module, mesh))

    faults = Faults(mesh.rank, runner.module)
    log = print if (is_rank0 and not cfg.quiet) else (lambda *a, **k: None)
    log(banner(cfg, backend, device, serial_params(cfg),
               sum(p.numel() for p in runner.module.parameters())))
    if cfg.resume:
        _resume(cfg, mesh, runner, engine, policy, log)
    hook = optim.install(mesh, runner, engine, clip=cfg.clip_grad, weight_decay=cfg.weight_decay)
    flops = mfu.step_flops(cfg.model_cfg, cfg.batch_size, cfg.recompute)
    peak = cfg.peak_tflops or (mfu.peak_tflops(torch.cuda.get_device_name(device), cfg.dtype)
                               if device.type == "cuda" else None)
    progress = Progress(cfg.start_step, cfg.steps, show_eta=is_rank0 and sys.stdout.isatty())
    # host syncs and metric collectives on logging steps only (minipar.steplog)
    steps = steplog.StepLog(cfg.log_every, cfg.steps, cfg.batch_size * cfg.seq_len, flops, peak,
                            cfg.world, mesh.dp * mesh.cp, device)
    # a resumed run appends to its metrics file; a fresh one starts it
    metrics_file = (open(cfg.metrics, "a" if cfg.resume else "w")
                    if (cfg.metrics and is_rank0) else None)
    history = []
    tracer = trace.start(mesh.rank) if cfg.trace else None
    if tracer:
        trace.instrument(runner.module, Block)
    try:
        for step in range(cfg.start_step + 1, cfg.steps + 1):
            lr = optim.lr_at(step, cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule, cfg.min_lr)
            optim.set_lr(engine.optimizer, lr)
            x, y = local_tokens(batches, step, mesh)
            x, y = to_device(x, device), to_device(y, device)
            evaluating = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
            saving = bool(cfg.save) and (step == cfg.steps or
                                         bool(cfg.save_every and step % cfg.save_every == 0))
            logging = steps.is_logging(step, also=evaluating or saving)
            hook.measure = logging                    # the norm: only when clipping or logging
            comm.stats.device_timing = logging        # NCCL: CUDA events on logging steps only
            comm.reset()
            steps.begin_step()
            t_step = time.perf_counter()
            scale = policy.loss_scaler.scale if policy.loss_scaler else None
            hook.grad_norm = None                     # a skipped step measures none
            faults.arm(step)

            engine.zero_grad()
            engine.begin_step(cfg.microbatches)
            with trace.span("forward + backward"):
                local_loss = runner.forward_backward(x, y)
            routing = moe.step_stats(runner.module)   # MoE: aux loss and drops; 0 when dense
            faults.crash(step)
            with trace.span("optimizer step (gradient sync + update)"):
                engine.step()

            # the loss lives on the last stage and every TP rank has it: one per replica counts
            holds_loss = mesh.is_last_stage and mesh.tp_rank == 0
            if tracer:                                # host time: no sync for the trace
                tracer.complete(f"step {step}", t_step, time.perf_counter(), cat="step")
            records = steps.end_step(step, lr, local_loss, holds_loss, logging, engine,
                                     lambda: hook.grad_norm)
            if not logging:
                continue
            record = records[-1]
            if cfg.model_cfg.moe_experts:
                # each rank holds its share (its stage's layers, its TP slice of the tokens) of
                # its replica's batch: summed over the world, averaged over the dp x cp replicas
                aux, z, dropped, assigned = comm.all_reduce_scalars(
                    [routing["aux_loss"], routing["z_loss"], routing["dropped"],
                     routing["assigned"]], comm.WORLD)
                replicas = cfg.dp * cfg.cp
                record.update(aux_loss=aux / replicas, z_loss=z / replicas,
                              drop_rate=dropped / assigned)
            if policy.loss_scaler is not None:
                record.update(loss_scale=scale, skipped_steps=policy.loss_scaler.skipped_steps)
            if evaluating:
                record["val_loss"] = evaluate(cfg, mesh, runner, val_batches, device)
                moe.step_stats(runner.module)     # MoE: forget the evaluation's routing
            if is_rank0:
                history.extend(records)
                if metrics_file:
                    metrics_file.write("".join(json.dumps(r) + "\n" for r in records))
                    metrics_file.flush()
                log(step_line(record, cfg.steps, progress))
            if saving:
                from . import checkpoint
                manifest = checkpoint.manifest_for(cfg, step, tokens.numel(), policy.loss_scaler)
                log(f"saved {checkpoint.save(cfg.save, step, manifest, mesh, runner, engine, cfg.keep)}")
    finally:
        comm.stats.device_timing = True
        if metrics_file:
            metrics_file.close()
        trace.stop()
    if tracer:
        with comm.untracked():
            trace.gather_and_write(cfg.trace, tracer)
        log(f"trace of every rank written to {cfg.trace} (open it at ui.perfetto.dev)"
            + ("; its times are the host's launch times, not GPU time (NCCL runs asynchronously)"
               if backend == "nccl" else ""))
    if is_rank0:
        print(summary(history))
    if return_state:
        return dict(history=history, **collect_state(mesh, runner, engine))
    return history if is_rank0 else None


def evaluate(cfg: RunConfig, grid: Mesh, runner: Runner, batches: data.Batches,
             device) -> float:
    """Mean held-out loss over ``cfg.eval_batches`` global batches (always the same ones),
    through the same runner (pipeline, TP) without gradients."""
    total = 0.0
    for i in range(1, cfg.eval_batches + 1):
        x, y = local_tokens(batches, i, grid)
        total += runner.evaluate(x.to(device), y.to(device))
    holds_loss = grid.is_last_stage and grid.tp_rank == 0
    loss_sum, = comm.all_reduce_scalars([total if holds_loss else 0.0], comm.WORLD)
    return loss_sum / (grid.dp * grid.cp * cfg.eval_batches)


def local_tokens(batches: data.Batches, step: int, mesh: Mesh):
    """This rank's sequences of the global batch (its dp slice) and, with ``--cp``, its two
    load-balanced chunks of each (``minipar.cp``). Every cp rank holds as many tokens, so the
    mean of the ranks' mean losses is the mean over every token of the global batch."""
    x, y = batches.local_batch(step, mesh.dp_rank, mesh.dp)
    if mesh.cp > 1:
        from . import cp
        x, y = (cp.shard_sequence(t, mesh.cp, mesh.coord("cp")) for t in (x, y))
    return x, y


def _resume(cfg: RunConfig, mesh: Mesh, runner: Runner, engine: Engine,
            policy: PrecisionPolicy, log) -> None:
    """Parameters (fp32 masters under mixed precision), Adam, RNG and the loss scaler."""
    from . import checkpoint
    saved = checkpoint.load(cfg.resume, mesh, runner, engine)
    if policy.loss_scaler is not None and saved.get("loss_scaler"):
        policy.loss_scaler.load_state_dict(saved["loss_scaler"])
    log(f"resumed from {cfg.resume} (step {saved['step']}, saved as "
        f"{layout_words(saved['layout'])})")
    note_changed_training(log, saved["training"], cfg)


def collect_state(grid: Mesh, runner: Runner, engine: Engine) -> dict:
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


class Faults:
    """Fault injection for the tests, off unless the environment names this rank.

    * ``MINIPAR_CRASH_AT="rank:step"``: that rank raises after the step's backward;
    * ``MINIPAR_OVERFLOW_AT="rank:step"``: that rank's gradient of its first parameter is inf
      in the step's backward (before any engine sees it), as a real fp16 overflow on one
      rank: every rank must skip the step.
    """

    def __init__(self, rank: int, module: torch.nn.Module):
        self.rank, self.armed, self.overflow_step = rank, False, None
        at = os.environ.get("MINIPAR_OVERFLOW_AT", "")
        if at.startswith(f"{rank}:"):
            self.overflow_step = int(at.split(":")[1])
            first = next(p for p in module.parameters() if p.requires_grad)
            first.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def arm(self, step: int) -> None:
        self.armed = step == self.overflow_step

    def crash(self, step: int) -> None:
        at = os.environ.get("MINIPAR_CRASH_AT")
        if at and at == f"{self.rank}:{step}":
            raise RuntimeError(f"injected crash on rank {self.rank} at step {step} "
                               f"(MINIPAR_CRASH_AT)")


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------
def run(argv: list[str]) -> list[dict]:
    """Check the flags, then train (launching --nproc processes if asked); rank 0's metrics."""
    cfg = parse_config(argv)
    with dist.timeout_default(dist.COMPILE_TIMEOUT_S if cfg.compile else None):
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
    return merge_states(results)


def merge_states(results: list[dict]) -> dict:
    """Every rank's ``worker(return_state=True)`` result as one serial picture."""
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
