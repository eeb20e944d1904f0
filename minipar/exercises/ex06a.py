"""ex06a (the warm-up of ex06): ZeRO-1 at its plainest, one flat buffer over one group.

The solution lives here, not in ``minipar/zero.py``: ``sharded_optimizer_step`` there is the
same algorithm per unit and over the shard mesh's groups (ex06); this is the idea alone.
"""
import torch

from minipar import comm

__all__ = ["zero1_step", "comm", "torch"]       # what the student file imports

TITLE = "ZeRO-1 by hand on one flat buffer (warm-up for ex06)"
SUMMARY = "ZeRO-1 by hand: reduce-scatter, update a slice, all-gather, on a few tensors"
DIFFICULTY = "easy"
MINUTES = 20
NOTEBOOK = "04, section 2 (ZeRO-1 by hand, on a few tensors)"
MODULE = "minipar.exercises.ex06a"
NAMES = ["zero1_step"]
API = ["minipar.comm.reduce_scatter", "minipar.comm.all_gather", "minipar.comm.size",
       "minipar.comm.rank"]
INTRO = """
ZeRO-1 keeps the whole model on each of the d ranks but Adam's state for 1/d of it only. Here
the model is a few tensors flattened into one buffer `flat` of N elements (N a multiple of d),
the same on every rank; `flat_grad` (N) is this rank's gradient (each rank saw other data).
Rank r owns slice r, `flat.chunk(d)[r]` (N/d elements): the `optimizer` was built over that
slice alone and reads its gradient from `shard_grad` (N/d), the slice's `.grad`. One step:

1. reduce-scatter `flat_grad` over the group: rank r receives the sum over the d ranks of
   slice r only. Write it straight into `shard_grad` (`comm.reduce_scatter(out, inp, group)`
   writes into `out`), then divide by d in place: gloo has no AVG.
2. `optimizer.step()` updates slice r of `flat` (a view: `flat` itself changes).
3. all-gather: every rank needs every updated slice again.
   `comm.all_gather(out, inp, group)` writes the d ranks' `inp` into `out` in rank order;
   give it `flat` as `out` and a copy of your slice as `inp` (a collective must not read
   from the buffer it writes).

The optimizer reads `shard_grad`'s memory: `shard_grad = shard_grad / d` makes a new tensor
and rebinds your local name to it; the optimizer never sees it. Write in place (`div_`,
`copy_`). Reduce-scatter plus all-gather send (d-1)/d N each, exactly one all-reduce's
bytes: ZeRO-1 costs no extra traffic. The checker runs d = 2 and 4 ranks with SGD and
compares every rank's buffer with one process's step on the averaged gradient.
"""


def zero1_step(flat: torch.Tensor, flat_grad: torch.Tensor, shard_grad: torch.Tensor,
               optimizer, group) -> None:
    """One ZeRO-1 step over ``group`` (d ranks, this one r): ``flat`` (N) the parameters, the
    same on every rank; ``flat_grad`` (N) this rank's gradient; ``optimizer`` updates
    ``flat.chunk(d)[r]`` only, reading its gradient from ``shard_grad`` (N/d)."""
    # EXERCISE ex06a begin
    # reduce-scatter flat_grad into shard_grad (in place), divide it by d; optimizer.step();
    # all-gather the d updated slices back into flat
    d = comm.size(group)
    comm.reduce_scatter(shard_grad, flat_grad, group)
    shard_grad.div_(d)                  # gloo has no AVG: sum, then divide
    optimizer.step()                    # updates slice r of flat, in place
    comm.all_gather(flat, flat.chunk(d)[comm.rank(group)].clone(), group)
    # EXERCISE ex06a end


SIZES = (4, 6, 2)       # a few tensors (a weight, a bias, ...), 12 elements: N divides by 2 and 4
LR = 0.1


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(k, generator=g) for k in SIZES])


def _run(student):
    from minipar.plan import ring_bytes
    r, d = comm.rank(comm.WORLD), comm.size(comm.WORLD)
    flat = _tensors(0)
    grads = [_tensors(100 + k) for k in range(d)]
    mean = sum(grads) / d
    want = flat - LR * mean                             # one process, the whole batch
    shard = flat.chunk(d)[r]
    shard_grad = torch.zeros_like(shard)
    shard.grad = shard_grad
    optimizer = torch.optim.SGD([shard], lr=LR)
    comm.reset()
    events, all_gather, step = [], comm.all_gather, optimizer.step
    optimizer.step = lambda *a, **k: (events.append("step"), step(*a, **k))[1]
    comm.all_gather = lambda *a, **k: (events.append("all_gather"), all_gather(*a, **k))[1]
    try:
        student.zero1_step(flat, grads[r].clone(), shard_grad, optimizer, comm.WORLD)
    finally:
        comm.all_gather = all_gather
    sent = comm.stats.bytes_by_op()
    n = flat.numel() // d
    mine = slice(r * n, (r + 1) * n)
    early = "all_gather" in events and "step" in events and \
        events.index("all_gather") < events.index("step")
    return dict(r=r, d=d, flat=flat.clone(), early_gather=early, want=want, start=_tensors(0), mean=mean[mine],
                local=grads[r][mine], shard_grad=shard_grad.clone(), sent=sent,
                sent_want={"reduce_scatter": ring_bytes("reduce_scatter", flat.numel() * 4, d),
                           "all_gather": ring_bytes("all_gather", flat.numel() * 4, d)})


def _diagnose(res) -> tuple[str, str] | None:
    d, r, n = res["d"], res["r"], res["flat"].numel() // res["d"]
    g, mean = res["shard_grad"], res["mean"]
    close = lambda a, b: torch.allclose(a, b, atol=1e-6)          # noqa: E731
    show = lambda t: "[" + ", ".join(f"{v:.3f}" for v in t[:3].tolist()) + ", ...]"   # noqa: E731
    if not close(g, mean):
        if close(g, d * mean):
            return ("missing division", f"shard_grad (its own slice r of the gradient) is {d}x "
                    f"the average over the ranks: a missing division by the group size. "
                    f"reduce_scatter sums; divide by comm.size(group) = {d}")
        if close(g, torch.zeros_like(g)):
            return ("rebound buffer", f"shard_grad still holds zeros, as before your call: a "
                    f"rebound buffer instead of an in-place write. `shard_grad = ...` only "
                    f"renames; the optimizer reads the tensor it was given: reduce-scatter into "
                    f"it and divide it in place (div_)")
        if close(g, res["local"]) or close(g, res["local"] / d):
            return ("not reduced", f"shard_grad holds this rank's own gradient of its slice"
                    f"{' / d' if close(g, res['local'] / d) else ''}, not the average over the "
                    f"{d} ranks: reduce-scatter flat_grad over the group")
        return ("wrong gradient", f"shard_grad should be the average over the {d} ranks of "
                f"slice {r} of their gradients, {show(mean)}; rank {r} got {show(g)}")
    flat, want, start = res["flat"], res["want"], res["start"]
    wrong = [k for k in range(d) if not close(flat.chunk(d)[k], want.chunk(d)[k])]
    if not wrong:
        return None
    if wrong == [k for k in range(d) if k != r] and all(close(flat.chunk(d)[k], start.chunk(d)[k]) for k in wrong):
        if res["early_gather"]:
            return ("early all-gather", f"the all-gather ran before optimizer.step(): it "
                    f"gathered the old slices, so only this rank's own slice r is new and the "
                    f"other {d - 1} still hold the old parameters. Step first, then all-gather "
                    f"the updated slices")
        return ("missing all-gather", f"only its own slice r was updated; the other {d - 1} "
                f"slices still hold the old parameters: all-gather the updated slices into flat")
    return ("wrong parameters", f"after the step slices {wrong} of flat differ from one "
            f"process's SGD step on the averaged gradient (slice {wrong[0]}: expected "
            f"{show(want.chunk(d)[wrong[0]])}, got {show(flat.chunk(d)[wrong[0]])})")


def check(student, report) -> None:
    from minipar.exercises import launch_student
    good = []
    for d in (2, 4):
        where = f"on {d} ranks"
        start = report.count
        results = launch_student(_run, d, student)
        report.fail_ranks(where, {res["r"]: found for res in results
                                  if (found := _diagnose(res)) is not None}, d)
        sent, want = results[0]["sent"], results[0]["sent_want"]
        if sent != want:
            extra = (" (an all-reduce sends twice what each half of ZeRO-1 does: reduce-scatter "
                     "the gradient, all-gather the parameters)" if "all_reduce" in sent else "")
            report.fail(f"{where}: rank 0 sent {sent}; ZeRO-1 sends {want}{extra}")
        if report.count == start:
            good.append(str(d))
    if good:
        report.ok(f"on {' and '.join(good)} ranks: shard_grad is the average of slice r over the "
                  f"ranks, written in place; after the step every rank holds one process's "
                  f"updated parameters; one reduce-scatter and one all-gather, (d-1)/d N bytes each")
