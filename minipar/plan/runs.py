"""Measured runs: the planner's input. One CSV schema for every sweep, one row per run.

A row says what ran and what it measured:

    model shape   model, arch, layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq_len, tied,
                  bias, dropout (1: masks kept)
    placement     nodes, gpus_per_node, dp, tp, pp, cp
    engine        shard (AMSP's P-G-OS group sizes, "1-1-8" is ZeRO-1 over 8), mbs,
                  grad_acc (micro-batches per step), gbs (sequences per step), recompute,
                  schedule, chunks, sp, flash (a fused attention kernel), dtype (mixed: 16-bit
                  with fp32 Adam states; fp32), framework
    measured      status (ok | oom | crashed), tokens_per_s_gpu, peak_mem_gib, mfu

``python -m minipar.scaling ... --runs FILE.csv`` writes it from its own sweeps (a laptop, a
node, an ``srun`` allocation); ``read_runs`` also reads the Ultra-Scale Playbook's grid
(``minipar/hardware/runs/playbook-grid-1B-8B.csv``: its ``zero`` column, the shapes below)
into the same rows. ``plan fit`` fits a hardware profile to them (``plan.fit``).

The ``mfu`` column is informational (``write_runs`` leaves it empty): MFU is recomputed from
tokens/s, FLOPs per token (``shapes.training_flops``) and the datasheet peak, alike for all.
"""
from __future__ import annotations

import csv
import hashlib
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import PlanError
from .frameworks import FRAMEWORKS
from .layout import Layout
from .shapes import RECOMPUTE_MODES, ModelShape, training_flops

COLUMNS = ("model", "arch", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
           "seq_len", "tied", "bias", "dropout", "nodes", "gpus_per_node", "dp", "tp", "pp", "cp",
           "shard", "mbs", "grad_acc", "gbs", "recompute", "schedule", "chunks", "sp", "flash",
           "dtype", "framework", "status", "tokens_per_s_gpu", "peak_mem_gib", "mfu")
STATUSES = ("ok", "oom", "crashed")

# The Ultra-Scale Playbook's grid (nanotron's benchmark configs): Llama-style shapes by name,
# (layers, hidden, heads, ffn), vocabulary 131,072, sequence 4,096, MHA, tied below ffn 10,000;
# nanotron, 8 H100 per node, sequence parallelism with TP, no recomputation. Another model of
# that grid needs the columns layers, hidden, heads and ffn_hidden.
PLAYBOOK_SHAPES = {"1B": (16, 2048, 32, 8192), "8B": (32, 4096, 32, 14336)}
PLAYBOOK_COLUMNS = ("model", "nodes", "gpus", "dp", "tp", "pp", "zero", "mbs", "grad_acc",
                    "gbs", "mfu", "tok_s_gpu", "mem_gb")


@dataclass(frozen=True)
class Run:
    shape: ModelShape
    layout: Layout
    nodes: int
    gpus_per_node: int
    framework: str
    flash: bool                  # a fused attention kernel (FlashAttention, SDPA's)
    dtype: str                   # mixed | fp32
    status: str                  # ok | oom | crashed
    tokens_per_s_gpu: float      # NaN unless ok
    peak_mem_gib: float          # NaN where not measured

    @property
    def ran(self) -> bool:
        return self.status == "ok"

    @property
    def cell(self) -> tuple[str, int]:
        """What a team chooses among: one model on one number of nodes."""
        return self.shape.name, self.nodes

    def mfu(self, peak_flops: float) -> float:
        per_token = training_flops(self.shape, 1, "none") / self.shape.seq_len
        return self.tokens_per_s_gpu * per_token / peak_flops


def _int(row: dict, key: str, where: str, default: int | None = None) -> int:
    value = row.get(key, "")
    if value in ("", None) and default is not None:
        return default
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: {key} must be a whole number, got {value!r}") from None
    if out < 0:
        raise PlanError(f"{where}: {key} must be >= 0, got {out}")
    return out


def _one_of(row: dict, key: str, where: str, allowed, default: str = "") -> str:
    value = row.get(key) or default
    if value not in allowed:
        raise PlanError(f"{where}: {key} is one of {', '.join(allowed)}, got {value!r}")
    return value


def _float(row: dict, key: str) -> float:
    try:
        return float(row.get(key))
    except (TypeError, ValueError):          # absent, empty or not a number: not measured
        return math.nan


def _run(row: dict, where: str, playbook: bool) -> Run:
    if playbook:
        name = row["model"]
        if row.get("layers"):
            layers, hidden, heads, ffn = (_int(row, k, where) for k in
                                          ("layers", "hidden", "heads", "ffn_hidden"))
        elif name in PLAYBOOK_SHAPES:
            layers, hidden, heads, ffn = PLAYBOOK_SHAPES[name]
        else:
            raise PlanError(f"{where}: the shape of playbook model {name!r} is not known; "
                            f"add the columns layers, hidden, heads and ffn_hidden")
        shape = ModelShape(name, "llama", layers, hidden, heads, 131072, 4096, ffn,
                           tied_head=ffn < 10_000, bias=False)
        gpus_per_node, framework, recompute, sp, flash = 8, "nanotron", "none", None, True
        dtype, cp, schedule, chunks = "mixed", 1, "1f1b", 1
        dp = _int(row, "dp", where)
        shard = (1, 1, dp) if _int(row, "zero", where) else (1, 1, 1)
        tok, mem = _float(row, "tok_s_gpu"), _float(row, "mem_gb")
        status = "ok" if math.isfinite(tok) else "crashed"
    else:
        dims = (_int(row, k, where) for k in ("layers", "hidden", "heads", "vocab", "seq_len"))
        tied, bias, dropout, sp, flash = (_one_of(row, k, where, ("0", "1"), "0") == "1"
                                          for k in ("tied", "bias", "dropout", "sp", "flash"))
        shape = ModelShape(row["model"], row["arch"], *dims, _int(row, "ffn_hidden", where, 0),
                           tied_head=tied, bias=bias, kv_heads=_int(row, "kv_heads", where, 0),
                           dropout=dropout)
        framework, recompute, schedule, dtype, status = (
            _one_of(row, k, where, *allowed) for k, allowed in (
                ("framework", [FRAMEWORKS]), ("recompute", [RECOMPUTE_MODES, "none"]),
                ("schedule", [("1f1b", "gpipe"), "1f1b"]), ("dtype", [("mixed", "fp32")]),
                ("status", [STATUSES])))
        gpus_per_node, dp = _int(row, "gpus_per_node", where), _int(row, "dp", where)
        cp, chunks = _int(row, "cp", where, 1), _int(row, "chunks", where, 1)
        try:
            shard = tuple(int(x) for x in row["shard"].split("-"))
        except ValueError:
            shard = ()
        if len(shard) != 3:
            raise PlanError(f"{where}: shard is P-G-OS sizes like 1-1-8, got {row['shard']!r}")
        tok, mem = _float(row, "tokens_per_s_gpu"), _float(row, "peak_mem_gib")
    if mem <= 0 or (status == "ok" and not 0 < tok < math.inf):     # NaN mem: not logged
        bad = f"peak_mem_gib > 0, got {mem}" if mem <= 0 else f"tokens_per_s_gpu > 0, got {tok}"
        raise PlanError(f"{where}: a run needs {bad}")
    tp, pp, mbs, acc = (_int(row, k, where) for k in ("tp", "pp", "mbs", "grad_acc"))
    gbs, nodes = _int(row, "gbs", where), _int(row, "nodes", where)
    if min(tp, pp, dp, cp, mbs, acc, gbs, nodes, gpus_per_node) < 1:
        raise PlanError(f"{where}: degrees, batch sizes and counts must be >= 1")
    if dp * mbs * acc != gbs:
        raise PlanError(f"{where}: dp x mbs x grad_acc = {dp} x {mbs} x {acc} = "
                        f"{dp * mbs * acc}, but gbs says {gbs}; fix the row or leave it out")
    if tp * pp * dp * cp != nodes * gpus_per_node:
        raise PlanError(f"{where}: tp x pp x dp x cp = {tp * pp * dp * cp} devices, but "
                        f"{nodes} nodes x {gpus_per_node} hold {nodes * gpus_per_node}")
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=mbs, microbatches=acc, shard=shard,
                    recompute=recompute, v=chunks, schedule=schedule,
                    sp=tp > 1 if sp is None else sp)
    return Run(shape, layout, nodes, gpus_per_node, framework, flash, dtype, status, tok, mem)


def read_runs(path: str | Path) -> tuple[list[Run], list[str]]:
    """The rows of a runs CSV (this schema, or the Playbook grid's) and notes on what was left
    out. A missing column, a row that contradicts itself (dp x mbs x grad_acc against gbs) or
    an unreadable value is a PlanError naming the file, the line and the fix; only the grid's
    own contradicting rows are left out, as its README says, and counted in a note."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            playbook = "tok_s_gpu" in header
            missing = [c for c in (PLAYBOOK_COLUMNS if playbook else COLUMNS) if c not in header]
            if missing:
                raise PlanError(f"{path}: missing column(s) {', '.join(missing)}; a runs CSV "
                                f"has {', '.join(COLUMNS)}")
            runs, left = [], 0
            for where, row in ((f"{path} line {i}", row) for i, row in enumerate(reader, 2)):
                if playbook and _int(row, "dp", where) * _int(row, "mbs", where) * _int(
                        row, "grad_acc", where) != _int(row, "gbs", where):
                    left += 1
                    continue
                runs.append(_run(row, where, playbook))
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read runs file {path}: {e}") from None
    if not runs:
        raise PlanError(f"{path} holds no runs")
    notes = [f"{path.name}: left out {left} rows whose dp x mbs x grad_acc is not their gbs "
             f"(they contradict themselves)"] if left else []
    return runs, notes


def write_runs(path: str | Path, runs: list[Run]) -> None:
    """The runs as a CSV of ``COLUMNS`` (appending when the file exists)."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        for r in runs:
            s, lay = r.shape, r.layout
            w.writerow([s.name, s.arch, s.layers, s.hidden, s.heads, s.kv_heads, s.ffn_hidden,
                        s.vocab, s.seq_len, int(s.tied_head), int(s.bias), int(s.dropout),
                        r.nodes, r.gpus_per_node, lay.dp, lay.tp, lay.pp, lay.cp,
                        "-".join(map(str, lay.shard)), lay.micro_batch, lay.microbatches,
                        lay.global_batch, lay.recompute, lay.schedule, lay.v, int(lay.sp),
                        int(r.flash), r.dtype, r.framework, r.status,
                        f"{r.tokens_per_s_gpu:.6g}", f"{r.peak_mem_gib:.6g}", ""])


def digest(path: str | Path) -> str:
    """The sha256 of a runs file: a fitted profile names the data it was fitted to."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def twins(runs: list[Run]) -> dict:
    """How far a sweep agrees with itself, by cell: {cell: (groups, median of log(fastest /
    slowest))} over the groups of runs that ran and differ only in how gradients and optimizer
    states shard (ZeRO-0, 1, 2: the same bytes over the same links, priced near alike; ZeRO-3's
    gathers are not). A spread there is noise, a floor under any model's errors in that cell."""
    groups: dict = {}
    for r in filter(lambda r: r.ran, runs):
        key = (r.cell, r.shape, replace(r.layout, shard=(r.layout.shard[0], 1, 1)),
               r.gpus_per_node, r.framework, r.flash, r.dtype)
        groups.setdefault(key, []).append(r.tokens_per_s_gpu)
    cells: dict = {}
    for key, tps in groups.items():
        if len(tps) > 1:
            cells.setdefault(key[0], []).append(math.log(max(tps) / min(tps)))
    return {c: (len(v), statistics.median(v)) for c, v in sorted(cells.items())}


def select(runs: list[Run], spec: str) -> list[Run]:
    """The runs a ``key=value[,value]`` spec names (``model=8B``, ``nodes=32,64``); a spec
    naming no run is a PlanError."""
    key, _, values = spec.partition("=")
    if key not in ("model", "nodes") or not values:
        raise PlanError(f"holdout {spec!r}: say model=NAME or nodes=N (comma-separated values)")
    value = lambda r: str(r.shape.name if key == "model" else r.nodes)     # noqa: E731
    wanted, have = set(values.split(",")), {value(r) for r in runs}
    if not wanted <= have:
        raise PlanError(f"holdout {spec!r} names no run with {key} "
                        f"{', '.join(sorted(wanted - have))}; the file has {key} "
                        f"{', '.join(sorted(have, key=lambda v: (len(v), v)))}")
    return [r for r in runs if value(r) in wanted]
