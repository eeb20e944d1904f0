"""Exercise ex01: Ring all-reduce from send and recv (harder track)

The harder track of ex01: the same checker, without the index table. Write
`ring_all_reduce(t, group)`: sum `t` over the n ranks of `group` in place, with point-to-point
messages to your ring neighbours only (`comm.isend` to `right`, `comm.recv` from `left`), in
2(n-1) steps of one chunk of N/n elements each: n-1 steps after which every rank holds one
chunk summed over every rank, then n-1 steps that pass the finished chunks around until every
rank has all of them. Which chunk rank r sends, and which one it writes, at step k of each
phase is yours to derive (notebook 00, section 2, works it out by hand on four tensors).

`chunks = t.view(n, -1)`: its rows are views of t, so write into them in place. The order of
each step's send and receive is yours too: a send waited for before the receive is posted
hangs once every rank does it, on gloo as on NCCL, and NCCL runs a rank's sends and receives
in the order it posted them. The checker runs 2, 3 and 4 ranks and replays your order under
NCCL's rule. Return t.

What you may call, each written as this file calls it (signatures from the package):

    comm.isend(t: Tensor, dst: int, label: str = 'p2p') -> Handle
        Asynchronous send to global rank ``dst``; ``label`` files its bytes (e.g. ``"cp"``).
    comm.recv(t: Tensor, src: int) -> None
        Blocking point-to-point receive from global rank ``src`` into ``t``.
    comm.size(group) -> int
        Ranks in ``group``; 1 for ``None``/``SOLO`` (a group of one) or without a process
        group.
    comm.rank(group) -> int

Fill in every block marked `# TODO ex01`, then run:

    python -m minipar.exercises check ex01 --file exercises/harder/ex01_ring_all_reduce_from.py

Generated from minipar.p2p_order by `python -m minipar.exercises make ex01`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.p2p_order import *  # noqa: F401,F403  everything else, as the package has it


def ring_all_reduce(t: torch.Tensor, group=comm.WORLD) -> torch.Tensor:
    n, r = comm.size(group), comm.rank(group)
    if n == 1:
        return t
    if t.numel() % n:
        raise ValueError(f"ring_all_reduce cuts the tensor into {n} equal chunks, but it has "
                         f"{t.numel()} elements; pad it to a multiple of {n}")
    peers = comm.global_ranks(group)
    right, left = peers[(r + 1) % n], peers[(r - 1) % n]
    chunks = t.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    # TODO ex01: write this part
    raise NotImplementedError("ex01: this part is yours to write")
    return t
