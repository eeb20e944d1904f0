"""ex01: a ring all-reduce from point-to-point send and receive."""
import torch

TITLE = "Ring all-reduce from send and recv"
MODULE = "minipar.p2p_order"
NAMES = ["ring_all_reduce"]
INTRO = """
All-reduce sums a tensor over every rank. The bandwidth-optimal way does it on a ring:
cut the tensor into n chunks; in n-1 reduce-scatter steps each rank passes a chunk to its
right neighbour and adds the one arriving from its left, so that each rank ends up owning one
fully summed chunk; in n-1 all-gather steps the finished chunks travel once more around the
ring. Use `comm.isend(tensor, dst)` (returns a handle: call `.wait()`), `comm.recv(tensor, src)` and the
`chunks`, `incoming`, `left`, `right`, `r`, `n` already prepared for you.

The order of each step's send and receive matters. On GPUs (NCCL, RCCL) a send completes only
together with the matching receive, and a rank's sends and receives run in the order it posted
them: if every rank sends first, every rank waits in its send for a neighbour that is also
sending, and nothing moves. gloo buffers sends, so that order would still pass on this CPU. The
checker replays the order your ranks used under NCCL's rule (`minipar.p2p_order`) and fails it
if it could hang: let even ranks send first and odd ranks receive first.
"""


def _run(student, numel):
    from minipar import comm
    from minipar.plan import ring_bytes
    import torch.distributed as dist
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float64) * (r + 1) + r
    expected = sum(torch.arange(numel, dtype=torch.float64) * (k + 1) + k for k in range(n))
    from minipar import p2p_order
    comm.reset()
    with p2p_order.record() as log:
        out = student.ring_all_reduce(x, comm.WORLD)
    return dict(ok=torch.allclose(out, expected) and torch.allclose(x, expected), order=log.events,
                sent=comm.stats.bytes_by_op().get("send", 0), other=sorted(
                    op for op in comm.stats.bytes_by_op() if op not in ("send", "recv")),
                expected_sent=ring_bytes("all_reduce", numel * 8, n))


def check(student) -> list[str]:
    from minipar import p2p_order
    from minipar.exercises import launch_student
    failures = []
    for n in (2, 3, 4):
        numel = 12 * n
        results = launch_student(_run, n, student, numel)
        for mode, problems in p2p_order.check([res["order"] for res in results]).items():
            if problems:
                failures.append(f"on {n} ranks your order of sends and receives would hang on "
                                f"NCCL ({mode} init: a send completes only with its receive, in "
                                f"the order posted): {problems[0]}; let even ranks send first "
                                f"and odd ranks receive first")
                return failures
        for rank, res in enumerate(results):
            if not res["ok"]:
                failures.append(f"on {n} ranks, rank {rank} does not hold the sum of every rank's tensor")
            if res["other"]:
                failures.append(f"on {n} ranks you called {res['other']}: build it from isend/recv only")
            if res["sent"] != res["expected_sent"]:
                failures.append(f"on {n} ranks, rank {rank} sent {res['sent']} bytes; a ring sends "
                                f"2(n-1)/n x N = {res['expected_sent']}")
            if failures:
                return failures
    return failures
