"""ex02: data-parallel gradient averaging with flat buckets."""
import torch

TITLE = "Bucketed data parallel gradient averaging"
MODULE = "minipar.dp"
NAMES = ["make_buckets", "sync_buckets"]
INTRO = """
Data parallelism averages every gradient over the ranks before the optimizer step. Doing
one all-reduce per parameter pays the collective's latency dozens of times; DDP packs the
gradients into a few flat buckets instead. Write `make_buckets` (walk the parameters from last
to first, as backward produces them, starting a new `Bucket` whenever adding the next parameter
would exceed `bucket_bytes` or its dtype differs) and `sync_buckets` (one all-reduce per bucket
with `comm.all_reduce`; gloo has no AVG, so sum and then divide by `comm.size(group)`).
"""


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _run(student, bucket_bytes):
    import torch.distributed as dist
    from minipar import comm
    r, n = dist.get_rank(), dist.get_world_size()
    data = [torch.randn(6, 8, generator=torch.Generator().manual_seed(k)) for k in range(n)]
    # reference: the mean over ranks of each rank's gradient, computed here without communication
    ref = _model()
    for k in range(n):
        (ref(data[k]).square().mean() / n).backward()
    model = _model()
    params = list(model.parameters())
    buckets = student.make_buckets(params, bucket_bytes)
    covered = [p for b in buckets for p in b.params]
    layout_ok = sorted(map(id, covered)) == sorted(map(id, params)) and len(covered) == len(params)
    order_ok = covered == list(reversed(params))
    sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in buckets]
    size_ok = all(s <= bucket_bytes or len(b.params) == 1 for s, b in zip(sizes, buckets))
    for b in buckets:
        b.attach()
    model(data[r]).square().mean().backward()
    comm.reset()
    student.sync_buckets(buckets, comm.WORLD)
    grads_ok = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(params, ref.parameters()))
    calls = sum(c for (op, _), c in comm.stats.calls.items() if op == "all_reduce")
    return dict(layout_ok=layout_ok, order_ok=order_ok, size_ok=size_ok, grads_ok=grads_ok,
                calls=calls, buckets=len(buckets))


def check(student) -> list[str]:
    from minipar.exercises import launch_student
    failures = []
    for bucket_bytes in (600, 10**6):
        res = launch_student(_run, 2, student, bucket_bytes)[0]
        where = f"with bucket_bytes={bucket_bytes}"
        if not res["layout_ok"]:
            failures.append(f"{where}: every parameter must be in exactly one bucket")
        if not res["order_ok"]:
            failures.append(f"{where}: buckets must take parameters last to first (backward order)")
        if not res["size_ok"]:
            failures.append(f"{where}: a bucket holds more than bucket_bytes (only a single "
                            f"parameter larger than the limit may exceed it)")
        if not res["grads_ok"]:
            failures.append(f"{where}: gradients are not the average over ranks")
        if res["calls"] != res["buckets"]:
            failures.append(f"{where}: {res['calls']} all-reduces for {res['buckets']} buckets; "
                            f"use exactly one per bucket")
        if bucket_bytes == 600 and res["buckets"] < 3:
            failures.append(f"{where}: only {res['buckets']} bucket(s); the limit should split "
                            f"this model into several")
        if failures:
            return failures
    return failures
