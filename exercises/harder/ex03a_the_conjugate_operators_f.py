"""Exercise ex03a: The conjugate operators f and g (warm-up for ex03) (harder track)

The harder track of ex03a: the same checker, without the table of what f and g do. Tensor
parallelism runs one layer on t ranks at once, and autograd must know where the ranks'
results meet. Megatron-LM glues it with two conjugate operators, each an autograd Function:
f (`CopyToTP`) stands in front of a column-parallel layer, whose t branches each read all of
X; g (`ReduceFromTP`) stands behind a row-parallel layer, whose t branches each give a partial
product, and Y is their sum. Derive what each must do in its forward and in its backward, and
write the four static methods (`f(x, group)` and `g(x, group)` below apply them).

`forward(ctx, x, group)` returns the output; `backward(ctx, grad)` returns one
gradient per forward input: `(grad_x, None)` (the group gets none). Keep what backward needs
on `ctx` (`ctx.group = group`). `comm.all_reduce(t, group)` sums in place, into t: reduce a
copy (`x.clone()`), never the tensor autograd handed you. The checker tests f and g alone on
t = 2 and 4 ranks, then a whole Megatron MLP, `g(gelu(f(X) A_r) B_r)`, against one process.

What you may call, each written as this file calls it (signatures from the package):

    comm.all_reduce(t: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N.

Fill in every block marked `# TODO ex03a`, then run:

    python -m minipar.exercises check ex03a --file exercises/harder/ex03a_the_conjugate_operators_f.py

Generated from minipar.tp by `python -m minipar.exercises make ex03a`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.tp import *  # noqa: F401,F403  everything else, as the package has it


class CopyToTP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03a: write this part
        raise NotImplementedError("ex03a: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03a: write this part
        raise NotImplementedError("ex03a: this part is yours to write")


class ReduceFromTP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03a: write this part
        raise NotImplementedError("ex03a: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03a: write this part
        raise NotImplementedError("ex03a: this part is yours to write")


def f(x: torch.Tensor, group) -> torch.Tensor:
    return CopyToTP.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)
