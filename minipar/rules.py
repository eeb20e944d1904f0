"""What a layout must obey, each rule written once: the trainer checks them before any process
starts (``minipar.train.config``), the planner before it prices a layout (``minipar.plan``),
and ZeRO's engine when a plain loop builds one. Torch-free.

Each ``*_violation`` returns None, or one line: what is wrong and what would fix it (the
trainer and the planner's commands print it and exit 2).

ZeRO as AMSP's shard spec (s_p, s_g, s_os) over d data-parallel ranks (Rajbhandari et al.
2020; Chen et al. 2023)::

    ZeRO-0 = (1, 1, 1)    ZeRO-1 = (1, 1, d)    ZeRO-2 = (1, d, d)    ZeRO-3 = (d, d, d)

A spec is legal when 1 <= s_p | s_g | s_os | d: the shards nest (an optimizer shard lies inside
a gradient shard, inside a parameter shard), and, when the devices per node are known, each
group is contiguous (it fills a node before it spans nodes). AMSP's own search adds s_g in
{s_p, s_os} (``amsp=True``).
"""
from __future__ import annotations

from .runtime.errors import PlanError

Shard = tuple[int, int, int]


def divisors(n: int) -> list[int]:
    """Every k in 1..n that divides n, ascending; trial division up to sqrt(n), so a search
    over a trillion devices lists them in a fraction of a second ([] for n < 1)."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


# --------------------------------------------------------------------------------------
# ZeRO / AMSP shard specs
# --------------------------------------------------------------------------------------
def zero_shard(stage: int, dp: int) -> Shard:
    """ZeRO stage 0-3 over ``dp`` ranks as (s_p, s_g, s_os)."""
    specs = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}
    if stage not in specs:
        raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}; "
                        f"use --shard P,G,OS for other layouts")
    return specs[stage]


def parse_shard(text: str) -> Shard:
    """'1,2,4' -> (1, 2, 4)."""
    try:
        parts = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3:
        raise PlanError(f"--shard wants three integers P,G,OS such as 1,8,8; got {text!r}")
    return parts  # type: ignore[return-value]


def contiguous(size: int, per_node: int) -> bool:
    """A group of ``size`` ranks fills a node (``per_node`` ranks) before spanning nodes."""
    return per_node % size == 0 if size <= per_node else size % per_node == 0


def shard_violation(shard: Shard, dp: int, per_node: int | None = None,
                    amsp: bool = False) -> str | None:
    """Why ``shard`` cannot shard ``dp`` ranks (None if it can)."""
    s_p, s_g, s_os = shard
    if not 1 <= s_p <= s_g <= s_os <= dp:
        return (f"shard {s_p},{s_g},{s_os} breaks 1 <= s_p <= s_g <= s_os <= dp={dp}; "
                f"order the factors and keep them at most the data-parallel size")
    bad = [s for s in shard if dp % s]
    if bad:
        return (f"shard factor {bad[0]} does not divide dp={dp}; use divisors of {dp} "
                f"({', '.join(map(str, divisors(dp)))})")
    if s_g % s_p or s_os % s_g:
        return (f"shard {s_p},{s_g},{s_os}: the shards nest, so s_p must divide s_g and s_g "
                f"must divide s_os; try {s_p},{s_p},{s_os} or {s_p},{s_os},{s_os}")
    if amsp and s_g not in (s_p, s_os):
        return (f"shard {s_p},{s_g},{s_os}: AMSP's search space needs s_g equal to s_p or "
                f"s_os; try {s_p},{s_p},{s_os} or {s_p},{s_os},{s_os}")
    if per_node is not None:
        for s in shard:
            if not contiguous(s, per_node):
                return (f"shard group of {s} ranks is not contiguous with {per_node} "
                        f"data-parallel ranks per node; use a divisor or a multiple of {per_node}")
    return None


def spec_flags_violation(shard, zero) -> str | None:
    """A spec comes from a shard spec or from a ZeRO stage (a preset of one), not both."""
    if shard is not None and zero is not None:
        return "give --zero or --shard, not both (a ZeRO stage is a preset of the shard spec)"
    return None


def resolve_shard(dp: int, shard: Shard | str | None = None, zero: int | None = None) -> Shard:
    """The (s_p, s_g, s_os) spec from a shard spec or a ZeRO stage (default 0), not both."""
    why = spec_flags_violation(shard, zero)
    if why:
        raise PlanError(why)
    if isinstance(shard, str):
        shard = parse_shard(shard)
    spec = zero_shard(zero or 0, dp) if shard is None else tuple(shard)
    why = shard_violation(spec, dp)
    if why:
        raise PlanError(why)
    return spec  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# Tensor, pipeline and context parallelism; MoE under them
# --------------------------------------------------------------------------------------
def tp_violation(heads: int, tp: int, kv_heads: int = 0, hidden: int = 0, ffn: int = 0,
                 seq_len: int = 0, sp: bool = False) -> str | None:
    """Megatron's split: each TP rank owns whole heads (and, with grouped-query attention,
    whole key/value heads; Megatron-LM asserts num_query_groups % tp == 0) and 1/tp of the
    hidden and MLP widths (when given); with sequence parallelism 1/tp of every sequence."""
    if tp < 1:
        return f"--tp must be >= 1, got {tp}"
    if heads % tp:
        return (f"--tp {tp} does not divide the {heads} attention heads of the model (each rank "
                f"owns whole heads); use a --tp that divides {heads}")
    if kv_heads and kv_heads % tp:
        return (f"--tp {tp} does not divide the {kv_heads} key/value heads (grouped-query "
                f"attention: each rank takes whole K/V heads); use a divisor of {kv_heads}")
    for what, n in ((f"the hidden size {hidden}", hidden), (f"the MLP width {ffn}", ffn)):
        if n and n % tp:
            return f"--tp {tp} does not divide {what}; use a --tp that divides {n}"
    if sp and seq_len % tp:
        return (f"--sp splits each sequence over the {tp} tensor-parallel ranks, but the sequence "
                f"length {seq_len} is not divisible by {tp}; use a --seq-len that is a multiple "
                f"of {tp}, or drop --sp")
    return None


def pp_violation(layers: int, pp: int, chunks: int = 1, uneven: bool = False) -> str | None:
    """Why ``layers`` layers cannot be cut into ``pp`` stages of ``chunks`` model chunks each:
    equal stages (minipar's trainer) need pp x chunks to divide the layers; ``uneven`` (a
    framework that builds uneven stages, ``plan.stages``) needs only a layer for every stage,
    and interleaving (chunks > 1) stays even."""
    p, v = pp, chunks
    if p < 1 or v < 1:
        return f"--pp and --chunks must be >= 1, got pp={p}, chunks={v}"
    if uneven and v == 1:
        if layers < p:
            return (f"pp={p} stages need at least one layer each, but the model has {layers} "
                    f"layers; use --pp {layers} or fewer")
        return None
    if layers % (p * v):
        what = f"pp={p} x chunks={v} = {p * v}" if v > 1 else f"pp={p}"
        return (f"the model has {layers} layers, which do not split into {what} equal stages; "
                f"use a pp{' x chunks' if v > 1 else ''} that divides {layers}")
    return None


def interleave_violation(pp: int, microbatches: int, chunks: int) -> str | None:
    """The interleaved schedule (chunks > 1) needs pp > 1 and runs micro-batches in groups of
    pp (Megatron-LM's rule and minipar's)."""
    if chunks == 1:
        return None
    if pp == 1:
        return "--schedule interleaved needs --pp > 1"
    if microbatches % pp:
        m = microbatches
        near = [k for k in (m - m % pp, m - m % pp + pp) if k >= pp]
        return (f"--schedule interleaved runs micro-batches in groups of pp={pp}, so "
                f"--microbatches {m} must be a multiple of {pp}; use --microbatches "
                f"{' or '.join(map(str, near))}, or --schedule 1f1b")
    return None


def cp_violation(seq_len: int, cp: int, tp: int = 1, sp: bool = False) -> str | None:
    """A sequence cuts into 2 cp equal chunks (rank i holds chunks i and 2cp-1-i, the causal
    balance), and with sequence parallelism each rank's s/cp tokens split again over tp."""
    if cp < 1:
        return f"--cp must be >= 1, got {cp}"
    if cp > 1 and seq_len % (2 * cp):
        return (f"--cp {cp} cuts each sequence into 2 x {cp} = {2 * cp} equal chunks (rank i "
                f"holds chunks i and {2 * cp - 1}-i, for causal balance), but the sequence "
                f"length {seq_len} is not divisible by {2 * cp}; use a --seq-len that is a "
                f"multiple of {2 * cp}")
    if cp > 1 and sp and (seq_len // cp) % tp:
        return (f"--cp {cp} with --sp: each rank's {seq_len // cp} tokens are split again over "
                f"--tp {tp}, which does not divide them; use a --seq-len that is a multiple "
                f"of {cp * tp * 2}")
    return None


def ep_violation(ep: int, dp: int) -> str | None:
    """Expert parallelism is carved inside the data-parallel axis: ep consecutive dp ranks."""
    if dp % ep:
        return (f"--ep {ep} must divide the data-parallel degree {dp} (EP groups are "
                f"consecutive data-parallel ranks); use an --ep that divides {dp}")
    return None


def add_moe_flags(group) -> None:
    """The MoE shape and layout flags that ``moe_violation`` checks, declared once for the
    trainer and the planner (each adds its own: the trainer's losses, ...)."""
    group.add_argument("--moe-experts", type=int, default=0, metavar="E",
                       help="experts per MoE layer (0: a dense model)")
    group.add_argument("--moe-top-k", type=int, default=2, metavar="K", help="experts per token")
    group.add_argument("--moe-every", type=int, default=1, metavar="N",
                       help="every N-th block's MLP becomes an MoE layer")
    group.add_argument("--ep", type=int, default=1, metavar="N",
                       help="expert-parallel degree: experts split over N consecutive DP ranks "
                            "(divides dp and E)")


def moe_violation(experts: int, top_k: int = 1, every: int = 1, ep: int = 1,
                  dp: int | None = None, layers: int | None = None) -> str | None:
    """An MoE of ``experts`` per layer (0: dense), ``top_k`` per token, every ``every``-th
    layer of ``layers``, its experts split over ``ep`` of the ``dp`` ranks (E/ep each)."""
    if experts < 0:
        return f"--moe-experts must be >= 0, got {experts}"
    if ep < 1:
        return f"--ep must be >= 1, got {ep}"
    if experts == 0:
        return "--ep splits the experts of an MoE model; give --moe-experts E too" if ep > 1 else None
    if not 1 <= top_k <= experts:
        return f"--moe-top-k must be between 1 and --moe-experts {experts}, got {top_k}"
    if every < 1 or (layers is not None and every > layers):
        return f"--moe-every must be between 1 and the model's {layers or 'number of'} layers, got {every}"
    if dp is not None and ep_violation(ep, dp):
        return ep_violation(ep, dp)
    if experts % ep:
        return f"--moe-experts {experts} must be a multiple of --ep {ep} (each EP rank holds E/ep experts)"
    return None


def moe_tp_violation(seq_len: int, tp: int = 1, cp: int = 1) -> str | None:
    """An MoE layer under TP routes 1/tp of a cp rank's s/cp tokens on each TP rank."""
    if tp > 1 and (seq_len // cp) % tp:
        where = (f"the sequence length {seq_len}" if cp == 1 else
                 f"a cp rank's share {seq_len // cp} of the sequence")
        return (f"an MoE layer under --tp {tp} routes 1/{tp} of each sequence's tokens on each "
                f"TP rank, but {where} is not divisible by {tp}; use a --seq-len that is a "
                f"multiple of {tp * cp * (2 if cp > 1 else 1)}")
    return None
