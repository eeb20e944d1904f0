"""ex07: ZeRO-2, reduce-scatter each unit's gradient as soon as backward is done with it."""
from .training import _close, check_training

TITLE = "ZeRO-2 gradient reduce-scatter"
SUMMARY = "ZeRO-2's gradient reduce-scatter, micro-batch by micro-batch"
DIFFICULTY = "medium"
MINUTES = 35
NOTEBOOK = "04, section 3 (ZeRO-1, 2 and 3, step by step)"
MODULE = "minipar.zero"
NAMES = ["reduce_scatter_gradient"]
API = ["minipar.zero.reduce_scatter_down", "minipar.zero.Unit.flat_grad"]
INTRO = """
ZeRO-2 also shards the gradient: a rank keeps only the slice of each gradient whose Adam
state it owns. The engine calls `reduce_scatter_gradient(u, mesh)` as soon as backward has
produced every gradient of a unit u (a block, the embedding or the head), once per
micro-batch. Flatten the unit's gradients into one padded buffer (`u.flat_grad()`),
reduce-scatter it (sum) over `mesh.p_group` and then `mesh.g_group` (`reduce_scatter_down`
does it group by group: together they are the G group), add the resulting shard into
`u.grad_shard` (micro-batches accumulate there), and drop the full gradients (`p.grad = None`
for every parameter of the unit) so that between steps only the shard is held. The checker
trains the nano model with `--zero 2` (also with 2 micro-batches) and `--shard 1,2,4` on 4
ranks and compares with one process, bytes sent and gradient memory.

Add into `u.grad_shard` in place (`add_`): with m micro-batches the engine calls you m times
per step, and the shard must end as the sum of all m. `u.grad_shard = shard` (or `copy_`)
keeps only the last micro-batch; a rebound `u.grad_shard` also leaves `u.os_grad`, a view of
the old buffer, behind. Sum only: the step (ex06) divides by d once, for all micro-batches.
"""


def step_counter(real_step, findings: list):
    """The package's optimizer step, noting when each step ends (micro-batches count from 1)."""
    def call(units, optimizer, mesh):
        for u in units:
            u._calls_this_step = 0
        return real_step(units, optimizer, mesh)
    return call


def spy_reduce_scatter(student_fn, findings: list):
    """The student's ``reduce_scatter_gradient`` with what it did to the unit compared."""
    from minipar import comm

    def call(u, mesh):
        mb = getattr(u, "_calls_this_step", 0) + 1
        u._calls_this_step = mb
        before_obj, before = u.grad_shard, u.grad_shard.clone()
        full = u.flat_grad()
        with comm.untracked():
            total = full.clone()
            for group in (mesh.p_group, mesh.g_group):
                comm.all_reduce(total, group)
                total = total.view(comm.size(group), -1)[comm.rank(group)]
            own = full
            for group in (mesh.p_group, mesh.g_group):
                own = own.view(comm.size(group), -1)[comm.rank(group)]
        student_fn(u, mesh)
        if len(findings) > 4:
            return
        name = f"micro-batch {mb}, {type(u.module).__name__} unit, this rank's G shard"
        got = u.grad_shard
        if got is not before_obj:
            findings.append(("rebound buffer", f"{name}: u.grad_shard was rebound to a new tensor "
                             f"(a rebound buffer instead of an in-place write): u.os_grad, the "
                             f"gradient Adam reads, is a view of the old one. Add into it: "
                             f"u.grad_shard.add_(shard)"))
        elif _close(got, before + total):
            pass
        elif mb > 1 and _close(got, total):
            findings.append(("not accumulated", f"{name}: holds micro-batch {mb}'s gradient "
                             f"only; micro-batch {mb - 1}'s is gone. Gradients are not "
                             f"accumulated over micro-batches: add into u.grad_shard (add_), "
                             f"do not copy over it"))
        elif _close(got, before + total / mesh.d) or _close(got, before + total / comm.size(mesh.g_group)):
            findings.append(("divided here", f"{name}: the sum was divided here; ZeRO-2 only "
                             f"sums (the optimizer step divides by d, once for all "
                             f"micro-batches)"))
        elif _close(got, before + own):
            findings.append(("not reduced", f"{name}: holds this rank's own gradient slice, "
                             f"not the sum over the G group: reduce-scatter u.flat_grad() over "
                             f"mesh.p_group, then mesh.g_group (reduce_scatter_down)"))
        else:
            findings.append(("wrong shard", f"{name}: u.grad_shard is not what it held before "
                             f"plus this micro-batch's gradient summed over the G group"))
        kept = [i for i, p in enumerate(u.params) if p.grad is not None]
        if kept:
            findings.append(("full gradients kept", f"{name}: {len(kept)} of the unit's "
                             f"{len(u.params)} parameters still hold a full .grad after your "
                             f"call: set p.grad = None for every parameter of the unit, so "
                             f"that between steps only the shard is held"))
    return call


def _expect(s_g, s_os, m):
    def expect(where, record, psi, units):
        sent, state, failures = record["comm_bytes"], record["model_state_bytes"], []
        want = m * (s_g - 1) * psi // s_g + (s_os - s_g) * (psi // s_g) // s_os
        if sent.get("reduce_scatter", 0) != want:
            failures.append(f"{where}: sent {sent.get('reduce_scatter', 0):,} bytes in "
                            f"reduce_scatter; expected {want:,}: one reduce-scatter of each "
                            f"unit's gradient per micro-batch")
        if "all_reduce" in sent:
            failures.append(f"{where}: an all_reduce was sent; ZeRO-2 reduce-scatters instead")
        if state["grads"] != psi // s_g:
            failures.append(f"{where}: a rank holds {state['grads']:,} bytes of gradients "
                            f"between steps; only its shard ({psi // s_g:,}) should remain: "
                            f"drop the full gradients")
        return failures
    return expect


def check(student, report) -> None:
    check_training(student, report, "reduce_scatter_gradient", [
        (["--zero", "2"], _expect(4, 4, 1), "6 steps on 4 ranks give one process's losses and "
         "weights; each unit's G shard is the sum over the G group, the full gradients are "
         "dropped, one reduce-scatter per unit"),
        (["--zero", "2", "--microbatches", "2"], _expect(4, 4, 2), "with 2 micro-batches the "
         "shards accumulate both"),
        (["--shard", "1,2,4"], _expect(2, 4, 1), "with gradients sharded over pairs of ranks")],
        hint_wrong_weights="the G shard must be the sum over the G group of every micro-batch's "
                           "gradient (add, do not divide)", spy=spy_reduce_scatter, wrap_step=step_counter)
