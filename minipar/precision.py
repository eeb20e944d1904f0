"""Mixed precision: bf16 parameters and gradients, fp32 master weights and Adam states.

With ``--dtype bf16`` the model itself is bf16 (parameters, activations, gradients: 2 bytes
each), and the optimizer never sees it directly. It updates an fp32 *master* copy of each
parameter (Micikevicius et al. 2018, "Mixed Precision Training"), whose Adam moments are fp32
too, then copies the result back into the bf16 parameter. Per parameter, as in the ZeRO
paper's accounting::

    bf16 parameter 2 B + bf16 gradient 2 B + (fp32 master 4 B + Adam m 4 B + Adam v 4 B) = 16 B

all of it under the optimizer's 12 B being what ZeRO-1 shards (``minipar.zero``: the masters
are kept for the rank's OS shard only). torch's Adam also keeps a 4-byte ``step`` counter per
tensor it updates, i.e. per master tensor: counted under the optimizer.

Where the fp32 gradient comes from. The masters' gradients exist only during ``step()``
(allocated, used, released: never part of the state between steps):

* by default each master's gradient is its bf16 parameter's ``.grad``, cast to fp32;
* an engine that reduced the gradient in fp32 (``--reduce-dtype fp32``, Megatron-LM's default
  for bf16) hands that fp32 result over as ``step(main_grads={param: fp32 gradient})``
  (Megatron's name), and it is used as is, without a round trip through bf16.

fp16 (``--dtype fp16``): the same, plus dynamic loss scaling (``DynamicLossScaler``). The
loss is multiplied by the scale before backward (the runners do it), so the 16-bit gradients
and the reduced ones are scaled; ``step`` unscales the fp32 master gradients, reduces one
found-inf flag over the world, and skips the update on every rank if any gradient anywhere
overflowed. Clipping and weight decay (step pre-hooks) see the unscaled fp32 gradients.

Gradients of micro-batches accumulate in the bf16 ``.grad`` (the 2 bytes the formula counts;
Megatron-LM instead keeps an fp32 gradient buffer, 4 bytes, for bit-better accumulation).

``MixedPrecision`` looks like the optimizer it wraps where the engines and the trainer touch
one: ``step()``, ``zero_grad()``, ``param_groups`` (a learning-rate schedule sets ``lr`` there),
``state``, ``state_dict()``. Its one collective is fp16's skip vote (``found_inf_anywhere``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------
# The policy: what every engine is told about dtypes, as one value
# --------------------------------------------------------------------------------------
class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018; torch's ``GradScaler``, Megatron-LM's
    ``DynamicGradScaler``): fp16's smallest normal number is 6e-5, so small gradients flush to
    zero unless the loss, and with it every gradient, is multiplied by ``scale`` first.

    Each step: backward of ``loss * scale``; ``unscale_`` divides the gradients by ``scale``
    and reports a local non-finite flag; the flag is reduced over the world
    (``found_inf_anywhere``); ``update``: an overflow skips the step and multiplies the
    scale by ``backoff_factor``; ``growth_interval`` clean steps in a row multiply it by
    ``growth_factor``. ``skipped_steps`` counts the skipped ones.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a whole number >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = 0          # clean steps since the last change of scale
        self.skipped_steps = 0

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; return this rank's found-inf flag, a 1-element
        fp32 tensor (1.0: some gradient here is inf or NaN) on the gradients' device."""
        grads = [g for g in grads if g is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, device=device)
        inv = torch.full((1,), 1.0 / self.scale, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():        # the fused kernel takes one dtype per call
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
        return found

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return dict(scale=self.scale, growth_factor=self.growth_factor,
                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                    growth_tracker=self.growth_tracker, skipped_steps=self.skipped_steps)

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self):
        return (f"DynamicLossScaler(scale={self.scale:g}, growth_interval={self.growth_interval}, "
                f"skipped_steps={self.skipped_steps})")


def found_inf_anywhere(local_flag) -> bool:
    """True when any rank of the world found a non-finite gradient: one max all-reduce of a
    4-byte flag over the whole world, so every rank (TP, PP, EP, ZeRO shards: each holds
    different gradients) skips the same step. Like the metrics' scalars, it is not counted in
    ``comm_bytes`` (it is not part of any paradigm's volume formula)."""
    from . import comm
    value = float(local_flag) if not torch.is_tensor(local_flag) else float(local_flag.max())
    return comm.all_reduce_scalars([value], comm.WORLD, op="max")[0] > 0


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes a run computes, reduces and updates in, and its loss scaler (or None).

    ============  ===========  ============  ============  ======================
    name          param_dtype  reduce_dtype  master_dtype  loss_scaler
    ============  ===========  ============  ============  ======================
    ``fp32``      fp32         fp32          fp32          None
    ``bf16``      bf16         fp32 or bf16  fp32          None (bf16 has fp32's range)
    ``fp16``      fp16         fp32 or fp16  fp32          ``DynamicLossScaler``
    ============  ===========  ============  ============  ======================

    ``param_dtype`` is also the compute dtype (the model itself is cast; no autocast).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    loss_scaler: DynamicLossScaler | None = None

    @classmethod
    def from_name(cls, name: str, reduce: str | None = None, loss_scale_init: float = 2.0**16,
                  loss_scale_window: int = 2000) -> "PrecisionPolicy":
        """``fp32``, ``bf16`` or ``fp16``; ``reduce`` names the reduce dtype (default fp32)."""
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}; choose {', '.join(DTYPES)}")
        param = DTYPES[name]
        reduce_dtype = DTYPES[reduce or "fp32"] if name != "fp32" else torch.float32
        scaler = (DynamicLossScaler(loss_scale_init, growth_interval=loss_scale_window)
                  if name == "fp16" else None)
        return cls(param, reduce_dtype, torch.float32, scaler)

    @property
    def mixed(self) -> bool:
        """16-bit parameters updated through fp32 masters."""
        return self.param_dtype != self.master_dtype

    @property
    def name(self) -> str:
        return {v: k for k, v in DTYPES.items()}[self.param_dtype]

    def optimizer(self, params, make_optimizer):
        """What updates ``params``: ``make_optimizer(params)`` itself, or under a mixed policy
        ``make_optimizer`` over fp32 masters of them (``MixedPrecision``), whose ``step`` takes
        the engine's fp32 reduced gradients as ``main_grads``."""
        params = list(params)
        if not self.mixed:
            return make_optimizer(params)
        return MixedPrecision(params, make_optimizer, loss_scaler=self.loss_scaler)

    def state_bytes(self, optimizer) -> int:
        """Bytes of the optimizer's state (Adam: m, v, step counters) and, under a mixed policy,
        of its fp32 masters."""
        if optimizer is None:
            return 0
        masters = optimizer.master_bytes() if self.mixed else 0
        return masters + sum(t.numel() * t.element_size() for state in optimizer.state.values()
                             for t in state.values() if torch.is_tensor(t))


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i] (with a cast), as one fused call where torch has it."""
    if not dst:
        return
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(dst, src)
        else:                                  # pragma: no cover (torch < 2.1)
            for d, s in zip(dst, src):
                d.copy_(s)


class MixedPrecision:
    """fp32 master weights for low-precision ``params``, updated by ``make_optimizer(masters)``;
    with a ``loss_scaler`` (fp16), gradients are unscaled and a step that overflowed anywhere
    is skipped on every rank."""

    def __init__(self, params, make_optimizer, loss_scaler: DynamicLossScaler | None = None):
        self.params = list(params)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.master_of = {p: m for p, m in zip(self.params, self.masters)}
        self.optimizer = make_optimizer(self.masters)
        self.loss_scaler = loss_scaler
        self.skipped = False                    # the last step was skipped (an overflow)
        self.grad_scale = 1.0                   # what the last step's 16-bit gradients carried

    # -- what an optimizer looks like to its callers ----------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def register_step_pre_hook(self, hook):
        """Hooks run on the fp32 optimizer, after the masters have their fp32 (unscaled)
        gradients (so ``--clip-grad`` scales those and sees the unscaled norm)."""
        return self.optimizer.register_step_pre_hook(hook)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def step(self, main_grads: dict | None = None):
        """Masters' gradients from ``main_grads[p]`` (fp32, as an engine reduced them) or
        ``p.grad`` (cast to fp32); unscaled and checked for overflow over the whole world
        under a loss scaler; one optimizer step on the masters, the result rounded into the
        16-bit parameters."""
        for p, m in zip(self.params, self.masters):
            main = main_grads.get(p) if main_grads is not None else None
            if main is not None and main.dtype != torch.float32:
                m.grad = main.float()
            elif main is not None:
                m.grad = main      # an engine's transient fp32 result: unscaled in place

            elif p.grad is not None:
                m.grad = p.grad.float()
            else:
                m.grad = None
        self.skipped = False
        if self.loss_scaler is not None:
            self.grad_scale = self.loss_scaler.scale
            found = self.loss_scaler.unscale_([m.grad for m in self.masters])
            self.skipped = found_inf_anywhere(found)
            self.loss_scaler.update(self.skipped)
        if not self.skipped:
            self.optimizer.step()
            self.params_from_masters()
        for m in self.masters:
            m.grad = None                       # the fp32 gradients are transient

    def params_from_masters(self) -> None:
        """Round the masters into the 16-bit parameters (after a step, or a checkpoint load)."""
        _copy(self.params, self.masters)

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)
