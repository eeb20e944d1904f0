"""Which elements of the serial model this rank holds: its state as boxes of serial tensors.

Every layout keeps the same numbers in other places. A TP rank holds a slice of each split
matrix (qkv's slice is three pieces: its heads of q, of k and of v; the vocabulary is padded
with rows that are no word), a pipeline stage holds some layers under other names, and a ZeRO
rank's optimizer sees a contiguous range of a unit's flat buffer that may start in the middle
of one parameter and end in the middle of another. Two things want the serial picture back:

* a checkpoint that any other layout can load (``minipar.checkpoint``), and
* the global gradient norm for clipping (``minipar.train.optim``): every element once.

The engines describe what their optimizer updates as flat ranges of their local parameters
(``engine.flat_ranges()``: local name, local shape, first element, 1-D views of the
parameter, its gradient and Adam's states, and whether this rank *owns* the range among its
data-parallel replicas). Here each range becomes boxes of the serial tensor::

    flat range of a local (R, C) tensor  ->  at most 3 local boxes (part of a row, whole rows,
                                             part of a row), each a view of the flat range
    local box  ->  serial box            ->  TP: shift along the split dim (per group of qkv),
                                             cut off the vocabulary padding
    local name ->  serial name           ->  PP: ``runner.serial_name``

A piece is owned by one rank only: the engine's owner among the data-parallel replicas and,
for a parameter that TP replicates (norms, row biases, positions), TP rank 0. The owned
pieces of all ranks tile every serial tensor exactly once.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

import torch.nn as nn
from einops import rearrange

from .. import comm
from .. import tp as tp_mod


@dataclass
class Piece:
    """A box of a serial tensor that this rank holds: ``offsets`` in the full ``shape``."""

    name: str                              # the serial model's parameter name
    shape: tuple[int, ...]                 # the serial tensor's full shape
    offsets: tuple[int, ...]               # where this box starts in it
    sizes: tuple[int, ...]                 # the box's extent
    views: Mapping[str, torch.Tensor]      # "param", "grad", "exp_avg", ...: views of `sizes`
    owner: bool                            # the one rank that writes it and counts it once


class _Views(Mapping):
    """A piece's views, each cut from its flat range's 1-D view when first read: the gradient
    norm reads only ``"grad"``, weight decay only ``"param"``."""

    def __init__(self, flat: dict[str, torch.Tensor], cut: tuple):
        self._flat, self._cut, self._made = flat, cut, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._made:
            at, rows, cols, d, start, length, one_d = self._cut
            v = self._flat[key][at:at + rows * cols].view(rows, cols).narrow(d, start, length)
            self._made[key] = v[0] if one_d else v
        return self._made[key]

    def __iter__(self):
        return iter(self._flat)

    def __len__(self) -> int:
        return len(self._flat)


def _row_boxes(shape: tuple[int, int], start: int, stop: int):
    """The flat range [start, stop) of a row-major (R, C) tensor as boxes:
    (row, col, rows, cols, flat offset from ``start``)."""
    _, C = shape
    out, i = [], start
    while i < stop:
        r, c = divmod(i, C)
        if c or stop - i < C:                       # part of one row
            n = min(C - c, stop - i)
            out.append((r, c, 1, n, i - start))
        else:                                       # whole rows
            rows = (stop - i) // C
            out.append((r, 0, rows, C, i - start))
            n = rows * C
        i += n
    return out


def _tp_segments(split, lo: int, hi: int, rank: int, t: int):
    """Local indices [lo, hi) along the split dim -> [(local lo, serial lo, length)].

    The local tensor is ``(g n)`` of the serial ``(g t n)`` (padded) along that dim: each
    group g of n local rows sits at g t n + rank n in the serial tensor; padding is dropped.
    """
    n = tp_mod.padded_size(split.full, t * split.groups) // (t * split.groups)
    out = []
    for g in range(split.groups):
        a, b = max(lo, g * n), min(hi, (g + 1) * n)
        if a >= b:
            continue
        serial = g * t * n + rank * n + (a - g * n)
        length = min(b - a, split.full - serial)
        if length > 0:
            out.append((a, serial, length))
    return out


def _boxes(mesh, runner, name: str, shape, start: int, stop: int, owner: bool) -> list[tuple]:
    """The geometry of one flat range: (serial name, full shape, offsets, sizes, cut, owner)
    per box, ``cut`` saying how ``_Views`` makes the box's view from the range's 1-D view."""
    split = split_of(name, runner.module) if mesh.tp > 1 else None
    if split is None and mesh.coord("tp") != 0:
        owner = False                               # TP replicates it: TP rank 0 owns it
    serial = runner.serial_name(name)
    shape2 = (1, shape[0]) if len(shape) == 1 else tuple(shape)
    if len(shape2) != 2:
        raise ValueError(f"{name}: only 1-d and 2-d parameters are supported, got {shape}")
    full = list(shape2)
    dim = None
    if split is not None:
        dim = split.dim + (1 if len(shape) == 1 else 0)
        full[dim] = split.full
    out = []
    for r, c, rows, cols, at in _row_boxes(shape2, start, stop):
        lo, size = (r, c), (rows, cols)
        if dim is None:                             # not split: the local box is the serial one
            d, segments = 0, [(r, r, rows)]
        else:
            d = dim
            segments = _tp_segments(split, lo[d], lo[d] + size[d], mesh.coord("tp"), mesh.tp)
        for local_lo, serial_lo, length in segments:
            o, s = list(lo), list(size)
            o[d], s[d] = serial_lo, length
            if len(shape) == 1:                     # back from (1, C) to (C,)
                o, s = o[1:], s[1:]
            out.append((serial, tuple(full[-len(shape):]), tuple(o), tuple(s),
                        (at, rows, cols, d, local_lo - lo[d], length, len(shape) == 1), owner))
    return out


def pieces(mesh, runner, engine, plans: dict | None = None) -> list[Piece]:
    """This rank's pieces of the serial model (see the module docstring).

    ``plans``: a dict the caller keeps between calls (the optimizer hook does): the geometry
    of each flat range is then worked out once, and only the views read are made each call.
    """
    out = []
    for name, shape, start, views, owner in engine.flat_ranges():
        stop = start + next(iter(views.values())).numel()
        key = (name, tuple(shape), start, stop, owner)
        boxes = plans.get(key) if plans is not None else None
        if boxes is None:
            boxes = _boxes(mesh, runner, name, shape, start, stop, owner)
            if plans is not None:
                plans[key] = boxes
        out += [Piece(serial, full, o, s, _Views(views, cut), own)
                for serial, full, o, s, cut, own in boxes]
    return out


# --------------------------------------------------------------------------------------
# A TP slice glued back into its serial tensor
# --------------------------------------------------------------------------------------
def unshard(parts: torch.Tensor, split: tp_mod.Split) -> torch.Tensor:
    """The serial tensor from every rank's part, stacked as (t, *part)."""
    x = parts.movedim(split.dim + 1, 1)
    x = rearrange(x, "t (g n) ... -> (g t n) ...", g=split.groups)
    return x[:split.full].movedim(0, split.dim).contiguous()


def split_of(name: str, module: nn.Module) -> tp_mod.Split | None:
    """How the parameter ``name`` of ``module`` is split over TP (None: replicated)."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return None
    return getattr(owner, "tp_splits", {}).get(leaf)   # the TP layers say how they split


def full_tensor(name: str, tensor: torch.Tensor, module: nn.Module, group) -> torch.Tensor:
    """The serial-shaped tensor of TP parameter (or gradient) ``name``: gather and unpad.

    Collective over the TP group (every rank of it must call it in the same order);
    replicated parameters come back as they are.
    """
    split = split_of(name, module)
    if split is None or comm.size(group) == 1:
        return tensor
    with comm.untracked():
        parts = comm.all_gather_stacked(tensor.detach(), group)
    return unshard(parts, split)
