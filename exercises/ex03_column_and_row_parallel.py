"""Exercise ex03: Column and row parallel linear layers

Tensor parallelism splits a linear layer Y = X A^T + b over the t ranks of a group.
ColumnParallelLinear keeps out/t rows of A (output features): every rank needs all of X and
computes its slice of Y, with no communication forward. RowParallelLinear keeps in/t columns
of A: its input arrives already split by features, each rank computes a partial product, and
the partial products are summed over the group. The two conjugate operators glue this to
autograd: f (CopyToTP) is the identity forward and an all-reduce of the gradient backward;
g (ReduceFromTP) is an all-reduce forward and the identity backward.

Write the forward and backward of f and g (use `comm.all_reduce(tensor, group)`, which works
in place: reduce a copy), then the two `forward`s: ColumnParallelLinear enters through f
(through `all_gather_seq` when `self.sequence_parallel`), and gathers its output with
`gather_from_tp` if `self.gather_output` (trim it to `self.out_features`);
RowParallelLinear sums with g (`reduce_scatter_seq` under sequence parallelism) and adds the
bias once, after the sum. A column layer followed by a row layer must cost exactly one
all-reduce forward and one backward.

Fill in every block marked `# TODO ex03`, then run:

    python -m minipar.exercises check ex03

Generated from minipar.tp by `python -m minipar.exercises make ex03`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.tp import *  # noqa: F401,F403  everything else, as the package has it


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, all-reduce (sum) of the gradient: 2(t-1)/t N bytes."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03: write this part
        # f forward is the identity: keep the group in ctx for the backward and return x
        raise NotImplementedError("ex03: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03: write this part
        # f backward: sum the gradient over the group with comm.all_reduce (on a copy: autograd may share grad)
        raise NotImplementedError("ex03: this part is yours to write")


class ReduceFromTP(torch.autograd.Function):
    """g: forward, all-reduce (sum) over the TP group: 2(t-1)/t N bytes; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO ex03: write this part
        # g forward: sum the partial results of every rank with comm.all_reduce (on a copy of x)
        raise NotImplementedError("ex03: this part is yours to write")

    @staticmethod
    def backward(ctx, grad):
        # TODO ex03: write this part
        # g backward is the identity (the gradient of a sum reaches every summand unchanged)
        raise NotImplementedError("ex03: this part is yours to write")


def f(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce backward."""
    return CopyToTP.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return ReduceFromTP.apply(x, group)


class ColumnParallelLinear(SplitLinear):
    """``Y = X A^T + b``, A (out, in) split by output features: this rank computes out/t. The
    input enters through f (SP: all-gather along the sequence); the output stays split unless
    ``gather_output``; the bias is split like the outputs, so it is added once."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, groups: int = 1):
        super().__init__()
        t = comm.size(group)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_splits = {"weight": Split(0, out_features, groups), "bias": Split(0, out_features, groups)}
        local = padded_size(out_features, t * groups) // t
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO ex03: write this part
        # enter with f(x, group) (all_gather_seq under SP), F.linear with the local rows, gather_from_tp if gather_output
        raise NotImplementedError("ex03: this part is yours to write")


class RowParallelLinear(SplitLinear):
    """``Y = X A^T + b``, A (out, in) split by input features: this rank holds in/t columns.
    The input arrives split (a column layer's output; else ``input_is_parallel=False``); g sums
    the partial products (SP: reduce-scatter); the bias is replicated, added once after."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        t = comm.size(group)
        assert in_features % t == 0, f"in_features {in_features} must divide by t={t}"
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_splits = {"weight": Split(1, in_features)}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        # With SP each rank adds the bias to its own s/t tokens: f sums the bias gradient.
        bias = self.bias
        if self.sequence_parallel and bias is not None:
            bias = f(bias, self.group)
        # TODO ex03: write this part
        # partial product with the local columns (no bias), sum it with g (reduce_scatter_seq under SP), then add bias once
        raise NotImplementedError("ex03: this part is yours to write")
