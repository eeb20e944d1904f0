"""Data parallelism in three visible steps: naive, bucketed, overlapped.

Every rank holds the whole model and runs its own slice of the global batch; before the
optimizer step the gradients are averaged over the data-parallel group of d ranks, so every
replica takes the same step and stays identical.

1. ``naive``: after backward, one all-reduce per parameter tensor. Many small messages:
   each pays the collective's latency.
2. ``bucketed``: gradients live in a few flat buffers (``param.grad`` is a view into one),
   so one all-reduce per bucket of ``bucket_mb`` MiB replaces dozens of small ones
   (``bucket_mb=None``: DDP's default bucket, 25 MiB; 0: one bucket per parameter).
3. ``overlapped``: a hook fires when a parameter's gradient is final; once every gradient
   of a bucket is final, that bucket's all-reduce starts asynchronously while backward goes
   on computing the earlier layers' gradients. Buckets start in order (as DDP's), so every
   rank issues the same collectives in the same order.

Communication per step, each rank (Ψ = gradient bytes, ring all-reduce over d ranks)::

    all_reduce: 2 (d-1)/d * Ψ        the same for all three variants; only the message
                                     count and the overlap differ
    broadcast:  Ψ from the first rank, once, when the wrapper is built (and the buffers'
                bytes every forward with ``broadcast_buffers``, none in a model without buffers)

gloo has no AVG for every collective: each all-reduce sums, then divides by d.

Parameters with their own reduction group (``param_groups``: ``minipar.groups.ParamGroup``
values, e.g. MoE experts over the ``edp`` axis) are broadcast and summed over that group
instead, divided by the group's ``divisor`` (d), in buckets of their own reduced when the
rest is averaged, in the same order on every rank: 2 (r-1)/r * Ψ_experts over the r = d/ep
replicas of a rank's experts (the rest, Ψ - Ψ_experts, as above).

Use it like torch's ``DistributedDataParallel`` (any ``nn.Module``, any optimizer)::

    model = dp.DataParallel(Net())           # rank 0's weights everywhere; group: the world
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:
        opt.zero_grad()
        with model.no_sync():                # accumulate: no communication
            loss_fn(model(x[:4]), y[:4]).backward()
        loss_fn(model(x[4:]), y[4:]).backward()   # averaged by the end of this backward
        opt.step()

What it shares with DDP: it is an ``nn.Module`` whose forward is the wrapped module's;
``group=None`` is the whole world (``comm.SOLO``: a group of one); the first rank's parameters
and buffers are broadcast when it is built; the synchronisation finishes by the end of each
backward pass run outside ``no_sync()`` (a callback queued on autograd's engine; every
all-reduce it started is waited on and released by then, so no async work outlives it); a backward
inside ``no_sync()`` only accumulates, and stepping an optimizer over gradients that were
accumulated but not averaged raises instead of silently using them. Where it differs:
``state_dict()``/``load_state_dict()``/``named_parameters()`` use the wrapped module's names
(DDP's carry a ``module.`` prefix; here a checkpoint loads straight into the bare model), and
a parameter no backward reached gets a zero gradient (torch's optimizers would skip it).

The trainer drives it as an engine instead (shared with ``minipar.zero``): ``zero_grad()``,
``begin_step(m)``, the m backward passes, ``step()`` (average, then the optimizer), and
``model_state_bytes()``, ``full_named_parameters()``, and ``flat_ranges()``/``sync_params()``
(for clipping and checkpoints). ``begin_step(m)`` announces that each
parameter receives m gradients this step: an overlapped bucket starts once each of its
gradients has had all m, and one more gradient into a bucket already being averaged is an
error, never a silent wrong sum.

Mixed precision (``--dtype bf16``, ``minipar.precision``): the parameters and the buckets are
bf16. ``reduce_dtype=torch.float32`` (``--reduce-dtype fp32``, the default, as Megatron-LM)
casts each bf16 bucket to an fp32 copy just before its all-reduce: the sum is taken in fp32,
the wire carries 4 bytes per gradient (Ψ = 4 Φ), and the copy (4 Φ bytes in all, transient)
lives until the optimizer step, which receives it as ``main_grads`` (``MixedPrecision.step``); the bf16
``.grad`` gets the averaged values too. ``reduce_dtype=None`` reduces the bf16 buckets in place
(Ψ = 2 Φ) and the optimizer casts afterwards, tensor by tensor. One process (d = 1) reduces
nothing but still casts bucket by bucket: one kernel per bucket rather than one per tensor.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .groups import ParamGroup
from .precision import MixedPrecision

MODES = ("naive", "bucketed", "overlapped")
DEFAULT_BUCKET_MB = 25.0     # bucket_mb=None: DDP's bucket_cap_mb default


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in the optimizer's state (Adam: m, v and the step counters),
    and the fp32 master weights of a mixed-precision one (``minipar.precision``)."""
    if optimizer is None:
        return 0
    masters = optimizer.master_bytes() if isinstance(optimizer, MixedPrecision) else 0
    return masters + sum(tensor_bytes(v for v in state.values() if torch.is_tensor(v))
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
        self.main = None        # mixed precision: the fp32 copy being reduced (transient)

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

    def hand_over(self, averaged: bool = True) -> dict:
        """After a reduction in a wider dtype: ``.grad`` gets the averaged values (if there
        was an average to take); returns each parameter's view into ``main`` (what its fp32
        master reads)."""
        if self.main is None:
            return {}
        if averaged:
            self.buffer.copy_(self.main)
        out, offset = {}, 0
        for p in self.params:
            out[p] = self.main[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return out


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


# --------------------------------------------------------------------------------------
# Groups and the start: DDP's defaults
# --------------------------------------------------------------------------------------
def resolve_group(group):
    """torch's meaning of ``group`` for comm's convention (where None is a group of one):
    None is the whole world (a single process without a process group: itself), ``comm.SOLO``
    a group of one, anything else the process group itself."""
    if group is comm.SOLO:
        return None
    if group is None:
        return comm.WORLD if tdist.is_initialized() and tdist.get_world_size() > 1 else None
    return group


def broadcast_from_first(tensors, group) -> None:
    """Overwrite each tensor, in place, with the first rank of ``group``'s (one broadcast each)."""
    if comm.size(group) == 1:
        return
    src = comm.global_ranks(group)[0]
    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous():
                comm.broadcast(t.detach(), src, group)
            else:                          # collectives need contiguous memory
                c = t.detach().contiguous()
                comm.broadcast(c, src, group)
                t.detach().copy_(c)


def broadcast_module(module: nn.Module, group, own_groups=()) -> None:
    """Give every rank of ``group`` its first rank's parameters and buffers, as DDP does when it
    is built: ranks may have built their models from different seeds. A parameter of one of
    ``own_groups`` (``ParamGroup``: an MoE expert, which differs across its EP group) comes
    from the first rank of that group instead."""
    own = {p: g.group for g in own_groups for p in g.params}
    rest = (p for p in module.parameters() if p not in own)
    broadcast_from_first(itertools.chain(rest, module.buffers()), group)
    for p, g in own.items():
        broadcast_from_first([p], g)


# Parameters some DataParallel averages already (a second wrapper would average them twice).
# (keyed by identity: a WeakSet would compare tensors with ==, which is elementwise)
_WRAPPED = WeakIdKeyDictionary()


def is_wrapped(p: nn.Parameter) -> bool:
    """``p`` belongs to a ``DataParallel`` (ZeRO's ``ShardedOptimizer`` refuses such parameters)."""
    return p in _WRAPPED


# DataParallels holding gradients accumulated (no_sync, or begin_step) but not averaged yet.
_UNSYNCED: weakref.WeakSet = weakref.WeakSet()
_GUARD = []


def refuse_unsynced(params, what: str = "optimizer.step()") -> None:
    """None of ``params`` may hold a gradient that a DataParallel has accumulated but not
    averaged (that gradient would be this rank's alone): raise before ``what`` uses it."""
    ids = {id(p) for p in params}
    for ddp in list(_UNSYNCED):
        if ids & ddp._param_ids:
            raise RuntimeError(
                "DataParallel: the gradients were accumulated (under no_sync(), or for "
                "begin_step(m)) but not averaged over the group yet; run the last backward "
                "outside no_sync(), or call finish_grad_sync() (or the engine's step()) before "
                f"{what}")


def _refuse_unsynced_step(optimizer, args, kwargs):
    """Before any optimizer's step (a global torch hook)."""
    if _UNSYNCED:
        refuse_unsynced([p for g in optimizer.param_groups for p in g["params"]])


def _install_guard() -> None:
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_refuse_unsynced_step))


# --------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------
class DataParallel(nn.Module):
    """Average gradients over ``group`` (None: the whole world, as torch; ``comm.SOLO``: one rank).

    ``mode`` is one of ``MODES``; ``bucket_mb`` the bucket size of the bucketed modes, in
    MiB (``None``: DDP's default, ``DEFAULT_BUCKET_MB`` = 25);
    ``optimizer`` (optional) is stepped by ``step()`` when the wrapper is driven as an engine.
    ``own_groups``: ``minipar.groups.ParamGroup`` values whose parameters reduce over their own
    group (summed, divided by the group's divisor) instead of ``group`` (MoE experts: the
    trainer passes them; every other parameter is averaged over ``group``).
    """

    def __init__(self, module: nn.Module, group=None, mode: str = "overlapped",
                 bucket_mb: float | None = 4.0, optimizer: torch.optim.Optimizer | None = None,
                 broadcast_buffers: bool = True, reduce_dtype: torch.dtype | None = None,
                 own_groups: tuple[ParamGroup, ...] | list[ParamGroup] = ()):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if bucket_mb is None:
            bucket_mb = DEFAULT_BUCKET_MB
        if not bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be a size in MiB >= 0 (or None: "
                             f"{DEFAULT_BUCKET_MB}), not {bucket_mb!r}")
        self.module, self.mode, self.optimizer = module, mode, optimizer
        self.group = resolve_group(group)
        self.d = comm.size(self.group)
        self.broadcast_buffers = broadcast_buffers
        self.params = [p for p in module.parameters() if p.requires_grad]
        if any(is_wrapped(p) for p in self.params):
            raise ValueError("these parameters are already wrapped by a minipar DataParallel; "
                             "wrap each module once")
        # -- parameters with their own reduction group (MoE experts over their replicas) are
        # broadcast and reduced over it, in buckets of their own (see the docstring)
        self.own_groups = [g for g in own_groups if g.params]
        own = {p for g in self.own_groups for p in g.params}
        self.tagged = [p for p in self.params if p in own]
        self.params = [p for p in self.params if p not in own]
        self.own_buckets = [(g, make_buckets(list(g.params), int(bucket_mb * 2**20)))
                            for g in self.own_groups]
        self.tagged_buckets = [b for _, bs in self.own_buckets for b in bs]
        self._own_group_of = {p: g.group for g in self.own_groups for p in g.params}
        for b in self.tagged_buckets:
            b.attach()
        self.main_grads: dict = {}      # mixed precision: the fp32 reduced gradients (transient)
        # --
        broadcast_module(module, self.group, self.own_groups)
        # a wider dtype to reduce in than the gradients' own (None: their own, in place)
        widen = reduce_dtype is not None and any(p.dtype != reduce_dtype for p in self.params)
        self.reduce_dtype = reduce_dtype if widen else None
        self.buckets: list[Bucket] = []
        if mode != "naive":
            self.buckets = make_buckets(self.params, int(bucket_mb * 2**20))
            for b in self.buckets:
                b.attach()
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._param_ids = {id(p) for p in self.params + self.tagged}
        self.microbatches: int | None = None   # set by begin_step (the engine's way)
        self._no_sync = False
        self._in_backward = False     # a backward pass has reached us; its end callback is queued
        self._averaging = False       # this backward pass ends with the average
        self._rearm()
        for p in self.params + self.tagged:
            _WRAPPED[p] = True
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        _install_guard()

    # -- an nn.Module in the wrapped module's names ----------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.training and torch.is_grad_enabled():
            broadcast_from_first(self.module.buffers(), self.group)   # as DDP: rank 0's buffers
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        return self.module.load_state_dict(state_dict, *args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes run inside only accumulate the local gradients (no communication);
        the first backward outside averages everything accumulated."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    # -- the hooks ------------------------------------------------------------------------
    def _rearm(self):
        self._count = dict.fromkeys(self.params, 0)
        self._next = 0                # buckets start in order: the next one to start
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()       # never leave an average in flight behind
            b.ready, b.handle = 0, None

    def _on_grad_ready(self, p: nn.Parameter):
        if not self._in_backward:     # the first gradient of a backward pass
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._averaging = not self._no_sync
            if self.microbatches is None and self._averaging:
                self._rearm()         # DDP's way: each backward outside no_sync is a whole step
        _UNSYNCED.add(self)
        b = self._bucket_of.get(p)
        if b is not None:
            if b.handle is not None:
                raise RuntimeError(
                    "DataParallel: a gradient arrived for a bucket that is already being "
                    "averaged: more backward passes reached it than "
                    f"begin_step({self.microbatches}) announced; call step() (or "
                    "finish_grad_sync()) first")
            b.adopt(p)
        if not self._averaging:
            return
        self._count[p] += 1
        if self.mode == "overlapped" and self._count[p] == (self.microbatches or 1):
            b.ready += 1
            self._start_ready_buckets()

    def _start_ready_buckets(self):
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            self._start_reduce(b)
            self._next += 1

    def _end_of_backward(self):
        self._in_backward = False
        if self._averaging and self.microbatches is None:
            self.finish_grad_sync()

    # -- the step ------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients and start a new step. The bucketed modes zero their buffers in
        place (each ``.grad`` stays a view into one); ``naive`` follows ``set_to_none``."""
        self._rearm()
        for b in self.buckets + self.tagged_buckets:
            b.buffer.zero_()
            b.attach()  # in case someone set .grad to None
        if not self.buckets:
            for p in self.params:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()
        _UNSYNCED.discard(self)
        self._in_backward = False     # a backward that raised never ran its end callback

    def begin_step(self, microbatches: int = 1):
        """The engine's way: each parameter receives ``microbatches`` gradients before
        ``step()``, which averages (an overlapped bucket starts as soon as its last one is in)."""
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"begin_step: microbatches must be a whole number >= 1, got {microbatches!r}")
        self.microbatches = microbatches
        self._in_backward = False
        self._rearm()

    def _start_reduce(self, b: Bucket):
        """The bucket's all-reduce (average), in ``reduce_dtype`` if one is set."""
        if self.reduce_dtype is None:
            b.handle = comm.all_reduce(b.buffer, self.group, op="avg", async_op=True)
        else:
            b.main = b.buffer.to(self.reduce_dtype)
            b.handle = comm.all_reduce(b.main, self.group, op="avg", async_op=True)

    def finish_grad_sync(self):
        """Every gradient becomes the average over the group (nothing to do if nothing was
        accumulated since the last average)."""
        if self not in _UNSYNCED:
            return
        if self.mode == "naive":
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self.reduce_dtype is None:
                    comm.all_reduce(p.grad, self.group, op="avg")
                else:
                    main = self.main_grads[p] = p.grad.to(self.reduce_dtype)
                    comm.all_reduce(main, self.group, op="avg")
                    p.grad.copy_(main)
        elif self.mode == "bucketed":
            for b in self.buckets:
                for p in b.params:
                    b.adopt(p)
            if self.reduce_dtype is None:
                sync_buckets(self.buckets, self.group)
            else:
                for b in self.buckets:
                    self._start_reduce(b)
                    b.handle.wait()
        else:
            for b in self.buckets[self._next:]:   # reached by no backward, or not by all m
                for p in b.params:
                    b.adopt(p)
                b.ready = len(b.params)
            self._start_ready_buckets()
            for b in self.buckets:
                b.handle.wait()
        for b in self.buckets:
            self.main_grads.update(b.hand_over(averaged=self.d > 1))
        self.sync_tagged()
        _UNSYNCED.discard(self)
        self._rearm()

    def sync_tagged(self):
        """Parameters with their own group (MoE experts): sum over it, divide by its divisor."""
        for g, buckets in self.own_buckets:
            for b in buckets:
                for p in b.params:
                    b.adopt(p)
                flat = b.buffer if self.reduce_dtype is None else b.buffer.to(self.reduce_dtype)
                comm.all_reduce(flat, g.group, op="sum")
                flat.div_(g.divisor)
                if self.reduce_dtype is not None:      # mixed precision: as the other buckets
                    b.main = flat
                    self.main_grads.update(b.hand_over(averaged=True))

    def step(self):
        self.finish_grad_sync()
        if isinstance(self.optimizer, MixedPrecision):
            self.optimizer.step(main_grads=self.main_grads)
        elif self.optimizer is not None:
            self.optimizer.step()
        # the fp32 copies were transient
        for b in self.buckets + self.tagged_buckets:
            b.main = None
        self.main_grads = {}

    def full_named_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """{name: (parameter, gradient)}: every rank holds them whole already. Under a loss
        scaler the gradient is given unscaled (fp32), as the optimizer saw it."""
        scale = (self.optimizer.grad_scale if isinstance(self.optimizer, MixedPrecision)
                 and self.optimizer.loss_scaler is not None else None)
        return {n: (p.detach(), p.grad if scale is None or p.grad is None else p.grad.float() / scale)
                for n, p in self.module.named_parameters()}

    def flat_ranges(self) -> list[tuple[str, torch.Size, int, dict[str, torch.Tensor], bool]]:
        """What this rank's optimizer updates, for clipping and checkpoints (``minipar.pieces``):
        per parameter (local name, shape, first element 0, 1-D views of the parameter, its
        gradient and optimizer states, owner). Every replica holds whole tensors; rank 0 of
        the group owns them."""
        owner = comm.rank(self.group) == 0
        mixed = isinstance(self.optimizer, MixedPrecision)
        out = []
        for name, p in self.module.named_parameters():
            # mixed precision: what the optimizer updates is the fp32 master (its gradient
            # exists during step() only: unscaled, what clipping reads)
            q = self.optimizer.master_of[p] if mixed else p
            views = {"param": q.detach().view(-1)}
            if q.grad is not None:
                views["grad"] = q.grad.view(-1)
            state = self.optimizer.state.get(q, {}) if self.optimizer is not None else {}
            views.update({k: v.view(-1) for k, v in state.items()
                          if torch.is_tensor(v) and v.numel() == p.numel()})
            # an MoE expert is owned by the first of its replicas (its own group)
            mine = comm.rank(self._own_group_of[p]) == 0 if p in self._own_group_of else owner
            out.append((name, p.shape, 0, views, mine))
        return out

    def sync_params(self):
        """After parameters were set outside ``step()`` (a checkpoint): nothing to gather;
        under mixed precision the 16-bit parameters are rounded from the loaded masters."""
        if isinstance(self.optimizer, MixedPrecision):
            self.optimizer.params_from_masters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Average what is still accumulated (``finish_grad_sync``), then clip as
        ``torch.nn.utils.clip_grad_norm_`` on one process (every rank holds the whole averaged
        gradient, so torch's own function is right here); returns the norm."""
        self.finish_grad_sync()
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

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
