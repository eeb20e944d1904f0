"""Exercise ex03: Column and row parallel linear layers

Tensor parallelism splits a linear layer over the t ranks of a group. Write the `forward` of
the two split layers; f and g (ex03a) come from the package.

From the notebook's notation to nn.Linear's: the notebook writes Y = X A with A of shape
(in, out), so "by columns" means by output features. nn.Linear stores `weight` = A^T, of shape
(out, in), and computes `F.linear(x, weight, bias)` = x weight^T + bias. So:

    ColumnParallelLinear   A by columns = weight by ROWS:    self.weight (out/t, in),  bias (out/t)
                           x (b, s, in) whole on every rank  ->  y (b, s, out/t), no communication
    RowParallelLinear      A by rows    = weight by COLUMNS: self.weight (out, in/t),  bias (out), whole
                           x (b, s, in/t), this rank's slice ->  partial y (b, s, out); sum over ranks

ColumnParallelLinear enters through f (its backward sums the input's gradient over the ranks),
runs F.linear with its rows and bias, and, if `self.gather_output`, gathers the slices with
`gather_from_tp` (then keep the first `self.out_features`: the output may be padded).
RowParallelLinear computes its partial product without the bias, sums the t partial products
with g, and adds the bias once, after the sum (added before, it would be summed t times). A
column layer followed by a row layer costs exactly one all-reduce forward (g) and one backward
(f).

Extension, sequence parallelism (`self.sequence_parallel`, notebook 02 section 5): the
activations outside the layers are split along the sequence, (b, s/t, h) per rank. The column
layer enters with `all_gather_seq` instead of f, the row layer leaves with
`reduce_scatter_seq` instead of g. The row layer's `bias` (already prepared above your block)
then passes through f, because each rank adds it to its own s/t tokens only. The checker
grades the core first; an extension not written yet (`if self.sequence_parallel: raise
NotImplementedError`) or not right yet is listed, but does not fail the exercise.

What you may call, each written as this file calls it (signatures from the package):

    f(x: Tensor, group) -> Tensor
        Enter a tensor-parallel region: identity forward, all-reduce backward.
    g(x: Tensor, group) -> Tensor
        Leave a tensor-parallel region: all-reduce forward, identity backward.
    gather_from_tp(x, group)
        all-gather along the last dim; bwd: keep the slice
    F.linear(input, weight, bias=None) -> Tensor
        Applies a linear transformation to the incoming data: :math:`y = xA^T + b`.
    all_gather_seq(x, group)
        SP's f: all-gather along the sequence; bwd: r-scatter
    reduce_scatter_seq(x, group)
        SP's g: reduce-scatter along the sequence; bwd: gather

Fill in every block marked `# TODO ex03`, then run:

    python -m minipar.exercises check ex03

Generated from minipar.tp by `python -m minipar.exercises make ex03`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.tp import *  # noqa: F401,F403  everything else, as the package has it


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
        # enter with f(x, group) (extension, SP: all_gather_seq), F.linear with the local rows and bias;
        # if gather_output: gather_from_tp, then keep the first out_features (padding)
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
        summed = self.sequence_parallel and self.bias is not None
        bias = f(self.bias, self.group) if summed else self.bias
        # TODO ex03: write this part
        # partial product with the local columns, no bias; sum it over the group with g (extension, SP:
        # reduce_scatter_seq); then add `bias` once (the variable above, not self.bias)
        raise NotImplementedError("ex03: this part is yours to write")
