"""Exercise ex06: ZeRO-1 sharded optimizer step

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

What you may call, each written as this file calls it (signatures from the package):

    reduce_scatter_down(x: Tensor, groups) -> Tensor
        Reduce-scatter (sum) ``x`` over each group in turn: this rank's summed chunk.
    all_gather_in_place(out: Tensor, group) -> None
        Every rank's own chunk of ``out`` is in place: fetch the others'.
    comm.all_reduce(t: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N.

The d = 4 data-parallel ranks as the mesh (rep, os, g, p), one process group per
axis (`mesh.rep_group`, `mesh.os_group`, ...), for the checks' shard specs:

    --zero 1: (s_p, s_g, s_os) = (1, 1, 4)
      os_group: [[0, 1, 2, 3]]
      rep_group, g_group, p_group: one rank each (nothing to send)
      rank 0: u.os_param = elements [0, N/4) of the unit's N
      rank 1: u.os_param = elements [N/4, 2N/4) of the unit's N
      rank 2: u.os_param = elements [2N/4, 3N/4) of the unit's N
      rank 3: u.os_param = elements [3N/4, N) of the unit's N

    --shard 1,1,2: (s_p, s_g, s_os) = (1, 1, 2)
      os_group: [[0, 1], [2, 3]]
      rep_group: [[0, 2], [1, 3]]
      g_group, p_group: one rank each (nothing to send)
      rank 0: u.os_param = elements [0, N/2) of the unit's N
      rank 1: u.os_param = elements [N/2, N) of the unit's N
      rank 2: u.os_param = elements [0, N/2) of the unit's N
      rank 3: u.os_param = elements [N/2, N) of the unit's N

Fill in every block marked `# TODO ex06`, then run:

    python -m minipar.exercises check ex06

Generated from minipar.zero by `python -m minipar.exercises make ex06`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.zero import *  # noqa: F401,F403  everything else, as the package has it


def sharded_optimizer_step(units: list[Unit], optimizer, mesh: ShardMesh):
    """Reduce each G shard down to this rank's OS shard, run Adam on it, gather the updates
    (ZeRO-1: the G shard is the whole local gradient, reduce-scattered over ``os_group``)."""
    # TODO ex06: write this part
    # per unit: reduce-scatter grad_shard over os_group, all-reduce over rep_group, /d, copy INTO u.os_grad
    # (Adam reads that memory: `u.os_grad = x` only rebinds); optimizer.step(); all-gather up (os, then g)
    raise NotImplementedError("ex06: this part is yours to write")
