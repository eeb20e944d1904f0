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
  for bf16) hands that fp32 result over as ``param.main_grad`` (Megatron's name), and it is
  used as is, without a round trip through bf16.

Gradients of micro-batches accumulate in the bf16 ``.grad`` (the 2 bytes the formula counts;
Megatron-LM instead keeps an fp32 gradient buffer, 4 bytes, for bit-better accumulation).

``MixedPrecision`` looks like the optimizer it wraps where the engines and the trainer touch
one: ``step()``, ``zero_grad()``, ``param_groups`` (a learning-rate schedule sets ``lr`` there),
``state``, ``state_dict()``. Nothing here communicates.
"""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    """fp32 master weights for low-precision ``params``, updated by ``make_optimizer(masters)``."""

    def __init__(self, params, make_optimizer):
        self.params = list(params)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.optimizer = make_optimizer(self.masters)

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
        """Hooks run on the fp32 optimizer, after the masters have their fp32 gradients (so
        ``--clip-grad`` scales those)."""
        return self.optimizer.register_step_pre_hook(hook)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def step(self):
        """Masters' gradients from ``main_grad`` (fp32, as reduced) or ``.grad`` (cast to fp32),
        one optimizer step on the masters, the result rounded into the bf16 parameters."""
        for p, m in zip(self.params, self.masters):
            main = getattr(p, "main_grad", None)
            if main is not None:
                m.grad = main if main.dtype == torch.float32 else main.float()
            elif p.grad is not None:
                m.grad = p.grad.float()
            else:
                m.grad = None
        self.optimizer.step()
        _copy(self.params, self.masters)
        for p, m in zip(self.params, self.masters):
            m.grad = None                       # the fp32 gradients are transient
            p.main_grad = None

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)
