"""Exercise ex09: Merge attention blocks by log-sum-exp

Ring attention (and flash attention inside one GPU) never computes one softmax over
all the keys: each block of keys gives a partial output `out_x = softmax(q k_x^T) v_x`,
normalised by that block's own sum, and its log-sum-exp `lse_x = log sum_j exp(q k_j)` for each
query. Write `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the output and log-sum-exp of
one softmax over both blocks' keys. Shapes: out (b h i d), lse (b h i). Hint: the merged lse is the log of
the sum of the two exponentials (compute it without overflow: scores can be large), and each
partial output is reweighted by exp(lse_x - lse). A row may have seen no key in one of the
blocks (lse = -inf there): it must take the other block's values unchanged.

Notebook 09 derives the merge by hand for one query (section 2). `out_x[..., None]`-style
broadcasting: lse (b h i) needs a trailing axis, `lse[..., None]`, to scale out (b h i d).

What you may call, each written as this file calls it (signatures from the package):

    torch.logaddexp(input, other, *, out=None) -> Tensor
        Logarithm of the sum of exponentiations of the inputs.
    torch.maximum(input, other, *, out=None) -> Tensor
        Computes the element-wise maximum of :attr:`input` and :attr:`other`.

Fill in every block marked `# TODO ex09`, then run:

    python -m minipar.exercises check ex09

Generated from minipar.cp by `python -m minipar.exercises make ex09`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.cp import *  # noqa: F401,F403  everything else, as the package has it


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention outputs over disjoint key blocks -> the output over both.

    ``out_*`` (b h i d) are each normalised by their own block's softmax, ``lse_*`` (b h i)
    the log-sum-exp of their scores. Returns (out, lse) as if one softmax had run over the
    union of the keys. At least one of ``lse_a``, ``lse_b`` is finite in every row.
    """
    # TODO ex09: write this part
    # lse = log(exp(lse_a) + exp(lse_b)) computed stably; reweight each output by exp(lse_x - lse)
    raise NotImplementedError("ex09: this part is yours to write")
    return out, lse
