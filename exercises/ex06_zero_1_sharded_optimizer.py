"""Exercise ex06: ZeRO-1 sharded optimizer step

ZeRO-1 keeps the whole model and its whole gradient on every rank but only 1/d of Adam's
state: each rank owns one slice of every flat parameter buffer. At the step, each unit's
gradient buffer `u.grad_shard` (with ZeRO-1 the whole local gradient) is reduce-scattered over
`mesh.os_group`, so each rank receives the sum of its slice only (`reduce_scatter_down`); the
replicas in `mesh.rep_group` (ranks owning the same slice in other groups, if any) all-reduce
it; divide by `mesh.d` (gloo has no AVG) and put it in `u.os_grad`, the gradient the optimizer
sees. `optimizer.step()` then updates every `u.os_param` in place. Finally every rank needs
the whole updated model again: all-gather the slices over `mesh.os_group` into `u.g_slice`,
then over `mesh.g_group` into `u.p_shard` (`all_gather_in_place` fetches the other ranks'
chunks around your own). The checker trains the nano model with `--zero 1` and
`--shard 1,1,2` on 4 ranks and compares with one process, bytes sent and memory.

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
    # per unit: reduce-scatter grad_shard over os_group, all-reduce over rep_group, /d into os_grad;
    # then optimizer.step(); then all-gather each unit's slices back up (os_group, then g_group)
    raise NotImplementedError("ex06: this part is yours to write")
