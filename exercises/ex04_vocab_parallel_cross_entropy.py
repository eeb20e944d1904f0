"""Exercise ex04: Vocab parallel cross entropy

The head's projection is column-parallel without a gather: rank r holds the logits of its
V'/t vocabulary entries only (V' is the vocabulary padded to a multiple of t). Gathering the
(tokens x V) logits on one rank would cost the memory TP is meant to save, so compute the loss
where the logits are:

    loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,target - m_i),   m_i = max_j z_ij

with three all-reduces of one value per token: the max (`comm.all_reduce(t, group, op="max")`),
the sum of exp, and the target's logit (only the rank owning the target contributes it; the
others add 0). Columns at or past `vocab_size` are padding: they are no word and must get
probability zero (mask them to -inf). The backward needs no communication: the gradient of
loss_i with respect to this rank's logits is softmax_ij minus 1 at the target, times the
incoming gradient. Write `VocabParallelCE.forward` (per-token losses; save what backward needs)
and `VocabParallelCE.backward`.

Shapes: `logits` (N, V'/t), this rank's columns, which are vocabulary entries
[r V'/t, (r+1) V'/t) (`start` is prepared for you); `targets` (N,) global vocabulary ids;
forward returns (N,) losses; backward gets `grad_loss` (N,) and returns the gradient of
`logits`, (N, V'/t), then None for targets, group and vocab_size. `ctx.save_for_backward(...)`
keeps tensors, `ctx.saved_tensors` gives them back. Notebook 02, section 6, works the three
all-reduces out by hand on two shards of one logits matrix.

What you may call, each written as this file calls it (signatures from the package):

    comm.all_reduce(t: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N.
    comm.rank(group) -> int

Fill in every block marked `# TODO ex04`, then run:

    python -m minipar.exercises check ex04

Generated from minipar.tp by `python -m minipar.exercises make ex04`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.tp import *  # noqa: F401,F403  everything else, as the package has it


class VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary: rank r holds entries
    [r V'/t, (r+1) V'/t), those >= ``vocab_size`` padding (probability zero). Forward: 3
    all-reduces of N fp32 values (max, sum of exp, target logit); backward: none, the gradient
    softmax - one-hot(target) of the local slice is local."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size):
        n_local = logits.shape[-1]
        start = comm.rank(group) * n_local
        ctx.dtype = logits.dtype
        # TODO ex04: write this part
        # mask padding (columns >= vocab_size) to -inf; all-reduce the max ("max"), the sum of exp and the target logit
        raise NotImplementedError("ex04: this part is yours to write")

    @staticmethod
    def backward(ctx, grad_loss):
        # TODO ex04: write this part
        # d loss_i / d logit_ij = softmax_ij - [j is i's target]: local to this rank's columns
        raise NotImplementedError("ex04: this part is yours to write")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy; ``logits`` (..., V'/t) this rank's vocabulary slice, ``targets`` (...)."""
    per_token = VocabParallelCE.apply(rearrange(logits, "... v -> (...) v"),
                                      rearrange(targets, "... -> (...)"), group, vocab_size)
    return per_token.mean()
