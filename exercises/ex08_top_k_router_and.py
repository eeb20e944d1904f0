"""Exercise ex08: Top-k router and load balancing

A mixture-of-experts layer sends each token to k of its E experts. Write the router's two
pieces. `route(logits, k)`: the softmax of the (t, E) router logits over the experts (in
fp32), the k most probable experts of each token (`torch.topk`), and their probabilities
renormalised to sum to 1 when k > 1 (at k = 1 the raw probability, as in Switch: p / p = 1
would give the router no gradient from the task loss); return `(probs, weights, experts)`
with shapes (t, E), (t, k), (t, k). `load_balancing_loss(probs, experts, seq_len)`: Switch
Transformer's auxiliary loss E * sum_e f_e P_e, computed for each sequence of `seq_len`
tokens and averaged over the sequences, where f_e is the share of the sequence's s*k choices
that went to expert e (a count: no gradient flows through it) and P_e the sum of the
probabilities of e over the sequence's tokens divided by `seq_len` (their mean). Under tensor
parallelism `probs` holds only a rank's share of each sequence's tokens, (b s/t, E), while
`experts` covers the whole sequences: divide by `seq_len` still, and the t ranks' results sum
to the loss. It is 1 when the routing is balanced and E when every token picks the same
expert. The checker compares both with plain loops, splits the tokens over t = 3 ranks, and
trains a step through them.

Shapes in `load_balancing_loss`: `probs` (b s, E), `experts` (b s, k) for b sequences of
s = `seq_len` tokens; `rearrange(x, "(b s) e -> b s e", s=seq_len)` gives each sequence its row.

What you may call, each written as this file calls it (signatures from the package):

    torch.topk(input, k, dim=None, largest=True, sorted=True, *, out=None) -> (Tensor, LongTensor)
        Returns the :attr:`k` largest elements of the given :attr:`input` tensor along a
        given dimension.
    F.one_hot(tensor, num_classes=-1) -> LongTensor
        Takes LongTensor with index values of shape ``(*)`` and returns a tensor of shape
        ``(*, num_classes)`` that have zeros everywhere except where the index of last
        dimension matches the corresponding value of the input tensor, in which case it will
        be 1.
    rearrange(tensor: Union[~Tensor, List[~Tensor]], pattern: str, **axes_lengths: Any) -> ~Tensor
        einops.rearrange is a reader-friendly smart element reordering for multidimensional
        tensors. This operation includes functionality of transpose (axes permutation),
        reshape (view), squeeze, unsqueeze, stack, concatenate and other operations.

Fill in every block marked `# TODO ex08`, then run:

    python -m minipar.exercises check ex08

Generated from minipar.moe by `python -m minipar.exercises make ex08`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.moe import *  # noqa: F401,F403  everything else, as the package has it


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t e) router logits -> probs (t e), weights (t k), experts (t k) indices.

    k > 1: the weights are the top-k probabilities renormalised to sum to 1 (Mixtral);
    k = 1: the raw probability (Switch), so the task loss's gradient reaches the router."""
    # TODO ex08: write this part
    # softmax over the experts (in fp32), take the k largest; renormalise them when k > 1
    raise NotImplementedError("ex08: this part is yours to write")
    return probs, weights, experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Switch's aux loss E * sum_e f_e P_e of each sequence, mean over the sequences.

    ``experts`` (b s, k) the choices of whole sequences of ``seq_len`` tokens; ``probs``
    (b s', e) the router's probabilities of s' of each sequence's tokens: all of them (s' =
    s), or under tensor parallelism this rank's s/t, and then the result is this rank's
    share of the aux loss (P_e is a sum over the tokens divided by s).
    """
    n_experts = probs.shape[-1]
    # TODO ex08: write this part
    # per sequence: f (b e) = share of its s k choices that went to e (counted, no gradient),
    # P (b e) = sum of probs over its tokens / s; then E * sum_e f P, mean over the sequences
    raise NotImplementedError("ex08: this part is yours to write")
