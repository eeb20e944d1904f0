"""ex08: the mixture-of-experts router and its load-balancing loss."""
TITLE = "Top-k router and load balancing"
MODULE = "minipar.moe"
NAMES = ["route", "load_balancing_loss"]
INTRO = """
A mixture-of-experts layer sends each token to k of its E experts. Write the router's two
pieces. `route(logits, k)`: the softmax of the (t, E) router logits over the experts (in
fp32), the k most probable experts of each token (`torch.topk`), and their probabilities
renormalised to sum to 1 when k > 1 (at k = 1 the raw probability, as in Switch: p / p = 1
would give the router no gradient from the task loss); return `(probs, weights, experts)`
with shapes (t, E), (t, k), (t, k). `load_balancing_loss(probs, experts, seq_len)`: Switch
Transformer's auxiliary loss E * sum_e f_e P_e, computed for each sequence of `seq_len`
tokens and averaged over the sequences, where f_e is the share of the sequence's s*k choices
that went to expert e (a count: no gradient flows through it) and P_e the sum of the
probabilities of e over the sequence's tokens divided by `seq_len` (their mean; under tensor
parallelism `probs` holds a rank's share of the tokens and this gives its share of the loss). It is 1 when the routing is balanced and E when every token picks the
same expert. The checker compares both with plain loops and trains a step through them.
"""


def _reference_route(logits, k):
    import torch
    probs = torch.softmax(logits.double(), dim=-1)
    weights, experts = [], []
    for row in probs:
        best = sorted(range(row.numel()), key=lambda e: -row[e].item())[:k]
        chosen = row[best]
        weights.append(chosen if k == 1 else chosen / chosen.sum())
        experts.append(best)
    return probs.float(), torch.stack(weights).float(), torch.tensor(experts)


def _reference_aux(probs, experts, seq_len):
    n_seq = probs.shape[0] // seq_len
    E, k = probs.shape[1], experts.shape[1]
    total = 0.0
    for b in range(n_seq):
        rows = range(b * seq_len, (b + 1) * seq_len)
        for e in range(E):
            f = sum(int(experts[t, j] == e) for t in rows for j in range(k)) / (seq_len * k)
            P = sum(probs[t, e] for t in rows) / seq_len
            total = total + E * f * P
    return total / n_seq


def check(student) -> list[str]:
    import torch
    failures = []
    g = torch.Generator().manual_seed(0)
    for t, E, k in [(12, 4, 1), (12, 4, 2), (20, 8, 3)]:
        logits = torch.randn(t, E, generator=g) * 2
        probs, weights, experts = student.route(logits, k)
        ref_p, ref_w, ref_e = _reference_route(logits, k)
        where = f"t={t}, E={E}, k={k}"
        if tuple(weights.shape) != (t, k) or tuple(experts.shape) != (t, k):
            return [f"{where}: weights and experts must be (t, k) = ({t}, {k}), got "
                    f"{tuple(weights.shape)} and {tuple(experts.shape)}"]
        if not torch.allclose(probs, ref_p, atol=1e-6):
            failures.append(f"{where}: probs are not the softmax of the logits over the experts")
        if not torch.equal(experts.long(), ref_e):
            failures.append(f"{where}: experts are not each token's k most probable, best first")
        elif not torch.allclose(weights.float(), ref_w, atol=1e-6):
            failures.append(f"{where}: weights must be the top-k probabilities renormalised "
                            f"to sum to 1 (k > 1), the raw probability at k = 1")
        if failures:
            return failures
    for s, b, E, k in [(4, 3, 4, 2), (6, 2, 8, 1)]:
        logits = torch.randn(b * s, E, generator=g, requires_grad=True)
        probs = torch.softmax(logits, dim=-1)
        experts = torch.topk(probs, k, dim=-1).indices
        where = f"{b} sequences of {s}, E={E}, k={k}"
        got = student.load_balancing_loss(probs, experts, s)
        want = _reference_aux(probs.detach(), experts, s)
        if not torch.is_tensor(got) or got.numel() != 1:
            return [f"{where}: return one scalar tensor"]
        if abs(got.item() - float(want)) > 1e-5:
            one = _reference_aux(probs.detach(), experts, b * s)
            hint = (" (that is the loss of the whole batch: compute it per sequence, then "
                    "average)" if abs(got.item() - float(one)) < 1e-5 else "")
            return [f"{where}: aux loss {got.item():.6f}, expected {float(want):.6f}{hint}"]
        if not got.requires_grad:
            return [f"{where}: no gradient reaches the router: P_e must come from probs"]
        got.backward()
        ref_logits = logits.detach().clone().requires_grad_()
        _reference_aux(torch.softmax(ref_logits, -1), experts, s).backward()
        if not torch.allclose(logits.grad, ref_logits.grad, atol=1e-6):
            failures.append(f"{where}: the loss's gradient differs from E * sum_e f_e P_e with "
                            f"f_e a constant")
    balanced = torch.full((8, 4), 0.25)
    if abs(student.load_balancing_loss(balanced, torch.arange(8).remainder(4)[:, None], 8).item() - 1) > 1e-6:
        failures.append("balanced routing (every expert equally often and equally likely) must give 1")
    return failures
