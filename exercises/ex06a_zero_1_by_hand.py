"""Exercise ex06a: ZeRO-1 by hand on one flat buffer (warm-up for ex06)

ZeRO-1 keeps the whole model on each of the d ranks but Adam's state for 1/d of it only. Here
the model is a few tensors flattened into one buffer `flat` of N elements (N a multiple of d),
the same on every rank; `flat_grad` (N) is this rank's gradient (each rank saw other data).
Rank r owns slice r, `flat.chunk(d)[r]` (N/d elements): the `optimizer` was built over that
slice alone and reads its gradient from `shard_grad` (N/d), the slice's `.grad`. One step:

1. reduce-scatter `flat_grad` over the group: rank r receives the sum over the d ranks of
   slice r only. Write it straight into `shard_grad` (`comm.reduce_scatter(out, inp, group)`
   writes into `out`), then divide by d in place: gloo has no AVG.
2. `optimizer.step()` updates slice r of `flat` (a view: `flat` itself changes).
3. all-gather: every rank needs every updated slice again.
   `comm.all_gather(out, inp, group)` writes the d ranks' `inp` into `out` in rank order;
   give it `flat` as `out` and a copy of your slice as `inp` (a collective must not read
   from the buffer it writes).

The optimizer reads `shard_grad`'s memory: `shard_grad = shard_grad / d` makes a new tensor
and rebinds your local name to it; the optimizer never sees it. Write in place (`div_`,
`copy_`). Reduce-scatter plus all-gather send (d-1)/d N each, exactly one all-reduce's
bytes: ZeRO-1 costs no extra traffic. The checker runs d = 2 and 4 ranks with SGD and
compares every rank's buffer with one process's step on the averaged gradient.

What you may call, each written as this file calls it (signatures from the package):

    comm.reduce_scatter(out: Tensor, inp: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        Rank i gets shard i of the reduction of every rank's flat ``inp``. Sends (n-1)/n N.
    comm.all_gather(out: Tensor, inp: Tensor, group=None, async_op: bool = False)
        Flat ``out`` (n x inp) gets every rank's ``inp`` in rank order. Sends (n-1)/n N.
    comm.size(group) -> int
        Ranks in ``group``; 1 for ``None``/``SOLO`` (a group of one) or without a process
        group.
    comm.rank(group) -> int

Fill in every block marked `# TODO ex06a`, then run:

    python -m minipar.exercises check ex06a

Generated from minipar.exercises.ex06a by `python -m minipar.exercises make ex06a`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.exercises.ex06a import *  # noqa: F401,F403  everything else, as the package has it


def zero1_step(flat: torch.Tensor, flat_grad: torch.Tensor, shard_grad: torch.Tensor,
               optimizer, group) -> None:
    """One ZeRO-1 step over ``group`` (d ranks, this one r): ``flat`` (N) the parameters, the
    same on every rank; ``flat_grad`` (N) this rank's gradient; ``optimizer`` updates
    ``flat.chunk(d)[r]`` only, reading its gradient from ``shard_grad`` (N/d)."""
    # TODO ex06a: write this part
    # reduce-scatter flat_grad into shard_grad (in place), divide it by d; optimizer.step();
    # all-gather the d updated slices back into flat
    raise NotImplementedError("ex06a: this part is yours to write")
