"""Hardware descriptions: what a device computes, holds and sends.

A hardware file is JSON with the fields of ``Hardware`` (plus an optional ``sources`` object
saying where each number comes from). The presets live in ``minipar/hardware/*.json``; any path
to such a file works wherever a preset name does, and ``python -m minipar.plan calibrate``
writes one for the machine it runs on. Units: bytes, seconds, FLOP/s; bandwidths per direction.

* ``peak_flops``: dense 16-bit matmul peak of one device (fp32 for a CPU process).
  ``compute_efficiency``: the fraction of peak a *large* GEMM (every side thousands wide)
  reaches; smaller shapes run slower (``compute.matmul_time``): a roofline with the HBM
  bandwidth, and F FLOPs take (F + ``gemm_half_flops``) / (peak x efficiency), a fixed cost
  per kernel (0: none); or ``matmul_table``, measured rows {"m", "n", "k", "flops_per_s"}
  that ``calibrate`` writes. ``attention_efficiency``: the fraction of peak a fused attention
  core (FlashAttention) reaches; 0: unfused, batched matmuls plus the softmax's bytes.
* ``hbm_bandwidth``: bytes/s a memory-bound kernel achieves (LayerNorm, GELU, residual adds,
  softmax, cross-entropy, the optimizer step); 0 leaves them out. ``step_calibration``: a
  factor on compute time, 1 unless ``calibrate`` measured a real training step here (its
  time over the model's, at the calibration point).
* ``intra_node_bandwidth``: what one device can push to a neighbour in its node (the slowest
  link a ring over the node crosses), of which collectives reach ``intra_node_efficiency``;
  ``local_links``: faster links inside aligned blocks of a node ([{"devices": 2,
  "bandwidth": ...}]: the two GCDs of one MI250X), for a group that stays inside one.
* ``inter_node_bandwidth``: the node's NICs together, shared by the node's devices when a
  group spans nodes; ``inter_node_efficiency`` ([[nodes, fraction], ...]): the fraction of
  it NCCL's ring reaches over that many nodes, measured (``timing.network_efficiency``; 1
  without rows); ``fabric_efficiency`` (the same form): the share of that the fabric leaves
  any group crossing nodes in a job of that many nodes, fitted where a sweep measured it
  (``timing``); none unless fitted. ``all_gather_efficiency`` and
  ``reduce_scatter_efficiency``: the share of the all-reduce's rate per byte a ring
  all-gather and reduce-scatter reach (NCCL runs them as one phase each of the same ring;
  an engine's coalesced calls may not), 1 unless fitted.
* latencies (NCCL's ``src/graph/tuning.cc``, ``timing``): ``collective_latency`` once per
  call (its baseLat), ``intra_node_latency`` per ring step inside a node and
  ``inter_node_latency`` per step across nodes (its hwLat); ``tree`` ({"base_latency",
  "intra_latency", "inter_latency", "bandwidth_factor"}) offers a tree all-reduce;
  ``bandwidth_by_size`` ([[bytes, factor], ...]) derates medium messages (RCCL's
  ringCorrectionFactor); ``collective_table`` (measured rows {"op", "bytes", "per_node",
  "nodes", "seconds"}, or a path to a JSON file of them, e.g. from nccl-tests/rccl-tests)
  replaces the model where it has the op and placement. ``p2p_latency`` ([[nodes,
  seconds], ...], read like ``inter_node_efficiency``): what a point-to-point message
  between nodes costs beyond its bytes in a job of that many nodes, an empirical term fitted
  where pipelines slow with the job's width far more than their bytes say (the Playbook
  grid's at 32 and 64 nodes); none unless fitted.
* ``runtime_bytes``: memory the runtime and libraries take before the model (context,
  communication buffers, workspaces); ``fragmentation``: the fraction of the rest an
  allocator loses. Together they set the usable memory (``peak``). ``layer_buffer_bytes``:
  what each layer on a device holds beyond the planner's accounting; 0 unless fitted.
* ``overlap_slowdown``: how much compute slows while a collective runs beside it (0.1:
  hidden communication costs a tenth of its time in compute); 0 unless measured.
  ``overlap_exposed``: the share of the traffic that could hide behind compute which stays
  exposed all the same; ``layer_overhead``: the host's seconds per layer and micro-batch
  (forward and backward: launches, scheduling, synchronisation); both 0 unless fitted.
  ``overhead_hiding`` (k, at least 1): how much of it the device's work hides, a stage's
  micro-batch taking (device^k + host^k)^(1/k) (``estimate.stage_time``): 1 adds them, a
  large k takes the longer; 1 unless fitted. ``pipeline_tp_latency``: the host's seconds a TP
  call waits per rank of its group once stages hand off across nodes (docs/decisions.md, 6-7).
* ``memory_sigma``: the robust standard deviation of log(predicted / measured) peak memory
  (1.4826 x their median absolute deviation) where ``plan fit`` measured it; a layout fits
  only when its predicted bytes x exp(1.645 x memory_sigma) do, 95% confidence
  (``peak.capacity``); 0: the prediction taken as exact.
* ``fitted``: what ``python -m minipar.plan fit`` fitted the profile to ({"data", "sha256",
  "rows", "parameters": {name: [value, sigma]}, "training", "holdout": [scores]}); every
  estimate notes the holdouts' error bar, or that the profile (empty: set by hand) is unfitted.
* ``cores``: the CPU cores a node's devices share, each device a one-thread process
  (``laptop-cpu``, a calibrated file; ``"auto"``: this machine's usable cores). With more
  processes on a node than cores, each computes ``processes / cores`` times slower
  (``Hardware.oversubscription``), and the estimate says so. 0 (GPUs): one engine each.

Every peak, bandwidth and latency must be finite and positive (those whose 0 means "left
out" may be 0), and the two-column tables (``bandwidth_by_size``, ``inter_node_efficiency``,
``fabric_efficiency``, ``p2p_latency``) pairs of such numbers by strictly increasing first
column: a file with a NaN, a zero, a negative, a malformed or an out-of-order one is refused
with one line.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from .errors import PlanError

PRESET_DIR = Path(__file__).resolve().parent.parent / "hardware"


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    compute_efficiency: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    dtype: str = "mixed"            # the training precision this hardware runs: mixed or fp32
    description: str = ""
    collective_latency: float = 0.0
    tree: dict | None = None
    bandwidth_by_size: list = field(default_factory=list)
    local_links: list = field(default_factory=list)
    collective_table: list | str | None = None
    inter_node_efficiency: list = field(default_factory=list)
    hbm_bandwidth: float = 0.0
    attention_efficiency: float = 0.0
    matmul_table: list = field(default_factory=list)
    step_calibration: float = 1.0
    runtime_bytes: float = 0.0
    fragmentation: float = 0.0
    overlap_slowdown: float = 0.0
    overlap_exposed: float = 0.0
    gemm_half_flops: float = 0.0
    intra_node_efficiency: float = 1.0
    layer_overhead: float = 0.0
    overhead_hiding: float = 1.0
    p2p_latency: list = field(default_factory=list)
    fabric_efficiency: list = field(default_factory=list)
    all_gather_efficiency: float = 1.0
    reduce_scatter_efficiency: float = 1.0
    memory_sigma: float = 0.0
    layer_buffer_bytes: float = 0.0
    pipeline_tp_latency: float = 0.0
    fitted: dict = field(default_factory=dict, compare=False)
    cores: int = 0                  # CPU cores a node's devices share; 0: one engine each
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    def usable_bytes(self, reserve: float | None = None) -> float:
        """What a model may fill: the memory less the runtime's share, less the
        fragmentation margin (``reserve`` overrides the hardware's fraction)."""
        frac = self.fragmentation if reserve is None else reserve
        return (self.memory_bytes - self.runtime_bytes) * (1 - frac)

    def oversubscription(self, devices: int) -> float:
        """How many times slower each device computes when ``devices`` of them share a
        node's ``cores`` (time-slicing: 4 one-thread processes on 2 cores each get half a
        core); 1 when every device has its own engine or core."""
        return max(1.0, min(devices, self.gpus_per_node) / self.cores) if self.cores else 1.0

    def nodes(self, devices: int) -> int:
        """Nodes a job of ``devices`` spans: where the fabric's share and the p2p cost are
        read (``timing.link_bandwidth``, ``timing.p2p_time``)."""
        return -(-devices // self.gpus_per_node)

    def to_dict(self) -> dict:
        return asdict(self)


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:             # macOS, Windows: no affinity call
        return os.cpu_count() or 1


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _positive(value, what: str, where: str, zero_ok: bool = False) -> None:
    """PlanError unless ``value`` is a finite number > 0 (>= 0 with ``zero_ok``)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= 0 if zero_ok else value > 0))
    if not ok:
        bound = "finite and >= 0" if zero_ok else "finite and > 0"
        raise PlanError(f"{where}: {what} must be {bound}, got {value!r}")


def _pairs(rows, what: str, where: str, first: str, second: str) -> None:
    """PlanError unless ``rows`` is a list of [number, number] pairs, both finite and > 0,
    the first column strictly increasing (the tables are read in that order: one row per
    size or width, no duplicates)."""
    if not isinstance(rows, list):
        old = (" (one number: a profile from an older minipar; fit it again with python -m "
               "minipar.plan fit)" if isinstance(rows, (int, float)) else "")
        raise PlanError(f"{where}: {what} must be a list of [{first}, {second}] pairs, got "
                        f"{rows!r}{old}")
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != 2:
            raise PlanError(f"{where}: each {what} row is a pair [{first}, {second}], got {row!r}")
        _positive(row[0], f"{what} {first}", where)
        _positive(row[1], f"{what} {second}", where)
        if i and row[0] <= rows[i - 1][0]:
            raise PlanError(f"{where}: {what} rows must go by strictly increasing {first}, "
                            f"one row each; got {row[0]!r} after {rows[i - 1][0]!r}")


def _objects(rows, what: str, where: str, keys: tuple[str, ...]) -> None:
    """PlanError unless ``rows`` is a list of JSON objects, each with ``keys`` finite and > 0."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise PlanError(f"{where}: {what} must be a list of objects, got {rows!r}")
    for row in rows:
        for key in keys:
            _positive(row.get(key), f"{what} {key}", where)


def check_numbers(hw: Hardware, where: str) -> None:
    """Every peak, bandwidth and latency finite and positive (a zero latency or bandwidth
    would make collectives free or infinite, a NaN poison every prediction); the optional
    ones that mean "left out" at 0 may be 0."""
    for name in ("gpus_per_node", "memory_bytes", "peak_flops", "compute_efficiency",
                 "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency",
                 "inter_node_latency", "step_calibration", "intra_node_efficiency",
                 "all_gather_efficiency", "reduce_scatter_efficiency", "overhead_hiding"):
        _positive(getattr(hw, name), name, where)
    for name in ("collective_latency", "hbm_bandwidth", "attention_efficiency", "runtime_bytes",
                 "cores", "gemm_half_flops", "layer_overhead", "memory_sigma",
                 "layer_buffer_bytes", "pipeline_tp_latency"):
        _positive(getattr(hw, name), name, where, zero_ok=True)
    for name in ("compute_efficiency", "attention_efficiency", "intra_node_efficiency",
                 "all_gather_efficiency", "reduce_scatter_efficiency"):
        if getattr(hw, name) > 1:
            raise PlanError(f"{where}: {name} is a fraction, at most 1, got {getattr(hw, name)!r}")
    if hw.overhead_hiding < 1:
        raise PlanError(f"{where}: overhead_hiding must be at least 1, got {hw.overhead_hiding!r}")
    if hw.runtime_bytes >= hw.memory_bytes:
        raise PlanError(f"{where}: runtime_bytes must be less than memory_bytes")
    if hw.tree is not None and not isinstance(hw.tree, dict):
        raise PlanError(f"{where}: tree must be an object, got {hw.tree!r}")
    for key in ("base_latency", "intra_latency", "inter_latency",
                "bandwidth_factor") if hw.tree is not None else ():
        _positive(hw.tree.get(key), f"tree.{key}", where, zero_ok=key == "base_latency")
    _objects(hw.local_links, "local_links", where, ("devices", "bandwidth"))
    _pairs(hw.bandwidth_by_size, "bandwidth_by_size", where, "bytes", "factor")
    _pairs(hw.inter_node_efficiency, "inter_node_efficiency", where, "nodes", "fraction")
    _pairs(hw.p2p_latency, "p2p_latency", where, "nodes", "seconds")
    _pairs(hw.fabric_efficiency, "fabric_efficiency", where, "nodes", "fraction")
    for name in ("inter_node_efficiency", "fabric_efficiency"):
        if any(row[1] > 1 for row in getattr(hw, name)):
            raise PlanError(f"{where}: {name} fractions are at most 1")
    _objects(hw.matmul_table, "matmul_table", where, ("m", "n", "k", "flops_per_s"))


def hardware_from_dict(data: dict, where: str = "hardware") -> Hardware:
    names = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware)
                if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise PlanError(f"{where} lacks {', '.join(missing)}; copy a preset from {PRESET_DIR} "
                        f"or run 'python -m minipar.bench calibrate' to write a complete file")
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"{where} has unknown field(s) {', '.join(unknown)}; "
                        f"known fields: {', '.join(sorted(names))}")
    for name in required - {"name"}:
        if isinstance(data[name], bool) or not isinstance(data[name], (int, float)):
            raise PlanError(f"{where}: {name} must be a number, got {data[name]!r}")
    if data.get("cores") == "auto":       # this machine's: the cores this process may use
        data = dict(data, cores=_cpu_cores())
    hw = Hardware(**data)
    check_numbers(hw, where)
    for name in ("fragmentation", "overlap_slowdown", "overlap_exposed"):
        if not 0 <= getattr(hw, name) < 1:
            raise PlanError(f"{where}: {name} must be a fraction from 0 to 1")
    if isinstance(hw.collective_table, str):
        table = Path(hw.collective_table)
        if not table.is_absolute() and where != "hardware":
            table = Path(where).parent / table
        try:
            rows = json.loads(table.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"{where}: cannot read collective_table {table}: {e}") from None
        hw = replace(hw, collective_table=rows)
    for row in hw.collective_table or []:
        if not isinstance(row, dict) or row.get("op") not in ("all_reduce", "all_gather",
                                                              "reduce_scatter"):
            raise PlanError(f"{where}: collective_table rows are {{op, bytes, per_node, "
                            f"nodes, seconds}} with op all_reduce, all_gather or "
                            f"reduce_scatter; got {row!r}")
        for key in ("bytes", "per_node", "nodes", "seconds"):
            _positive(row.get(key), f"collective_table {key}", where)
    if hw.dtype not in ("mixed", "fp32"):
        raise PlanError(f"{where}: dtype must be 'mixed' or 'fp32', got {hw.dtype!r}")
    return hw


def load_hardware(name_or_path: str | Path | Hardware) -> Hardware:
    """A preset by name (``frontier-mi250x``) or a JSON file by path."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    preset = PRESET_DIR / f"{name_or_path}.json"
    path = preset if preset.is_file() else Path(name_or_path)
    if not path.is_file():
        raise PlanError(f"unknown hardware {str(name_or_path)!r}: not a preset "
                        f"({', '.join(hardware_presets())}) nor an existing JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read hardware file {path}: {e}; fix the JSON or "
                        f"write a new one with 'python -m minipar.bench calibrate'") from None
    if not isinstance(data, dict):
        raise PlanError(f"hardware file {path} must hold a JSON object")
    return hardware_from_dict(data, where=str(path))
