"""The process mesh: the world as named axes, one process group per axis.

The world is laid out as ``torch.arange(world).view(dp, pp, cp, tp)``: the ranks of one
tensor-parallel group are adjacent (on one node, as the Frontier study advises), then the
context-parallel ranks, then the pipeline stages; data parallelism is outermost. Every
paradigm gets its process groups from the same mesh, by name::

    mesh.size("tp")    ranks on the axis              mesh.coord("tp")  this rank's index on it
    mesh.group("tp")   the process group of this rank's line (None for a size-1 axis)
    mesh.ranks("tp")   the global ranks of this rank's line, in axis order
    mesh.lines("tp")   every line of the axis, (n_lines, size), for groups finer than an axis

The axes:

========  =======================================================================
``dp``    data parallel: the same pipeline stage, CP and TP index in every replica
``pp``    pipeline stages
``cp``    context parallel: each sequence split across ranks (``minipar.cp``, ring attention)
``tp``    tensor parallel (innermost)
``ep``    expert parallel, carved inside ``dp`` (DeepSpeed-MoE, Megatron-LM): ``ep``
          consecutive dp indices; ``ep`` divides ``dp``
``edp``   expert data parallel: the dp indices with the same ep index (size dp/ep), and
          every cp index (the cp ranks hold the same experts), so size dp/ep x cp: what an
          expert's gradient is summed over (torchtitan keeps a separate mesh for it)
``dp_cp`` dp x cp flattened: what a dense gradient is averaged over (= ``dp`` when cp = 1)
========  =======================================================================

So ``dp = edp x ep`` as ``view(dp, ...) = view(edp, ep, ...)``: rank ``r`` of an EP group
holds the same experts as rank ``r`` of every other EP group, and those copies form its
``edp`` line. Every rank creates every group (``torch.distributed.new_group`` requires it);
an axis whose lines equal another's shares its group (``ep`` = 1 makes ``edp`` the ``dp``
group). Without an initialised process group every group is None and every size is 1, so the
serial path needs no special case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as tdist
import torch.nn as nn
from einops import rearrange

from . import comm, rules
from .runtime.errors import UsageError
from .runtime.timeouts import new_group as timed_group   # every group gets the collective timeout

AXES = ("dp", "pp", "cp", "tp")
DERIVED = ("ep", "edp", "dp_cp")


def axis_lines(dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1
               ) -> dict[str, torch.Tensor]:
    """Every line of every axis as a (n_lines, size) tensor of global ranks (no processes).

    The one place the layout is written down; the notebooks draw it from here."""
    r = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)
    e = dict(e=ep)
    return {
        "dp": rearrange(r, "d p c t -> (p c t) d"),
        "pp": rearrange(r, "d p c t -> (d c t) p"),
        "cp": rearrange(r, "d p c t -> (d p t) c"),
        "tp": rearrange(r, "d p c t -> (d p c) t"),
        "ep": rearrange(r, "(x e) p c t -> (x p c t) e", **e),
        "edp": rearrange(r, "(x e) p c t -> (e p t) (x c)", **e),
        "dp_cp": rearrange(r, "d p c t -> (p t) (d c)"),
    }


class Mesh:
    """The (dp, pp, cp, tp) layout of the world with ``ep`` carved inside ``dp``; one process
    group per axis.

    ``ranks[d, p, c, t]`` is the global rank at data-parallel index d, stage p, context index
    c and tensor index t. An engine is handed one axis as a value (``axis(name)``).
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1):
        for name, n in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)):
            if not (isinstance(n, int) and n >= 1):
                raise UsageError(f"mesh axis {name} must be a whole number >= 1, got {n!r}")
        why = rules.ep_violation(ep, dp)
        if why:
            raise UsageError(why)
        self.dp, self.pp, self.tp, self.cp, self.ep = dp, pp, tp, cp, ep
        world = dp * pp * cp * tp
        self.distributed = tdist.is_initialized()
        actual = tdist.get_world_size() if self.distributed else 1
        if world != actual:
            raise UsageError(f"mesh dp={dp} x pp={pp} x cp={cp} x tp={tp} = {world} ranks, but "
                             f"the world has {actual}; make the product equal the number of "
                             f"processes")
        self.world = world
        self.ranks_tensor = torch.arange(world).view(dp, pp, cp, tp)
        self.rank = tdist.get_rank() if self.distributed else 0
        d, p, c, t = (self.ranks_tensor == self.rank).nonzero()[0].tolist()
        self._coord = dict(dp=d, pp=p, cp=c, tp=t, ep=d % ep, edp=(d // ep) * cp + c,
                           dp_cp=d * cp + c)
        self._lines = axis_lines(dp, pp, cp, tp, ep)
        self._groups: dict[str, object] = {}
        made: dict[tuple, object] = {}       # an axis with the same lines shares the group
        for name in AXES + DERIVED:
            lines = self._lines[name]
            key = tuple(map(tuple, lines.tolist()))
            if key not in made:
                made[key] = self.new_groups(lines.tolist(), name)
            self._groups[name] = made[key]

    # -- the named axes -------------------------------------------------------------------
    def _check(self, axis: str) -> None:
        if axis not in self._lines:
            raise KeyError(f"no mesh axis {axis!r}; the axes are {', '.join(AXES + DERIVED)}")

    def size(self, axis: str) -> int:
        self._check(axis)
        return self._lines[axis].shape[1]

    def coord(self, axis: str) -> int:
        """This rank's index on ``axis`` (its rank in ``group(axis)``)."""
        self._check(axis)
        return self._coord[axis]

    def group(self, axis: str):
        """The process group of this rank's line along ``axis``; None when the axis has size 1
        (``minipar.comm``'s "a group of one")."""
        self._check(axis)
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks on this rank's line along ``axis``, in axis order."""
        self._check(axis)
        return next(line for line in self._lines[axis].tolist() if self.rank in line)

    def lines(self, axis: str) -> torch.Tensor:
        """Every line of ``axis``, (n_lines, size): for paradigms that cut an axis finer (AMSP's
        shard groups are cut from the ``dp`` lines)."""
        self._check(axis)
        return self._lines[axis]

    def new_groups(self, rank_lists: list[list[int]], name: str):
        """Create one group per list (collectively, on every rank); return the one holding us.

        Used by the axes and by paradigms that need finer groups (AMSP's shard groups)."""
        return new_groups(rank_lists, name) if self.distributed else None

    def axis(self, name: str) -> "Axis":
        """One axis as the value an engine is built from (``Axis``)."""
        self._check(name)
        return Axis(name, self.group(name), self.size(name), self.coord(name), self.lines(name),
                    self.new_groups)

    # -- pipeline helpers -----------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self._coord["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self._coord["pp"] == self.pp - 1

    @property
    def holds_loss(self) -> bool:
        """Counts the loss once: the last stage computes it, replicated over its TP ranks."""
        return self.is_last_stage and self._coord["tp"] == 0

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` on this rank's (dp, cp, tp) line."""
        return self.ranks("pp")[stage % self.pp]

    def __repr__(self):
        where = " ".join(f"{a}={self._coord[a]}" for a in AXES + ("ep",) if self.size(a) > 1)
        sizes = f"dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}"
        return f"Mesh({sizes}; rank {self.rank}{' at ' + where if where else ''})"


def new_groups(rank_lists: list[list[int]], name: str):
    """One process group per list of global ranks, made on every rank (as
    ``torch.distributed.new_group`` requires); returns the one holding this rank (None for a
    list of one)."""
    me, mine = tdist.get_rank(), None
    for ranks in rank_lists:
        g = timed_group(ranks) if len(ranks) > 1 else None
        if me in ranks:
            mine = g
            if g is not None:
                comm.name_group(g, name)
    return mine


# --------------------------------------------------------------------------------------
# What an engine is built from: one axis, and the parameter groups that reduce over axes
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Axis:
    """One axis of the mesh as a value: this rank's line (``group``, ``size``, ``rank``), every
    line of the axis (``lines``, (n_lines, size) global ranks) and ``new_groups``, the
    collective that makes finer groups cut from those lines (AMSP's shard groups)."""

    name: str
    group: object                  # None: a line of one rank (comm's convention)
    size: int
    rank: int
    lines: torch.Tensor
    new_groups: Callable[[list[list[int]], str], object] = field(repr=False, compare=False)

    @classmethod
    def of_group(cls, group, name: str = "dp") -> "Axis":
        """A plain process group as one line (torch's meaning: None is the whole world,
        ``comm.SOLO`` one rank). Finer groups need every rank of the world to make them, so
        they are refused unless the group is the world."""
        group = comm.resolve_group(group)
        ranks = comm.global_ranks(group)

        def cut(rank_lists, what):
            mine = next(r for r in rank_lists if comm.global_ranks(None)[0] in r)
            if len(mine) == 1:
                return None
            if sorted(mine) == sorted(ranks):
                return group
            if len(ranks) != tdist.get_world_size():
                raise UsageError(f"the group {what} ({len(mine)} of this group's {len(ranks)} "
                                 f"ranks) must be made by every rank of the world: use the "
                                 f"whole world, or a Mesh axis")
            return new_groups(rank_lists, what)

        return cls(name, group, len(ranks), comm.rank(group), torch.tensor(ranks).view(1, -1), cut)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters whose gradients are summed over ``group`` (the mesh axis ``reduce_axis``;
    None: a group of one) and divided by ``divisor``: the replicas of the loss.

    ``dense`` parameters reduce over ``dp_cp``, every replica of the model; an MoE model's
    ``expert`` parameters over ``edp``, the other copies of the same experts (their gradient
    already sums the tokens of the whole EP group: the all-to-all brought them). Both divide
    by dp x cp. Built once, handed to the engines as values (no tags on tensors)."""

    name: str
    params: tuple
    reduce_axis: str
    group: object = field(default=None, compare=False)
    divisor: int = 1

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))

    def __len__(self):
        return len(self.params)


def param_groups(model, mesh: "Mesh | None" = None, experts=()) -> list[ParamGroup]:
    """``dense`` and, if ``experts`` (the MoE experts' parameters) is not empty, ``expert``,
    each with its process group from ``mesh`` (None: one process); every trainable parameter
    in exactly one, in ``model.parameters()`` order, empty groups left out."""
    ids = {id(p) for p in experts}
    trainable = [p for p in model.parameters() if p.requires_grad]
    divisor = mesh.size("dp_cp") if mesh is not None else 1
    out = [ParamGroup("dense", [p for p in trainable if id(p) not in ids], "dp_cp",
                      mesh.group("dp_cp") if mesh else None, divisor),
           ParamGroup("expert", [p for p in trainable if id(p) in ids], "edp",
                      mesh.group("edp") if mesh else None, divisor)]
    return [g for g in out if g.params]


# --------------------------------------------------------------------------------------
# Units: which parameters are gathered, freed and reduced together
# --------------------------------------------------------------------------------------
def units_of(module: nn.Module, units=None, exclude=()) -> list[tuple[nn.Module, list]]:
    """FSDP's wrapping, [(module, its parameters)]: ``units`` None (each child owning parameters,
    containers looked into: the GPT's ``parts()``), modules, or a policy ``module -> bool`` (the
    outermost it accepts). Tied parameters and those outside every unit are one more unit, on
    ``module``, first; ``exclude`` (and frozen parameters) stay out, kept whole by the owner."""
    def children(m, accept):
        out = []
        for c in m.children():
            if accept(c):
                out.append(c)
            else:
                out += children(c, accept)
        return out

    if units is None:
        parts = children(module, lambda c: not isinstance(c, (nn.ModuleList, nn.ModuleDict))
                         and any(True for _ in c.parameters()))
    else:
        parts = children(module, units) if callable(units) else list(units)
    count: dict[int, int] = {}
    for part in parts:
        for i in {id(p) for p in part.parameters()}:
            count[i] = count.get(i, 0) + 1
    taken = {i for i, n in count.items() if n > 1} | {id(p) for p in exclude}
    out = []
    for part in parts:
        params = [p for p in part.parameters() if p.requires_grad and id(p) not in taken]
        taken |= set(map(id, params))
        if params:
            out.append((part, params))
    rest = [p for p in module.parameters() if p.requires_grad and id(p) not in taken
            or count.get(id(p), 0) > 1 and p.requires_grad]
    rest = [p for p in rest if id(p) not in {id(q) for q in exclude}]
    return ([(module, rest)] if rest else []) + out
