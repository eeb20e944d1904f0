"""The mechanics ZeRO, AMSP and the ZeRO-3 wrapper share: shard specs, the shard mesh, flat units.

``minipar.zero`` explains the idea (AMSP's (s_p, s_g, s_os) partitioning, ZeRO's stages as
four of its points) and runs it; this module holds the pieces it is built from:

* ``Spec``: (s_p, s_g, s_os), ZeRO's presets and the rules (the rules live in the planner,
  ``minipar.sharding``, so the engine and the planner cannot disagree);
* ``ShardMesh``: the data-parallel ranks viewed as ``(rep, os, g, p)``, one group per axis;
* ``units_of``: FSDP's wrapping policy, which modules are gathered, freed and reduced together;
* ``Unit``: one unit's state as flat padded buffers, cut like the mesh, so that every collective
  works on whole chunks in rank order (the OS shard lies inside the G shard, inside the P shard);
* ``reduce_scatter_down`` / ``gather_up`` / ``all_gather_in_place``: collectives over the mesh's
  groups in turn;
* ``ShardedUnits``: the hooks that move the units (P sharding's gather before use and free
  after, G sharding's reduce once backward is done with a unit), shared by the trainer's
  engine (``zero.ShardedEngine``) and the FSDP-shaped wrapper (``fsdp.fully_shard``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as tdist
import torch.nn as nn
from einops import rearrange
from torch.utils._pytree import tree_leaves

from . import comm, dp
from .runtime import dist
from .plan import sharding
from .runtime.errors import UsageError


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
def units_of(module: nn.Module, units=None,
             exclude=()) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """FSDP's wrapping: the groups of parameters gathered, freed and reduced together.

    ``units`` picks the modules that become units:
      * None: each child module that owns parameters (containers without a forward,
        ModuleList and ModuleDict, are looked into): for minipar's GPT the embedding, each
        block and the head, what ``GPT.parts()`` lists (the trainer passes ``parts()``, which a
        pipeline ``Stage`` has too, as the list);
      * a list of modules;
      * a policy, a function ``module -> bool`` (FSDP's auto-wrap policy): the outermost
        submodules it accepts.
    A parameter used by two units (tied weights) and the parameters outside every unit form
    one more unit on ``module`` itself, whose forward spans every use of them. So every
    trainable parameter is sharded, except ``exclude`` (the owner keeps those whole: MoE
    experts) and frozen ones (``requires_grad=False``), which stay replicated.
    """
    if units is None:
        parts = _children_with_parameters(module)
    elif callable(units):
        parts = _accepted(module, units)
    else:
        parts = list(units)
    owners: dict[int, int] = {}
    for part in parts:
        for p in {id(p) for p in part.parameters()}:
            owners[p] = owners.get(p, 0) + 1
    seen = {p for p, n in owners.items() if n > 1}      # tied across units: the root's
    experts = {id(p) for p in exclude}
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
    ``dtype``       the compute dtype of ``flat`` and ``p_shard`` (None: the parameters'). When
                    it differs from the parameters' (the FSDP wrapper's ``param_dtype``),
                    ``master`` keeps this rank's P shard in the parameters' dtype (fp32): the
                    optimizer updates it and the owner casts it into ``p_shard``.
    ``grad_dtype``  the G shard's dtype (None: the compute dtype): the FSDP wrapper keeps it in
                    its masters' fp32, so its shards' ``.grad`` are fp32 under bf16 compute.
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], mesh: ShardMesh,
                 reduce_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 dtype: torch.dtype | None = None):
        s_p, s_g, s_os = mesh.spec
        self.module, self.params = module, params
        self.numel = sum(p.numel() for p in params)
        self.N = math.ceil(self.numel / s_os) * s_os
        like = params[0]
        n_p, n_g, n_os = self.N // s_p, self.N // s_g, self.N // s_os
        full = torch.cat([p.detach().reshape(-1) for p in params]
                         + [like.new_zeros(self.N - self.numel)])
        self.master = None
        if dtype is not None and dtype != like.dtype:
            self.master = full[mesh.p_index * n_p:(mesh.p_index + 1) * n_p].clone()
        self.flat = full.to(dtype or like.dtype)
        offset = 0
        for p in params:
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        if s_p == 1:
            self.p_shard = self.flat
        else:
            self.p_shard = self.flat[mesh.p_index * n_p:(mesh.p_index + 1) * n_p].clone()
            free_storage(self.flat)
        # the G slice of the P shard and the OS slice of the G slice: nested chunks
        self.g_slice = self.p_shard[mesh.g_index * n_g:(mesh.g_index + 1) * n_g]
        self.os_param = self.g_slice[mesh.os_index * n_os:(mesh.os_index + 1) * n_os]
        self.grad_shard = torch.zeros(n_g, dtype=grad_dtype or self.flat.dtype, device=like.device)
        self.os_slice = slice(mesh.os_index * n_os, (mesh.os_index + 1) * n_os)
        self.os_grad = self.grad_shard[self.os_slice]
        if self.os_grad.dtype == self.os_param.dtype:
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
        OS slice ``os_grad`` is what the fp32 master reads (``zero._MastersStep``)."""
        self._narrow = self.grad_shard, self.os_grad
        self.grad_shard = self.grad_shard.to(self.reduce_dtype)
        self.os_grad = self.grad_shard[self.os_slice]

    def narrow(self):
        """After the step: the bf16 G shard again, its OS slice holding the averaged gradient."""
        grad_shard, os_grad = self._narrow
        os_grad.copy_(self.os_grad)
        self.grad_shard, self.os_grad, self._narrow = grad_shard, os_grad, None


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
# P sharding (ZeRO-3): gather before use, free after, with hooks. Shared by the trainer's
# engine (``zero.ShardedEngine``) and the FSDP-shaped wrapper (``minipar.fsdp``): the same code, two owners.
# --------------------------------------------------------------------------------------
class ShardedUnits:
    """A module's units (``units_of``) as flat ``Unit`` buffers over ``mesh``, and the hooks that
    move them: with s_p > 1 each unit is all-gathered before its forward and again before its
    backward and freed after each (``prefetch``: the next unit's gather starts while this one
    computes); once backward is done with a unit, ``reduce(u)`` runs (every backward pass when
    ``reduce_each_backward``, else the owner reduces at its step).

    ``dtype`` the units' compute dtype and ``grad_dtype`` the G shard's (None: the parameters');
    ``exclude`` parameters stay outside the units (MoE experts, replicated). The owner
    subclasses ``reduce``: the engine sums into the G shard and divides at its step, the
    FSDP-shaped wrapper (``minipar.fsdp``) averages into each shard's ``.grad``.
    """

    def __init__(self, module: nn.Module, mesh: ShardMesh, units=None, prefetch: bool = True,
                 reduce_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 reduce_each_backward: bool = False, exclude=(), dtype: torch.dtype | None = None):
        self.module, self.mesh, self.spec, self.prefetch = module, mesh, mesh.spec, prefetch
        self.reduce_each_backward = reduce_each_backward
        self.units = [Unit(m, params, mesh, reduce_dtype, grad_dtype, dtype)
                      for m, params in units_of(module, units, exclude)]
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self._unit_of]
        if self.spec.p > 1:
            for u in self.units:
                self._hooks.append(u.module.register_forward_pre_hook(
                    lambda m, args, u=u: self._pre_forward(u)))
                self._hooks.append(u.module.register_forward_hook(
                    lambda m, args, out, u=u: self._post_forward(u, out)))

    # -- the unit's full parameters exist only while it computes ------------------------------
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
        if self.reduce_each_backward:
            self.reduce(u)                   # every micro-batch: full grads never pile up

    def reduce(self, u: Unit):
        raise NotImplementedError

    def settle(self):
        """End of a backward pass or a step: reduce the units whose backward never finished
        (a parameter it did not use), and wait on and release every gather still in flight
        (a prefetch nobody used), so no async work outlives the sync."""
        for u in self.units:
            if self.spec.p > 1:
                self._free(u)
            if self.reduce_each_backward and any(p.grad is not None for p in u.params):
                self.reduce(u)
            u.ready = 0
