"""Exercise ex03a: The conjugate operators f and g (warm-up for ex03)

Tensor parallelism runs one layer on t ranks at once, and autograd must know where the ranks'
results meet. Megatron-LM glues it with two conjugate operators, each an autograd Function:

    f  (CopyToTP)      forward: identity            backward: all-reduce (sum) of the gradient
    g  (ReduceFromTP)  forward: all-reduce (sum)    backward: identity

f stands in front of a column-parallel layer: every rank's branch used all of X, so the
gradient of X is the sum of the t branches' gradients. g stands behind a row-parallel layer:
the t partial products are summed, and the gradient of a sum reaches every summand unchanged.

Write the four static methods. `forward(ctx, x, group)` returns the output; `backward(ctx, grad)` returns one
gradient per forward input: `(grad_x, None)` (the group gets none). Keep what backward needs
on `ctx` (`ctx.group = group`). `comm.all_reduce(t, group)` sums in place, into t: reduce a
copy (`x.clone()`), never the tensor autograd handed you. The checker tests f and g alone on
t = 2 and 4 ranks, then a whole Megatron MLP, `g(gelu(f(X) A_r) B_r)`, against one process.

What you may call, each written as this file calls it (signatures from the package):

    comm.all_reduce(t: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N.

Fill in every block marked `# TODO ex03a`, then run:

    python -m minipar.exercises check ex03a

Generated from minipar.tp by `python -m minipar.exercises make ex03a`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.tp import *  # noqa: F401,F403  everything else, as the package has it


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, all-reduce (sum) of the gradient: 2(t-1)/t N bytes."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03a: write this part
        # f forward is the identity: keep the group in ctx for the backward and return x
        raise NotImplementedError("ex03a: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03a: write this part
        # f backward: sum the gradient over the group with comm.all_reduce (on a copy: autograd may share grad)
        raise NotImplementedError("ex03a: this part is yours to write")


class ReduceFromTP(torch.autograd.Function):
    """g: forward, all-reduce (sum) over the TP group: 2(t-1)/t N bytes; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03a: write this part
        # g forward: sum the partial results of every rank with comm.all_reduce (on a copy of x)
        raise NotImplementedError("ex03a: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03a: write this part
        # g backward is the identity (the gradient of a sum reaches every summand unchanged)
        raise NotImplementedError("ex03a: this part is yours to write")


def f(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce backward."""
    return CopyToTP.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return ReduceFromTP.apply(x, group)
