"""ex08: the mixture-of-experts router and its load-balancing loss."""
TITLE = "Top-k router and load balancing"
SUMMARY = "the MoE top-k router and its load-balancing loss"
DIFFICULTY = "easy"
MINUTES = 30
NOTEBOOK = "08, section 2 (Where the tokens go) and 3 (Load balance)"
MODULE = "minipar.moe"
NAMES = ["route", "load_balancing_loss"]
API = ["torch.topk", "torch.nn.functional.one_hot", "einops.rearrange"]
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
probabilities of e over the sequence's tokens divided by `seq_len` (their mean). Under tensor
parallelism `probs` holds only a rank's share of each sequence's tokens, (b s/t, E), while
`experts` covers the whole sequences: divide by `seq_len` still, and the t ranks' results sum
to the loss. It is 1 when the routing is balanced and E when every token picks the same
expert. The checker compares both with plain loops, splits the tokens over t = 3 ranks, and
trains a step through them.

Shapes in `load_balancing_loss`: `probs` (b s, E), `experts` (b s, k) for b sequences of
s = `seq_len` tokens; `rearrange(x, "(b s) e -> b s e", s=seq_len)` gives each sequence its row.
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


def _show(x):
    import torch
    x = torch.as_tensor(x).reshape(-1)
    return "[" + ", ".join(f"{v:.3f}" for v in x[:4].tolist()) + (", ...]" if x.numel() > 4 else "]")


def check(student, report) -> None:
    import torch
    g = torch.Generator().manual_seed(0)
    good_route = []
    for t, E, k in [(12, 4, 1), (12, 4, 2), (20, 8, 3)]:
        logits = torch.randn(t, E, generator=g) * 2
        probs, weights, experts = student.route(logits, k)
        ref_p, ref_w, ref_e = _reference_route(logits, k)
        where = f"route, t={t} tokens, E={E} experts, k={k}"
        if tuple(weights.shape) != (t, k) or tuple(experts.shape) != (t, k) or tuple(probs.shape) != (t, E):
            report.fail(f"{where}: probs must be (t, E) = ({t}, {E}), weights and experts (t, k) "
                        f"= ({t}, {k}); got {tuple(probs.shape)}, {tuple(weights.shape)} and "
                        f"{tuple(experts.shape)}")
            continue
        start = report.count
        if not torch.allclose(probs, ref_p, atol=1e-6):
            over_tokens = torch.allclose(probs, torch.softmax(logits, dim=0), atol=1e-6)
            report.fail(f"{where}: token 0's probs are {_show(probs[0])}, the softmax over the "
                        f"experts is {_show(ref_p[0])}" + (
                            ": this is the softmax over the tokens (dim 0); take it over the "
                            "experts, dim -1" if over_tokens else ""))
        if not torch.equal(experts.long(), ref_e):
            same_sets = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(experts.long(), ref_e))
            bad = next(i for i in range(t) if not torch.equal(experts[i].long(), ref_e[i]))
            report.fail(f"{where}: token {bad} chose experts {experts[bad].tolist()}, its k most "
                        f"probable are {ref_e[bad].tolist()}" + (
                            " (the right ones, but not best first: torch.topk sorts them)"
                            if same_sets else ""))
        elif not torch.allclose(weights.float(), ref_w, atol=1e-6):
            raw = torch.allclose(weights.float(), ref_p.gather(1, ref_e), atol=1e-6)
            why = (" (the raw probabilities: with k > 1 renormalise them to sum to 1)" if raw and k > 1
                   else " (renormalised: at k = 1 keep the raw probability, or p / p = 1 leaves "
                        "the router no gradient from the task loss)" if k == 1 and torch.allclose(
                            weights.float(), torch.ones_like(ref_w)) else "")
            report.fail(f"{where}: token 0's weights are {_show(weights[0])}, expected "
                        f"{_show(ref_w[0])}{why}")
        if report.count == start:
            good_route.append(f"k={k}")
    if good_route:
        report.ok(f"route with {', '.join(good_route)}: probs are the softmax over the experts, "
                  f"experts the k most probable (best first), weights renormalised for k > 1 "
                  f"and raw at k = 1")
    good_aux = []
    for s, b, E, k in [(4, 3, 4, 2), (6, 2, 8, 1)]:
        logits = torch.randn(b * s, E, generator=g, requires_grad=True)
        probs = torch.softmax(logits, dim=-1)
        experts = torch.topk(probs, k, dim=-1).indices
        where = f"load_balancing_loss, {b} sequences of {s} tokens, E={E}, k={k}"
        got = student.load_balancing_loss(probs, experts, s)
        want = float(_reference_aux(probs.detach(), experts, s))
        if not torch.is_tensor(got) or got.numel() != 1:
            report.fail(f"{where}: return one scalar tensor")
            continue
        if abs(got.item() - want) > 1e-5:
            whole = float(_reference_aux(probs.detach(), experts, b * s))
            why = (" (that is the loss of the whole batch: compute it per sequence, then "
                   "average)" if abs(got.item() - whole) < 1e-5 else
                   f" (1/E of it: multiply by E = {E})" if abs(got.item() * E - want) < 1e-5 else
                   f" ({s}x it: P_e is the sum of the probabilities divided by seq_len)"
                   if abs(got.item() - s * want) < 1e-4 else "")
            report.fail(f"{where}: aux loss {got.item():.6f}, expected {want:.6f}{why}")
            continue
        if not got.requires_grad:
            report.fail(f"{where}: no gradient reaches the router: P_e must come from probs")
            continue
        got.backward()
        ref_logits = logits.detach().clone().requires_grad_()
        _reference_aux(torch.softmax(ref_logits, -1), experts, s).backward()
        if not torch.allclose(logits.grad, ref_logits.grad, atol=1e-6):
            report.fail(f"{where}: the loss's gradient differs from E * sum_e f_e P_e with f_e a "
                        f"constant (max error {(logits.grad - ref_logits.grad).abs().max():.3g}): "
                        f"f_e is a count, no gradient may flow through it")
            continue
        good_aux.append(f"{b} sequences of {s}")
    # Under tensor parallelism (sequence parallel) rank r holds tokens [r s/t, (r+1) s/t) of
    # every sequence: its probs (b s/t, E), the experts of the whole sequences (b s, k)
    s, b, E, k, tp = 6, 2, 4, 2, 3
    probs = torch.softmax(torch.randn(b * s, E, generator=g), dim=-1)
    experts = torch.topk(probs, k, dim=-1).indices
    want = float(_reference_aux(probs, experts, s))
    parts = probs.view(b, tp, s // tp, E)
    shares = [student.load_balancing_loss(parts[:, r].reshape(-1, E), experts, s) for r in range(tp)]
    where = f"load_balancing_loss under tensor parallelism, t={tp} ranks of {s // tp} tokens per sequence"
    total = sum(float(x) for x in shares)
    if abs(total - want) > 1e-5:
        why = (f" ({tp}x it: P_e divides by seq_len = {s}, the whole sequence, not by the "
               f"{s // tp} tokens this rank holds)" if abs(total - tp * want) < 1e-4 else "")
        report.fail(f"{where}: the {tp} ranks' shares sum to {total:.6f}, the whole batch's loss "
                    f"is {want:.6f}{why}")
    else:
        good_aux.append(f"the shares of {tp} tensor-parallel ranks (they sum to the loss)")
    balanced = torch.full((8, 4), 0.25)
    got = student.load_balancing_loss(balanced, torch.arange(8).remainder(4)[:, None], 8).item()
    if abs(got - 1) > 1e-6:
        report.fail(f"balanced routing (every expert equally often and equally likely) must give "
                    f"1, got {got:.6f}")
    elif good_aux:
        report.ok(f"load_balancing_loss on {' and '.join(good_aux)}: the value and its gradient "
                  f"equal E * sum_e f_e P_e per sequence, averaged; balanced routing gives 1")
