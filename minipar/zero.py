"""Sharded data parallelism: ZeRO-1/2/3 as presets of AMSP's (P, G, OS) partitioning.

Where the memory goes. Adam in fp32 keeps, per parameter, 4 bytes of weight (P), 4 of
gradient (G) and 8 of optimizer state (OS: Adam's m and v): 16 Phi bytes for Phi parameters
(mixed precision: 2 + 2 + 12, the same 16). Plain data parallelism keeps all of it on every
one of its d ranks. AMSP (Chen et al. 2023) shards each kind of state over its own group
of ranks inside the data-parallel group, s_p ranks for P, s_g for G, s_os for OS, and
replicates it across the d/s groups. Factor 1 is a full replica, d is full sharding, anything
between is partial sharding (MiCS, hybrid sharding). ZeRO's stages (Rajbhandari et al. 2020)
are four points of that space::

    ZeRO-0 (plain DP) = (1, 1, 1)    ZeRO-1 = (1, 1, d)    ZeRO-2 = (1, d, d)    ZeRO-3 = (d, d, d)

Constraints: 1 <= s_p <= s_g <= s_os <= d, each divides d, and a group is contiguous ranks
(it fills a node before it spans nodes). Our layout also needs s_p | s_g | s_os (the shards
nest; always true for powers of two). AMSP's planner further keeps s_g in {s_p, s_os}
(gradients follow the parameters or the optimizer states). The points between are not
dominated; they trade memory for traffic differently. Gradients are reduce-scattered over
s_g every micro-batch, so ``1,2,4`` holds twice the gradient memory of ``1,4,4`` but with
m > 1 micro-batches sends less reduce-scatter traffic ((s_g-1)/s_g of the gradient per
micro-batch: half of it against three quarters); with m = 1 the step's totals are equal
(``1,2,4`` reduce-scatters the other quarter at the step). This engine runs them, so the
whole space can be measured.

The sharding mesh. The d data-parallel ranks are viewed as a 4-d mesh, like the process grid::

    dp_ranks.view(rep, os, g, p) = (d/s_os, s_os/s_g, s_g/s_p, s_p)

    zero_p    the s_p contiguous ranks of one P group
    zero_g    the s_g/s_p ranks of one G group with the same p coordinate
    zero_os   the s_os/s_g ranks of one OS group with the same (g, p) coordinates
    zero_rep  the d/s_os replicas: the same place in every OS group

For example d = 4 and ``2,2,4``: the mesh is (1, 2, 1, 2), zero_p = {0, 1} and {2, 3},
zero_os = {0, 2} and {1, 3}; ZeRO-3 is (1, 1, 1, 4), a single zero_p of 4 ranks.

Each unit of the model (the embedding, each block, the head: FSDP's wrapping) keeps its
state in flat fp32 buffers of N elements, N = its parameter count padded up to a multiple of
s_os. The buffer is cut like the mesh: this rank's P shard is chunk p of N/s_p, its G shard
chunk g of the P shard, its OS shard chunk os of the G shard. So the OS shard lies inside the
G shard, inside the P shard, and every collective works on whole chunks in rank order.

One step, per unit, in the order it runs (the code below tells it the other way round,
from ZeRO-1 to ZeRO-3):

* P sharding (s_p > 1): before the unit's forward, and again before its backward, all-gather
  the full parameters over zero_p; free them right after. ``prefetch`` starts the next
  unit's all-gather while this one computes (AMSP's communication optimiser).
* G sharding (s_g > 1): when a unit's backward is done, reduce-scatter its full gradient over
  zero_p then zero_g (together: the G group) and add it into this rank's G shard; free the
  full gradient. With s_g = 1 the full gradient stays, accumulating micro-batches.
* OS sharding, at ``step()``: reduce-scatter the G shard over zero_os down to the OS shard,
  all-reduce it across zero_rep, divide by d (gloo has no AVG: sum, then divide); Adam
  updates the OS shard; all-gather the updated shards over zero_os, then zero_g, back into
  the P shard.

Model-state bytes one rank holds between steps (Phi' = padded parameter count)::

    fp32:   4 Phi'/s_p + 4 Phi'/s_g + 8 Phi'/s_os   (+ 4 B of Adam step counter per unit)
    mixed:  2 Phi'/s_p + 2 Phi'/s_g + 12 Phi'/s_os  (+ 4 B per unit: the masters' counters)

Bytes one rank sends per step (Psi = 4 Phi', ring volumes, m micro-batches), by group, with
(P, G, O, R) = (s_p, s_g/s_p, s_os/s_g, d/s_os) the mesh's sides::

    zero_p    all_gather     2m (P-1)/P Psi         parameters, before forward and backward
              reduce_scatter  m (P-1)/P Psi         gradients, every micro-batch
    zero_g    reduce_scatter  m (G-1)/G Psi/s_p     gradients, every micro-batch
              all_gather        (G-1)/G Psi/s_p     updated shards, after the step
    zero_os   reduce_scatter    (O-1)/O Psi/s_g     G shard down to the OS shard, at the step
              all_gather        (O-1)/O Psi/s_g     updated shards, after the step
    zero_rep  all_reduce      2 (R-1)/R Psi/s_os    across the replicas

    summed:   all_gather 2m (s_p-1)/s_p Psi + (s_os-s_p)/s_os Psi/s_p
              reduce_scatter m (s_g-1)/s_g Psi + (s_os-s_g)/s_os Psi/s_g
              all_reduce 2 (R-1)/R Psi/s_os

With m = 1: plain DP 2 Psi (d-1)/d (all-reduce), ZeRO-1 and ZeRO-2 2 Psi (d-1)/d
(reduce-scatter + all-gather), ZeRO-3 3 Psi (d-1)/d.

Mixed precision (``--dtype bf16``; ``minipar.precision``). The flat buffers, so the P and G
shards, are bf16; the optimizer updates an fp32 master copy of this rank's OS shard, with fp32
Adam moments: the 12 bytes per parameter that s_os divides. Gradients are reduced in
``reduce_dtype`` (``--reduce-dtype``): with fp32 (the default, as Megatron-LM) each
micro-batch's reduce-scatter over the G group sends an fp32 copy of the bf16 gradient
(``Unit.flat_grad``) and the sum is rounded into the bf16 G shard; at the step the G shard is
cast to an fp32 copy (``Unit.widen``, 4 Phi'/s_g bytes, transient) whose reduction over
zero_os and zero_rep the master reads directly. So fp32 reduction sends Psi = 4 Phi' bytes of
gradient and bf16 reduction 2 Phi'; the parameter all-gathers always carry bf16 (2 Phi').

With tensor and pipeline parallelism the engine shards whatever parameters this rank's
module holds (a TP slice, a pipeline stage) over its own data-parallel line of the grid;
every spec composes with both. Under a pipeline, each micro-batch's forward and backward
gathers the parameters again, 2 m all-gathers per step: that is why Megatron-DeepSpeed
pairs pipelines with ZeRO-1, whose traffic does not grow with m.

MoE experts (``minipar.moe``) differ from one expert-parallel rank to the next, so they stay
out of the shards: the engine takes the parameter groups (``minipar.groups``: ``dense`` over
the data-parallel axis is sharded, ``expert`` over ``edp`` is not) and keeps the experts whole,
as in plain DP, summed over their own group (the expert's replicas) at the step, in
``reduce_dtype``, and divided by d. Under bf16/fp16 their fp32 masters sit in the optimizer
beside the OS shards' (``MixedPrecision`` over both), so checkpoints, weight decay and clipping
act on them (``flat_ranges``: during the step, each master's own fp32 gradient).

fp16: the optimizer (``precision.MixedPrecision`` with a loss scaler) unscales the fp32 master
gradients the engine hands it (``_MastersStep``), reduces one found-inf flag over the whole
world and skips the same step on every rank; the runner multiplies the loss by the scale.

The engine has the DP engine's interface (``minipar.dp``): ``zero_grad()``,
``begin_step(m)``, ``step()``, ``model_state_bytes()``, ``full_named_parameters()``,
``flat_ranges()`` and ``sync_params()`` (for clipping and checkpoints).

What lives where: ``minipar.shard`` holds the mechanics (the spec, the shard mesh, ``units_of``,
the flat ``Unit`` buffers and ``ShardedUnits``, the gather/free/reduce hooks of P and G
sharding); this module the collectives of one step (``sharded_optimizer_step``,
``reduce_scatter_gradient``) and the engine built on ``ShardedUnits``. Two more owners use the same code outside the trainer:
``minipar.fsdp.fully_shard`` (ZeRO-3 as an nn.Module with FSDP2's contract: ``ShardedUnits`` at
(d, d, d), any optimizer built afterwards) and ``minipar.zero_optimizer.ShardedOptimizer``
(ZeRO-1/2 shaped like a torch optimizer, re-exported here)::

    opt = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    for x, y in batches:                     # ZeRO-1/2: a torch optimizer's shape
        opt.zero_grad()
        loss_fn(net(x), y).backward()        # stage 2: gradients reduce-scattered here
        opt.step()                           # stage 1: here; then the all-gather

    model = fsdp.fully_shard(net)            # ZeRO-3: FSDP2's shape
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)      # steps this rank's shards

``ShardedOptimizer`` makes one unit per parameter group; the engine and ``fully_shard`` one per
child module that owns parameters (``units_of``: or a list, or a policy).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from . import comm, dp
from .runtime import dist
from .dp import optimizer_state_bytes
from .groups import ParamGroup, param_groups
from .precision import MixedPrecision, PrecisionPolicy
from .runtime.errors import UsageError
from .shard import (GroupGrid, ShardedUnits, ShardMesh, Spec, Unit,  # noqa: F401
                    all_gather_in_place, alloc_storage, as_grid, free_storage, gather_up,
                    parse_shard, reduce_scatter_down, spec_violation, storage_bytes, units_of,
                    zero_spec)


# --------------------------------------------------------------------------------------
# OS sharding (ZeRO-1): each rank updates its slice, then the slices are all-gathered
# --------------------------------------------------------------------------------------
def sharded_optimizer_step(units: list[Unit], optimizer: torch.optim.Optimizer, mesh: ShardMesh):
    """Reduce each G shard down to this rank's OS shard, run Adam on it, gather the updates.

    With s_g = 1 (ZeRO-1) ``grad_shard`` is the whole local gradient, so the reduce-scatter
    over ``mesh.os_group`` is ZeRO-1's: each rank only ever needs the averaged gradient of
    the slice whose Adam state it keeps.
    """
    # EXERCISE ex06 begin
    # per unit: reduce-scatter grad_shard over os_group, all-reduce over rep_group, /d into os_grad;
    # then optimizer.step(); then all-gather each unit's slices back up (os_group, then g_group)
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
    """Add the unit's full gradient, summed over the G group, into this rank's G shard.

    The G group is zero_p x zero_g; reduce-scattering over zero_p and then zero_g sends the
    same bytes as one reduce-scatter over the G group and leaves the chunks nested. The full
    gradient is dropped afterwards: between steps this rank holds only its G shard.
    """
    # EXERCISE ex07 begin
    # flatten the unit's grads (u.flat_grad()), reduce-scatter over p_group then g_group,
    # add the result into u.grad_shard, and drop every p.grad of the unit
    shard = reduce_scatter_down(u.flat_grad(), [mesh.p_group, mesh.g_group])
    u.grad_shard.add_(shard)
    for p in u.params:
        p.grad = None
    # EXERCISE ex07 end


# --------------------------------------------------------------------------------------
# fp16 at the step, and the engine
# --------------------------------------------------------------------------------------
class _MastersStep:
    """What ``sharded_optimizer_step`` calls as ``optimizer.step()`` under mixed precision
    (``precision.MixedPrecision``): each OS shard's averaged gradient, fp32 when it was reduced
    in fp32 (``Unit.widen``), goes to its master as a value (``main_grads``); the experts' from
    their ``.grad``. fp16's loss scaling happens there: unscaled fp32 master gradients, one
    found-inf flag over the world, the same step skipped on every rank (a skipped step still
    all-gathers the unchanged shards: every rank runs the same collectives every step)."""

    def __init__(self, engine: "ShardedEngine"):
        self.engine = engine

    def step(self):
        e = self.engine
        e.optimizer.step(main_grads={u.os_param: u.os_grad for u in e.units})


# --------------------------------------------------------------------------------------
# The engine: the trainer's ZeRO/AMSP, (s_p, s_g, s_os) with its own optimizer
# --------------------------------------------------------------------------------------
class ShardedEngine(ShardedUnits):
    """Data parallelism with (s_p, s_g, s_os) sharding over ``grid``'s data-parallel group.

    ``grid`` is a ``dist.Grid`` (the trainer) or a process group (None: the whole world), so
    the engine also runs a plain model in a plain loop (``zero_grad()``, backward, ``step()``).
    The first rank's parameters and buffers are broadcast first (ranks may have built
    different models). ``units``: which modules are gathered together (``units_of``).
    Outside the trainer, ``minipar.fsdp.fully_shard`` (the same units and hooks) is the
    nn.Module-shaped way, with any optimizer built afterwards.
    """

    def __init__(self, module: nn.Module, grid, spec: Spec, make_optimizer,
                 prefetch: bool = True, units=None, reduce_dtype: torch.dtype | None = None,
                 groups: list[ParamGroup] | None = None, policy: PrecisionPolicy | None = None):
        grid = as_grid(grid)
        if policy is not None:
            reduce_dtype = policy.reduce_dtype if policy.mixed else None
        spec = Spec(*spec)
        reason = spec_violation(spec, grid.dp)
        if reason:
            raise UsageError(reason)
        # -- parameter groups (``minipar.groups``): the one reduced over the data-parallel axis
        # is sharded; any other with a group of its own (MoE experts over ``edp`` with ep > 1)
        # stays whole, as in plain DP; with ep = 1 the experts are replicas like the rest
        if groups is None:
            groups = (param_groups(module, grid) if isinstance(grid, dist.Grid) else
                      [ParamGroup("dense", [p for p in module.parameters() if p.requires_grad],
                                  "dp_cp", grid.dp_group, grid.dp)])
        self.whole = [g for g in groups
                      if g.reduce_axis != "dp_cp" and g.group is not grid.dp_group]
        self.tagged = [p for g in self.whole for p in g.params]
        dp.broadcast_module(module, grid.dp_group, self.whole)   # experts: from their group's first
        mesh = ShardMesh(grid, spec)
        # a wider dtype to reduce gradients in than the parameters' own (None: their own)
        if reduce_dtype is not None and (mesh.d == 1 or all(
                p.dtype == reduce_dtype for p in module.parameters())):
            reduce_dtype = None
        self.reduce_dtype = reduce_dtype
        super().__init__(module, mesh, units, prefetch, reduce_dtype,
                         reduce_each_backward=spec.g > 1, exclude=self.tagged)
        self.optimizer = make_optimizer([u.os_param for u in self.units] + self.tagged)

    def reduce(self, u: Unit):
        if storage_bytes(u.grad_shard) == 0:        # first gradient of the step for this unit
            alloc_storage(u.grad_shard)
            u.grad_shard.zero_()
        reduce_scatter_gradient(u, self.mesh)

    # -- the engine interface ------------------------------------------------------------
    def zero_grad(self):
        """Zero the gradients; a G shard's memory is released until backward refills it
        (as ``set_to_none`` does), so the forward pass runs without any gradient storage."""
        for p in self.tagged:
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
        """Nothing to arm per micro-batch count: with s_g > 1 every micro-batch's gradient is
        reduce-scattered as it is produced, with s_g = 1 they accumulate until ``step()``."""
        for u in self.units:
            u.ready = 0

    def step(self):
        self.settle()
        for u in self.units:
            if self.spec.g > 1 and storage_bytes(u.grad_shard) == 0:
                self.reduce(u)                  # a unit no backward reached
        for g in self.whole:                    # MoE experts: sum over their replicas, / d
            for p in g.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                # in reduce_dtype (fp32 under bf16/fp16), the average rounded into .grad
                grad = p.grad if self.reduce_dtype is None else p.grad.to(self.reduce_dtype)
                comm.all_reduce(grad, g.group)
                p.grad.copy_(grad.div_(g.divisor))
        optimizer = _MastersStep(self) if isinstance(self.optimizer, MixedPrecision) else self.optimizer
        if self.reduce_dtype is None:
            sharded_optimizer_step(self.units, optimizer, self.mesh)
            return
        for u in self.units:
            u.widen()
        sharded_optimizer_step(self.units, optimizer, self.mesh)
        for u in self.units:
            u.narrow()

    def model_state_bytes(self) -> dict[str, int]:
        """Storage this rank holds now (between steps: only the shards the spec keeps)."""
        params = sum(storage_bytes(u.p_shard) for u in self.units)
        if self.spec.p > 1:
            params += sum(storage_bytes(u.flat) for u in self.units)
        grads = sum(storage_bytes(u.grad_shard) for u in self.units)
        if self.spec.g > 1:
            grads += sum(storage_bytes(p.grad) for u in self.units for p in u.params)
        params += sum(p.numel() * p.element_size() for p in self.tagged)
        grads += sum(storage_bytes(p.grad) for p in self.tagged)
        optimizer = optimizer_state_bytes(self.optimizer)
        return dict(params=params, grads=grads, optimizer=optimizer,
                    total=params + grads + optimizer)

    def full_named_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{local name: (full parameter, full averaged gradient of the last step)}.

        Gathers the shards (bookkeeping, not training traffic: untracked).
        """
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        with comm.untracked():
            for u in self.units:
                flat = gather_up(u.p_shard, [self.mesh.p_group])
                grad = gather_up(u.os_grad, [self.mesh.os_group, self.mesh.g_group,
                                             self.mesh.p_group])
                offset = 0
                for p in u.params:
                    sl = slice(offset, offset + p.numel())
                    out[names[p]] = (flat[sl].view_as(p), grad[sl].view_as(p))
                    offset += p.numel()
        # the experts' .grad still carries fp16's loss scale (their masters were unscaled):
        # given unscaled, as the optimizer saw it, like the OS shards' above
        opt = self.optimizer
        scale = (opt.grad_scale if isinstance(opt, MixedPrecision) and opt.loss_scaler is not None
                 else None)
        for p in self.tagged:
            grad = p.grad if scale is None or p.grad is None else p.grad.float() / scale
            out[names[p]] = (p.detach(), grad)
        return out


    def flat_ranges(self) -> list[tuple[str, torch.Size, int, dict[str, torch.Tensor], bool]]:
        """What this rank's optimizer updates, for clipping and checkpoints (``minipar.pieces``):
        each parameter's part of this rank's OS shard, as (local name, shape, first element,
        1-D views of the parameter, the averaged gradient and Adam's states, owner). The OS
        shards of one replica tile each unit; replica 0 (of ``zero_rep``) owns them."""
        s_p, s_g, s_os = self.spec
        names = {p: n for n, p in self.module.named_parameters()}
        owner = comm.rank(self.mesh.rep_group) == 0
        masters = self._masters()
        out = []
        for u in self.units:
            # the OS shard is chunk os of chunk g of chunk p of the unit's flat buffer
            lo = (self.mesh.p_index * (u.N // s_p) + self.mesh.g_index * (u.N // s_g)
                  + self.mesh.os_index * (u.N // s_os))
            hi = lo + u.N // s_os
            param = masters.get(u.os_param, u.os_param)      # mixed precision: the fp32 master
            # the master's gradient exists during step() only (unscaled): what clipping must scale
            flat = {"param": param.detach(),
                    "grad": u.os_grad if param.grad is None else param.grad}
            flat.update({k: v for k, v in self.optimizer.state.get(param, {}).items()
                         if torch.is_tensor(v) and v.numel() == u.os_param.numel()})
            offset = 0
            for p in u.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    out.append((names[p], p.shape, a - offset,
                                {k: v[a - lo:b - lo] for k, v in flat.items()}, owner))
                offset += p.numel()
        for g in self.whole:        # MoE experts: whole, owned by the first of their replicas
            for p in g.params:
                param = masters.get(p, p)
                views = {"param": param.detach().view(-1)}
                grad = p.grad if param.grad is None else param.grad   # the master's, in step()
                if grad is not None:
                    views["grad"] = grad.view(-1)
                views.update({k: v.view(-1) for k, v in self.optimizer.state.get(param, {}).items()
                              if torch.is_tensor(v) and v.numel() == p.numel()})
                out.append((names[p], p.shape, 0, views, comm.rank(g.group) == 0))
        return out

    def _masters(self):
        """Under mixed precision (``precision.MixedPrecision``) the fp32 master of each tensor
        the optimizer updates (an OS shard, an expert): what a checkpoint saves and loads, what
        weight decay scales. Empty in fp32, where the tensors are their own masters."""
        opt = self.optimizer
        if not isinstance(opt, MixedPrecision):
            return WeakIdKeyDictionary()
        return WeakIdKeyDictionary(zip(opt.params, opt.masters))

    def sync_params(self):
        """After the OS shards of the parameters were set outside ``step()`` (a checkpoint: the
        fp32 masters under mixed precision, rounded into the 16-bit shards here): gather them
        up into every rank's P shard, as the end of a step does."""
        with torch.no_grad():
            for p, m in self._masters().items():
                p.copy_(m)
        for u in self.units:
            all_gather_in_place(u.g_slice, self.mesh.os_group)
            all_gather_in_place(u.p_shard, self.mesh.g_group)


from .zero_optimizer import ELEMENT_WISE, ShardedOptimizer  # noqa: E402,F401  (re-exported)
