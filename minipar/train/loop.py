"""The GPT trainer's loop, ``python -m minipar.train`` (flags and metrics: docs/reference.md).

nanoGPT's loop, whatever the layout: each step sets the learning rate, takes this rank's part
of the global batch, zeroes the gradients, runs forward and backward over the micro-batches
(one device, or a pipeline stage), and steps the engine (gradient sync, then the update).
Around it, named calls: ``build_*`` (the layout, ``minipar.parallelize``; the engine,
``engines``), a ``steplog.Recorder`` (what is printed and recorded), ``evaluate``,
``checkpoint.save``. The flags are checked once (``config.parse_config``) into the frozen
``RunConfig`` every rank receives. Three ways to start: ``--nproc N``, ``torchrun``, ``srun``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .. import comm, cp, data, moe, parallelize
from ..mesh import Mesh, param_groups
from ..model import build
from ..precision import PrecisionPolicy
from ..runtime import dist, trace
from . import checkpoint, engines, optim, report, steplog
from .config import RunConfig, parse_config


def _nothing(*args) -> None:
    return None


def _rank0_history(mesh, runner, engine, history):
    return history if mesh.rank == 0 else None


@dataclass(frozen=True)
class Hooks:
    """What a caller adds to a run, as values (the tests inject faults and read the final
    state; the exercise checkers too): ``begin(mesh, runner, engine)`` once built,
    ``before_step(step)``, ``after_backward(step)``, and ``end(mesh, runner, engine, history)``,
    whose result ``worker`` returns (default: rank 0's history, None elsewhere). Module-level
    functions or picklable objects: ``--nproc`` sends them to every rank."""

    begin: Callable = _nothing
    before_step: Callable = _nothing
    after_backward: Callable = _nothing
    end: Callable = _rank0_history


def worker(cfg: RunConfig, hooks: Hooks | None = None):
    """One rank's training run (see ``Hooks`` for what it returns)."""
    hooks = hooks or Hooks()
    backend, device = _start(cfg)
    mesh, policy = build_mesh(cfg), build_policy(cfg)
    torch.manual_seed(cfg.seed)
    corpus = batches(cfg)
    model = build_model(cfg, mesh, device, policy)
    runner = build_runner(cfg, mesh, model, policy)
    engine = build_engine(cfg, mesh, runner.module, policy)
    log = steplog.Recorder(cfg, mesh, policy, device, runner, report.banner(
        cfg, backend, device, serial_params(cfg), sum(p.numel() for p in runner.module.parameters())))
    if cfg.resume:
        resume(cfg, mesh, runner, engine, policy, log.say)
    clip = optim.install(mesh, runner, engine, clip=cfg.clip_grad, weight_decay=cfg.weight_decay)
    hooks.begin(mesh, runner, engine)
    with deterministic(cfg.deterministic, device), log:
        for step in range(cfg.start_step + 1, cfg.steps + 1):
            lr = optim.lr_at(step, cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule, cfg.min_lr)
            optim.set_lr(engine.optimizer, lr)
            x, y = local_tokens(corpus.train, step, mesh, device)
            log.begin_step(step, clip)
            hooks.before_step(step)

            engine.zero_grad()
            engine.begin_step(cfg.microbatches)
            with trace.span("forward + backward"):
                loss = runner.forward_backward(x, y)
            hooks.after_backward(step)
            with trace.span("optimizer step (gradient sync + update)"):
                engine.step()

            record = log.end_step(step, lr, loss, engine, clip)   # None between logging steps
            if record is not None and log.evaluates(step):
                record["val_loss"] = evaluate(cfg, mesh, runner, corpus.held_out, device)
            log.write()
            if log.saves(step):
                log.say(f"saved {save(cfg, step, mesh, runner, engine, policy, corpus.tokens)}")
    return hooks.end(mesh, runner, engine, log.history)


# --------------------------------------------------------------------------------------
# What the loop is built from
# --------------------------------------------------------------------------------------
def build_mesh(cfg: RunConfig) -> Mesh:
    return Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, ep=cfg.ep)


def build_policy(cfg: RunConfig) -> PrecisionPolicy:
    return PrecisionPolicy.from_name(cfg.dtype, reduce=cfg.reduce_dtype,
                                     loss_scale_init=cfg.loss_scale_init,
                                     loss_scale_window=cfg.loss_scale_window)


def build_model(cfg: RunConfig, mesh: Mesh, device, policy: PrecisionPolicy | None = None):
    """The full serial model from the seed (the same on every rank), then this rank's part of
    it (``minipar.parallelize``), in the policy's parameter dtype on ``device``."""
    return parallelize.parallelize(build(cfg.model_cfg, seed=cfg.seed), mesh, sp=cfg.sp,
                                   policy=policy or build_policy(cfg), device=device,
                                   compile=cfg.compile)


def build_runner(cfg: RunConfig, mesh: Mesh, model, policy: PrecisionPolicy | None = None):
    return parallelize.build_runner(model, mesh, cfg.microbatches, cfg.schedule, cfg.chunks,
                                    cfg.sp, policy)


def build_engine(cfg: RunConfig, mesh: Mesh, module, policy: PrecisionPolicy | None = None):
    """The model-state engine of this layout (``minipar.train.engines``)."""
    groups = param_groups(module, mesh, moe.expert_parameters(module))
    return engines.build_engine(cfg, mesh, module, policy or build_policy(cfg), groups,
                                lambda params: make_optimizer(params, cfg.lr))


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW; torch's fused CUDA kernel when every parameter is on a GPU (one launch)."""
    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             **({"fused": True} if fused else {}))


def serial_params(cfg: RunConfig) -> int:
    """The serial model's parameter count (from shapes alone, nothing allocated)."""
    return sum(math.prod(shape) for shape in checkpoint.serial_shapes(cfg.model_cfg).values())


class Corpus(NamedTuple):
    train: data.Batches
    held_out: data.Batches       # the corpus's last tenth
    tokens: int


def batches(cfg: RunConfig) -> Corpus:
    """The training and held-out batches of the corpus."""
    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    train, held_out = data.split(tokens)
    return Corpus(data.Batches(train, cfg.seq_len, cfg.batch_size, seed=cfg.seed),
                  data.Batches(held_out, cfg.seq_len, cfg.batch_size, seed=cfg.seed), tokens.numel())


def pinned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in pinned host memory (one copy, whatever ``t``'s strides:
    ``Batches`` hands out strided views, which ``pin_memory()`` would keep strided)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device; on a GPU from contiguous pinned memory, without blocking the host."""
    if device.type == "cuda":
        return pinned(t).to(device, non_blocking=True)
    return t.to(device)


def local_tokens(batches: data.Batches, step: int, mesh: Mesh, device=None):
    """This rank's sequences of the global batch (its dp slice) and, with ``--cp``, its two
    load-balanced chunks of each (``minipar.cp``). Every cp rank holds as many tokens, so the
    mean of the ranks' mean losses is the mean over every token of the global batch."""
    x, y = batches.local_batch(step, mesh.coord("dp"), mesh.dp)
    if mesh.cp > 1:
        x, y = (cp.shard_sequence(t, mesh.cp, mesh.coord("cp")) for t in (x, y))
    return (x, y) if device is None else (to_device(x, device), to_device(y, device))


# --------------------------------------------------------------------------------------
# Evaluation, checkpoints, the state of a finished run
# --------------------------------------------------------------------------------------
def evaluate(cfg: RunConfig, mesh: Mesh, runner, batches: data.Batches, device) -> float:
    """Mean held-out loss over ``cfg.eval_batches`` global batches (always the same ones),
    through the same runner (pipeline, TP) without gradients."""
    total = 0.0
    for i in range(1, cfg.eval_batches + 1):
        total += runner.evaluate(*local_tokens(batches, i, mesh, device))
    moe.step_stats(runner.module)        # MoE: forget the evaluation's routing
    loss_sum, = comm.all_reduce_scalars([total if mesh.holds_loss else 0.0], comm.WORLD)
    return loss_sum / (mesh.dp * mesh.cp * cfg.eval_batches)


def save(cfg: RunConfig, step: int, mesh: Mesh, runner, engine, policy: PrecisionPolicy,
         tokens: int) -> str:
    manifest = checkpoint.manifest_for(cfg, step, tokens, policy.loss_scaler)
    return checkpoint.save(cfg.save, step, manifest, mesh, runner, engine, cfg.keep)


def resume(cfg: RunConfig, mesh: Mesh, runner, engine, policy: PrecisionPolicy, say) -> None:
    """Parameters (fp32 masters under mixed precision), Adam, RNG and the loss scaler."""
    saved = checkpoint.load(cfg.resume, mesh, runner, engine)
    if policy.loss_scaler is not None and saved.get("loss_scaler"):
        policy.loss_scaler.load_state_dict(saved["loss_scaler"])
    say(f"resumed from {cfg.resume} (step {saved['step']}, saved as "
        f"{report.layout_words(saved['layout'])})")
    report.note_changed_training(say, saved, cfg)


def collect_state(mesh: Mesh, runner, engine) -> dict:
    """This rank's parameters and gradients in the serial model's names and full shapes:
    ZeRO gathers its shards (``engine.full_named_parameters``), TP glues its slices
    (``pieces.full_tensor``), a pipeline stage maps its names (``runner.serial_name``)."""
    from .pieces import full_tensor
    params, grads = {}, {}
    for name, (p, g) in engine.full_named_parameters().items():
        if mesh.tp > 1:
            p = full_tensor(name, p, runner.module, mesh.group("tp"))
            g = full_tensor(name, g, runner.module, mesh.group("tp")) if g is not None else None
        serial = runner.serial_name(name)
        params[serial] = p.detach().cpu().clone()
        grads[serial] = None if g is None else g.detach().cpu().clone()
    return dict(params=params, grads=grads)


def with_state(mesh: Mesh, runner, engine, history) -> dict:
    """``Hooks.end`` for tests and checkers: every rank returns its history (rank 0's is
    the run's), parameters and last gradients (``collect_state``)."""
    return dict(history=history, **collect_state(mesh, runner, engine))


# cuBLAS's fixed workspace for repeatable results (NVIDIA's documented setting)
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic(on: bool, device: torch.device):
    """``--deterministic`` on a GPU: two fresh runs give the same bits. Inside: torch's
    deterministic algorithms (an op that has none raises instead of varying), cuBLAS's fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS first runs in a process, so it is
    set here before the first step; a process that ran matmuls before keeps its own), cuDNN
    without autotuning, and attention on SDPA's math backend (matmuls and a softmax; the fused
    kernels' backward may accumulate in any order). Restored on leaving. On the CPU it sets
    nothing: CPU runs already repeat bit for bit (tests/test_determinism.py)."""
    if not on or device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def _start(cfg: RunConfig) -> tuple[str, torch.device]:
    """Join the process group (torchrun, srun, --nproc) or pick the single process's device."""
    if dist.env_from_os():
        return dist.init(cfg.backend)
    _, device, note = dist.resolve(cfg.backend, 1)     # one process: the same device rule
    if note:
        print(note, flush=True)
    return "none", device


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------
def run(argv: list[str], hooks: Hooks | None = None) -> list[dict]:
    """Check the flags, then train (launching --nproc processes if asked); rank 0's metrics."""
    cfg = parse_config(argv)
    with dist.timeout_default(dist.COMPILE_TIMEOUT_S if cfg.compile else None):
        if cfg.nproc is not None and cfg.nproc > 1 and dist.env_from_os() is None:
            return dist.launch(worker, cfg.nproc, cfg, hooks, backend=cfg.backend,
                               timeout=cfg.timeout)[0]
        return worker(cfg, hooks)


def run_state(argv: list[str], nproc: int, timeout: float = 240.0, hooks: Hooks | None = None) -> dict:
    """For tests: train, then merge every rank's final parameters and gradients.

    Returns ``dict(losses=[...], history=[...], params={serial name: tensor}, grads={...})``.
    """
    cfg = dataclasses.replace(parse_config(argv + ["--nproc", str(nproc)]), quiet=True)
    hooks = dataclasses.replace(hooks or Hooks(), end=with_state)
    results = ([worker(cfg, hooks)] if nproc == 1 else
               dist.launch(worker, nproc, cfg, hooks, timeout=timeout))
    return merge_states(results)


def merge_states(results: list[dict]) -> dict:
    """Every rank's ``with_state`` result as one serial picture."""
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
