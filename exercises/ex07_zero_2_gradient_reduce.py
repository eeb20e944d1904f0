"""Exercise ex07: ZeRO-2 gradient reduce-scatter

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

What you may call, each written as this file calls it (signatures from the package):

    reduce_scatter_down(x: Tensor, groups) -> Tensor
        Reduce-scatter (sum) ``x`` over each group in turn: this rank's summed chunk.
    Unit.flat_grad(self) -> Tensor
        The unit's gradients, one padded flat tensor in ``reduce_dtype`` (zeros if none).

Fill in every block marked `# TODO ex07`, then run:

    python -m minipar.exercises check ex07

Generated from minipar.zero by `python -m minipar.exercises make ex07`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.zero import *  # noqa: F401,F403  everything else, as the package has it


def reduce_scatter_gradient(u: Unit, mesh: ShardMesh) -> None:
    """Add the unit's full gradient, summed over the G group (p then g), into this rank's G
    shard; drop the full gradient: between steps only the shard is held."""
    # TODO ex07: write this part
    # flatten the unit's grads (u.flat_grad()), reduce-scatter over p_group then g_group,
    # add the result into u.grad_shard, and drop every p.grad of the unit
    raise NotImplementedError("ex07: this part is yours to write")
