"""How long one collective takes: NCCL's and RCCL's model, or a measured table.

Time, per call, as NCCL's and RCCL's tuner model it (``src/graph/tuning.cc`` in both; the
constants in the hardware presets cite the version): a base latency per call, a latency per ring
step, and the bytes one rank sends over the slowest link the ring crosses. A ring over n ranks
takes n-1 steps per phase (two for an all-reduce), of which those that cross nodes pay the
network's latency (2 x nodes for an all-reduce, nodes - 1 for a gather or reduce-scatter, as
NCCL counts them) and the rest the intra-node link's. An all-reduce may also run as a tree,
log2(nodes) network levels and a chain inside each node (latency 2 ((per_node - 1) x intra +
log2(nodes) x inter), bandwidth the ring's times a factor), taken when faster, as NCCL's tuner
does; gathers, reduce-scatters and broadcasts only ring. Bandwidth: inside one node
``intra_node_bandwidth``, or a faster ``local_links`` entry when the group stays inside one
aligned block (the two GCDs of an MI250X). A group that spans nodes shares each node's NICs with
every device of the node (all groups run at once in lockstep), so each device gets
``inter_node_bandwidth / gpus_per_node``; a ring visiting k of its members in a node crosses
that node's boundary once, carrying their k shares, so its slowest link runs at k x that (capped
by the intra-node link), times the measured fraction NCCL reaches over that many nodes
(``network_efficiency``: a NIC's protocol overhead, and a fabric that delivers less as the group
widens, as measured, not as the line rate says), and the share the fabric leaves any group in a
job ``job_nodes`` wide (the hardware's ``fabric_efficiency``, 1 without rows: on the Playbook
grid the 8B's best layout with TP over 2 nodes measures 3,459 tokens/s per GPU in a 32-node job
and 840 in a 64-node one). ``bandwidth_by_size`` derates medium messages (RCCL's correction
table), and a fitted profile's ``all_gather_efficiency`` and ``reduce_scatter_efficiency`` those
ops' rate. Where the hardware carries a measured ``collective_table`` with the op and placement,
its interpolated time replaces all of this (``table_time``): between measured sizes linearly in
bytes, between measured node counts linearly in log2(nodes), never below the smallest measured
size; beyond the widest measured group the model times it, but never faster than the widest
measurement at that size (widening a group never makes a byte cheaper). A collective the table
does not cover (it spans nodes, is wider than the table or smaller than its rows) is timed by
the model and named by ``coverage``: the estimate lists it under ``unvalidated``, and so does
``search``'s output.

``ring_bytes`` is the byte count of ``network``'s table (what one rank sends); ``network``
re-exports everything here.
"""
from __future__ import annotations

import math

from .hardware import Hardware


def ring_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for ``op`` on an ``nbytes`` buffer over ``n`` ranks."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) * nbytes // n
    if op == "send":
        return nbytes
    raise ValueError(f"unknown op {op!r}")


def placement(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(members per node, nodes) of a group of ``size`` ranks ``stride`` devices apart."""
    per_node = max(1, min(size, gpus_per_node // stride))     # 1 once stride >= a node
    return per_node, math.ceil(size / per_node)


def intra_bandwidth(per_node: int, stride: int, hw: Hardware) -> float:
    """The slowest link a ring over ``per_node`` members ``stride`` apart crosses in a node:
    a faster local link when the members stay inside one aligned block of it."""
    span = (per_node - 1) * stride + 1
    for link in sorted(hw.local_links, key=lambda x: x["devices"]):
        if span <= link["devices"]:
            return float(link["bandwidth"]) * hw.intra_node_efficiency
    return hw.intra_node_bandwidth * hw.intra_node_efficiency


def size_factor(nbytes: float, hw: Hardware) -> float:
    """The ring's bandwidth derating for a message of ``nbytes`` (RCCL's step table)."""
    reached = [f for bound, f in hw.bandwidth_by_size if nbytes >= bound]
    return reached[-1] if reached else 1.0


def log_interp(rows: list, x: float, log=math.log2) -> float:
    """The value at ``x`` of [[x, value], ...] rows in order of x: linear in log(x) between
    the two rows around it, held beyond the first and the last (the base of ``log`` changes
    only the rounding, not the line: each caller keeps its own)."""
    if x <= rows[0][0]:
        return rows[0][1]
    if x >= rows[-1][0]:
        return rows[-1][1]
    for (x0, v0), (x1, v1) in zip(rows, rows[1:]):
        if x0 <= x <= x1:
            w = (log(x) - log(x0)) / (log(x1) - log(x0))
            return (1 - w) * v0 + w * v1


def by_nodes(rows: list, nodes: int, default: float) -> float:
    """A table's value at ``nodes`` from its [[nodes, value], ...] rows (by node count, as
    loading checked): ``log_interp`` in log2(nodes); ``default`` without rows."""
    return log_interp(rows, nodes) if rows else default


def network_efficiency(nodes: int, hw: Hardware) -> float:
    """The fraction of ``inter_node_bandwidth`` a ring over ``nodes`` nodes reaches: the
    hardware's measured ``inter_node_efficiency`` rows (``by_nodes``); 1 without rows."""
    return by_nodes(hw.inter_node_efficiency, nodes, 1.0)


def link_bandwidth(per_node: int, nodes: int, stride: int, hw: Hardware,
                   job_nodes: int = 0) -> float:
    """The slowest link a ring over ``per_node`` members per node on ``nodes`` nodes crosses:
    inside a node ``intra_bandwidth``, across nodes the node's share of the NICs times
    their measured efficiency at that width (module docstring)."""
    beta = intra_bandwidth(per_node, stride, hw)
    if nodes > 1:
        beta = min(beta, hw.inter_node_bandwidth * per_node / hw.gpus_per_node
                   * network_efficiency(nodes, hw)
                   * by_nodes(hw.fabric_efficiency, max(nodes, job_nodes), 1.0))
    return beta


def ring_time(op: str, nbytes: float, size: int, stride: int, hw: Hardware,
              job_nodes: int = 0) -> float:
    per_node, nodes = placement(size, stride, hw.gpus_per_node)
    beta = link_bandwidth(per_node, nodes, stride, hw, job_nodes)
    steps = (2 if op == "all_reduce" else 1) * (size - 1)    # all-reduce: two phases
    crossings = 2 * nodes if op == "all_reduce" else nodes - 1      # as NCCL counts them
    inter = min(crossings, steps) if nodes > 1 else 0
    latency = (hw.collective_latency + (steps - inter) * hw.intra_node_latency
               + inter * hw.inter_node_latency)
    share = {"all_gather": hw.all_gather_efficiency,
             "reduce_scatter": hw.reduce_scatter_efficiency}.get(op, 1.0)
    return latency + ring_bytes(op, int(nbytes), size) / (beta * share * size_factor(nbytes, hw))


def tree_time(nbytes: float, size: int, stride: int, hw: Hardware, job_nodes: int = 0) -> float:
    """A tree all-reduce (NCCL's double binary tree across nodes, a chain inside)."""
    tree = hw.tree
    per_node, nodes = placement(size, stride, hw.gpus_per_node)
    beta = link_bandwidth(per_node, nodes, stride, hw, job_nodes)
    latency = tree["base_latency"] + 2 * ((per_node - 1) * tree["intra_latency"]
                                          + math.ceil(math.log2(nodes)) * tree["inter_latency"])
    return latency + 2 * nbytes / (beta * tree["bandwidth_factor"])


def _size_time(rows: list[tuple[float, float]], nbytes: float) -> float | None:
    """Seconds for ``nbytes`` from (bytes, seconds) rows of one placement: linear in bytes
    between the two rows around it (the alpha-beta line through them); above the largest,
    its bandwidth (the ring's bandwidth term is linear in the size); below the smallest
    None (latency dominates there: a row at 64 MiB says nothing of a 64 KiB call)."""
    rows = sorted(rows)
    if nbytes < rows[0][0]:
        return None
    if nbytes == rows[0][0]:
        return rows[0][1]
    if nbytes >= rows[-1][0]:
        return nbytes * rows[-1][1] / rows[-1][0]
    for (b0, t0), (b1, t1) in zip(rows, rows[1:]):
        if b0 <= nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)


def table_time(op: str, nbytes: float, size: int, stride: int, hw: Hardware) -> float | None:
    """Seconds from the measured ``collective_table`` (module docstring), or None where it
    does not cover this op and placement: a node count beyond the measured ones, or a size
    below the smallest measured at either count around it, is not extrapolated."""
    rows = _bracket(op, size, stride, hw)
    if rows is None:
        return None
    (n0, r0), (n1, r1), nodes = rows
    t0, t1 = _size_time(r0, nbytes), _size_time(r1, nbytes)
    return None if t0 is None or t1 is None else by_nodes([[n0, t0], [n1, t1]], nodes, t0)


def _measured(op: str, size: int, stride: int, hw: Hardware) -> tuple[int, dict[int, list]]:
    """The group's node count, and the ``collective_table``'s (bytes, seconds) rows of ``op``
    at its members per node, by node count."""
    per_node, nodes = placement(size, stride, hw.gpus_per_node)
    by_nodes: dict[int, list] = {}
    for r in hw.collective_table or []:
        if r["op"] == op and r["per_node"] == per_node:
            by_nodes.setdefault(r["nodes"], []).append((r["bytes"], r["seconds"]))
    return nodes, by_nodes


def _bracket(op: str, size: int, stride: int, hw: Hardware):
    """The measured (nodes, [(bytes, seconds)]) rows of ``op`` at this group's members per
    node that its node count is read from: the nearest measured count at or below it and
    the nearest at or above (its own twice where measured); None beyond them (or none)."""
    nodes, by_nodes = _measured(op, size, stride, hw)
    n0 = max((n for n in by_nodes if n <= nodes), default=None)
    n1 = min((n for n in by_nodes if n >= nodes), default=None)
    return None if n0 is None or n1 is None else ((n0, by_nodes[n0]), (n1, by_nodes[n1]), nodes)


def coverage(op: str, size: int, stride: int, hw: Hardware,
             nbytes: float | None = None) -> str | None:
    """Why the time of ``op`` over this group is a model, not a measurement: None when the
    measured table covers it (at ``nbytes`` per call, or at some measured size when it is
    None), or when the group stays in one node and no table was given (NCCL's intra-node
    model); else one phrase for the ``unvalidated`` list."""
    if size <= 1:
        return None
    per_node, nodes = placement(size, stride, hw.gpus_per_node)
    where = f"over {size} ranks ({nodes} node{'s' if nodes > 1 else ''})"
    if table_time(op, math.inf if nbytes is None else nbytes, size, stride, hw) is not None:
        return None
    rows = [r for r in hw.collective_table or [] if r["op"] == op]
    placed = [r for r in rows if r["per_node"] == per_node]
    bracket = _bracket(op, size, stride, hw)
    if bracket is not None:             # the node count is measured, this size is not
        smallest = max(min(b for b, _ in rows_) for _, rows_ in bracket[:2])
        return f"{op} of {size_text(nbytes)} {where}: measured only from {size_text(smallest)}"
    if not placed and nodes == 1:      # rows measured at another placement say nothing here
        return None
    widths = sorted({r["per_node"] * r["nodes"] for r in placed})
    if placed:
        span = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
        measured = f"measured only over {span} ranks"
    elif rows:
        per = ", ".join(str(n) for n in sorted({r["per_node"] for r in rows}))
        measured = f"measured only with {per} ranks per node"
    else:
        measured = "no measured table"
    return f"{op} {where}: {measured}"


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches, to 3 significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def collective_time(op: str, nbytes: float, size: int, stride: int, hw: Hardware,
                    job_nodes: int = 0) -> float:
    """Seconds for one call of ``op`` on an ``nbytes`` buffer over ``size`` ranks ``stride``
    devices apart: the measured table where it covers the case, else NCCL's alpha-beta
    model (ring, or tree for an all-reduce when faster), the fabric's share read at
    ``job_nodes``, the job's width (the group's own when not given)."""
    if size <= 1:
        return 0.0
    measured = table_time(op, nbytes, size, stride, hw)
    if measured is not None:
        return measured
    t = ring_time(op, nbytes, size, stride, hw, job_nodes)
    if op == "all_reduce" and hw.tree:
        t = min(t, tree_time(nbytes, size, stride, hw, job_nodes))
    widest = _widest_time(op, nbytes, size, stride, hw)
    return t if widest is None else max(t, widest)


def _widest_time(op: str, nbytes: float, size: int, stride: int, hw: Hardware) -> float | None:
    """The time the widest measured group of this op and placement took for ``nbytes``,
    where this group is wider still (a floor: module docstring); else None."""
    nodes, by_nodes = _measured(op, size, stride, hw)
    if not by_nodes or nodes <= max(by_nodes):
        return None
    return _size_time(by_nodes[max(by_nodes)], nbytes)


def p2p_time(nbytes: float, across_nodes: bool, hw: Hardware, job_nodes: int = 2) -> float:
    """One point-to-point send; across nodes every device of the node sends at once, at the
    NICs' measured efficiency between two nodes, plus ``p2p_latency`` at the job's width
    (``job_nodes``: rows a fitted profile measured, module docstring of ``hardware``)."""
    if across_nodes:
        return (hw.collective_latency + hw.inter_node_latency
                + by_nodes(hw.p2p_latency, job_nodes, 0.0)
                + nbytes / (hw.inter_node_bandwidth / hw.gpus_per_node
                            * network_efficiency(2, hw)))
    return (hw.collective_latency + hw.intra_node_latency
            + nbytes / (hw.intra_node_bandwidth * hw.intra_node_efficiency))
