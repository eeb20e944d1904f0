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

``minipar.train.pieces`` gives exactly that set: the pieces a rank *owns* tile the serial model.
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
"""
from __future__ import annotations

import math

import torch

from .. import comm
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


def _owned_grads(mesh, runner, engine, plans=None) -> list[torch.Tensor]:
    return [piece.views["grad"] for piece in pieces(mesh, runner, engine, plans)
            if piece.owner and "grad" in piece.views]


def global_grad_norm(mesh, runner, engine, plans: dict | None = None) -> torch.Tensor:
    """The serial model's gradient norm, from the pieces this rank owns (collective).

    On the device and without a host sync: one ``torch._foreach_norm`` per (device, dtype)
    group of owned gradient pieces (norms in fp32, their squares summed in fp64), then one
    all-reduce of that scalar over the world. Returns a 0-d fp64 tensor; ``float()`` of it
    is the only sync, and the trainer makes it on logging steps only. ``plans``: the pieces'
    geometry, kept by the caller between steps (``minipar.train.pieces``).
    """
    grads = _owned_grads(mesh, runner, engine, plans)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device if grads else comm.scalar_device()
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

    def __init__(self, mesh, runner, engine, clip: float | None = None,
                 weight_decay: float = 0.0):
        self.mesh, self.runner, self.engine = mesh, runner, engine
        self._plans = {}               # the pieces' geometry, worked out at the first step
        self.clip, self.weight_decay = clip, weight_decay
        self.measure = True            # the trainer sets it per step (its logging steps)
        self._norm = None

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
            self._norm = global_grad_norm(self.mesh, self.runner, self.engine, self._plans)
        if self.clip is not None:
            coef = (self.clip / (self._norm + 1e-6)).clamp(max=1.0)
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None]
            for device in {g.device for g in grads}:
                torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
        if self.weight_decay:
            lr = optimizer.param_groups[0]["lr"]
            decayed = [piece.views["param"]
                       for piece in pieces(self.mesh, self.runner, self.engine, self._plans)
                       if decays(piece.name, len(piece.shape))]
            if decayed:
                torch._foreach_mul_(decayed, 1.0 - lr * self.weight_decay)


def install(mesh, runner, engine, clip: float | None = None,
            weight_decay: float = 0.0) -> StepHook:
    hook = StepHook(mesh, runner, engine, clip, weight_decay)
    engine.optimizer.register_step_pre_hook(hook)
    return hook


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
