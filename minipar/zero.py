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
out of the shards: parameters tagged with ``p.grad_group`` are kept whole, as in plain DP,
summed over that group (the expert's replicas) at the step and divided by d.

The engine has the DP engine's interface (``minipar.dp``): ``zero_grad()``,
``begin_step(m)``, ``step()``, ``model_state_bytes()``, ``full_named_parameters()``,
``flat_ranges()`` and ``sync_params()`` (for clipping and checkpoints).

Outside the trainer, on any model in a plain loop (group=None: the whole world; rank 0's
parameters are broadcast first, so ranks may start from different seeds)::

    opt = zero.ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    for x, y in batches:                     # ZeRO-1/2: a torch optimizer's shape
        opt.zero_grad()
        loss_fn(net(x), y).backward()        # stage 2: gradients reduce-scattered here
        opt.step()                           # stage 1: here; then the all-gather

    engine = zero.ShardedEngine(net, None, zero.zero_spec(3, d), lambda ps: torch.optim.AdamW(ps))
    ...  engine.zero_grad(); loss_fn(net(x), y).backward(); engine.step()     # ZeRO-3

``ShardedOptimizer`` makes one unit per parameter group; the engine one per child module
that owns parameters (``units_of``: or a list, or a policy).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as tdist
import torch.nn as nn
from einops import rearrange
from torch.utils._pytree import tree_leaves

from . import comm, dist, dp, sharding
from .dp import optimizer_state_bytes
from .errors import UsageError
from .groups import ParamGroup


# --------------------------------------------------------------------------------------
# The spec: (s_p, s_g, s_os), ZeRO's presets, and the constraints
# --------------------------------------------------------------------------------------
class Spec(NamedTuple):
    p: int    # s_p: the parameters are split over groups of s_p ranks
    g: int    # s_g: the gradients, over groups of s_g ranks
    os: int   # s_os: the optimizer states, over groups of s_os ranks


# The rules live in the planner (torch-free), so the engine and the planner cannot disagree
# about which specs exist; here they only get the engine's Spec type.
def zero_spec(stage: int, d: int) -> Spec:
    """ZeRO stage 0-3 over d data-parallel ranks."""
    return Spec(*sharding.zero_shard(stage, d))


def parse_shard(text: str) -> Spec:
    return Spec(*sharding.parse_shard(text))


def spec_violation(spec: Spec, d: int) -> str | None:
    """Why ``spec`` cannot shard d ranks (one line: what is wrong; what would fix it), or None."""
    return sharding.shard_violation(tuple(spec), d)


# --------------------------------------------------------------------------------------
# The sharding mesh
# --------------------------------------------------------------------------------------
class ShardMesh:
    """This rank's place in ``dp_ranks.view(rep, os, g, p)`` and a group along each axis.

    Every rank creates the groups of every data-parallel line of the grid (one line per
    pipeline stage and tensor-parallel rank), as ``torch.distributed.new_group`` requires.
    """

    def __init__(self, grid, spec: Spec):
        self.spec, self.d = spec, grid.dp
        s_p, s_g, s_os = spec
        sizes = dict(rep=self.d // s_os, o=s_os // s_g, g=s_g // s_p, p=s_p)
        lines = grid.lines("dp")
        axes = "l (rep o g p)"
        self.p_group = grid.new_groups(
            rearrange(lines, f"{axes} -> (l rep o g) p", **sizes).tolist(), "zero_p")
        self.g_group = grid.new_groups(
            rearrange(lines, f"{axes} -> (l rep o p) g", **sizes).tolist(), "zero_g")
        self.os_group = grid.new_groups(
            rearrange(lines, f"{axes} -> (l rep g p) o", **sizes).tolist(), "zero_os")
        self.rep_group = grid.new_groups(
            rearrange(lines, f"{axes} -> (l o g p) rep", **sizes).tolist(), "zero_rep")
        # i = ((rep * O + os) * G + g) * P + p, with i this rank's index in its DP line
        i = grid.dp_rank
        self.p_index = i % s_p
        self.g_index = (i // s_p) % sizes["g"]
        self.os_index = (i // s_g) % sizes["o"]


class GroupGrid:
    """One data-parallel line over a process group: the part of ``dist.Grid`` a ShardMesh reads.

    It lets the engine and ``ShardedOptimizer`` shard over any group (None: the whole world;
    ``comm.SOLO``: one rank). A mesh group that is the whole line reuses ``group`` itself (all
    of ZeRO's stages); finer groups (AMSP's partial specs) are created with ``new_group``,
    which every rank of the world must call, so they need the group to be the whole world.
    """

    def __init__(self, group):
        self.dp_group = group
        ranks = comm.global_ranks(group)
        self.dp, self.dp_rank = len(ranks), comm.rank(group)
        self.line = torch.tensor(ranks).view(1, -1)

    def lines(self, axis: str) -> torch.Tensor:    # what ShardMesh reads: the one dp line
        return self.line

    def new_groups(self, rank_lists: list[list[int]], name: str):
        me = comm.global_ranks(None)[0]
        mine = next(ranks for ranks in rank_lists if me in ranks)
        if len(mine) == 1:
            return None
        if sorted(mine) == sorted(self.line.flatten().tolist()):
            return self.dp_group
        if self.dp != tdist.get_world_size():
            raise UsageError(f"the shard group {name} ({len(mine)} of the group's {self.dp} "
                             f"ranks) must be created by every rank of the world: shard over "
                             f"the whole world, or pass a dist.Grid")
        return dist.Grid.new_groups(self, rank_lists, name)

    @property
    def distributed(self) -> bool:        # what dist.Grid.new_groups reads
        return tdist.is_initialized()

    @property
    def rank(self) -> int:
        return comm.global_ranks(None)[0]


def as_grid(grid_or_group):
    """A ``dist.Grid`` as it is; a process group (None: the whole world) as one data-parallel line."""
    if isinstance(grid_or_group, (dist.Grid, GroupGrid)):
        return grid_or_group
    return GroupGrid(dp.resolve_group(grid_or_group))


# --------------------------------------------------------------------------------------
# Flat buffers, one set per unit
# --------------------------------------------------------------------------------------
def units_of(module: nn.Module, units=None) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """FSDP's wrapping: the groups of parameters gathered, freed and reduced together.

    ``units`` picks the modules that become units:
      * None: the module's ``parts()`` when it names them (minipar's GPT and pipeline stages:
        the embedding, each block, the head), else each child module that owns parameters
        (containers without a forward, ModuleList and ModuleDict, are looked into);
      * a list of modules;
      * a policy, a function ``module -> bool`` (FSDP's auto-wrap policy): the outermost
        submodules it accepts.
    A parameter used by two units (tied weights) and the parameters outside every unit form
    one more unit on ``module`` itself, whose forward spans every use of them.
    """
    if units is None:
        parts = module.parts() if hasattr(module, "parts") else _children_with_parameters(module)
    elif callable(units):
        parts = _accepted(module, units)
    else:
        parts = list(units)
    owners: dict[int, int] = {}
    for part in parts:
        for p in {id(p) for p in part.parameters()}:
            owners[p] = owners.get(p, 0) + 1
    seen = {p for p, n in owners.items() if n > 1}      # tied across units: the root's
    experts = {id(p) for p in module.parameters() if hasattr(p, "grad_group")}  # MoE: not sharded
    out = []
    for part in parts:
        params = [p for p in part.parameters()
                  if p.requires_grad and id(p) not in seen and id(p) not in experts]
        seen.update(map(id, params))
        if params:
            out.append((part, params))
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in experts
            and (id(p) not in seen or owners.get(id(p), 0) > 1)]
    if rest:
        out.insert(0, (module, rest))
    return out


def _children_with_parameters(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _children_with_parameters(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def _accepted(module: nn.Module, policy) -> list[nn.Module]:
    out = []
    for child in module.children():
        out += [child] if policy(child) else _accepted(child, policy)
    return out


def free_storage(t: torch.Tensor) -> None:
    """Release a buffer's memory but keep the tensor (and every view of it) for later."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().nbytes() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())


def storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


class Unit:
    """A part's state as flat buffers of N elements (padded to a multiple of s_os).

    ``flat``        the full parameters; each parameter's ``.data`` is a view into it. With
                    s_p > 1 its memory is released between uses (``free_storage``).
    ``p_shard``     this rank's P shard (``flat`` itself when s_p = 1).
    ``grad_shard``  this rank's G shard of the gradient. With s_g = 1 it is the full
                    gradient, and each parameter's ``.grad`` is a view into it.
    ``os_param``, ``os_grad``  this rank's OS shard of the parameters (a view into
                    ``p_shard``) and of the averaged gradient (a view into ``grad_shard``):
                    what the optimizer sees.
    ``reduce_dtype`` None: gradients are reduced in the parameters' dtype; else in this one
                    (mixed precision's fp32 reduction: ``flat_grad`` and ``widen``).
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], mesh: ShardMesh,
                 reduce_dtype: torch.dtype | None = None):
        s_p, s_g, s_os = mesh.spec
        self.module, self.params = module, params
        self.numel = sum(p.numel() for p in params)
        self.N = math.ceil(self.numel / s_os) * s_os
        like = params[0]
        self.flat = torch.zeros(self.N, dtype=like.dtype, device=like.device)
        offset = 0
        for p in params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        n_p, n_g, n_os = self.N // s_p, self.N // s_g, self.N // s_os
        if s_p == 1:
            self.p_shard = self.flat
        else:
            self.p_shard = self.flat[mesh.p_index * n_p:(mesh.p_index + 1) * n_p].clone()
            free_storage(self.flat)
        # the G slice of the P shard and the OS slice of the G slice: nested chunks
        self.g_slice = self.p_shard[mesh.g_index * n_g:(mesh.g_index + 1) * n_g]
        self.os_param = self.g_slice[mesh.os_index * n_os:(mesh.os_index + 1) * n_os]
        self.grad_shard = torch.zeros(n_g, dtype=like.dtype, device=like.device)
        self.os_slice = slice(mesh.os_index * n_os, (mesh.os_index + 1) * n_os)
        self.os_grad = self.grad_shard[self.os_slice]
        self.os_param.grad = self.os_grad
        self.reduce_dtype = reduce_dtype
        self._narrow = None     # the bf16 G shard and its OS view while ``widen`` is in effect
        self.handle = None      # a parameter all-gather in flight
        self.ready = 0          # gradients accumulated in this step (one per param per micro-batch)

    def attach_grads(self):
        """With s_g = 1 every ``.grad`` is a view into the flat gradient (as DP's buckets)."""
        offset = 0
        for p in self.params:
            p.grad = self.grad_shard[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradients as one padded flat tensor (zeros for a parameter without one)."""
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                 for p in self.params]
        flat = torch.cat(grads + [self.flat.new_zeros(self.N - self.numel)])
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)

    def widen(self):
        """Before the step's reductions (mixed precision, fp32 reduction): ``grad_shard`` becomes
        an fp32 copy of the bf16 G shard, so ``sharded_optimizer_step`` reduces in fp32, and its
        OS slice ``os_grad`` is what the fp32 master reads (``os_param.main_grad``)."""
        self._narrow = self.grad_shard, self.os_grad
        self.grad_shard = self.grad_shard.to(self.reduce_dtype)
        self.os_grad = self.grad_shard[self.os_slice]
        self.os_param.main_grad = self.os_grad

    def narrow(self):
        """After the step: the bf16 G shard again, its OS slice holding the averaged gradient."""
        grad_shard, os_grad = self._narrow
        os_grad.copy_(self.os_grad)
        self.grad_shard, self.os_grad, self._narrow = grad_shard, os_grad, None
        self.os_param.main_grad = None


def reduce_scatter_down(x: torch.Tensor, groups) -> torch.Tensor:
    """Reduce-scatter (sum) ``x`` over each group in turn; return this rank's summed chunk."""
    for group in groups:
        n = comm.size(group)
        if n > 1:
            out = x.new_empty(x.numel() // n)
            comm.reduce_scatter(out, x, group)
            x = out
    return x


def all_gather_in_place(out: torch.Tensor, group) -> None:
    """Every rank's own chunk of ``out`` is already in place: fetch the others' chunks."""
    n = comm.size(group)
    if n > 1:
        mine = out.chunk(n)[comm.rank(group)].clone()
        comm.all_gather(out, mine, group)


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
# The engine, and P sharding (ZeRO-3): gather before use, free after, with hooks
# --------------------------------------------------------------------------------------
class ShardedEngine:
    """Data parallelism with (s_p, s_g, s_os) sharding over ``grid``'s data-parallel group.

    ``grid`` is a ``dist.Grid`` (the trainer) or a process group (None: the whole world), so
    the engine also runs a plain model in a plain loop (``zero_grad()``, backward, ``step()``).
    The first rank's parameters and buffers are broadcast first (ranks may have built
    different models). ``units``: which modules are gathered together (``units_of``).
    """

    def __init__(self, module: nn.Module, grid, spec: Spec, make_optimizer,
                 prefetch: bool = True, units=None, reduce_dtype: torch.dtype | None = None):
        grid = as_grid(grid)
        self.module, self.spec, self.prefetch = module, Spec(*spec), prefetch
        reason = spec_violation(self.spec, grid.dp)
        if reason:
            raise UsageError(reason)
        # MoE experts come from the first rank of their own group (they differ across EP)
        experts = [p for p in module.parameters() if hasattr(p, "grad_group")]
        dp.broadcast_module(module, grid.dp_group, [ParamGroup(
            "expert", experts, "edp", experts[0].grad_group)] if experts else [])
        self.mesh = ShardMesh(grid, self.spec)
        # a wider dtype to reduce gradients in than the parameters' own (None: their own)
        if reduce_dtype is not None and (self.mesh.d == 1 or all(
                p.dtype == reduce_dtype for p in module.parameters())):
            reduce_dtype = None
        self.reduce_dtype = reduce_dtype
        self.units = [Unit(m, params, self.mesh, reduce_dtype)
                      for m, params in units_of(module, units)]
        self._unit_of = {p: u for u in self.units for p in u.params}
        # -- MoE: experts (tagged with their own reduction group) stay whole, as in plain DP
        self.tagged = [p for p in module.parameters() if hasattr(p, "grad_group")]
        self.optimizer = make_optimizer([u.os_param for u in self.units] + self.tagged)
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.spec.p > 1:
            for u in self.units:
                u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
                u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))

    # -- P sharding: the unit's full parameters exist only while it computes -----------------
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

    def _pre_forward(self, u: Unit):
        self._gather(u)
        nxt = self._neighbour(u, +1)
        if self.prefetch and nxt is not None:
            self._gather(nxt, wait=False)     # overlaps with this unit's forward

    def _post_forward(self, u: Unit, out):
        self._free(u)
        if torch.is_grad_enabled():
            # the gradient of the unit's output arrives just before the unit's backward
            for t in tree_leaves(out):     # a tensor, or tensors in tuples, lists, dicts
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))

    def _pre_backward(self, u: Unit):
        self._gather(u)
        prev = self._neighbour(u, -1)
        if self.prefetch and prev is not None:
            self._gather(prev, wait=False)    # overlaps with this unit's backward

    # -- the unit's backward is done once every parameter's gradient has accumulated ----------
    def _on_grad_ready(self, p: nn.Parameter):
        u = self._unit_of[p]
        u.ready += 1
        if u.ready % len(u.params):
            return
        if self.spec.p > 1:
            self._free(u)
        if self.spec.g > 1:
            self._reduce(u)                          # every micro-batch: full grads never pile up

    def _reduce(self, u: Unit):
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
        for u in self.units:
            if self.spec.p > 1:
                self._free(u)                   # a prefetch nobody waited for
            if self.spec.g > 1 and (storage_bytes(u.grad_shard) == 0
                                    or any(p.grad is not None for p in u.params)):
                self._reduce(u)                 # a unit whose backward never finished
        for p in self.tagged:                   # MoE experts: sum over their replicas, / d
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, p.grad_group)
            p.grad.div_(self.mesh.d)
        if self.reduce_dtype is None:
            sharded_optimizer_step(self.units, self.optimizer, self.mesh)
            return
        for u in self.units:
            u.widen()
        sharded_optimizer_step(self.units, self.optimizer, self.mesh)
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
        for p in self.tagged:
            out[names[p]] = (p.detach(), p.grad)
        return out


    def flat_ranges(self) -> list[tuple[str, torch.Size, int, dict[str, torch.Tensor], bool]]:
        """What this rank's optimizer updates, for clipping and checkpoints (``minipar.pieces``):
        each parameter's part of this rank's OS shard, as (local name, shape, first element,
        1-D views of the parameter, the averaged gradient and Adam's states, owner). The OS
        shards of one replica tile each unit; replica 0 (of ``zero_rep``) owns them."""
        s_p, s_g, s_os = self.spec
        names = {p: n for n, p in self.module.named_parameters()}
        owner = comm.rank(self.mesh.rep_group) == 0
        out = []
        for u in self.units:
            # the OS shard is chunk os of chunk g of chunk p of the unit's flat buffer
            lo = (self.mesh.p_index * (u.N // s_p) + self.mesh.g_index * (u.N // s_g)
                  + self.mesh.os_index * (u.N // s_os))
            hi = lo + u.N // s_os
            flat = {"param": u.os_param.detach(), "grad": u.os_grad}
            flat.update({k: v for k, v in self.optimizer.state.get(u.os_param, {}).items()
                         if torch.is_tensor(v) and v.numel() == u.os_param.numel()})
            offset = 0
            for p in u.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    out.append((names[p], p.shape, a - offset,
                                {k: v[a - lo:b - lo] for k, v in flat.items()}, owner))
                offset += p.numel()
        for p in self.tagged:       # MoE experts: whole, owned by the first of their replicas
            views = {"param": p.detach().view(-1)}
            if p.grad is not None:
                views["grad"] = p.grad.view(-1)
            views.update({k: v.view(-1) for k, v in self.optimizer.state.get(p, {}).items()
                          if torch.is_tensor(v) and v.numel() == p.numel()})
            out.append((names[p], p.shape, 0, views, comm.rank(p.grad_group) == 0))
        return out

    def sync_params(self):
        """After the OS shards of the parameters were set outside ``step()`` (a checkpoint):
        gather them up into every rank's P shard, as the end of a step does."""
        for u in self.units:
            all_gather_in_place(u.g_slice, self.mesh.os_group)
            all_gather_in_place(u.p_shard, self.mesh.g_group)


def gather_up(x: torch.Tensor, groups) -> torch.Tensor:
    """All-gather ``x`` over each group in turn (the reverse of ``reduce_scatter_down``)."""
    for group in groups:
        n = comm.size(group)
        if n > 1:
            out = x.new_empty(x.numel() * n)
            comm.all_gather(out, x, group)
            x = out
    return x


# --------------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2 shaped like a torch optimizer, for any model in a plain loop
# --------------------------------------------------------------------------------------
# Optimizers whose update of an element reads only that element's parameter, gradient and
# state (and scalars such as the step count): a flat slice across tensors leaves them exact.
ELEMENT_WISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
    "Rprop", "ASGD") if hasattr(torch.optim, name))
_SCALAR_STATE = ("step", "eta", "mu", "mu_product")   # per-tensor scalars of those optimizers


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``) over ``group``, shaped like a torch optimizer.

    Where one process writes ``torch.optim.AdamW(model.parameters(), lr=1e-3)``, each of d
    ranks writes ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` on the
    bare model (group=None: the whole world; rank 0's parameters are broadcast first) and runs
    the same loop. Each parameter group's trainable parameters become one flat ``Unit``
    (their ``.data`` become views into it); this rank keeps the optimizer state of its 1/d
    slice only, and the gradients are averaged here, not by a DataParallel:

    * stage 1: backward accumulates this rank's gradients (``.grad`` are views into the
      unit's flat gradient); ``step()`` reduce-scatters them down to this rank's slice,
      updates it, and all-gathers the parameters;
    * stage 2: as soon as backward is done with a unit, its gradient is reduce-scattered into
      this rank's slice and the full gradient is dropped (after every backward pass: with
      accumulation, m reduce-scatters per step); ``step()`` updates and all-gathers.

    Bytes one rank sends per step (Psi = parameter bytes, padded; m backward passes)::

        reduce_scatter  (d-1)/d Psi  (stage 2: m times)      all_gather  (d-1)/d Psi
        broadcast       Psi from the first rank, once, when it is built

    What keeps the numbers torch's (each is checked; a violation raises):
    * only element-wise optimizers (``ELEMENT_WISE``; ``element_wise=True`` vouches for
      another): a per-tensor statistic (Adafactor's rows and columns, LAMB's trust ratio)
      over a slice of several tensors would silently differ;
    * every trainable parameter gets a gradient before each ``step()``: torch skips a
      parameter without one, a flat slice cannot;
    * not over the parameters of a ``dp.DataParallel``, which would average them a second time.
    ``step()`` consumes the gradients (as ``zero_grad(set_to_none=True)`` after it) and
    ``.grad`` never holds the average: read gradients through the optimizer, not ``.grad``.
    ``state_dict()`` is torch's own layout (every parameter's whole state, torch's indices),
    gathered from the slices, so it loads into a plain optimizer and back: call it, and
    ``load_state_dict()``, on every rank.
    """

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 element_wise: bool | None = None, **defaults):
        if stage not in (1, 2):
            raise UsageError(f"ShardedOptimizer stage must be 1 (optimizer states) or 2 (and "
                             f"gradients), not {stage!r}; ZeRO-3 shards the parameters too: "
                             f"zero.ShardedEngine(model, group, zero_spec(3, d), make_optimizer)")
        if not (optimizer_class in ELEMENT_WISE if element_wise is None else element_wise):
            raise UsageError(
                f"ShardedOptimizer updates flat slices that cut across tensors, exact only for "
                f"element-wise optimizers ({', '.join(c.__name__ for c in ELEMENT_WISE)}); "
                f"{getattr(optimizer_class, '__name__', optimizer_class)} may compute per-tensor "
                f"statistics. Use torch.distributed.optim.ZeroRedundancyOptimizer (whole "
                f"parameters per rank), or element_wise=True if each update is element by element")
        super().__init__(params, defaults)
        self.stage, self.group = stage, dp.resolve_group(group)
        d = comm.size(self.group)
        self.mesh = ShardMesh(GroupGrid(self.group), Spec(1, 1, d) if stage == 1 else Spec(1, d, d))
        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        for params in trainable:
            if not params:
                raise UsageError("ShardedOptimizer: a parameter group has no trainable parameter")
            if len({(p.dtype, p.device) for p in params}) > 1:
                raise UsageError("ShardedOptimizer: the parameters of one group must share a "
                                 "dtype and a device (make one group per dtype)")
            if any(dp.is_wrapped(p) for p in params):
                raise UsageError("ShardedOptimizer averages the gradients itself (reduce-"
                                 "scatter); give it the bare model's parameters, not those of a "
                                 "dp.DataParallel, which would average them a second time")
        self.units = [Unit(None, params, self.mesh) for params in trainable]
        dp.broadcast_from_first([u.flat for u in self.units], self.group)
        self.optimizer = optimizer_class([
            {**{k: v for k, v in g.items() if k != "params"}, "params": [u.os_param]}
            for g, u in zip(self.param_groups, self.units)])
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():          # the class's defaults the caller left out
                g.setdefault(k, v)
        self.defaults = {**self.optimizer.defaults, **defaults}
        self._index = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                      for p in g["params"])}
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._views = {}                         # stage 1: each .grad a view into the flat gradient
        for u in self.units if stage == 1 else []:
            offset = 0
            for p in u.params:
                self._views[p] = u.grad_shard[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self._got_grad: set[int] = set()
        self._in_backward = False
        self.zero_grad()
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def add_param_group(self, param_group):
        if hasattr(self, "units"):
            raise NotImplementedError("ShardedOptimizer: give every parameter group when it is built")
        super().add_param_group(param_group)

    # -- gradients ---------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter):
        self._got_grad.add(id(p))
        if self.stage == 1:
            return
        if not self._in_backward:               # the first gradient of a backward pass
            self._in_backward = True
            for u in self.units:
                u.ready = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        u = self._unit_of[p]
        u.ready += 1
        if u.ready == len(u.params):
            reduce_scatter_gradient(u, self.mesh)   # ZeRO-2: the full gradient is dropped

    def _end_of_backward(self):
        """Units that this backward reached only in part (a parameter it did not use)."""
        self._in_backward = False
        for u in self.units:
            if any(p.grad is not None for p in u.params):
                reduce_scatter_gradient(u, self.mesh)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients (stage 1 keeps ``.grad`` as views into the flat gradient)."""
        for u in self.units:
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = self._views[p] if self.stage == 1 else None
        self._got_grad.clear()
        self._in_backward = False     # a backward that raised never ran its end callback

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        missing = [p for p in self._unit_of if id(p) not in self._got_grad]
        if missing:
            raise RuntimeError(
                f"ShardedOptimizer: {len(missing)} of {len(self._unit_of)} trainable parameters "
                f"(shapes {[tuple(p.shape) for p in missing[:4]]}...) got no gradient since the "
                f"last step; torch's optimizer would skip them, a flat slice cannot: leave them "
                f"out of the optimizer or freeze them (requires_grad=False)")
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})   # e.g. an LR scheduler's
        for u in self.units:
            if self.stage == 1:                 # a .grad someone replaced (set_to_none) comes back
                for p in u.params:
                    if p.grad is None:
                        self._views[p].zero_()
                    elif p.grad is not self._views[p]:
                        self._views[p].copy_(p.grad)
            elif any(p.grad is not None for p in u.params):
                reduce_scatter_gradient(u, self.mesh)
        sharded_optimizer_step(self.units, self.optimizer, self.mesh)
        for u in self.units:                    # the step consumed the gradients
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = None
        self._got_grad.clear()
        return loss

    # -- checkpoints in torch's layout ---------------------------------------------------------
    def _os_offset(self, u: Unit) -> int:
        s_p, s_g, s_os = self.mesh.spec
        return (self.mesh.p_index * (u.N // s_p) + self.mesh.g_index * (u.N // s_g)
                + self.mesh.os_index * (u.N // s_os))

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict()`` of the whole model (a collective: every rank)."""
        state = {}
        with comm.untracked():
            for u in self.units:
                mine = self.optimizer.state.get(u.os_param, {})
                whole = {k: gather_up(v, [self.mesh.os_group, self.mesh.g_group, self.mesh.p_group])
                         if torch.is_tensor(v) and v.dim() == 1 else v for k, v in mine.items()}
                offset = 0
                for p in u.params:
                    if whole:
                        state[self._index[id(p)]] = {
                            k: (v[offset:offset + p.numel()].view_as(p).clone()
                                if torch.is_tensor(v) and v.dim() == 1
                                else v.clone() if torch.is_tensor(v) else v)
                            for k, v in whole.items()}
                    offset += p.numel()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout (from ``state_dict()`` here, or from a plain torch optimizer)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("load_state_dict: the saved parameter groups do not match this "
                             "optimizer's (their number or their sizes differ)")
        index = {}
        for g, inner, saved in zip(self.param_groups, self.optimizer.param_groups, saved_groups):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            g.update(hyper)
            inner.update(hyper)
            index.update({id(p): i for p, i in zip(g["params"], saved["params"])})
        for u in self.units:
            per = [state_dict["state"].get(index[id(p)]) for p in u.params]
            if all(s is None for s in per):
                self.optimizer.state.pop(u.os_param, None)
                continue
            if any(s is None for s in per):
                raise ValueError("load_state_dict: state for some parameters of a group but not all")
            n_os, start = u.os_param.numel(), self._os_offset(u)
            mine = {}
            for k, v in per[0].items():
                if self._per_element(k, [s[k] for s in per], u.params):
                    flat = torch.cat([s[k].reshape(-1).to(u.flat.device) for s in per]
                                     + [per[0][k].new_zeros(u.N - u.numel).to(u.flat.device)])
                    mine[k] = flat[start:start + n_os].clone()
                else:
                    mine[k] = v.clone() if torch.is_tensor(v) else v
            self.optimizer.state[u.os_param] = mine

    @staticmethod
    def _per_element(key, values, params) -> bool:
        if not all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params)):
            return False
        return any(p.dim() > 0 for p in params) or key not in _SCALAR_STATE

