"""ex07: ZeRO-2, reduce-scatter each unit's gradient as soon as backward is done with it."""
from .ex06 import check_training

TITLE = "ZeRO-2 gradient reduce-scatter"
MODULE = "minipar.zero"
NAMES = ["reduce_scatter_gradient"]
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
"""


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


def check(student) -> list[str]:
    return check_training(student, "reduce_scatter_gradient",
                          [(["--zero", "2"], _expect(4, 4, 1)),
                           (["--zero", "2", "--microbatches", "2"], _expect(4, 4, 2)),
                           (["--shard", "1,2,4"], _expect(2, 4, 1))])
