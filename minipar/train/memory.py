"""Activation memory, measured: the bytes autograd keeps for the backward pass, per layer.

What a forward pass keeps alive until its backward is exactly the set of tensors autograd's
nodes save (``ctx.save_for_backward`` and the built-in ops' saved inputs and outputs), and
``torch.autograd.graph.saved_tensors_hooks`` sees each one as it is saved. So this works on a
CPU too, where there is no allocator to ask. We count each *storage* once (q, k and v are
views of one qkv output; a Linear saves a reshaped view of its input), leave out the
parameters (model states, counted elsewhere), and file every storage under the transformer
Block that saved it first. A Block's input is saved by its first LayerNorm, so it counts
for that Block; with full recomputation it is all a Block keeps (the checkpoint saves it).

Compared with Korthikanti et al. 2022 (``minipar.plan.layer_activation_bytes``), per layer
and micro-batch of b sequences of s tokens, h wide, a heads, e bytes per element:

* no recomputation, SDPA's fused kernel (flash, on CPU and GPU): 16 s b h e. That is the
  paper's 34 s b h at e = 2 less its two one-byte dropout masks (absent at dropout 0): the
  LayerNorm inputs 2, the QKV input 1, Q K V 3, the attention output 1 (the kernel's saved
  output and the output projection's input share one storage), the MLP input 1, GELU's input
  4 and output 4. The kernel never stores the a s^2 scores (the planner's ``flash=True``).
  Plus side tensors the paper leaves out: each LayerNorm's mean and 1/std (2 b s elements
  each) and the kernel's fp32 log-sum-exp (4 a b s bytes).
* selective: the attention core keeps only its inputs, Q K V, which are saved anyway: it
  saves just the log-sum-exp. With a fused kernel there are no scores left to save, so
  selective recomputation buys almost nothing (the planner says the same with ``flash``).
* full: the Block's input, s b h e: the paper's 2 s b h exactly.

Under tensor parallelism (t ranks) the Q K V, attention output and GELU tensors are split
(12 s b h e / t) and the LayerNorm inputs and the two first matmuls' inputs are not
(4 s b h e); ``tests/test_recompute.py`` holds these and the sequence-parallel case against
the planner.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..model import Block


@contextlib.contextmanager
def saved_tensors_by_layer(model: nn.Module):
    """Within the block, every storage autograd saves is recorded, by the Block that saved it.

    Yields a dict {Block name (as in ``model.named_modules()``) or "outside": bytes} that is
    filled as the forward runs. Parameters and buffers are left out; each storage counts once.
    """
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: set[int] = set()
    out: dict[str, int] = {}
    where = ["outside"]
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, Block):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: where.append(name)))
            handles.append(m.register_forward_hook(lambda mod, args, res: [where.pop(), None][1]))
    out.update({name: 0 for name, m in model.named_modules() if isinstance(m, Block)})

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in skip and key not in seen and storage.nbytes() > 0:
            seen.add(key)
            out[where[-1]] = out.get(where[-1], 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield out
    finally:
        for h in handles:
            h.remove()


def activation_bytes_per_layer(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One forward of ``model(x, y)`` (one micro-batch), then its backward: the bytes saved for
    backward by each Block and outside the Blocks ("outside": embedding, head, loss)."""
    with saved_tensors_by_layer(model) as saved:
        loss = model(x, y)
    loss.backward()
    return dict(saved)
