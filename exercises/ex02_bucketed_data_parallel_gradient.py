"""Exercise ex02: Bucketed data parallel gradient averaging

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

What you may call, each written as this file calls it (signatures from the package):

    Bucket(params: list[nn.Parameter])
        A flat gradient buffer; each parameter's ``.grad`` is a view into it.
    comm.all_reduce(t: Tensor, group=None, op: str = 'sum', async_op: bool = False)
        In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N.
    comm.size(group) -> int
        Ranks in ``group``; 1 for ``None``/``SOLO`` (a group of one) or without a process
        group.

Fill in every block marked `# TODO ex02`, then run:

    python -m minipar.exercises check ex02

Generated from minipar.dp by `python -m minipar.exercises make ex02`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.dp import *  # noqa: F401,F403  everything else, as the package has it


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group parameters into buckets in reverse order, roughly the order backward finishes them."""
    # TODO ex02: write this part
    # walk the parameters last to first, closing a bucket when the next one would overflow it
    raise NotImplementedError("ex02: this part is yours to write")
    return buckets


def sync_buckets(buckets: list[Bucket], group) -> None:
    """Average every bucket's flat gradient buffer over ``group``: one all-reduce per bucket.

    Because each ``param.grad`` is a view into its bucket, the parameters see the averaged
    gradients without any copy back.
    """
    # TODO ex02: write this part
    # one all-reduce per bucket (sum), then divide by the group size: the average
    raise NotImplementedError("ex02: this part is yours to write")
