"""Around Adam's update: the learning-rate schedule, global gradient clipping, weight decay.

**Schedule** (``lr_at``): linear warm-up from 0 over ``warmup`` steps, then ``constant``, or
a ``cosine`` or ``linear`` decay from ``lr`` down to ``min_lr`` at the final step (nanoGPT's
shape). It is a function of the step alone, so a resumed run continues it exactly.

**Clipping** (``--clip-grad``): the norm is the *global* one, of the whole serial model's
gradient, so every layout must count each element exactly once:

* TP ranks hold different slices of a split matrix (sum over TP), but the *same* copy of a
  replicated norm, row bias or position table (count it on one TP rank), and vocabulary
  padding rows that are no parameter of the serial model (leave them out);
* pipeline stages hold different layers (sum over PP);
* plain DP replicas hold the same averaged gradient (count it once); a ZeRO rank's optimizer
  sees only its OS shard of the averaged gradient (sum over the shards, once per replica).

``minipar.pieces`` gives exactly that set: the pieces a rank *owns* tile the serial model.
So ``norm^2 = all_reduce(sum over owned pieces of grad^2)`` over every rank (one 8-byte
scalar; metrics bookkeeping, not counted in ``comm_bytes``), and every rank scales all the
gradients its optimizer sees by the same ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does. The norm stays on the device (``torch._foreach_norm``,
no host sync) and is computed only when clipping, or on the trainer's logging steps.

**Weight decay** (``--weight-decay``), decoupled as in AdamW (``p *= 1 - lr wd`` before the
update), on the matrices only: not on biases, LayerNorms and the position table. Leaving the
position table out is minipar's own rule (nanoGPT and Megatron-LM decay it: they exclude only
biases and norms). The choice is made by the serial name, so every layout decays the same
elements; a ZeRO unit's flat shard mixes kinds, so decay is applied piece by piece rather
than through Adam's parameter groups (Adam itself runs with weight_decay = 0).

All three run in the optimizer's step pre-hook (``install``): the one moment at which every
engine holds the averaged gradients of exactly what it is about to update.

**Clipping in a plain loop** (outside the trainer), with the wrappers, which call to make:

=========================================  =================================================
wrapper                                     clip with
=========================================  =================================================
``dp.DataParallel``                         ``torch.nn.utils.clip_grad_norm_`` or
                                            ``clip_grad_norm_`` below (every rank holds the
                                            averaged gradient after backward)
``fsdp.fully_shard`` (ZeRO-3)               ``model.clip_grad_norm_(max_norm)`` or
                                            ``clip_grad_norm_(model.parameters(), ...)``: the
                                            shards' squares are summed over the group
``zero.ShardedOptimizer`` stage 1 and 2     ``opt.clip_grad_norm_(max_norm)`` before
                                            ``opt.step()``: the averaged gradient exists only
                                            inside the step, where the clip is applied
=========================================  =================================================

``clip_grad_norm_`` refuses what would clip the wrong tensor: the parameters of a
``ShardedOptimizer`` (stage 1's ``.grad`` is this rank's unaveraged gradient, stage 2's is
None after backward) and those of a ``DataParallel`` whose accumulated gradients are not
averaged yet (``no_sync``). torch's own function cannot check this: with those two it
silently clips the wrong thing (or nothing).
"""
from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .pieces import pieces

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, lr: float, steps: int, warmup: int = 0, schedule: str = "constant",
          min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (1-based) of a run of ``steps`` steps."""
    if warmup and step <= warmup:
        return lr * step / warmup
    if schedule == "constant" or steps <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / (steps - warmup))
    if schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
    if schedule == "linear":
        return lr + progress * (min_lr - lr)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def decays(serial_name: str, ndim: int) -> bool:
    """Weight decay on matrices (and the token embedding), not on biases, norms, positions."""
    return ndim >= 2 and serial_name != "embed.pos.weight"


def _owned_grads(grid, runner, engine, plans=None) -> list[torch.Tensor]:
    return [piece.views["grad"] for piece in pieces(grid, runner, engine, plans)
            if piece.owner and "grad" in piece.views]


def global_grad_norm(grid, runner, engine, plans: dict | None = None) -> torch.Tensor:
    """The serial model's gradient norm, from the pieces this rank owns (collective).

    On the device and without a host sync: one ``torch._foreach_norm`` per (device, dtype)
    group of owned gradient pieces (norms in fp32, their squares summed in fp64), then one
    all-reduce of that scalar over the world. Returns a 0-d fp64 tensor; ``float()`` of it
    is the only sync, and the trainer makes it on logging steps only. ``plans``: the pieces'
    geometry, kept by the caller between steps (``minipar.pieces``).
    """
    grads = _owned_grads(grid, runner, engine, plans)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device if grads else (
        torch.device("cuda", torch.cuda.current_device()) if comm.clock() == "cuda-events"
        else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in groups.values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        total += torch.stack(norms).double().pow(2).sum().to(device)
    with comm.untracked():                         # metrics bookkeeping, not training traffic
        comm.all_reduce(total, comm.WORLD)
    return total.sqrt()


class StepHook:
    """Clip, then decay, right before each Adam update; keeps the norm for the metrics.

    The norm is computed only when it is needed: on every step when clipping, else only on
    the steps the trainer asks for (``measure = True``: its logging steps). Clipping scales
    by ``min(1, max_norm / (norm + 1e-6))`` on the device (``torch._foreach_mul_``, as
    ``clip_grad_norm_`` does), so it costs no host sync either.
    """

    def __init__(self, grid, runner, engine, clip: float | None = None,
                 weight_decay: float = 0.0):
        self.grid, self.runner, self.engine = grid, runner, engine
        self.clip, self.weight_decay = clip, weight_decay
        self.measure = True            # the trainer sets it per step (its logging steps)
        self._norm = None
        self._plans = {}               # the pieces' geometry, worked out at the first step

    @property
    def grad_norm(self) -> float | None:
        """The last computed norm as a number (one host sync), None if not computed."""
        return None if self._norm is None else float(self._norm)

    @grad_norm.setter
    def grad_norm(self, value) -> None:
        self._norm = value             # None: forget it (a step the loss scaler skipped)

    def __call__(self, optimizer, args=(), kwargs=None):
        self._norm = None
        if self.clip is not None or self.measure:
            self._norm = global_grad_norm(self.grid, self.runner, self.engine, self._plans)
        if self.clip is not None:
            coef = (self.clip / (self._norm + 1e-6)).clamp(max=1.0)
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
            for device in {g.device for g in grads}:
                torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
        if self.weight_decay:
            lr = optimizer.param_groups[0]["lr"]
            decayed = [piece.views["param"]
                       for piece in pieces(self.grid, self.runner, self.engine, self._plans)
                       if decays(piece.name, len(piece.shape))]
            if decayed:
                torch._foreach_mul_(decayed, 1.0 - lr * self.weight_decay)


def install(grid, runner, engine, clip: float | None = None,
            weight_decay: float = 0.0) -> StepHook:
    hook = StepHook(grid, runner, engine, clip, weight_decay)
    engine.optimizer.register_step_pre_hook(hook)
    return hook


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------
# Clipping for the wrappers in a plain loop (see the table in the module's docstring)
# --------------------------------------------------------------------------------------
_SHARDED = WeakIdKeyDictionary()     # shard -> the group its siblings are spread over
_ELSEWHERE = WeakIdKeyDictionary()   # parameter -> why its .grad is not the gradient to clip


def register_sharded(params, group) -> None:
    """``params`` are disjoint pieces of one model spread over ``group`` (``fsdp``'s shards)."""
    for p in params:
        _SHARDED[p] = group


def register_elsewhere(params, reason: str) -> None:
    """The averaged gradient of ``params`` is not in their ``.grad``: ``reason`` says where."""
    for p in params:
        _ELSEWHERE[p] = reason


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that may be sharded over ranks.

    The norm is the whole model's: the contributions of shards (``fsdp``) are summed over
    their group (one scalar all-reduce), replicated gradients are counted once. Every rank
    scales its gradients by the same ``min(1, max_norm / (norm + 1e-6))``; returns the norm.
    """
    from . import dp
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    for p in params:
        if p in _ELSEWHERE:
            raise RuntimeError(_ELSEWHERE[p])
    dp.refuse_unsynced(params, "clip_grad_norm_")
    groups = {id(_SHARDED[p]): _SHARDED[p] for p in params if p in _SHARDED}
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the parameters are sharded over different groups; "
                         "clip each wrapper's parameters by itself")
    group = next(iter(groups.values()), None)
    sharded = [p.grad for p in params if p.grad is not None and p in _SHARDED]
    local = [p.grad for p in params if p.grad is not None and p not in _SHARDED]
    p_norm = float(norm_type)
    if math.isinf(p_norm):
        part = lambda gs: max((float(g.abs().max()) for g in gs if g.numel()), default=0.0)  # noqa: E731
        total = max(comm.all_reduce_scalars([part(sharded)], group, op="max")[0], part(local))
    else:
        part = lambda gs: sum(float(g.double().abs().pow(p_norm).sum()) for g in gs)  # noqa: E731
        total = (comm.all_reduce_scalars([part(sharded)], group)[0] + part(local)) ** (1 / p_norm)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in sharded + local:
                g.mul_(coef)
    return torch.tensor(total)
