"""AMSP's search space and the shard checks the planner raises on; the rules themselves live
in ``minipar.rules`` (one copy for the trainer, the engine and the planner)."""
from __future__ import annotations

from ..rules import (Shard, contiguous, divisors, parse_shard, resolve_shard,  # noqa: F401
                     shard_violation, spec_flags_violation, zero_shard)
from .errors import raise_if


def check_shard(shard: Shard, dp: int, per_node: int | None = None, amsp: bool = False) -> Shard:
    """``shard`` as a tuple, or PlanError saying which rule it breaks (``shard_violation``)."""
    raise_if(shard_violation(tuple(shard), dp, per_node, amsp))
    return tuple(shard)  # type: ignore[return-value]


def shard_specs(dp: int, per_node: int | None = None) -> list[Shard]:
    """AMSP's search space over ``dp`` ranks: every (s_p, s_g, s_os) with s_p | s_os | dp
    and s_g in {s_p, s_os} (groups contiguous when ``per_node`` is given). Accounting takes
    more than this (any s_p | s_g | s_os | dp); only the search enumerates just these."""
    sizes = [s for s in divisors(dp) if per_node is None or contiguous(s, per_node)]
    return [(s_p, s_g, s_os) for s_p in sizes for s_os in sizes
            if s_os >= s_p and s_os % s_p == 0 for s_g in sorted({s_p, s_os})]

