"""Data parallelism in three visible steps: naive, bucketed, overlapped.

Every rank holds the whole model and runs its own slice of the global batch; before the
optimizer step the gradients are averaged over the d ranks of the data-parallel group, so
every replica takes the same step and stays identical.

1. ``naive``: after backward, one all-reduce per parameter tensor. Many small messages, each
   paying the collective's latency.
2. ``bucketed``: gradients live in a few flat buffers (each ``param.grad`` a view into one),
   so one all-reduce per bucket of ``bucket_mb`` MiB replaces dozens of small ones.
3. ``overlapped``: a hook fires when a parameter's gradient is final; once every gradient of a
   bucket is, that bucket's all-reduce starts asynchronously while backward goes on computing
   the earlier layers' gradients. Buckets start in a fixed order (as DDP's), so every rank
   issues the same collectives in the same order.

Sent per step by each rank (Psi = gradient bytes, ring all-reduce over d ranks)::

    all_reduce   2 (d-1)/d Psi      the same for all three; only the message count and the
                                    overlap differ
    broadcast    Psi from the first rank, once, when the wrapper is built (and the buffers'
                 bytes each forward with ``broadcast_buffers``)

gloo has no AVG for every collective: each all-reduce sums, then divides.

Parameter groups (``minipar.mesh.ParamGroup``): each group is summed over its own process
group and divided by its divisor. The default is one group, every parameter over ``group``
divided by d; an MoE model adds its experts, summed over their replicas only (``edp``),
reduced at the end of the sync: 2 (r-1)/r Psi_experts over r = d/ep replicas.

Gradient accumulation: the backward of a forward run inside ``no_sync()`` (or with
``require_backward_grad_sync = False``, DDP's flag, read by the forward as DDP reads it) only
accumulates; the next one outside averages everything accumulated, by its end: one
all-reduce per bucket per optimizer step, as DDP. An engine announces instead that each parameter
receives m gradients this step (``begin_step(m)``) and averages at its step
(``finish_grad_sync()``); an overlapped bucket starts once each of its gradients has had all m.
One counter per parameter serves both: a backward that syncs counts one arrival per parameter.

Mixed precision (``minipar.precision``): with ``reduce_dtype`` wider than the gradients (bf16
buckets, fp32 reduction, Megatron-LM's default) each bucket is cast to an fp32 copy just before
its all-reduce (Psi = 4 bytes a gradient); the copies are kept in ``main_grads`` for the
optimizer's fp32 masters, and the averaged values are rounded back into ``.grad``.

Use it like torch's ``DistributedDataParallel`` (``minipar.wrappers`` lists what carries over)::

    model = dp.DataParallel(Net())           # rank 0's weights everywhere; group: the world
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:
        opt.zero_grad()
        with model.no_sync():                # accumulate: no communication
            loss_fn(model(x[:4]), y[:4]).backward()
        loss_fn(model(x[4:]), y[4:]).backward()   # averaged by the end of this backward
        opt.step()
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from . import comm
from .mesh import ParamGroup
from .wrappers import ddp_arguments

MODES = ("naive", "bucketed", "overlapped")
DEFAULT_BUCKET_MB = 25.0     # bucket_mb=None: DDP's bucket_cap_mb default


class Bucket:
    """A flat gradient buffer; each parameter's ``.grad`` is a view into it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views, offset = {}, 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0          # parameters whose gradient is final this step
        self.handle = None      # the all-reduce in flight
        self.main = None        # a wider copy being reduced (mixed precision)

    def attach(self):
        """Make every ``.grad`` the bucket's view again: if someone replaced it (``zero_grad``
        sets it to None, and backward then allocates a fresh tensor), copy it in first."""
        for p in self.params:
            view = self.views[p]
            if p.grad is not view:
                view.zero_() if p.grad is None else view.copy_(p.grad)
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


class _Reduction:
    """One parameter group's buckets (one bucket per parameter in ``naive`` mode), reduced over
    its group: sum, then divide by its divisor, in ``reduce_dtype`` when that is wider."""

    def __init__(self, group: ParamGroup, bucket_bytes: int | None, reduce_dtype):
        self.group, self.divisor = group.group, group.divisor
        params = list(group.params)
        self.buckets = ([Bucket([p]) for p in reversed(params)] if bucket_bytes is None
                        else make_buckets(params, bucket_bytes))
        self.reduce_dtype = reduce_dtype if any(p.dtype != reduce_dtype for p in params) else None
        self.next = 0           # buckets start in order: the next one to start

    def start(self, b: Bucket):
        b.attach()
        b.main = b.buffer if self.reduce_dtype is None else b.buffer.to(self.reduce_dtype)
        b.handle = comm.all_reduce(b.main, self.group, async_op=True)

    def start_ready(self):
        while self.next < len(self.buckets) and \
                self.buckets[self.next].ready == len(self.buckets[self.next].params):
            self.start(self.buckets[self.next])
            self.next += 1

    def finish(self, main_grads: dict) -> None:
        """Start what has not started (in order), wait, divide; fp32 copies into ``main_grads``."""
        for b in self.buckets[self.next:]:
            b.ready = len(b.params)
        self.start_ready()
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.main.div_(self.divisor)
            if b.main is not b.buffer:
                b.buffer.copy_(b.main)
                main_grads.update({p: b.main[o:o + p.numel()].view_as(p)
                                   for p, o in zip(b.params, _offsets(b.params))})
            b.main, b.ready = None, 0
        self.next = 0


def _offsets(params):
    out, o = [], 0
    for p in params:
        out.append(o)
        o += p.numel()
    return out


class DataParallel(nn.Module):
    """Average gradients over ``group`` (None: the whole world, as torch; ``comm.SOLO``: one
    rank), DDP's way. ``mode`` one of ``MODES``; ``bucket_mb`` the bucket size (None: DDP's 25);
    ``groups``: ``ParamGroup`` values (default: every trainable parameter over ``group``);
    ``reduce_dtype``: the dtype gradients are summed in (None: their own). The positional
    arguments are DDP's: ``device_ids``/``output_device`` None on CPU, at most the module's one
    GPU; ``init_sync``: broadcast when built; ``process_group``/``device_mesh``: ``group``;
    ``bucket_cap_mb``: ``bucket_mb`` (``minipar.wrappers.ddp_arguments`` reads the rest)."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, *args, group=None, mode: str = "overlapped",
                 bucket_mb: float | None = 4.0, groups: list[ParamGroup] | None = None,
                 reduce_dtype=None, **ddp_kwargs):
        super().__init__()
        group, bucket_mb, self.find_unused = ddp_arguments(
            module, device_ids, output_device, process_group, group, bucket_cap_mb, bucket_mb,
            args, ddp_kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        bucket_mb = DEFAULT_BUCKET_MB if bucket_mb is None else bucket_mb
        if not bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be a size in MiB >= 0, not {bucket_mb!r}")
        self.module, self.mode, self.broadcast_buffers = module, mode, broadcast_buffers
        self.group = comm.resolve_group(group)
        self.d = comm.size(self.group)
        trainable = [p for p in module.parameters() if p.requires_grad]
        groups = groups or [ParamGroup("dense", trainable, "dp", self.group, self.d)]
        listed = [id(p) for g in groups for p in g.params]
        if sorted(listed) != sorted(map(id, trainable)):   # each averaged once, none left out
            raise ValueError("groups must list every trainable parameter of the module exactly once")
        # the first rank's weights everywhere (ranks may have built different models); a
        # group with its own process group (MoE experts) from that group's first rank
        if init_sync:
            frozen = [p for p in module.parameters() if not p.requires_grad]
            if frozen and any(g.group is not self.group for g in groups):
                raise ValueError("DataParallel: frozen parameters beside groups with their own "
                                 "process group: a frozen one may belong to such a group, so "
                                 "the first rank's copy cannot be broadcast to all; make them "
                                 "equal yourself and pass init_sync=False")
            comm.broadcast_from_first([p for g in groups if g.group is self.group for p in g.params]
                                      + frozen + list(module.buffers()), self.group)
            for g in groups:
                if g.group is not self.group:
                    comm.broadcast_from_first(g.params, g.group)
        size = None if mode == "naive" else int(bucket_mb * 2**20)
        self.reductions = [_Reduction(g, size, reduce_dtype) for g in groups]
        self._bucket_of = {p: b for r in self.reductions for b in r.buckets for p in b.params}
        self.main_grads: dict = {}              # mixed precision: fp32 averaged gradients
        self.require_backward_grad_sync = True   # DDP's flag: False accumulates, as no_sync()
        self._sync_next = True   # the flag as the last forward read it (DDP reads it there)
        self._expected = None    # gradients each parameter receives before the average
        self._count: dict = {}
        self._pending = False    # accumulated gradients not averaged yet
        self._used: set = set()  # parameters a backward reached since the last average
        self._in_backward = False
        self._finish_at_end = False   # this backward pass ends with the average (DDP's way)
        for b in self.buckets():
            b.attach()
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- an nn.Module holding the wrapped one as .module (state dicts: DDP's module.<name>) --
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._sync_next = self.require_backward_grad_sync
            if self.broadcast_buffers and self.training:
                comm.broadcast_from_first(list(self.module.buffers()), self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """A forward and its backward inside only accumulate (no communication); the first
        backward of a forward outside averages everything accumulated (DDP's rule)."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- one counter per parameter: when is its gradient final? --------------------------
    def begin_step(self, microbatches: int = 1):
        """The engine's way: each parameter receives ``microbatches`` gradients before
        ``finish_grad_sync()``; an overlapped bucket starts when its last one is in."""
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"begin_step: microbatches must be a whole number >= 1, got {microbatches!r}")
        self._arm(microbatches)

    def _arm(self, expected: int):
        self._expected, self._count = expected, dict.fromkeys(self._bucket_of, 0)

    def _on_grad_ready(self, p: nn.Parameter):
        b = self._bucket_of[p]
        if b.handle is not None:
            raise RuntimeError("DataParallel: a gradient arrived for a bucket already being "
                               f"averaged: more backward passes than begin_step({self._expected}) "
                               "announced; finish the step (finish_grad_sync) first")
        self._pending = True
        self._used.add(p)
        if not self._in_backward:              # the first gradient of this backward pass
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._expected is None and self._sync_next:
                self._arm(1)                   # DDP's way: this backward is the whole step
                self._finish_at_end = True
        if self._expected is None:
            return                             # accumulating (no_sync)
        self._count[p] += 1
        if self.mode == "overlapped" and self._count[p] == self._expected:
            b.ready += 1
            self.reductions[0].start_ready()   # the others' buckets start at the finish, in order

    def _end_of_backward(self):
        self._in_backward = False
        if self._finish_at_end:
            self._finish_at_end = False
            unused = [n for n, p in self.module.named_parameters()
                      if p in self._bucket_of and p not in self._used]
            self.finish_grad_sync()
            if unused and not self.find_unused:     # DDP's error, after this step's averages
                raise RuntimeError(f"DataParallel: {unused[0]} (and {len(unused) - 1} more) got "
                                   f"no gradient in this backward; pass find_unused_parameters"
                                   f"=True, as DDP requires")

    def finish_grad_sync(self):
        """Every gradient becomes its group's average (nothing to do if nothing accumulated);
        ``find_unused_parameters``: one no rank's backward reached keeps grad None."""
        if self._pending:
            self.main_grads = {}
            for r in self.reductions:
                r.finish(self.main_grads)
            if self.find_unused:
                self._drop_unused()
        self._pending, self._expected, self._used = False, None, set()

    def _drop_unused(self):
        """DDP's search: all-reduce a used flag per parameter (its group's); a parameter no
        rank used was averaged as zeros, but the optimizer must see no gradient for it."""
        for r in self.reductions:
            params = [p for b in r.buckets for p in b.params]
            used = torch.tensor([float(p in self._used) for p in params], device=params[0].device)
            comm.all_reduce(used, r.group)
            for p, n in zip(params, used.tolist()):
                if n == 0:
                    p.grad = None

    def zero_grad(self, set_to_none: bool = True):
        """Zero the buckets in place (each ``.grad`` stays a view into one); never leave an
        average in flight behind."""
        for r in self.reductions:
            r.next = 0
        for b in self.buckets():
            if b.handle is not None:
                b.handle.wait()
            b.buffer.zero_()
            b.attach()
            b.handle, b.main, b.ready = None, None, 0
        self._pending, self._expected, self._in_backward = False, None, False
        self._used = set()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Average what is still accumulated, then clip as ``torch.nn.utils.clip_grad_norm_``
        on one process (every rank holds the whole averaged gradient); returns the norm."""
        if any(r.group is not self.group for r in self.reductions):
            raise ValueError("DataParallel.clip_grad_norm_: a parameter group is averaged over its "
                             "own process group, so ranks hold different parameters and norms; "
                             "sum the squared norms over each group's ranks before clipping")
        self.finish_grad_sync()
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def buckets(self) -> list[Bucket]:
        return [b for r in self.reductions for b in r.buckets]
