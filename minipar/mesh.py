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
``cp``    context parallel (sequence split across ranks; size 1 until a paradigm uses it)
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

import torch
import torch.distributed as tdist
from einops import rearrange

from .runtime.errors import UsageError

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
    c and tensor index t. ``dist.Grid`` is this class under its old name; the old attributes
    (``dp_group``, ``tp_rank``, ``pp_ranks``, ...) are kept as aliases of ``group``, ``coord``
    and ``ranks``.
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1):
        for name, n in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)):
            if not (isinstance(n, int) and n >= 1):
                raise UsageError(f"mesh axis {name} must be a whole number >= 1, got {n!r}")
        if dp % ep:
            raise UsageError(f"ep={ep} must divide dp={dp} (expert parallelism is carved inside "
                             f"the data-parallel axis)")
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
        from . import comm
        from .runtime.timeouts import new_group as timed_group  # every group gets the collective timeout
        if not self.distributed:
            return None
        mine = None
        for ranks in rank_lists:
            g = timed_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = g
                if g is not None:
                    comm.name_group(g, name, ranks)
        return mine

    # -- pipeline helpers -----------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self._coord["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self._coord["pp"] == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` on this rank's (dp, cp, tp) line."""
        return self.ranks("pp")[stage % self.pp]

    # -- the old Grid's names (kept so existing code and notebooks run unchanged) ---------
    dp_rank = property(lambda self: self._coord["dp"])
    pp_rank = property(lambda self: self._coord["pp"])
    tp_rank = property(lambda self: self._coord["tp"])
    cp_rank = property(lambda self: self._coord["cp"])
    dp_group = property(lambda self: self._groups["dp"])
    pp_group = property(lambda self: self._groups["pp"])
    tp_group = property(lambda self: self._groups["tp"])
    dp_ranks = property(lambda self: self.ranks("dp"))
    pp_ranks = property(lambda self: self.ranks("pp"))
    tp_ranks = property(lambda self: self.ranks("tp"))

    def __repr__(self):
        where = " ".join(f"{a}={self._coord[a]}" for a in AXES + ("ep",) if self.size(a) > 1)
        sizes = f"dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}"
        return f"Mesh({sizes}; rank {self.rank}{' at ' + where if where else ''})"
