"""Framework profiles: what a training framework can run, and how its engine communicates.

A search should only return layouts the target framework runs, and an estimate should
charge collectives the way that framework's engine issues them. A profile (``Framework``,
each field's comment saying what it is) says what the framework runs (its rank order,
schedules, ``specs``, recomputation modes, sequence and context parallelism, stage rule),
how its data-parallel engine issues collectives (``network.engine_collectives``: buckets,
overlap, prefetch), and what needs more words:

* ``gather_per_module``: sharded parameters are gathered module by module, as the engine's
  hooks fetch them (DeepSpeed ZeRO-3's parameter coordinator, AMSP's executor): a GPT layer
  has 6 modules with parameters (QKV, output projection, fc1, fc2, two LayerNorms), a LLaMA
  layer 9 (q, k, v, o, gate, up, down, two RMSNorms), and each gather pays its latency;
  otherwise one gather per model unit (a layer; FSDP's wrapping, minipar's ZeRO units);
* ``memory_reserve``: the fraction of device memory its allocator holds beyond the live
  tensors at their peak, (reserved - allocated) / reserved, from a measurement (None: the
  hardware file's ``fragmentation``); the search refuses layouts that do not fit what is left;
* ``grad_bytes``: bytes per parameter of the gradient buffer the engine keeps (Megatron-LM
  accumulates bf16 gradients into fp32 ``main_grad`` buffers, DeepSpeed's BF16_Optimizer
  into fp32 buffers too: 4; None: the dtype's 2); ``reduce_bytes``: the precision its
  gradient reductions send (Megatron-LM reduces its fp32 buffers: 4);
* ``tp_overlap``: its tensor-parallel collectives run beside the GEMMs they feed (Megatron-LM's
  ``--tp-comm-overlap``, TransformerEngine's userbuffers), hiding behind them what the
  GEMMs' time allows, at the hardware's ``overlap_slowdown``; otherwise they block.

The profiles describe the frameworks as their documentation and source say; where a framework
has a switch, the profile takes the setting its published large-scale recipes use and says so.
They live in ``frameworks.json`` beside this module, as the hardware presets live in
``minipar/hardware/*.json``: one object per framework, keyed by its name, with the fields of
``Framework`` (those left out take its defaults) and ``sources``, where each setting comes from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import PlanError, raise_if
from .memory import GLU_SAVED
from .sharding import Shard, shard_specs, zero_shard

DATA = Path(__file__).resolve().parent / "frameworks.json"


@dataclass(frozen=True)
class Framework:
    name: str
    description: str
    order: str                    # its process grid over device numbers, innermost axis first
    interleaving: bool            # the interleaved 1F1B schedule
    sp: bool                      # Megatron's sequence parallelism
    recompute: tuple              # its activation-recomputation modes
    spec_family: str              # amsp | zero01 (ZeRO-0/1; 0-3 without PP) | dist-opt | fsdp
    grad_bucket: float | None     # parameters per gradient bucket; None: one call per unit
    grad_overlap: bool            # reductions start during backward, bucket by bucket
    param_prefetch: bool          # sharded parameters gathered per unit, next one prefetched
    gather_overlaps_forward: bool  # the after-step parameter gather hides behind next forward
    grad_bytes: int | None = None  # bytes per parameter of the gradient buffer; None: dtype's
    reduce_bytes: int | None = None  # bytes per element its gradient reductions send
    bucket_per_rank: float = 0.0   # buckets grow with dp: max(grad_bucket, this x dp)
    dp_bucket_bytes: float | None = None  # plain DP (1,1,1) all-reduce buckets, in bytes,
                                          # when its engine differs from the sharded one
    dp_overlap: bool | None = None        # plain DP buckets overlap backward (None: as grads)
    gather_per_module: bool = False       # one parameter gather per module (module docstring)
    memory_reserve: float | None = None   # its allocator's measured reserve (module docstring)
    cp: bool = False                      # context parallelism (ring attention next to tp)
    stage_rule: str = "even"              # how pipeline stages are cut (plan.stages), and so
                                          # whether a pp that does not divide the layers runs
    logit_bytes: float = 10               # bytes per logit at the loss's peak, mixed (plan.peak)
    tp_overlap: bool = False              # TP collectives overlap the GEMMs they feed
    glu_saved: int = GLU_SAVED            # F-wide tensors a SwiGLU MLP keeps (plan.memory)
    sources: tuple = ()

    def bucket_params(self, dp: int) -> float | None:
        return None if self.grad_bucket is None else max(self.grad_bucket,
                                                         self.bucket_per_rank * dp)

    def specs(self, dp: int, pp: int, per_node: int | None) -> list[Shard]:
        """The (s_p, s_g, s_os) shardings this framework runs over ``dp`` ranks."""
        if self.spec_family == "amsp":
            return shard_specs(dp, per_node)
        if self.spec_family == "zero01":        # DeepSpeed: ZeRO-2/3 refuse pipelines
            return sorted({zero_shard(z, dp) for z in ((0, 1) if pp > 1 else (0, 1, 2, 3))})
        if self.spec_family == "dist-opt":      # Megatron-LM: DDP or distributed optimizer
            return sorted({zero_shard(0, dp), zero_shard(1, dp)})
        if self.spec_family == "fsdp":          # NO_SHARD, SHARD_GRAD_OP, FULL/HYBRID_SHARD
            out = {zero_shard(0, dp), zero_shard(2, dp), zero_shard(3, dp)}
            if per_node and dp > per_node and dp % per_node == 0:
                out.add((per_node, per_node, per_node))
            return sorted(out)
        raise ValueError(self.spec_family)


def _profiles() -> dict[str, Framework]:
    """The profiles of ``frameworks.json``, in its order (``--framework``'s choices)."""
    return {name: Framework(name, **{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in profile.items()})
            for name, profile in json.loads(DATA.read_text()).items()}


FRAMEWORKS: dict[str, Framework] = _profiles()
# Every GPU framework here allocates through PyTorch's CUDA caching allocator; their profiles
# share one published measurement of what it holds beyond live tensors in LLM training (GMLake,
# in their sources) until one is measured per framework (python -m minipar.bench gpu prints it)
CACHING_ALLOCATOR_RESERVE = FRAMEWORKS["megatron-lm"].memory_reserve


MODULES_PER_LAYER = {"gpt": 6, "llama": 9}     # modules holding parameters, per layer


def gather_calls(fw: Framework, arch: str, layers: int, ends: int) -> int:
    """Parameter gathers one pass of a stage with ``layers`` layers and ``ends`` end units
    (embedding, head) issues under ``fw``."""
    return layers * (MODULES_PER_LAYER[arch] if fw.gather_per_module else 1) + ends


def load_framework(name: str | Framework) -> Framework:
    if isinstance(name, Framework):
        return name
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise PlanError(f"unknown framework {name!r}; use one of "
                        f"{', '.join(FRAMEWORKS)}") from None


def capability_violation(fw: Framework, sp: bool = False, v: int = 1,
                         recompute: tuple = (), cp: int = 1) -> str | None:
    """Why ``fw`` cannot run what was asked, or None: sequence parallelism, v > 1 chunks
    (interleaving), recomputation where it has none of the ``recompute`` modes, cp > 1."""
    if sp and not fw.sp:
        return (f"{fw.name} has no sequence parallelism; leave out --sp or choose another "
                f"--framework")
    if v > 1 and not fw.interleaving:
        return (f"{fw.name} has no interleaved schedule; use --chunks 1 (and no --schedule "
                f"interleaved) or another --framework")
    if recompute and not set(recompute) & set(fw.recompute):
        return (f"{fw.name} has no {' or '.join(map(repr, recompute))} recomputation; it has "
                f"{', '.join(fw.recompute)}")
    if cp > 1 and not fw.cp:
        frameworks = " or ".join(f.name for f in FRAMEWORKS.values() if f.cp)
        return (f"{fw.name} has no context parallelism in this planner; use --cp 1 (and no "
                f"--max-cp) or --framework {frameworks}")
    return None


def check_framework(fw: Framework, layout, dp_per_node: int | None = None) -> None:
    """PlanError unless ``fw`` can run ``layout`` (``capability_violation``, the spec; its
    stages, cut by ``fw.stage_rule``, are ``layout.check_layout``'s)."""
    raise_if(capability_violation(fw, layout.sp, layout.v, (layout.recompute,), layout.cp))
    specs = fw.specs(layout.replicas, layout.pp, dp_per_node)
    if fw.spec_family != "amsp" and tuple(layout.shard) not in specs:
        raise PlanError(f"{fw.name} does not run shard spec {tuple(layout.shard)} with "
                        f"dp x cp = {layout.replicas}, pp={layout.pp}; it runs "
                        f"{', '.join(str(s) for s in specs)}")
