"""ex03a (the warm-up of ex03): Megatron's conjugate operators f and g."""
import torch

from ..mesh import Mesh

TITLE = "The conjugate operators f and g (warm-up for ex03)"
SUMMARY = "f and g, the autograd functions behind tensor parallelism"
DIFFICULTY = "easy"
MINUTES = 20
NOTEBOOK = "02, section 2 (Where f and g sit in a block)"
MODULE = "minipar.tp"
NAMES = ["CopyToTP", "ReduceFromTP", "f", "g"]
API = ["minipar.comm.all_reduce"]
_METHODS = """`forward(ctx, x, group)` returns the output; `backward(ctx, grad)` returns one
gradient per forward input: `(grad_x, None)` (the group gets none). Keep what backward needs
on `ctx` (`ctx.group = group`). `comm.all_reduce(t, group)` sums in place, into t: reduce a
copy (`x.clone()`), never the tensor autograd handed you. The checker tests f and g alone on
t = 2 and 4 ranks, then a whole Megatron MLP, `g(gelu(f(X) A_r) B_r)`, against one process."""
INTRO = """
Tensor parallelism runs one layer on t ranks at once, and autograd must know where the ranks'
results meet. Megatron-LM glues it with two conjugate operators, each an autograd Function:

    f  (CopyToTP)      forward: identity            backward: all-reduce (sum) of the gradient
    g  (ReduceFromTP)  forward: all-reduce (sum)    backward: identity

f stands in front of a column-parallel layer: every rank's branch used all of X, so the
gradient of X is the sum of the t branches' gradients. g stands behind a row-parallel layer:
the t partial products are summed, and the gradient of a sum reaches every summand unchanged.

Write the four static methods. """ + _METHODS

HARD_INTRO = """
The harder track of ex03a: the same checker, without the table of what f and g do. Tensor
parallelism runs one layer on t ranks at once, and autograd must know where the ranks'
results meet. Megatron-LM glues it with two conjugate operators, each an autograd Function:
f (`CopyToTP`) stands in front of a column-parallel layer, whose t branches each read all of
X; g (`ReduceFromTP`) stands behind a row-parallel layer, whose t branches each give a partial
product, and Y is their sum. Derive what each must do in its forward and in its backward, and
write the four static methods (`f(x, group)` and `g(x, group)` below apply them).

""" + _METHODS


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(student, t):
    import torch.nn.functional as F
    from minipar import comm
    grid = Mesh(1, 1, t)
    group, r = grid.group("tp"), grid.coord("tp")
    out = {}

    def one(fn, seed_x, seed_up):
        """fn on this rank's x, backward of (y * up).sum(): y, x's gradient, x after, bytes."""
        x = _rand(4, seed=seed_x + r).requires_grad_()
        kept = x.detach().clone()
        comm.reset()
        y = fn(x, group)
        fwd = comm.stats.bytes_by_op()
        comm.reset()
        (y * _rand(4, seed=seed_up + r)).sum().backward()
        return dict(y=y.detach(), grad=x.grad, changed=not torch.equal(x.detach(), kept), fwd=fwd,
                    bwd=comm.stats.bytes_by_op(), x=kept, up=_rand(4, seed=seed_up + r))

    out["f"] = one(student.f, 10, 20)
    out["g"] = one(student.g, 30, 40)
    out["sum_x"] = {name: sum(_rand(4, seed=s + k) for k in range(t)) for name, s in (("f", 10), ("g", 30))}
    out["sum_up"] = {name: sum(_rand(4, seed=s + k) for k in range(t)) for name, s in (("f", 20), ("g", 40))}
    # a Megatron MLP: A (h, 4h) by columns, B (4h, h) by rows; X (b s, h)
    X, A, B = _rand(6, 8, seed=1), _rand(8, 16, seed=2) / 3, _rand(16, 8, seed=3) / 4
    ref = [v.clone().requires_grad_() for v in (X, A, B)]
    (F.gelu(ref[0] @ ref[1]) @ ref[2]).square().sum().backward()
    mine = [X.clone().requires_grad_(), A.chunk(t, 1)[r].clone().requires_grad_(),
            B.chunk(t, 0)[r].clone().requires_grad_()]
    y = student.g(F.gelu(student.f(mine[0], group) @ mine[1]) @ mine[2], group)
    y.square().sum().backward()
    out["mlp"] = dict(y=(y.detach() - F.gelu(X @ A) @ B).abs().max().item(),
                      dX=(mine[0].grad - ref[0].grad).abs().max().item() if mine[0].grad is not None else float("inf"),
                      dA=(mine[1].grad - ref[1].grad.chunk(t, 1)[r]).abs().max().item(),
                      dB=(mine[2].grad - ref[2].grad.chunk(t, 0)[r]).abs().max().item())
    return out


def _close(a, b):
    return a is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def _show(x):
    return "None" if x is None else "[" + ", ".join(f"{v:.3f}" for v in x.reshape(-1)[:3].tolist()) + ", ...]"


def check(student, report) -> None:
    from minipar.exercises import launch_student
    from minipar.plan import ring_bytes
    good = []
    for t in (2, 4):
        res = launch_student(_run, t, student, t)[0]
        f, g = res["f"], res["g"]
        one = ring_bytes("all_reduce", 16, t)
        where = f"t={t}, rank 0"
        start = report.count
        swapped = _close(f["y"], res["sum_x"]["f"]) and _close(g["grad"], res["sum_up"]["g"])
        if swapped:
            report.fail(f"{where}: f sums in forward and g sums in backward: f and g are swapped. "
                        f"f: identity forward, all-reduce backward; g: the reverse")
        for name, x, kind in (("f", f, "forward"), ("g", g, "forward")):
            if x["changed"]:
                report.fail(f"{where}: {name}'s {kind} changed its input x in place (the caller's "
                            f"tensor): all-reduce a copy, x.clone()")
        if not swapped:
            if not _close(f["y"], f["x"]):
                report.fail(f"{where}: f forward must return its input unchanged: expected "
                            f"{_show(f['x'])}, got {_show(f['y'])}")
            if not _close(f["grad"], res["sum_up"]["f"]):
                own = _close(f["grad"], f["up"])
                report.fail(f"{where}: f backward must sum the gradient over the group "
                            f"(all-reduce): expected the sum of the {t} ranks' gradients "
                            f"{_show(res['sum_up']['f'])}, got {_show(f['grad'])}"
                            + (" (this rank's own gradient: the all-reduce is missing, or its "
                               "result is not what you return)" if own else ""))
            if not _close(g["y"], res["sum_x"]["g"]):
                own = _close(g["y"], g["x"])
                report.fail(f"{where}: g forward must sum its input over the group (all-reduce): "
                            f"expected {_show(res['sum_x']['g'])}, got {_show(g['y'])}"
                            + (" (this rank's own partial result)" if own else ""))
            if not _close(g["grad"], g["up"]):
                report.fail(f"{where}: g backward must pass the gradient through unchanged: "
                            f"expected {_show(g['up'])}, got {_show(g['grad'])}")
        for name, x, phase, want in (("f", f, "fwd", {}), ("f", f, "bwd", {"all_reduce": one}),
                                     ("g", g, "fwd", {"all_reduce": one}), ("g", g, "bwd", {})):
            if x[phase] != want:
                report.fail(f"{where}: {name}'s {'forward' if phase == 'fwd' else 'backward'} sent "
                            f"{x[phase] or 'nothing'}; expected {want or 'nothing'}",
                            kind="bytes")
        if report.count == start:
            bad = {k: v for k, v in res["mlp"].items() if not v <= 1e-5}
            if bad:
                report.fail(f"t={t}: the Megatron MLP g(gelu(f(X) A_r) B_r) differs from one "
                            f"process: max errors {bad}")
        if report.count == start:
            good.append(t)
    if good:
        report.ok(f"on t = {' and '.join(map(str, good))} ranks: f is the identity forward and "
                  f"sums the gradient backward, g the reverse; each sends one all-reduce where "
                  f"it should and nothing elsewhere; neither changes its input; the MLP "
                  f"g(gelu(f(X) A_r) B_r) gives one process's output and gradients")
