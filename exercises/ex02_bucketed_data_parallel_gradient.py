"""Exercise ex02: Bucketed data parallel gradient averaging

Data parallelism averages every gradient over the ranks before the optimizer step. Doing
one all-reduce per parameter pays the collective's latency dozens of times; DDP packs the
gradients into a few flat buckets instead. Write `make_buckets` (walk the parameters from last
to first, as backward produces them, starting a new `Bucket` whenever adding the next parameter
would exceed `bucket_bytes` or its dtype differs) and `sync_buckets` (one all-reduce per bucket
with `comm.all_reduce`; gloo has no AVG, so sum and then divide by `comm.size(group)`).

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
