"""ex09: merge two partial attention outputs with their log-sum-exp (ring/flash attention)."""
TITLE = "Merge attention blocks by log-sum-exp"
MODULE = "minipar.cp"
NAMES = ["merge"]
INTRO = """
Ring attention (and flash attention inside one GPU) never computes one softmax over all the
keys: each block of keys gives a partial output `out_x = softmax(q k_x^T) v_x`, normalised by
that block's own sum, and its log-sum-exp `lse_x = log sum_j exp(q k_j)` for each query. Write
`merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the output and log-sum-exp of one softmax
over both blocks' keys. Shapes: out (b h i d), lse (b h i). Hint: the merged lse is the log of
the sum of the two exponentials (compute it without overflow: scores can be large), and each
partial output is reweighted by exp(lse_x - lse). A row may have seen no key in one of the
blocks (lse = -inf there): it must take the other block's values unchanged.
"""


def _blocks(g, b=2, h=3, i=5, j=7, d=4, scale=1.0, dtype=None):
    import torch
    q = torch.randn(b, h, i, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, j, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, j, d, generator=g, dtype=dtype)
    return q, k, v


def _attend(q, k, v):
    """Plain softmax attention (no mask) and its log-sum-exp, in float64."""
    import torch
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double())
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def check(student) -> list[str]:
    import torch
    g = torch.Generator().manual_seed(0)
    for scale, cut, where in [(1.0, 3, "ordinary scores"), (1.0, 1, "a block of one key"),
                              (400.0, 4, "large scores (|q.k| in the thousands)")]:
        q, k, v = _blocks(g, scale=scale, dtype=torch.float64)
        a = _attend(q, k[:, :, :cut], v[:, :, :cut])
        b = _attend(q, k[:, :, cut:], v[:, :, cut:])
        want_out, want_lse = _attend(q, k, v)
        got = student.merge(*a, *b)
        if not (isinstance(got, tuple) and len(got) == 2):
            return ["merge must return the pair (out, lse)"]
        out, lse = got
        if tuple(out.shape) != tuple(want_out.shape) or tuple(lse.shape) != tuple(want_lse.shape):
            return [f"{where}: out must be (b h i d) {tuple(want_out.shape)} and lse (b h i) "
                    f"{tuple(want_lse.shape)}, got {tuple(out.shape)} and {tuple(lse.shape)}"]
        if not torch.isfinite(lse).all() or not torch.isfinite(out).all():
            return [f"{where}: the merged values overflow to inf/nan: subtract the larger lse "
                    f"before exponentiating (or use torch.logaddexp)"]
        if not torch.allclose(lse, want_lse, atol=1e-9):
            return [f"{where}: the merged lse is not log(exp(lse_a) + exp(lse_b))"]
        if not torch.allclose(out, want_out, atol=1e-9):
            swapped = torch.exp(b[1] - lse)[..., None] * a[0] + torch.exp(a[1] - lse)[..., None] * b[0]
            hint = (" (each output must be weighted by its own block's exp(lse_x - lse))"
                    if torch.allclose(out, swapped, atol=1e-9) else
                    " (weight out_a by exp(lse_a - lse) and out_b by exp(lse_b - lse))")
            return [f"{where}: the merged output is not softmax attention over both blocks{hint}"]
    q, k, v = _blocks(g, dtype=torch.float64)
    a = _attend(q, k, v)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for order in ("(seen, empty)", "(empty, seen)"):
        out, lse = student.merge(*a, *empty) if order == "(seen, empty)" else student.merge(*empty, *a)
        if not (torch.allclose(out, a[0]) and torch.equal(lse, a[1])):
            return [f"a block that saw no key (lse = -inf), merged as {order}, must leave the "
                    f"other block's out and lse unchanged"]
    return []
