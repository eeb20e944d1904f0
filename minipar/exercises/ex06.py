"""ex06: ZeRO-1, the sharded optimizer step, over AMSP's shard mesh."""
import torch

from .training import _close, _unit_name, check_training

TITLE = "ZeRO-1 sharded optimizer step"
SUMMARY = "ZeRO-1's sharded optimizer step over the (rep, os, g, p) shard mesh"
DIFFICULTY = "hard"
MINUTES = 50
NOTEBOOK = "04, section 3 (ZeRO-1, 2 and 3, step by step), after ex06a"
MODULE = "minipar.zero"
NAMES = ["sharded_optimizer_step"]
API = ["minipar.zero.reduce_scatter_down", "minipar.zero.all_gather_in_place",
       "minipar.comm.all_reduce"]
INTRO = """
ZeRO-1 keeps the whole model and its whole gradient on every rank but only 1/d of Adam's
state: each rank owns one slice of every flat parameter buffer (do ex06a first: the same step
on one buffer and one group). At the step, each unit's gradient buffer `u.grad_shard` (with
ZeRO-1 the whole local gradient) is reduce-scattered over `mesh.os_group`, so each rank
receives the sum of its slice only (`reduce_scatter_down`); the replicas in `mesh.rep_group`
(ranks owning the same slice in other groups, if any) all-reduce it; divide by `mesh.d` (gloo
has no AVG) and copy it into `u.os_grad`, the gradient the optimizer sees. `optimizer.step()`
then updates every `u.os_param` in place. Finally every rank needs the whole updated model
again: all-gather the slices over `mesh.os_group` into `u.g_slice`, then over `mesh.g_group`
into `u.p_shard` (`all_gather_in_place` fetches the other ranks' chunks around your own).
The checker trains the nano model with `--zero 1` and `--shard 1,1,2` on 4 ranks and
compares with one process, bytes sent and memory.

Copy into `u.os_grad`, don't rebind it: `u.os_grad` is a view of `u.grad_shard`, and the
optimizer's parameter `u.os_param` has `.grad` = that same view. `u.os_grad.copy_(x)` writes
where Adam reads; `u.os_grad = x` only points the attribute at a new tensor Adam never sees.

A unit `u` (the embedding, each block, the head) keeps its parameters in one flat buffer of
N elements (padded to a multiple of s_os). Its buffers, nested chunks of each other:

    u.p_shard     (N/s_p)   this rank's P shard (s_p = 1: the whole flat parameter buffer)
    u.grad_shard  (N/s_g)   its G shard of the gradient (s_g = 1: the whole local gradient)
    u.g_slice     (N/s_g)   the part of p_shard that matches grad_shard
    u.os_param    (N/s_os)  the part of g_slice whose Adam state this rank keeps
    u.os_grad     (N/s_os)  the matching part of grad_shard: the gradient Adam reads
"""


def NOTES() -> str:
    """The shard mesh of the checker's runs, made by the package's own ``ShardMesh``."""
    lines = ["The d = 4 data-parallel ranks as the mesh (rep, os, g, p), one process group per",
             "axis (`mesh.rep_group`, `mesh.os_group`, ...), for the checks' shard specs:", ""]
    for flag, spec in (("--zero 1", (1, 1, 4)), ("--shard 1,1,2", (1, 1, 2))):
        lines += [f"    {flag}: (s_p, s_g, s_os) = {spec}"] + ["    " + ln for ln in mesh_table(4, spec)]
        lines.append("")
    return "\n".join(lines).rstrip()


def mesh_table(d: int, spec) -> list[str]:
    """Each group of the shard mesh and, per rank, which chunk of a unit's N it updates."""
    from minipar.mesh import Axis
    from minipar.zero import ShardMesh, Spec
    meshes = [ShardMesh(Axis("dp", None, d, r, torch.arange(d).view(1, -1), lambda lists, name: lists),
                        Spec(*spec)) for r in range(d)]
    m = meshes[0]
    big = [name for name in ("os", "rep", "g", "p") if len(getattr(m, name + "_group")[0]) > 1]
    small = [name for name in ("os", "rep", "g", "p") if name not in big]
    out = [f"  {name}_group: {getattr(m, name + '_group')}" for name in big]
    if small:
        out.append(f"  {', '.join(n + '_group' for n in small)}: one rank each (nothing to send)")
    n = spec[2]
    at = lambda k: "0" if k == 0 else "N" if k == n else f"{'' if k == 1 else k}N/{n}"   # noqa: E731
    for r, mr in enumerate(meshes):
        out.append(f"  rank {r}: u.os_param = elements [{at(mr.os_index)}, {at(mr.os_index + 1)}) "
                   f"of the unit's N")
    return out


# --------------------------------------------------------------------------------------
# The spies: what the student's function did, call by call, on each rank
# --------------------------------------------------------------------------------------
def spy_optimizer_step(student_fn, findings: list):
    """The student's ``sharded_optimizer_step`` with its effects compared, unit by unit."""
    from minipar import comm
    step = [0]

    def call(units, optimizer, mesh):
        step[0] += 1
        with comm.untracked():
            before, want, only_os = [], [], []
            for u in units:
                total = u.grad_shard.clone()
                comm.all_reduce(total, mesh.os_group)
                partial = total.clone()
                comm.all_reduce(total, mesh.rep_group)
                want.append(total[u.os_slice] / mesh.d)
                only_os.append(partial[u.os_slice] / mesh.d)
                before.append((u.os_grad, u.grad_shard[u.os_slice].clone()))
        student_fn(units, optimizer, mesh)
        if len(findings) > 4:
            return
        where = f"step {step[0]}"
        with comm.untracked():
            for u, (os_grad, local), w, o in zip(units, before, want, only_os):
                name = f"{where}, {_unit_name(units, u)}, this rank's OS shard"
                seen = u.os_param.grad               # what Adam read
                if u.os_grad is not os_grad:
                    findings.append(("rebound buffer", f"{name}: u.os_grad was rebound to a new "
                                     f"tensor (a rebound buffer instead of an in-place write); "
                                     f"Adam reads the old one, which still holds this rank's "
                                     f"unreduced gradient. Copy into it: u.os_grad.copy_(...)"))
                elif _close(seen, w):
                    pass
                elif _close(seen, w * mesh.d):
                    findings.append(("missing division", f"{name}: the gradient Adam read is "
                                     f"{mesh.d}x the average: a missing division by the group "
                                     f"size. Divide the sum by mesh.d = {mesh.d} (every rank of "
                                     f"the data-parallel group)"))
                elif _close(seen, local + w) or _close(seen, (local + w * mesh.d) / mesh.d):
                    findings.append(("accumulated", f"{name}: the gradient Adam read is the "
                                     f"average plus what u.os_grad held before your step (this "
                                     f"rank's own unreduced gradient): a stale shard. u.os_grad "
                                     f"is a view of u.grad_shard, which still holds it: write it "
                                     f"with `copy_`, do not accumulate (add_, +=)"))
                elif _close(seen, o) and comm.size(mesh.rep_group) > 1:
                    findings.append(("replicas not summed", f"{name}: the gradient Adam read "
                                     f"sums the os group only; the {comm.size(mesh.rep_group)} "
                                     f"replicas in mesh.rep_group hold the same slice for other "
                                     f"ranks' data: all-reduce it over mesh.rep_group too"))
                elif _close(seen, local) or _close(seen, local / mesh.d):
                    findings.append(("not reduced", f"{name}: the gradient Adam read is this "
                                     f"rank's own, not summed over the ranks: reduce-scatter "
                                     f"u.grad_shard over mesh.os_group"))
                else:
                    err = (seen - w).abs().max().item() if seen is not None and seen.shape == w.shape else "shape"
                    findings.append(("wrong gradient", f"{name}: the gradient Adam read is not "
                                     f"the average over the d ranks (max error {err})"))
                mine = u.p_shard.clone()
                everyone = comm.all_gather_stacked(mine, mesh.os_group)
                if comm.size(mesh.os_group) > 1 and not all(torch.equal(x, mine) for x in everyone):
                    findings.append(("missing all-gather", f"{where}, {_unit_name(units, u)}: "
                                     f"after the step the ranks of mesh.os_group hold different "
                                     f"parameters: each updated only its own slice. All-gather "
                                     f"the slices: u.g_slice over mesh.os_group, then u.p_shard "
                                     f"over mesh.g_group"))
    return call


def _expect(d_os, replicas):
    def expect(where, record, psi, units):
        sent, state, failures = record["comm_bytes"], record["model_state_bytes"], []
        want = {"reduce_scatter": (d_os - 1) * psi // d_os, "all_gather": (d_os - 1) * psi // d_os}
        if replicas > 1:
            want["all_reduce"] = 2 * (replicas - 1) * (psi // d_os) // replicas
        for op, b in want.items():
            if sent.get(op, 0) != b:
                what = "the updated parameter slices" if op == "all_gather" else "the gradients"
                failures.append(f"{where}: sent {sent.get(op, 0):,} bytes in {op}; ZeRO-1 sends "
                                f"{b:,} per step (one {op} of {what})")
        extra = sorted(set(sent) - set(want))
        if extra:
            failures.append(f"{where}: unexpected collectives {extra}")
        if state["optimizer"] != 2 * psi // d_os + 4 * units:
            failures.append(f"{where}: Adam holds {state['optimizer']:,} bytes; a rank should "
                            f"keep state for its slice only ({2 * psi // d_os + 4 * units:,})")
        return failures
    return expect


def check(student, report) -> None:
    check_training(student, report, "sharded_optimizer_step", [
        (["--zero", "1"], _expect(4, 1), "6 steps on 4 ranks give one process's losses and "
         "weights; at every step Adam read the average gradient of its OS shard and every rank "
         "holds the whole updated model; one reduce-scatter and one all-gather per step, Adam "
         "state for 1/4 of the model"),
        (["--shard", "1,1,2"], _expect(2, 2), "the same with optimizer states sharded over pairs "
         "of ranks and the two replicas all-reduced")],
        hint_wrong_weights="check the average (sum, then divide by d) and that every rank gets "
                           "every updated slice", spy=spy_optimizer_step)
