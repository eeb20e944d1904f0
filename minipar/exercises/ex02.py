"""ex02: data-parallel gradient averaging with flat buckets."""
import torch

TITLE = "Bucketed data parallel gradient averaging"
SUMMARY = "gradient buckets and their averaging"
DIFFICULTY = "easy"
MINUTES = 25
NOTEBOOK = "01, section 1 (Buckets)"
MODULE = "minipar.dp"
NAMES = ["make_buckets", "sync_buckets"]
API = ["minipar.dp.Bucket", "minipar.comm.all_reduce", "minipar.comm.size"]
INTRO = """
Data parallelism averages every gradient over the ranks before the optimizer step. Doing
one all-reduce per parameter pays the collective's latency dozens of times; DDP packs the
gradients into a few flat buckets instead. Write `make_buckets` (walk the parameters from last
to first, as backward produces them, starting a new `Bucket` whenever adding the next parameter
would exceed `bucket_bytes` or its dtype differs) and `sync_buckets` (one all-reduce per bucket
with `comm.all_reduce`; gloo has no AVG, so sum and then divide by `comm.size(group)`).

`Bucket(params)` allocates one flat buffer `b.buffer` for its parameters (in the order given)
and `b.attach()` makes every `p.grad` a view into it: an in-place change of `b.buffer` is a
change of every `p.grad` of the bucket. A parameter's size in bytes is
`p.numel() * p.element_size()`.
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
    # reference: each rank's own gradient, and their mean, computed here without communication
    local, mean = [], []
    for k in range(n):
        m = _model()
        m(data[k]).square().mean().backward()
        local.append([p.grad.clone() for p in m.parameters()])
    mean = [sum(g[i] for g in local) / n for i in range(len(local[0]))]
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    buckets = student.make_buckets(params, bucket_bytes)
    covered = [p for b in buckets for p in b.params]
    index = {id(p): i for i, p in enumerate(params)}
    layout = [[names[index[id(p)]] for p in b.params] for b in buckets]
    sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in buckets]
    for b in buckets:
        b.attach()
    model(data[r]).square().mean().backward()
    comm.reset()
    ops, all_reduce = [], comm.all_reduce

    def spy(t, group=None, op="sum", *args, **kwargs):
        ops.append(op)
        return all_reduce(t, group, op, *args, **kwargs)

    comm.all_reduce = spy
    try:
        student.sync_buckets(buckets, comm.WORLD)
    finally:
        comm.all_reduce = all_reduce
    grads = []
    for name, p, want, own in zip(names, params, mean, local[r]):
        got = p.grad
        err = (got - want).abs().max().item() if got is not None else float("inf")
        ratio = (got.norm() / want.norm()).item() if got is not None and want.norm() > 0 else None
        grads.append(dict(name=name, err=err, ratio=ratio,
                          own=got is not None and torch.allclose(got, own, atol=1e-6)))
    calls = sum(c for (op, _), c in comm.stats.calls.items() if op == "all_reduce")
    return dict(layout=layout, names=list(reversed(names)), sizes=sizes,
                missing=[names[i] for i in range(len(params))
                             if id(params[i]) not in {id(p) for p in covered}],
                twice=len(covered) != len({id(p) for p in covered}), grads=grads, calls=calls,
                buckets=len(buckets), n=n, avg="avg" in ops)


def check(student, report) -> None:
    from minipar.exercises import launch_student
    good = []
    for n, bucket_bytes in ((2, 600), (2, 10**6), (3, 600)):
        where = f"{n} ranks, bucket_bytes={bucket_bytes}"
        res = launch_student(_run, n, student, bucket_bytes)[0]
        start = report.count
        if res["missing"] or res["twice"]:
            report.fail(f"{where}: every parameter must be in exactly one bucket "
                        f"(missing: {res['missing'] or 'none'}; "
                        f"{'some twice' if res['twice'] else 'none twice'})")
        flat = [name for b in res["layout"] for name in b]
        if not res["missing"] and flat != res["names"]:
            report.fail(f"{where}: buckets must take the parameters last to first (backward "
                        f"order): expected {res['names'][:3]}..., got {flat[:3]}...")
        for k, (size, names) in enumerate(zip(res["sizes"], res["layout"])):
            if size > bucket_bytes and len(names) > 1:
                report.fail(f"{where}: bucket {k} holds {size} bytes ({names}), more than "
                            f"bucket_bytes; only a single parameter larger than the limit may "
                            f"exceed it", kind="bucket too large")
        if bucket_bytes == 600 and res["buckets"] < 3:
            report.fail(f"{where}: only {res['buckets']} bucket(s); 600 bytes should split this "
                        f"model ({sum(res['sizes']):,} bytes of gradients) into several")
        wrong = [g for g in res["grads"] if not g["err"] <= 1e-6]
        if wrong and all(g["ratio"] is not None and abs(g["ratio"] - n) < 1e-3 for g in wrong):
            report.fail(f"{where}: every gradient is {n}.00x the average over the {n} ranks "
                        f"(e.g. {wrong[0]['name']}): a missing division by the group size. "
                        f"all_reduce sums; divide each bucket's buffer by comm.size(group) "
                        f"(gloo has no AVG)")
        elif wrong and all(g["ratio"] is not None for g in wrong) and \
                max(g["ratio"] for g in wrong) - min(g["ratio"] for g in wrong) < 1e-3 and \
                abs(n / wrong[0]["ratio"] - round(n / wrong[0]["ratio"])) < 1e-3:
            k = round(n / wrong[0]["ratio"])
            report.fail(f"{where}: every gradient is {wrong[0]['ratio']:.2f}x the average: the sum "
                        f"was divided by {k}, not by the group size {n}: divide by "
                        f"comm.size(group)")
        elif wrong and all(g["own"] for g in wrong):
            report.fail(f"{where}: the gradients of {[g['name'] for g in wrong]} are still this "
                        f"rank's own, not the average: their bucket was never all-reduced, or "
                        f"the result was not written back into its buffer (in place)")
        else:
            for g in wrong:
                ratio = f", {g['ratio']:.2f}x its norm" if g["ratio"] is not None else ""
                report.fail(f"{where}: the gradient of {g['name']} is not the average over the "
                            f"ranks (max error {g['err']:.3g}{ratio})", kind="wrong gradient")
        if res["avg"]:
            report.fail(f"{where}: you called comm.all_reduce(..., op=\"avg\"). gloo has no AVG "
                        f"(minipar.comm emulates it: a sum, then a division); write the two steps "
                        f"yourself: all-reduce with op=\"sum\", then divide the buffer by "
                        f"comm.size(group)", kind="avg")
        if res["calls"] != res["buckets"]:
            report.fail(f"{where}: {res['calls']} all-reduces for {res['buckets']} buckets; use "
                        f"exactly one per bucket")
        if report.count == start:
            good.append(where)
    if good:
        report.ok(f"with {'; '.join(good)}: every parameter in one bucket, last to first, none "
                  f"over the limit; one all-reduce per bucket; every gradient equals the "
                  f"average of the ranks' gradients")
