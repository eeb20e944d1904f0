"""ZeRO-1/2/3 as presets of AMSP's (s_p, s_g, s_os): each model state sharded over its own group.

Adam keeps, per parameter, 4 bytes of weight (P), 4 of gradient (G) and 8 of optimizer state
(OS: m and v), 16 Phi bytes for Phi parameters (mixed precision: 2 + 2 + 12). Plain data
parallelism holds all of it on each of d ranks. AMSP (Chen et al. 2023) shards P over groups
of s_p ranks, G over s_g and OS over s_os, and replicates each across the d/s groups. ZeRO's
stages (Rajbhandari et al. 2020) are four points of that space::

    ZeRO-0 = (1, 1, 1)    ZeRO-1 = (1, 1, d)    ZeRO-2 = (1, d, d)    ZeRO-3 = (d, d, d)

with 1 <= s_p | s_g | s_os | d, each group contiguous ranks (``minipar.rules``). The d ranks are viewed as a mesh ``(rep, os, g, p) =
(d/s_os, s_os/s_g, s_g/s_p, s_p)``, one group per axis (``ShardMesh``). Each unit of the model
(a block, the embedding, the head: FSDP's wrapping) keeps its state in flat buffers of N
elements (its parameters, padded to a multiple of s_os), cut like the mesh: this rank's P shard
is chunk p of N, its G shard chunk g of that, its OS shard chunk os of that (``Unit``). So
every collective works on whole chunks, in rank order.

One step, per unit, in the order it runs (the code below goes the other way, ZeRO-1 first):

* **P** (s_p > 1): all-gather the unit's parameters over ``p`` before its forward, free them
  after; again before its backward (``ShardedUnits``; ``prefetch`` starts the next unit's
  gather while this one computes);
* **G** (s_g > 1): once backward is done with the unit, reduce-scatter its gradient over ``p``
  then ``g`` into this rank's G shard, and drop the full gradient (``reduce_scatter_gradient``);
* **OS**, at the step: reduce-scatter the G shard over ``os``, all-reduce across ``rep``,
  divide by d; Adam updates the OS shard; all-gather it back over ``os`` then ``g``
  (``sharded_optimizer_step``).

Held between steps, per rank (Phi' padded; fp32)::

    4 Phi'/s_p + 4 Phi'/s_g + 8 Phi'/s_os         (mixed: 2/s_p + 2/s_g + 12/s_os)

Sent per step (Psi = 4 Phi', m micro-batches), summed over the groups::

    all_gather      2m (s_p-1)/s_p Psi + (s_os-s_p)/s_os Psi/s_p
    reduce_scatter   m (s_g-1)/s_g Psi + (s_os-s_g)/s_os Psi/s_g
    all_reduce      2 (R-1)/R Psi/s_os              R = d/s_os replicas

So with m = 1: plain DP and ZeRO-1/2 send 2 Psi (d-1)/d, ZeRO-3 3 Psi (d-1)/d; under a
pipeline ZeRO-3 gathers again for every micro-batch (why Megatron-DeepSpeed pairs pipelines
with ZeRO-1). Derivations per group: ``docs/reference.md`` (ZeRO). In your own loop:
``ShardedEngine``, ``ShardedOptimizer`` (ZeRO-1/2, torch's optimizer shape), and ZeRO-3 with
FSDP2's contract (``minipar.fsdp``).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
from einops import rearrange
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from . import comm
from .mesh import Axis, units_of  # noqa: F401 (FSDP's wrapping: zero.units_of)
from .rules import shard_violation, zero_shard
from .precision import PrecisionPolicy
from .runtime.errors import UsageError
from .wrappers.zero_optimizer import OptimizerSurface


class Spec(NamedTuple):         # groups of s_p ranks split the parameters, of s_g the
    p: int                      # gradients, of s_os the optimizer states
    g: int
    os: int


def zero_spec(stage: int, d: int) -> Spec:
    """ZeRO stage 0-3 over d data-parallel ranks."""
    return Spec(*zero_shard(stage, d))


# --------------------------------------------------------------------------------------
# The shard mesh: the data-parallel ranks as (rep, os, g, p)
# --------------------------------------------------------------------------------------
class ShardMesh:
    """This rank's place in ``line.view(rep, os, g, p)`` and one group along each side (every
    rank makes the groups of every line of the axis, as ``new_group`` requires)."""

    def __init__(self, axis: Axis, spec: Spec):
        self.spec, self.d = spec, axis.size
        s_p, s_g, s_os = spec
        sides = dict(rep=self.d // s_os, o=s_os // s_g, g=s_g // s_p, p=s_p)
        cut = lambda out, name: axis.new_groups(      # noqa: E731
            rearrange(axis.lines, f"l (rep o g p) -> {out}", **sides).tolist(), name)
        self.p_group = cut("(l rep o g) p", "zero_p")
        self.g_group = cut("(l rep o p) g", "zero_g")
        self.os_group = cut("(l rep g p) o", "zero_os")
        self.rep_group = cut("(l o g p) rep", "zero_rep")
        i = axis.rank                          # = ((rep * O + os) * G + g) * P + p
        self.p_index, self.g_index, self.os_index = i % s_p, (i // s_p) % sides["g"], (i // s_g) % sides["o"]


def free_storage(t: torch.Tensor) -> None:
    """Release a buffer's memory but keep the tensor (and every view of it) for later."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().nbytes() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())


def storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


class Unit:
    """A unit's state as flat buffers of N elements (its parameters, padded to s_os):

    ``flat`` the full parameters (each ``.data`` a view; s_p > 1: allocated only while used);
    ``p_shard`` this rank's P shard; ``grad_shard`` its G shard (s_g = 1: the full gradient);
    ``g_slice``, ``os_param``, ``os_grad``: nested chunks, what the optimizer updates.
    ``reduce_dtype``: gradients summed in it (None: their own)."""

    def __init__(self, module, params: list, mesh: ShardMesh, reduce_dtype=None):
        s_p, s_g, s_os = mesh.spec
        self.module, self.params = module, params
        self.numel = sum(p.numel() for p in params)
        self.N = math.ceil(self.numel / s_os) * s_os
        n_p, n_g, n_os = self.N // s_p, self.N // s_g, self.N // s_os
        like = params[0]
        self.flat = torch.cat([p.detach().reshape(-1) for p in params]
                              + [like.new_zeros(self.N - self.numel)])
        mine = slice(mesh.p_index * n_p, (mesh.p_index + 1) * n_p)
        offset = 0
        for p in params:
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.p_shard = self.flat if s_p == 1 else self.flat[mine].clone()
        if s_p > 1:
            free_storage(self.flat)
        self.g_slice = self.p_shard[mesh.g_index * n_g:(mesh.g_index + 1) * n_g]
        self.os_slice = slice(mesh.os_index * n_os, (mesh.os_index + 1) * n_os)
        self.os_param = self.g_slice[self.os_slice]
        self.grad_shard = torch.zeros(n_g, dtype=self.flat.dtype, device=like.device)
        self.os_grad = self.grad_shard[self.os_slice]
        self.os_param.grad = self.os_grad
        self.reduce_dtype = reduce_dtype
        self.handle = None      # a parameter all-gather in flight
        self.waiting = 0        # forward calls whose backward has not ended
        self.reduced = False    # by its module's post-backward since the last settle

    def attach_grads(self):
        """s_g = 1: every ``.grad`` a view into the flat gradient (as DP's buckets)."""
        offset = 0
        for p in self.params:
            p.grad = self.grad_shard[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradients, one padded flat tensor in ``reduce_dtype`` (zeros if none)."""
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                 for p in self.params]
        flat = torch.cat(grads + [self.flat.new_zeros(self.N - self.numel)])
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)


# --------------------------------------------------------------------------------------
# Collectives over the shard mesh's groups, in turn
# --------------------------------------------------------------------------------------
def reduce_scatter_down(x: torch.Tensor, groups) -> torch.Tensor:
    """Reduce-scatter (sum) ``x`` over each group in turn: this rank's summed chunk."""
    for group in groups:
        if comm.size(group) > 1:
            out = x.new_empty(x.numel() // comm.size(group))
            comm.reduce_scatter(out, x, group)
            x = out
    return x


def all_gather_in_place(out: torch.Tensor, group) -> None:
    """Every rank's own chunk of ``out`` is in place: fetch the others'."""
    if comm.size(group) > 1:
        mine = out.chunk(comm.size(group))[comm.rank(group)].clone()
        comm.all_gather(out, mine, group)


def gather_up(x: torch.Tensor, groups) -> torch.Tensor:
    """All-gather ``x`` over each group in turn (the reverse of ``reduce_scatter_down``)."""
    for group in groups:
        if comm.size(group) > 1:
            out = x.new_empty(x.numel() * comm.size(group))
            comm.all_gather(out, x, group)
            x = out
    return x


# --------------------------------------------------------------------------------------
# OS sharding (ZeRO-1): each rank updates its slice, then the slices are all-gathered
# --------------------------------------------------------------------------------------
def sharded_optimizer_step(units: list[Unit], optimizer, mesh: ShardMesh):
    """Reduce each G shard down to this rank's OS shard, run Adam on it, gather the updates
    (ZeRO-1: the G shard is the whole local gradient, reduce-scattered over ``os_group``)."""
    # EXERCISE ex06 begin
    # per unit: reduce-scatter grad_shard over os_group, all-reduce over rep_group, /d, copy INTO u.os_grad
    # (Adam reads that memory: `u.os_grad = x` only rebinds); optimizer.step(); all-gather up (os, then g)
    for u in units:
        summed = reduce_scatter_down(u.grad_shard, [mesh.os_group])
        comm.all_reduce(summed, mesh.rep_group)
        u.os_grad.copy_(summed).div_(mesh.d)    # gloo has no AVG: sum over d ranks, then divide
    optimizer.step()                             # Adam on each unit's os_param, in place
    for u in units:
        all_gather_in_place(u.g_slice, mesh.os_group)   # OS shards -> this rank's G slice
        all_gather_in_place(u.p_shard, mesh.g_group)    # G slices -> this rank's P shard
    # EXERCISE ex06 end


# --------------------------------------------------------------------------------------
# G sharding (ZeRO-2): reduce-scatter each unit's gradient as soon as backward is done with it
# --------------------------------------------------------------------------------------
def reduce_scatter_gradient(u: Unit, mesh: ShardMesh) -> None:
    """Add the unit's full gradient, summed over the G group (p then g), into this rank's G
    shard; drop the full gradient: between steps only the shard is held."""
    # EXERCISE ex07 begin
    # flatten the unit's grads (u.flat_grad()), reduce-scatter over p_group then g_group,
    # add the result into u.grad_shard, and drop every p.grad of the unit
    shard = reduce_scatter_down(u.flat_grad(), [mesh.p_group, mesh.g_group])
    u.grad_shard.add_(shard)
    for p in u.params:
        p.grad = None
    # EXERCISE ex07 end


# --------------------------------------------------------------------------------------
# P sharding (ZeRO-3): gather before use, free after
# --------------------------------------------------------------------------------------
class PostBackward(torch.autograd.Function):
    """The identity on a module's inputs; its backward runs ``done()`` once the module's backward
    is over (FSDP2's): a point set by the graph's shape, not by the parameters a branch used."""

    @staticmethod
    def forward(ctx, done, *inputs):
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


def after_backward(done, args, kwargs):
    """``(args, kwargs)``, those needing a gradient through ``PostBackward``; None if none does."""
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if not where:
        return None
    for i, t in zip(where, PostBackward.apply(done, *[flat[i] for i in where])):
        flat[i] = t
    return tree_unflatten(flat, spec)


class ShardedUnits:
    """The ``units`` ([(module, params)], ``units_of``) as ``Unit`` buffers, and the hooks that
    move them: with s_p > 1 each unit is gathered before its forward and freed after, again
    before its backward (a hook on its output's gradient) and freed after (``prefetch``: the
    neighbour's gather starts meanwhile). When its module's backward is over (``PostBackward``;
    else at the end of the backward, in unit order) it is freed and, if ``reduce_each_backward``
    (G sharding), ``reduce(u)`` runs: the same collectives in the same order on every rank,
    whichever parameters its graph used (a missing gradient is reduced as zeros)."""

    def __init__(self, module, mesh: ShardMesh, units: list, prefetch: bool = True,
                 reduce_dtype=None, reduce_each_backward: bool = False):
        self.module, self.mesh, self.spec, self.prefetch = module, mesh, mesh.spec, prefetch
        self.reduce_each_backward = reduce_each_backward
        self.units = [Unit(m, ps, mesh, reduce_dtype) for m, ps in units]
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._queued = False    # the end of this backward is queued
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        for u in [u for u in self.units if u.module is not None]:
            u.module.register_forward_pre_hook(
                lambda m, args, kwargs, u=u: self._pre_forward(u, args, kwargs), with_kwargs=True)
            if self.spec.p > 1:
                u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))

    def _gather(self, u: Unit, wait: bool = True):
        if u.handle is None and storage_bytes(u.flat) == 0:
            alloc_storage(u.flat)
            u.handle = comm.all_gather(u.flat, u.p_shard, self.mesh.p_group, async_op=True)
        if wait and u.handle is not None:
            u.handle.wait()
            u.handle = None

    def _free(self, u: Unit):
        if u.handle is not None:
            u.handle.wait()
            u.handle = None
        free_storage(u.flat)

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        k = self.units.index(u) + step
        return self.units[k] if 0 <= k < len(self.units) else None

    def _pre_forward(self, u: Unit, args, kwargs):
        if self.spec.p > 1:
            self._gather(u)
            if self.prefetch and self._neighbour(u, +1) is not None:
                self._gather(self._neighbour(u, +1), wait=False)   # overlaps this unit's forward
        marked = torch.is_grad_enabled() and after_backward(lambda: self._post_backward(u), args, kwargs)
        u.waiting += bool(marked)
        return marked or None

    def _post_forward(self, u: Unit, out):
        self._free(u)
        if torch.is_grad_enabled():     # its output's gradient arrives just before its backward
            for t in tree_leaves(out):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))

    def _pre_backward(self, u: Unit):
        self._gather(u)
        if self.prefetch and self._neighbour(u, -1) is not None:
            self._gather(self._neighbour(u, -1), wait=False)   # overlaps this unit's backward

    def _on_grad_ready(self, p):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        u = self._unit_of[p]
        if u.reduced and u.waiting == 0:
            raise RuntimeError(f"ZeRO: a gradient of shape {tuple(p.shape)} arrived after its unit "
                               f"was reduced (a use outside its module's forward)")

    def _post_backward(self, u: Unit):
        u.waiting -= 1
        if u.waiting == 0:                      # every forward call's backward is over
            if self.spec.p > 1:
                self._free(u)
            if self.reduce_each_backward:
                self.reduce(u)
                u.reduced = True

    def reduce(self, u: Unit):
        raise NotImplementedError

    def _end_of_backward(self):
        """In unit order: free, and reduce each unit no post-backward reduced."""
        self._queued = False
        for u in self.units:
            if self.spec.p > 1:
                self._free(u)
            if self.reduce_each_backward and not u.reduced:
                self.reduce(u)
            u.waiting, u.reduced = 0, False

    def settle(self):
        """Before a step: wait on every gather in flight (a prefetch no unit used)."""
        for u in self.units if self.spec.p > 1 else []:
            self._free(u)


# --------------------------------------------------------------------------------------
# The engine: (s_p, s_g, s_os) over one data-parallel axis, with its own optimizer
# --------------------------------------------------------------------------------------
class ShardedEngine(ShardedUnits):
    """ZeRO/AMSP over ``axis`` (a ``mesh.Axis``; a process group, None the world): ``zero_grad()``,
    backward, ``step()``, after broadcasting rank 0's weights. ``units``: as ``units_of``;
    ``make_optimizer`` runs over the OS shards (and ``whole``, kept out of them); under a mixed
    ``policy`` over their fp32 masters, gradients reduced in its ``reduce_dtype``."""

    def __init__(self, module, axis, spec, make_optimizer, units=None, prefetch: bool = True,
                 policy: PrecisionPolicy | None = None, whole=()):
        axis = axis if isinstance(axis, Axis) else Axis.of_group(axis)
        spec = Spec(*spec)
        reason = shard_violation(tuple(spec), axis.size)
        if reason:
            raise UsageError(reason)
        self.policy = policy or PrecisionPolicy()
        units = units if units and isinstance(units[0], tuple) else units_of(module, units, whole)
        rest = ([] if module is None else    # frozen weights and buffers too, as DDP
                [p for p in module.parameters() if not p.requires_grad] + list(module.buffers()))
        comm.broadcast_from_first([p for _, ps in units for p in ps] + rest,  # ``whole``: the owner's
                                  axis.group)
        mesh, self.group = ShardMesh(axis, spec), axis.group
        # mixed precision: gradients summed in the policy's (wider) reduce dtype
        self.reduce_dtype = self.policy.reduce_dtype if self.policy.mixed and mesh.d > 1 else None
        super().__init__(module, mesh, units, prefetch, self.reduce_dtype,
                         reduce_each_backward=spec.g > 1)
        self.whole = list(whole)
        self.optimizer = self.policy.optimizer([u.os_param for u in self.units] + self.whole,
                                               make_optimizer)

    def reduce(self, u: Unit):
        if storage_bytes(u.grad_shard) == 0:        # the step's first gradient for this unit
            alloc_storage(u.grad_shard)
            u.grad_shard.zero_()
        reduce_scatter_gradient(u, self.mesh)

    def zero_grad(self):
        """Zero the gradients (s_g > 1: a G shard's memory released until backward refills it)."""
        for p in self.whole:
            p.grad = None
        for u in self.units:
            if self.spec.g == 1:
                u.grad_shard.zero_()
                u.attach_grads()
            else:
                free_storage(u.grad_shard)
                for p in u.params:
                    p.grad = None

    def begin_step(self, microbatches: int = 1):
        """Nothing to arm: gradients are reduce-scattered as they come (s_g > 1) or accumulate."""

    def step(self, before_update=None):
        """Reduce, update, gather (``before_update()`` first: the owner's ``whole`` reduced)."""
        self.settle()
        for u in self.units:
            if self.spec.g > 1 and storage_bytes(u.grad_shard) == 0:
                self.reduce(u)                  # a unit no backward reached
        if before_update is not None:
            before_update()
        if self.reduce_dtype is None:
            sharded_optimizer_step(self.units, self.optimizer, self.mesh)
            return
        # mixed precision: each G shard's fp32 copy is reduced, its OS chunk handed to the fp32
        # master as a value (Megatron's main_grad); the average rounded back into the G shard
        narrow = [(u.grad_shard, u.os_grad) for u in self.units]
        for u in self.units:
            u.grad_shard = u.grad_shard.to(self.reduce_dtype)
            u.os_grad = u.grad_shard[u.os_slice]
        main = {u.os_param: u.os_grad for u in self.units}
        sharded_optimizer_step(self.units, SimpleNamespace(step=lambda: self.optimizer.step(main)), self.mesh)
        for u, (grad_shard, os_grad) in zip(self.units, narrow):
            os_grad.copy_(u.os_grad)
            u.grad_shard, u.os_grad = grad_shard, os_grad

    def model_state_bytes(self) -> dict[str, int]:
        """Storage this rank holds now (between steps: only the shards its spec keeps)."""
        params = sum(storage_bytes(u.p_shard) + (storage_bytes(u.flat) if self.spec.p > 1 else 0)
                     for u in self.units) + sum(p.numel() * p.element_size() for p in self.whole)
        grads = sum(storage_bytes(u.grad_shard) for u in self.units)
        if self.spec.g > 1:
            grads += sum(storage_bytes(p.grad) for u in self.units for p in u.params)
        grads += sum(storage_bytes(p.grad) for p in self.whole)
        optimizer = self.policy.state_bytes(self.optimizer)
        return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)


class ShardedOptimizer(OptimizerSurface):
    """ZeRO-1/2 shaped like a torch optimizer: ZeRO-1 (``stage=1``) or ZeRO-2 over ``group`` (None: the world) for
    ``optimizer_class(params, **defaults)``: a ``ShardedEngine`` of one unit per parameter group
    at (1, 1, d) or (1, d, d); its torch surface is ``minipar.wrappers.zero_optimizer``."""

    engine_class = ShardedEngine
    gather = staticmethod(gather_up)
