"""Data parallelism in three visible steps: naive, bucketed, overlapped.

Every rank holds the whole model and runs its own slice of the global batch; before the
optimizer step the gradients are averaged over the data-parallel group of d ranks, so every
replica takes the same step and stays identical.

1. ``naive``: after backward, one all-reduce per parameter tensor. Many small messages:
   each pays the collective's latency.
2. ``bucketed``: gradients live in a few flat buffers (``param.grad`` is a view into one),
   so one all-reduce per bucket of ``bucket_mb`` megabytes replaces dozens of small ones.
3. ``overlapped``: a hook fires when a parameter's gradient is final; once every gradient
   of a bucket is final, that bucket's all-reduce starts asynchronously while backward goes
   on computing the earlier layers' gradients. ``step()`` waits for the last ones.

Gradient accumulation over m micro-batches: the gradients accumulate locally, and only the
m-th backward of a step launches communication (``begin_step(m)`` arms the count).

Communication per step, each rank (Ψ = gradient bytes, ring all-reduce over d ranks)::

    all_reduce: 2 (d-1)/d * Ψ        the same for all three variants; only the message
                                     count and the overlap differ

gloo has no AVG for every collective: each all-reduce sums, then divides by d.

Parameters with their own reduction group (``p.grad_group``: MoE experts, ``minipar.moe``)
are summed over that group instead, still divided by d, in buckets of their own that are
reduced after backward, in the same order on every rank: 2 (r-1)/r * Ψ_experts over the
r = d/ep replicas of a rank's experts (the rest, Ψ - Ψ_experts, as above).

The engine interface (shared with ``minipar.zero``):
``zero_grad()``, ``begin_step(microbatches)``, ``step()``, ``model_state_bytes()``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import comm

MODES = ("naive", "bucketed", "overlapped")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in the optimizer's state (Adam: m, v and the step counters)."""
    if optimizer is None:
        return 0
    return sum(tensor_bytes(v for v in state.values() if torch.is_tensor(v))
               for state in optimizer.state.values())


class Bucket:
    """A flat gradient buffer; each parameter's ``.grad`` is a view into it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views = {}
        offset = 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0          # parameters whose gradient is final this step
        self.handle = None      # the all-reduce in flight

    def attach(self):
        for p in self.params:
            p.grad = self.views[p]

    def adopt(self, p: nn.Parameter):
        """Make ``p.grad`` the bucket's view again if someone replaced it (``optimizer.zero_grad()``
        sets grads to None, and backward then allocates a fresh tensor): copy it in first."""
        view = self.views[p]
        if p.grad is not view:
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group parameters into buckets in reverse order, roughly the order backward finishes them."""
    # EXERCISE ex02 begin
    # walk the parameters last to first, closing a bucket when the next one would overflow it
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and (size + p.numel() * p.element_size() > bucket_bytes
                        or p.dtype != current[0].dtype):
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(Bucket(current))
    # EXERCISE ex02 end
    return buckets


def sync_buckets(buckets: list[Bucket], group) -> None:
    """Average every bucket's flat gradient buffer over ``group``: one all-reduce per bucket.

    Because each ``param.grad`` is a view into its bucket, the parameters see the averaged
    gradients without any copy back.
    """
    # EXERCISE ex02 begin
    # one all-reduce per bucket (sum), then divide by the group size: the average
    n = comm.size(group)
    for b in buckets:
        comm.all_reduce(b.buffer, group, op="sum")
        b.buffer.div_(n)
    # EXERCISE ex02 end


class DataParallel:
    """Average gradients over ``group`` (None: a group of one, i.e. no data parallelism)."""

    def __init__(self, module: nn.Module, group=None, mode: str = "overlapped",
                 bucket_mb: float = 4.0, optimizer: torch.optim.Optimizer | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.module, self.group, self.mode, self.optimizer = module, group, mode, optimizer
        self.d = comm.size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        # -- MoE: parameters tagged with their own reduction group get buckets of their own
        self.tagged = [p for p in self.params if hasattr(p, "grad_group")]
        self.params = [p for p in self.params if not hasattr(p, "grad_group")]
        self.tagged_buckets = make_buckets(self.tagged, int(bucket_mb * 2**20)) if self.tagged else []
        for b in self.tagged_buckets:
            b.attach()
        # --
        if mode != "naive":
            self.buckets = make_buckets(self.params, int(bucket_mb * 2**20))
            for b in self.buckets:
                b.attach()
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._count: dict[nn.Parameter, int] = {}
        self.microbatches = 1
        if mode == "overlapped":
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- the step ------------------------------------------------------------------------
    def zero_grad(self):
        for b in self.tagged_buckets:
            b.buffer.zero_()
            b.attach()
        if self.buckets:
            for b in self.buckets:
                b.buffer.zero_()
                b.attach()  # in case someone set .grad to None
        else:
            for p in self.params:
                p.grad = None

    def begin_step(self, microbatches: int = 1):
        """Arm the hooks: a bucket's all-reduce starts after the m-th gradient of each param."""
        self.microbatches = microbatches
        self._count = {p: 0 for p in self.params}
        for b in self.buckets:
            b.ready, b.handle = 0, None

    def _on_grad_ready(self, p: nn.Parameter):
        self._count[p] = self._count.get(p, 0) + 1
        b = self._bucket_of[p]
        b.adopt(p)
        if self._count[p] == self.microbatches:
            b.ready += 1
            if b.ready == len(b.params):
                b.handle = comm.all_reduce(b.buffer, self.group, op="avg", async_op=True)

    def finish_grad_sync(self):
        """After the last backward: every gradient is the average over the group."""
        if self.mode == "naive":
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, self.group, op="avg")
        elif self.mode == "bucketed":
            for b in self.buckets:
                for p in b.params:
                    b.adopt(p)
            sync_buckets(self.buckets, self.group)
        else:
            for b in self.buckets:
                if b.handle is None:   # a parameter unused this step: reduce it now
                    b.handle = comm.all_reduce(b.buffer, self.group, op="avg", async_op=True)
            for b in self.buckets:
                b.handle.wait()
        self.sync_tagged()
        self.begin_step(self.microbatches)  # re-arm, so a caller who forgets begin_step is safe

    def sync_tagged(self):
        """MoE experts: sum over their own group (a rank's experts share one), divide by d."""
        for b in self.tagged_buckets:
            for p in b.params:
                b.adopt(p)
            comm.all_reduce(b.buffer, b.params[0].grad_group, op="sum")
            b.buffer.div_(self.d)

    def step(self):
        self.finish_grad_sync()
        if self.optimizer is not None:
            self.optimizer.step()

    def full_named_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """{name: (parameter, gradient)}: every rank holds them whole already."""
        return {n: (p.detach(), p.grad) for n, p in self.module.named_parameters()}

    # -- accounting ----------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        params = tensor_bytes(self.params) + tensor_bytes(self.tagged)
        if self.buckets:
            grads = tensor_bytes(b.buffer for b in self.buckets)
        else:
            grads = tensor_bytes(p.grad for p in self.params)
        grads += tensor_bytes(b.buffer for b in self.tagged_buckets)
        optimizer = optimizer_state_bytes(self.optimizer)
        return dict(params=params, grads=grads, optimizer=optimizer,
                    total=params + grads + optimizer)
