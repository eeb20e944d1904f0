"""ex04: cross-entropy over a vocabulary split across the tensor-parallel ranks."""
import torch
from ..mesh import Mesh

TITLE = "Vocab parallel cross entropy"
SUMMARY = "cross-entropy over a vocabulary split across ranks"
DIFFICULTY = "medium"
MINUTES = 40
NOTEBOOK = "02, section 6 (Vocab-parallel cross-entropy, by hand)"
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
keeps tensors, `ctx.saved_tensors` gives them back. Notebook 02, section 6, works the three
all-reduces out by hand on two shards of one logits matrix.
"""


TARGET_BUG = ("targets are global ids: subtract start, and only the owner contributes (the "
              "rank whose columns hold the target adds its logit; the others add 0)")


def _local_max_loss(logits, targets, t, vocab):
    """Per-token losses if each rank shifts by its own max, never all-reduced: the sum of exp
    then mixes t different shifts."""
    from minipar import tp
    n_local = tp.padded_size(vocab, t) // t
    z = torch.full((logits.shape[0], n_local * t), float("-inf"))
    z[:, :vocab] = logits
    z = z.view(-1, t, n_local)
    m = z.max(dim=-1).values                                    # (N, t): one max per rank
    log_sum = (z - m[..., None]).exp().sum(dim=(1, 2)).log()
    rows = torch.arange(len(targets))
    return log_sum - (logits[rows, targets] - m[rows, targets // n_local])


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
        # The target term alone: move every target to another rank's columns. Whatever the
        # log-sum-exp, the per-token loss must change by exactly z_old - z_new.
        moved = (targets + local.shape[-1]) % vocab
        with torch.no_grad():
            per_token = student.VocabParallelCE.apply(local.detach(), targets, group, vocab)
            per_moved = student.VocabParallelCE.apply(local.detach(), moved, group, vocab)
    rows = torch.arange(n)
    target_err = ((per_moved - per_token) - (logits[rows, targets] - logits[rows, moved])).abs().max()
    softmax = torch.softmax(logits, -1) / n
    grad_is = ("softmax" if torch.allclose(grad, softmax, atol=1e-5) else
               "unscaled" if torch.allclose(grad, ref_in.grad * n, atol=1e-5) else "")
    return dict(loss=loss.item(), ref=ref.item(), grad_err=(grad - ref_in.grad).abs().max().item(),
                grad_is=grad_is, finite=bool(torch.isfinite(loss)),
                local_max=bool(torch.allclose(per_token, _local_max_loss(logits, targets, t, vocab),
                                              atol=1e-5)) and t > 1,
                target_wrong=not float(target_err) <= 1e-4,
                sent=sent, sent_backward=sent_backward,
                budget=3 * ring_bytes("all_reduce", n * 4, t))


CASES = ((2, 12, 1.0), (4, 10, 1.0), (2, 12, 100.0))    # the second one padded: 10 -> 12


def _diagnose(res, scale) -> tuple[str, str] | None:
    """(kind, message) for one rank's result; None if right."""
    if res["local_max"] and not abs(res["loss"] - res["ref"]) <= 1e-5:
        return ("local max", f"the loss is {res['loss']:.6f}, F.cross_entropy gives "
                f"{res['ref']:.6f}: each rank shifted by its own max. All-reduce the max with "
                f"op='max' (comm.all_reduce(top, group, op=\"max\")), so every rank subtracts "
                f"the same m_i")
    if not res["finite"] and scale > 1:     # finite with small logits, not with large ones
        return ("missing max", f"the loss is not finite (expected {res['ref']:.4f}) with "
                f"logits of size ~{scale:g}, though it is finite with small ones: a missing max "
                f"in log-sum-exp. exp of a logit of ~{scale:g} overflows; subtract the max over "
                f"the WHOLE vocabulary first (local max, then comm.all_reduce(top, group, "
                f"op=\"max\"))")
    if res["target_wrong"]:
        inf = "" if res["finite"] else (" (the loss is not finite: a padding column's -inf was "
                                        "taken as a target logit)")
        return ("target", f"the target's logit is wrong{inf}: moving each target to another "
                f"rank's columns changes the loss by the wrong amount. {TARGET_BUG}")
    if not res["finite"]:
        return ("not finite", f"the loss is not finite (expected {res['ref']:.4f}) with logits "
                f"of size ~{scale:g}, where exp cannot overflow: a -inf or nan reached the sum "
                f"of exp (a padding column kept at -inf after the max?)")
    if abs(res["loss"] - res["ref"]) > 1e-5:
        return ("wrong loss", f"the loss is {res['loss']:.6f}, F.cross_entropy gives "
                f"{res['ref']:.6f}")
    if not res["grad_err"] <= 1e-5:
        why = {"softmax": ": it is the softmax without the -1 at the target",
               "unscaled": ": it is N times too large: multiply by the incoming "
                           "grad_loss (the mean's 1/N)"}.get(res["grad_is"], "")
        return ("wrong gradient", f"the logits' gradients differ from F.cross_entropy's (max "
                f"error {res['grad_err']:.3g}){why}")
    if "all_gather" in res["sent"] or sum(res["sent"].values()) > res["budget"]:
        return ("bytes", f"forward sent {res['sent']}: more than three all-reduces of one value "
                f"per token ({res['budget']} bytes); never gather the logits")
    if res["sent_backward"]:
        return ("bytes", f"backward sent {res['sent_backward']}; the gradient softmax - "
                f"one-hot is local, it needs no communication")
    return None


def check(student, report) -> None:
    from minipar.exercises import launch_student
    from minipar.runtime.dist import RankFailed
    good, wrong_loss = [], {}
    for t, vocab, scale in CASES:
        where = f"t={t}, vocabulary {vocab}" + (" (padded to a multiple of t)" if vocab % t else "") + \
            (f", logits of size ~{scale:g}" if scale > 1 else "")
        start = report.count
        try:
            results = launch_student(_run, t, student, t, vocab, scale)
        except RankFailed as e:
            if "IndexError" not in str(e) and "out of bounds" not in str(e):
                raise
            report.fail(f"{where}: a rank indexed past its own columns ("
                        f"{next(ln.strip() for ln in str(e).splitlines() if 'IndexError' in ln or 'out of bounds' in ln)}"
                        f"): "
                        f"{TARGET_BUG}")
            continue
        found = {rank: d for rank, res in enumerate(results) if (d := _diagnose(res, scale))}
        if any(kind == "wrong loss" for kind, _ in found.values()):
            wrong_loss[where] = vocab % t != 0
        report.fail_ranks(where, found, t)
        if report.count == start:
            good.append(where)
    if wrong_loss and all(wrong_loss.values()) and len(good) == len(CASES) - len(wrong_loss):
        report.fail("only the padded vocabulary fails: columns at or past vocab_size are no word; "
                    "mask them to -inf before the max and the exp")
    if good:
        report.ok(f"{'; '.join(good)}: every rank's loss and logit gradients equal "
                  f"F.cross_entropy's; forward sends at most three all-reduces of one value per "
                  f"token, backward nothing")
