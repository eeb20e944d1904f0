"""Exercise ex08: Top-k router and load balancing

A mixture-of-experts layer sends each token to k of its E experts. Write the router's two
pieces. `route(logits, k)`: the softmax of the (t, E) router logits over the experts (in
fp32), the k most probable experts of each token (`torch.topk`), and their probabilities
renormalised to sum to 1; return `(probs, weights, experts)` with shapes (t, E), (t, k),
(t, k). `load_balancing_loss(probs, experts, seq_len)`: Switch Transformer's auxiliary loss
E * sum_e f_e P_e, computed for each sequence of `seq_len` tokens and averaged over the
sequences, where f_e is the share of the sequence's s*k choices that went to expert e (a
count: no gradient flows through it) and P_e the mean of the probabilities of e over the
sequence's tokens. It is 1 when the routing is balanced and E when every token picks the
same expert. The checker compares both with plain loops and trains a step through them.

Fill in every block marked `# TODO ex08`, then run:

    python -m minipar.exercises check ex08

Generated from minipar.moe by `python -m minipar.exercises make ex08`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.moe import *  # noqa: F401,F403  everything else, as the package has it


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t e) router logits -> probs (t e), weights (t k) summing to 1, experts (t k) indices."""
    # TODO ex08: write this part
    # softmax over the experts (in fp32), take the k largest, renormalise their probabilities
    raise NotImplementedError("ex08: this part is yours to write")
    return probs, weights, experts


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Switch's aux loss E * sum_e f_e P_e of each sequence, mean over the sequences.

    ``probs`` (t e) the router's probabilities, ``experts`` (t k) its choices, t = b s.
    """
    n_experts = probs.shape[-1]
    # TODO ex08: write this part
    # per sequence: f (b e) = share of its s k choices that went to e (counted, no gradient),
    # P (b e) = mean of probs over its tokens; then E * sum_e f P, mean over the sequences
    raise NotImplementedError("ex08: this part is yours to write")
