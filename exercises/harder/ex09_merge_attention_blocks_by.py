"""Exercise ex09: Merge attention blocks by log-sum-exp (harder track)

The harder track of ex09: the same checker, without the formula.

Ring attention (and flash attention inside one GPU) never computes one softmax over
all the keys: each block of keys gives a partial output `out_x = softmax(q k_x^T) v_x`,
normalised by that block's own sum, and its log-sum-exp `lse_x = log sum_j exp(q k_j)` for each
query. Write `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the output and log-sum-exp of
one softmax over both blocks' keys,
from these four alone (derive it for one query first, on paper). Shapes: out (b h i d), lse
(b h i). The checker's scores reach the thousands, and a row may have seen no key in one of
the blocks (lse = -inf there).

What you may call, each written as this file calls it (signatures from the package):

    torch.exp(input, *, out=None) -> Tensor
        Returns a new tensor with the exponential of the elements of the input tensor
        :attr:`input`.
    torch.log(input, *, out=None) -> Tensor
        Returns a new tensor with the natural logarithm of the elements of :attr:`input`.

Fill in every block marked `# TODO ex09`, then run:

    python -m minipar.exercises check ex09 --file exercises/harder/ex09_merge_attention_blocks_by.py

Generated from minipar.cp by `python -m minipar.exercises make ex09`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.cp import *  # noqa: F401,F403  everything else, as the package has it


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # TODO ex09: write this part
    raise NotImplementedError("ex09: this part is yours to write")
    return out, lse
