"""AMSP's search space and the shard checks the planner raises on; the rules themselves live
in ``minipar.rules`` (one copy for the trainer, the engine and the planner)."""
from __future__ import annotations

from ..rules import (Shard, contiguous, divisors, parse_shard, resolve_shard,  # noqa: F401
                     shard_violation, spec_flags_violation, zero_shard)
from ..runtime.errors import PlanError


def check_shard(shard: Shard, dp: int, per_node: int | None = None,
                amsp: bool = False) -> Shard:
    """``shard`` as a tuple, or PlanError saying which rule it breaks (``shard_violation``)."""
    reason = shard_violation(tuple(shard), dp, per_node, amsp)
    if reason:
        raise PlanError(reason)
    return tuple(shard)  # type: ignore[return-value]


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


# --------------------------------------------------------------------------------------
# AMSP's scale-aware partitioner (Chen et al. 2023, arXiv 2311.00257; ``search``'s
# objective="amsp"): among the specs that fit memory, the least data-parallel communication
# time, nothing hidden, each of P, G and OS on the fastest links its group allows: a group
# of at most a node's devices (contiguous, ``contiguous``) inside one node on its links, a
# wider one on each device's share of the NICs, at datasheet rates. That is AMSP's cost model,
# not the planner's (which lets a ring carry a node's shares over its boundary at once and
# slows as a group widens): it is what AMSP's partitioner picks by (``amsp_key``), and the
# step time ranks the rest.
# --------------------------------------------------------------------------------------
def amsp_seconds(collectives, microbatches: int, stride: int, hw) -> float:
    """AMSP's objective for one step: ``collectives`` (``estimate.dp_collectives`` of one
    micro-batch), each group ``stride`` devices between neighbouring dp ranks, every call's
    latency and bytes at its links' rate, nothing hidden."""
    from .timing import placement, ring_bytes
    total = 0.0
    for c in collectives:
        inside = placement(c.size, c.stride * stride, hw.gpus_per_node)[1] == 1
        beta = hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth / hw.gpus_per_node
        count = c.count * (microbatches if c.kind in ("gather", "grad") else 1)
        total += count * (c.calls * hw.collective_latency
                          + ring_bytes(c.op, c.nbytes, c.size) / beta)
    return total


def amsp_cost(shape, hw, layout, fw, order: str, dtype: str) -> float:
    """``amsp_seconds`` of ``layout``."""
    from dataclasses import replace
    from .estimate import dp_collectives
    return amsp_seconds(dp_collectives(shape, replace(layout, microbatches=1), fw, dtype),
                        layout.microbatches, layout.replica_stride(order, hw.gpus_per_node), hw)


def amsp_key(seconds: float, shard: Shard) -> tuple:
    """AMSP's ranking: its time to three significant digits (closer is a tie that latency
    alone decides), then the smaller groups, on the faster links."""
    return float(f"{seconds:.3g}"), sum(shard)


def amsp_reasons(shape, hw, best, fw, order: str, dtype: str, flash: bool,
                 reserve=None) -> list[str]:
    """One line per group of ``best``'s spec (P, G, OS): where it runs, and what the next
    smaller and larger valid sizes would do instead (not fit, or cost more AMSP time)."""
    from dataclasses import replace
    from .estimate import estimate
    from .timing import placement
    lay = best.layout
    stride = lay.replica_stride(order, hw.gpus_per_node)
    per_node = max(1, hw.gpus_per_node // stride)
    base = amsp_cost(shape, hw, lay, fw, order, dtype)

    def where(s):
        nodes = placement(s, stride, hw.gpus_per_node)[1]
        return "inside a node" if nodes == 1 else f"across {nodes} nodes"

    lines = []
    for i, name in enumerate(("P", "G", "OS")):
        s, notes = lay.shard[i], []
        sizes = divisors(lay.replicas)
        for k in (max((d for d in sizes if d < s), default=None),
                  min((d for d in sizes if d > s), default=None)):
            spec = lay.shard[:i] + (k,) + lay.shard[i + 1:]
            if k is None or shard_violation(spec, lay.replicas, per_node):
                continue
            other = replace(lay, shard=spec)
            e = estimate(shape, hw, other, order=order, flash=flash, dtype=dtype,
                         reserve=reserve, check=False, framework=fw)
            notes.append(f"{k} ({where(k)}) does not fit: {e.memory['total'] / 2**30:.1f} of "
                         f"{e.capacity / 2**30:.1f} GiB" if not e.fits else
                         f"{k} ({where(k)}) costs "
                         f"{amsp_cost(shape, hw, other, fw, order, dtype) - base:+.3g} s")
        lines.append(f"{name}={s} ({where(s)}): " + ("; ".join(notes) or "the only size its neighbours allow"))
    return lines
