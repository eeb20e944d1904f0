"""ex04: cross-entropy over a vocabulary split across the tensor-parallel ranks."""
import torch
from ..mesh import Mesh

TITLE = "Vocab parallel cross entropy"
SUMMARY = "cross-entropy over a vocabulary split across ranks"
DIFFICULTY = "medium"
MINUTES = 40
NOTEBOOK = "02, section 2 (Where f and g sit in a block; slides: Vocab-parallel embedding and loss)"
MODULE = "minipar.tp"
NAMES = ["VocabParallelCE", "vocab_parallel_cross_entropy"]
API = ["minipar.comm.all_reduce", "minipar.comm.rank"]
INTRO = """
The head's projection is column-parallel without a gather: rank r holds the logits of its
V'/t vocabulary entries only (V' is the vocabulary padded to a multiple of t). Gathering the
(tokens x V) logits on one rank would cost the memory TP is meant to save, so compute the loss
where the logits are:

    loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,target - m_i),   m_i = max_j z_ij

with three all-reduces of one value per token: the max (`comm.all_reduce(t, group, op="max")`),
the sum of exp, and the target's logit (only the rank owning the target contributes it; the
others add 0). Columns at or past `vocab_size` are padding: they are no word and must get
probability zero (mask them to -inf). The backward needs no communication: the gradient of
loss_i with respect to this rank's logits is softmax_ij minus 1 at the target, times the
incoming gradient. Write `VocabParallelCE.forward` (per-token losses; save what backward needs)
and `VocabParallelCE.backward`.

Shapes: `logits` (N, V'/t), this rank's columns, which are vocabulary entries
[r V'/t, (r+1) V'/t) (`start` is prepared for you); `targets` (N,) global vocabulary ids;
forward returns (N,) losses; backward gets `grad_loss` (N,) and returns the gradient of
`logits`, (N, V'/t), then None for targets, group and vocab_size. `ctx.save_for_backward(...)`
keeps tensors, `ctx.saved_tensors` gives them back.
"""


def _run(student, t, vocab, scale):
    import torch.nn.functional as F
    from minipar import comm, tp
    from minipar.train import pieces
    from minipar.plan import ring_bytes
    grid = Mesh(1, 1, t)
    group, r = grid.group("tp"), grid.coord("tp")
    n = 24
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, targets)
    ref.backward()
    split = tp.Split(1, vocab)
    local = tp.shard(logits, split, r, t).requires_grad_()
    comm.reset()
    loss = student.vocab_parallel_cross_entropy(local, targets, group, vocab)
    sent = comm.stats.bytes_by_op()
    comm.reset()
    loss.backward()
    sent_backward = comm.stats.bytes_by_op()
    with comm.untracked():
        grad = pieces.unshard(comm.all_gather_stacked(local.grad, group), split)
    softmax = torch.softmax(logits, -1) / n
    grad_is = ("softmax" if torch.allclose(grad, softmax, atol=1e-5) else
               "unscaled" if torch.allclose(grad, ref_in.grad * n, atol=1e-5) else "")
    return dict(loss=loss.item(), ref=ref.item(), grad_err=(grad - ref_in.grad).abs().max().item(),
                grad_is=grad_is,
                finite=bool(torch.isfinite(loss)), sent=sent, sent_backward=sent_backward,
                budget=3 * ring_bytes("all_reduce", n * 4, t))


def check(student, report) -> None:
    from minipar.exercises import launch_student
    good = []
    for t, vocab, scale in ((2, 12, 1.0), (4, 10, 1.0), (2, 12, 100.0)):
        where = f"t={t}, vocabulary {vocab}" + (" (padded to a multiple of t)" if vocab % t else "") + \
            (f", logits of size ~{scale:g}" if scale > 1 else "")
        start = report.count
        found = {}
        for rank, res in enumerate(launch_student(_run, t, student, t, vocab, scale)):
            if not res["finite"]:
                found[rank] = ("missing max", f"the loss is not finite (expected "
                               f"{res['ref']:.4f}): a missing max in log-sum-exp. exp of a logit "
                               f"of ~{scale:g} overflows; subtract the max over the WHOLE "
                               f"vocabulary first (local max, then comm.all_reduce(top, group, "
                               f"op=\"max\"))")
            elif abs(res["loss"] - res["ref"]) > 1e-5:
                why = (" Only the padded vocabulary fails? Columns at or past vocab_size are no "
                       "word: mask them to -inf before the max and the exp" if vocab % t else "")
                found[rank] = ("wrong loss", f"the loss is {res['loss']:.6f}, F.cross_entropy "
                               f"gives {res['ref']:.6f}.{why}")
            elif not res["grad_err"] <= 1e-5:
                why = {"softmax": ": it is the softmax without the -1 at the target",
                       "unscaled": ": it is N times too large: multiply by the incoming "
                                   "grad_loss (the mean's 1/N)"}.get(res["grad_is"], "")
                found[rank] = ("wrong gradient", f"the logits' gradients differ from "
                               f"F.cross_entropy's (max error {res['grad_err']:.3g}){why}")
            elif "all_gather" in res["sent"] or sum(res["sent"].values()) > res["budget"]:
                found[rank] = ("bytes", f"forward sent {res['sent']}: more than three "
                               f"all-reduces of one value per token ({res['budget']} bytes); "
                               f"never gather the logits")
            elif res["sent_backward"]:
                found[rank] = ("bytes", f"backward sent {res['sent_backward']}; the gradient "
                               f"softmax - one-hot is local, it needs no communication")
        report.fail_ranks(where, found, t)
        if report.count == start:
            good.append(where)
    if good:
        report.ok(f"{'; '.join(good)}: every rank's loss and logit gradients equal "
                  f"F.cross_entropy's; forward sends at most three all-reduces of one value per "
                  f"token, backward nothing")
