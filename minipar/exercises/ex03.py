"""ex03: column- and row-parallel linear layers with Megatron's f and g operators."""
import torch
from ..mesh import Mesh

TITLE = "Column and row parallel linear layers"
MODULE = "minipar.tp"
NAMES = ["CopyToTP", "ReduceFromTP", "f", "g", "ColumnParallelLinear", "RowParallelLinear"]
INTRO = """
Tensor parallelism splits a linear layer Y = X A^T + b over the t ranks of a group.
ColumnParallelLinear keeps out/t rows of A (output features): every rank needs all of X and
computes its slice of Y, with no communication forward. RowParallelLinear keeps in/t columns
of A: its input arrives already split by features, each rank computes a partial product, and
the partial products are summed over the group. The two conjugate operators glue this to
autograd: f (CopyToTP) is the identity forward and an all-reduce of the gradient backward;
g (ReduceFromTP) is an all-reduce forward and the identity backward.

Write the forward and backward of f and g (use `comm.all_reduce(tensor, group)`, which works
in place: reduce a copy), then the two `forward`s: ColumnParallelLinear enters through f
(through `all_gather_seq` when `self.sequence_parallel`), and gathers its output with
`gather_from_tp` if `self.gather_output` (trim it to `self.out_features`);
RowParallelLinear sums with g (`reduce_scatter_seq` under sequence parallelism) and adds the
bias once, after the sum. A column layer followed by a row layer must cost exactly one
all-reduce forward and one backward.
"""


RULES = {"f forward": "f must return its input unchanged",
         "f backward": "f's backward must sum the gradient over the group (all-reduce)",
         "g forward": "g must sum its input over the group (all-reduce)",
         "g backward": "g's backward must pass the gradient through unchanged"}


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _err(a, b):
    return float("inf") if a is None or a.shape != b.shape else (a - b).abs().max().item()


def _run(student, t):
    import torch.nn as nn
    import torch.nn.functional as F
    from minipar import comm, tp
    from minipar.train import pieces
    from minipar.runtime import dist
    from minipar.plan import ring_bytes
    grid = Mesh(1, 1, t)
    group, r = grid.group("tp"), grid.coord("tp")
    out = {}

    def gathered(local, split):
        with comm.untracked():
            return pieces.unshard(comm.all_gather_stacked(local.detach(), group), split)

    # f and g alone, with a different tensor on every rank
    x = _rand(4, seed=10 + r).requires_grad_()
    up = _rand(4, seed=20 + r)
    (student.f(x, group) * up).sum().backward()
    everyone_up = sum(_rand(4, seed=20 + k) for k in range(t))
    out["f forward"] = _err(student.f(x, group).detach(), x.detach())
    out["f backward"] = _err(x.grad, everyone_up)
    x.grad = None
    y = student.g(x, group)
    (y * up).sum().backward()
    out["g forward"] = _err(y.detach(), sum(_rand(4, seed=10 + k) for k in range(t)))
    out["g backward"] = _err(x.grad, up)

    b, s, d_in, d_out = 2, 4, 8, 12
    x = _rand(b, s, d_in, seed=1)
    up = _rand(b, s, d_out, seed=2)
    for gather in (False, True):
        for sp in (False, True):
            torch.manual_seed(3)
            ref = nn.Linear(d_in, d_out)
            xr = x.clone().requires_grad_()
            (ref(xr) * up).sum().backward()
            col = student.ColumnParallelLinear.from_serial(ref, group, gather_output=gather,
                                                           sequence_parallel=sp)
            xs = (x.chunk(t, dim=1)[r] if sp else x).clone().requires_grad_()
            y = col(xs)
            (y * (up if gather else up.chunk(t, dim=-1)[r])).sum().backward()
            tag = f"ColumnParallelLinear(gather_output={gather}, sequence_parallel={sp})"
            out[tag + ": output"] = _err(y.detach(), ref(x).detach() if gather else ref(x).detach().chunk(t, dim=-1)[r])
            out[tag + ": input gradient"] = _err(xs.grad, xr.grad.chunk(t, dim=1)[r] if sp else xr.grad)
            out[tag + ": weight gradient"] = _err(gathered(col.weight.grad, col.tp_splits["weight"]), ref.weight.grad)
            out[tag + ": bias gradient"] = _err(gathered(col.bias.grad, col.tp_splits["bias"]), ref.bias.grad)
    for sp in (False, True):
        torch.manual_seed(4)
        ref = nn.Linear(d_in, d_out)
        xr = x.clone().requires_grad_()
        (ref(xr) * up).sum().backward()
        row = student.RowParallelLinear.from_serial(ref, group, sequence_parallel=sp)
        xs = x.chunk(t, dim=-1)[r].clone().requires_grad_()
        y = row(xs)
        (y * (up.chunk(t, dim=1)[r] if sp else up)).sum().backward()
        tag = f"RowParallelLinear(sequence_parallel={sp})"
        out[tag + ": output"] = _err(y.detach(), ref(x).detach().chunk(t, dim=1)[r] if sp else ref(x).detach())
        out[tag + ": input gradient"] = _err(xs.grad, xr.grad.chunk(t, dim=-1)[r])
        out[tag + ": weight gradient"] = _err(gathered(row.weight.grad, row.tp_splits["weight"]), ref.weight.grad)
        out[tag + ": bias gradient"] = _err(row.bias.grad, ref.bias.grad)

    # column then row: the bytes of exactly one all-reduce each way
    torch.manual_seed(5)
    fc, proj = nn.Linear(d_in, 16), nn.Linear(16, d_in)
    pfc = student.ColumnParallelLinear.from_serial(fc, group)
    pproj = student.RowParallelLinear.from_serial(proj, group)
    xs = x.clone().requires_grad_()
    comm.reset()
    y = pproj(F.gelu(pfc(xs)))
    fwd = comm.stats.bytes_by_op()
    comm.reset()
    y.sum().backward()
    bwd = comm.stats.bytes_by_op()
    one = ring_bytes("all_reduce", b * s * d_in * 4, t)     # one (b, s, d_in) fp32 all-reduce
    return dict(errors=out, fwd=fwd, bwd=bwd, one=one)


def check(student) -> list[str]:
    from minipar.exercises import launch_student
    failures = []
    for t in (2, 4):
        res = launch_student(_run, t, student, t)[0]
        for what, err in res["errors"].items():
            if not err <= 1e-5:
                if what in RULES:
                    failures.append(f"with t={t}: {what} is wrong: {RULES[what]}")
                else:
                    failures.append(f"with t={t}: {what} differs from the serial nn.Linear "
                                    f"(max error {err:.3g})")
        if not failures:
            for phase, got in (("forward", res["fwd"]), ("backward", res["bwd"])):
                if got != {"all_reduce": res["one"]}:
                    failures.append(f"with t={t}: a column layer then a row layer sent {got} in "
                                    f"{phase}; it must be one all-reduce of the (b, s, h) "
                                    f"activation: {{'all_reduce': {res['one']}}}")
        if failures:
            return failures
    return failures
