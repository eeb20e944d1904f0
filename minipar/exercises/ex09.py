"""ex09: merge two partial attention outputs with their log-sum-exp (ring/flash attention)."""
TITLE = "Merge attention blocks by log-sum-exp"
SUMMARY = "merging two partial attention outputs by their log-sum-exp (ring attention)"
DIFFICULTY = "easy"
MINUTES = 20
NOTEBOOK = "09, section 2 (A ring-attention step, block by block)"
MODULE = "minipar.cp"
NAMES = ["merge"]
API = ["torch.logaddexp", "torch.maximum"]
_BLOCKS = """Ring attention (and flash attention inside one GPU) never computes one softmax over
all the keys: each block of keys gives a partial output `out_x = softmax(q k_x^T) v_x`,
normalised by that block's own sum, and its log-sum-exp `lse_x = log sum_j exp(q k_j)` for each
query. Write `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the output and log-sum-exp of
one softmax over both blocks' keys"""
INTRO = _BLOCKS + """. Shapes: out (b h i d), lse (b h i). Hint: the merged lse is the log of
the sum of the two exponentials (compute it without overflow: scores can be large), and each
partial output is reweighted by exp(lse_x - lse). A row may have seen no key in one of the
blocks (lse = -inf there): it must take the other block's values unchanged.

Notebook 09 derives the merge by hand for one query (section 2). `out_x[..., None]`-style
broadcasting: lse (b h i) needs a trailing axis, `lse[..., None]`, to scale out (b h i d).
"""

HARD_INTRO = "The harder track of ex09: the same checker, without the formula.\n\n" + _BLOCKS + """,
from these four alone (derive it for one query first, on paper). Shapes: out (b h i d), lse
(b h i). The checker's scores reach the thousands, and a row may have seen no key in one of
the blocks (lse = -inf there).
"""
HARD_API = ["torch.exp", "torch.log"]


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


def check(student, report) -> None:
    import torch
    g = torch.Generator().manual_seed(0)
    good = []
    for scale, cut, where in [(1.0, 3, "ordinary scores"), (1.0, 1, "a block of one key"),
                              (400.0, 4, "large scores (|q.k| in the thousands)")]:
        q, k, v = _blocks(g, scale=scale, dtype=torch.float64)
        a = _attend(q, k[:, :, :cut], v[:, :, :cut])
        b = _attend(q, k[:, :, cut:], v[:, :, cut:])
        want_out, want_lse = _attend(q, k, v)
        got = student.merge(*a, *b)
        if not (isinstance(got, tuple) and len(got) == 2):
            report.fail("merge must return the pair (out, lse)")
            return
        out, lse = got
        if tuple(out.shape) != tuple(want_out.shape) or tuple(lse.shape) != tuple(want_lse.shape):
            report.fail(f"{where}: out must be (b h i d) {tuple(want_out.shape)} and lse (b h i) "
                        f"{tuple(want_lse.shape)}, got {tuple(out.shape)} and {tuple(lse.shape)}")
            continue
        if not torch.isfinite(lse).all():
            top = max(a[1].abs().max().item(), b[1].abs().max().item())
            report.fail(f"{where}: the merged lse or out overflows to inf/nan (the lse values "
                        f"reach {top:.0f}, and exp(710) is already inf in float64): a "
                        f"missing max in log-sum-exp. log(exp(x) + exp(y)) = m + log(exp(x - m) "
                        f"+ exp(y - m)) with m = max(x, y); torch.logaddexp does this")
            continue
        if not torch.allclose(lse, want_lse, atol=1e-9):
            i = (lse - want_lse).abs().flatten().argmax().item()
            maxed = torch.allclose(lse, torch.maximum(a[1], b[1]), atol=1e-9)
            report.fail(f"{where}: the merged lse is not log(exp(lse_a) + exp(lse_b)): query "
                        f"{i} has {lse.flatten()[i].item():.6f}, expected "
                        f"{want_lse.flatten()[i].item():.6f}" + (
                            " (that is max(lse_a, lse_b): the max is only the shift, add "
                            "log(exp(lse_a - m) + exp(lse_b - m)))" if maxed else ""))
            continue
        unnormalised = torch.exp(a[1])[..., None] * a[0] + torch.exp(b[1])[..., None] * b[0]
        if not torch.isfinite(out).all() or torch.allclose(out, unnormalised, atol=1e-9):
            report.fail(f"{where}: the merged lse is right, but the output "
                        f"{'overflows' if not torch.isfinite(out).all() else 'is wrong'}: its "
                        f"weights are exp(lse_x), which do not sum to 1 (unnormalised weights). "
                        f"Weight each block by exp(lse_x - lse): the two weights then sum to 1 "
                        f"and never overflow")
            continue
        if not torch.allclose(out, want_out, atol=1e-9):
            swapped = torch.exp(b[1] - lse)[..., None] * a[0] + torch.exp(a[1] - lse)[..., None] * b[0]
            hint = (" (each output must be weighted by its own block's exp(lse_x - lse))"
                    if torch.allclose(out, swapped, atol=1e-9) else
                    " (weight out_a by exp(lse_a - lse) and out_b by exp(lse_b - lse))")
            report.fail(f"{where}: the merged output is not softmax attention over both "
                        f"blocks (max error {(out - want_out).abs().max().item():.3g}){hint}")
            continue
        good.append(where)
    q, k, v = _blocks(g, dtype=torch.float64)
    a = _attend(q, k, v)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for order in ("(seen, empty)", "(empty, seen)"):
        out, lse = student.merge(*a, *empty) if order == "(seen, empty)" else student.merge(*empty, *a)
        if not (torch.allclose(out, a[0]) and torch.equal(lse, a[1])):
            nan = " (it gave nan: exp(-inf - (-inf)); the larger lse is finite, shift by it)" \
                if torch.isnan(out).any() or torch.isnan(lse).any() else ""
            report.fail(f"a block that saw no key (lse = -inf), merged as {order}, must leave the "
                        f"other block's out and lse unchanged{nan}")
            return
    if good:
        report.ok(f"with {', '.join(good)}: out and lse equal one softmax over both blocks' keys; "
                  f"a block that saw no key leaves the other unchanged")
