"""Hardware descriptions: what a device computes, holds and sends.

A hardware file is JSON with the fields of ``Hardware`` (plus an optional ``sources`` object
saying where each number comes from). The presets live in ``minipar/hardware/*.json``; any
path to such a file works wherever a preset name does, and ``python -m minipar.plan
calibrate`` writes one for the machine it runs on.

Units: bytes, seconds, FLOP/s. Bandwidths are per direction.

* ``peak_flops``: dense 16-bit matmul peak of one device (fp32 for a CPU process).
* ``compute_efficiency``: the fraction of peak at which a training step runs its matmul
  FLOPs; the planner computes at ``peak_flops * compute_efficiency`` ("achievable"), so it
  also carries everything that is not a large matmul (attention, element-wise kernels, the
  optimizer, the framework). The GPU presets assume large GEMMs' efficiency (a
  billion-parameter model's step is mostly large GEMMs); ``calibrate`` measures a real
  small-model step's model FLOP/s over the measured matmul peak.
* ``intra_node_bandwidth``: what one device can push to a neighbour in its node (the slowest
  link a ring over the node crosses).
* ``inter_node_bandwidth``: the node's NICs together. A collective whose group spans nodes
  gets, per device, this divided by the devices of the node that share the NICs.
* latencies: the alpha of the alpha-beta model, per ring step.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
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
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    def to_dict(self) -> dict:
        return asdict(self)


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def hardware_from_dict(data: dict, where: str = "hardware") -> Hardware:
    names = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware)} - {"dtype", "description", "sources"}
    missing = sorted(required - set(data))
    if missing:
        raise PlanError(f"{where} lacks {', '.join(missing)}; copy a preset from {PRESET_DIR} "
                        f"or run 'python -m minipar.plan calibrate' to write a complete file")
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"{where} has unknown field(s) {', '.join(unknown)}; "
                        f"known fields: {', '.join(sorted(names))}")
    for name in required - {"name"}:
        if isinstance(data[name], bool) or not isinstance(data[name], (int, float)):
            raise PlanError(f"{where}: {name} must be a number, got {data[name]!r}")
    hw = Hardware(**data)
    for name in ("gpus_per_node", "memory_bytes", "peak_flops", "compute_efficiency",
                 "intra_node_bandwidth", "inter_node_bandwidth"):
        if not getattr(hw, name) > 0:
            raise PlanError(f"{where}: {name} must be positive, got {getattr(hw, name)!r}")
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
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read hardware file {path}: {e}; fix the JSON or "
                        f"write a new one with 'python -m minipar.plan calibrate'") from None
    if not isinstance(data, dict):
        raise PlanError(f"hardware file {path} must hold a JSON object")
    return hardware_from_dict(data, where=str(path))
