"""ZeRO stages as AMSP shard specs, and the rules a spec must obey.

AMSP (Chen et al. 2023, "AMSP: Reducing Communication Overhead of ZeRO for Efficient LLM
Training") shards each part of the model states over its own group of data-parallel ranks:
parameters over s_p ranks, gradients over s_g, optimizer states over s_os. ZeRO's stages are
four points of that space, over d data-parallel ranks (Rajbhandari et al. 2020):

    ZeRO-0 (plain DP) = (1, 1, 1)     ZeRO-1 = (1, 1, d)
    ZeRO-2            = (1, d, d)     ZeRO-3 = (d, d, d)

Two sets of rules, for two jobs:

* Accounting (``model_state_bytes``, ``zero_comm_bytes``, ``estimate``, the ``memory`` and
  ``estimate`` commands, a spec fixed with ``--shard``) accepts every spec that
  ``minipar.zero`` runs: 1 <= s_p <= s_g <= s_os <= d, each dividing the next and d
  (s_p | s_g | s_os | d), so the shards nest: an optimizer shard lies inside a gradient
  shard, inside a parameter shard. A rank cannot hold less gradient than it has parameters
  to produce it from, nor less optimizer state than it has gradient to apply. So ``1,2,4``
  is a legal spec and is accounted exactly.
* The search's enumeration (``shard_specs``) is AMSP's space, which adds AMSP's dependency
  rule: s_g is s_p or s_os (gradients follow either the parameters or the optimizer
  states). The values between are not enumerated: they trade gradient memory against
  reduce-scatter traffic per micro-batch, a trade AMSP's planner does not explore.

Both add, when the devices per node are known, that groups are contiguous: a group fills a
node before it spans nodes, so a group smaller than a node divides the node's data-parallel
ranks and a larger one is a multiple of them.
"""
from __future__ import annotations

from ..runtime.errors import PlanError

Shard = tuple[int, int, int]


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
    """Why ``shard`` cannot shard ``dp`` ranks, or None if it can.

    The accounting rules (s_p | s_g | s_os | dp, in that order), plus contiguity when
    ``per_node`` is given, plus AMSP's s_g in {s_p, s_os} when ``amsp`` is true.
    """
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


def check_shard(shard: Shard, dp: int, per_node: int | None = None,
                amsp: bool = False) -> Shard:
    """``shard`` as a tuple, or PlanError saying which rule it breaks (``shard_violation``)."""
    reason = shard_violation(tuple(shard), dp, per_node, amsp)
    if reason:
        raise PlanError(reason)
    return tuple(shard)  # type: ignore[return-value]


def resolve_shard(dp: int, shard: Shard | str | None = None, zero: int | None = None) -> Shard:
    """The (s_p, s_g, s_os) spec from either a shard spec or a ZeRO stage (default stage 0)."""
    if shard is not None and zero is not None:
        raise PlanError("give either a ZeRO stage or a shard spec, not both "
                        "(a ZeRO stage is a preset of the spec)")
    if isinstance(shard, str):
        shard = parse_shard(shard)
    spec = zero_shard(zero or 0, dp) if shard is None else tuple(shard)
    return check_shard(spec, dp)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def shard_specs(dp: int, per_node: int | None = None) -> list[Shard]:
    """AMSP's search space over ``dp`` ranks: every (s_p, s_g, s_os) with s_p | s_os | dp
    and s_g in {s_p, s_os} (groups contiguous when ``per_node`` is given). Accounting takes
    more than this (any s_p | s_g | s_os | dp); only the search enumerates just these."""
    sizes = [s for s in divisors(dp) if per_node is None or contiguous(s, per_node)]
    specs = []
    for s_p in sizes:
        for s_os in sizes:
            if s_os < s_p or s_os % s_p:
                continue
            for s_g in sorted({s_p, s_os}):
                specs.append((s_p, s_g, s_os))
    return specs
