"""ex04: cross-entropy over a vocabulary split across the tensor-parallel ranks."""
import torch
from ..mesh import Mesh

TITLE = "Vocab parallel cross entropy"
MODULE = "minipar.tp"
NAMES = ["VocabParallelCE", "vocab_parallel_cross_entropy"]
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
"""


def _run(student, t, vocab, scale):
    import torch.nn.functional as F
    from minipar import comm, tp
    from minipar.train import pieces
    from minipar.runtime import dist
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
    return dict(loss=loss.item(), ref=ref.item(), grad_err=(grad - ref_in.grad).abs().max().item(),
                finite=bool(torch.isfinite(loss)), sent=sent, sent_backward=sent_backward,
                budget=3 * ring_bytes("all_reduce", n * 4, t))


def check(student) -> list[str]:
    from minipar.exercises import launch_student
    failures = []
    for t, vocab, scale in ((2, 12, 1.0), (4, 10, 1.0), (2, 12, 100.0)):
        where = f"with t={t}, vocabulary {vocab}" + (" (padded to a multiple of t)" if vocab % t else "") + \
            (f", logits of size ~{scale:g}" if scale > 1 else "")
        for rank, res in enumerate(launch_student(_run, t, student, t, vocab, scale)):
            if not res["finite"]:
                failures.append(f"{where}: rank {rank}'s loss is not finite; subtract the max "
                                f"before exp")
            elif abs(res["loss"] - res["ref"]) > 1e-5:
                failures.append(f"{where}: rank {rank}'s loss {res['loss']:.6f} is not "
                                f"F.cross_entropy's {res['ref']:.6f}")
            elif not res["grad_err"] <= 1e-5:
                failures.append(f"{where}: rank {rank}'s logit gradients differ from "
                                f"F.cross_entropy's (max error {res['grad_err']:.3g})")
            if "all_gather" in res["sent"] or sum(res["sent"].values()) > res["budget"]:
                failures.append(f"{where}: forward sent {res['sent']}: that is more than three "
                                f"all-reduces of one value per token ({res['budget']} bytes); "
                                f"never gather the logits")
            if res["sent_backward"]:
                failures.append(f"{where}: backward sent {res['sent_backward']}; the gradient "
                                f"softmax - one-hot is local, it needs no communication")
            if failures:
                return failures
    return failures
