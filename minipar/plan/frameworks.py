"""Framework profiles: what a training framework can run, and how its engine communicates.

A search should only return layouts the target framework runs, and an estimate should
charge collectives the way that framework's engine issues them. A profile says:

* ``order``: how its process grid is laid over device numbers, innermost axis first;
* ``interleaving``, ``sp``, ``cp``: whether it has the interleaved 1F1B schedule, Megatron's
  sequence parallelism and context parallelism (ring attention over a cp axis next to tp);
  ``recompute``: its activation-recomputation modes;
* ``specs``: which (s_p, s_g, s_os) data-parallel shardings it has, given dp and pp;
* how its data-parallel engine issues collectives (``network.engine_collectives``):
  gradient reductions in buckets of ``grad_bucket`` parameters (None: one call per model
  unit, FSDP's wrapping), whether they start during backward (``grad_overlap``), whether
  sharded parameters are gathered unit by unit with prefetch (``param_prefetch``), and
  whether the gather of updated parameters after the optimizer step overlaps the next
  forward (``gather_overlaps_forward``);
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
* ``stage_rule``: how it cuts the layers into pipeline stages (``stages``: even, megatron,
  uniform, balanced), and so whether a pp that does not divide the layers runs;
* ``logit_bytes``: bytes per logit at the loss's peak in mixed precision (``peak``);
* ``tp_overlap``: its tensor-parallel collectives run beside the GEMMs they feed (Megatron-LM's
  ``--tp-comm-overlap``, TransformerEngine's userbuffers), hiding behind them what the
  GEMMs' time allows, at the hardware's ``overlap_slowdown``; otherwise they block.

The profiles describe the frameworks as their documentation and source say; where a
framework has a switch, the profile takes the setting its published large-scale recipes use
and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError
from .sharding import Shard, shard_specs, zero_shard


@dataclass(frozen=True)
class Framework:
    name: str
    description: str
    order: str
    interleaving: bool
    sp: bool
    recompute: tuple
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
    gather_per_module: bool = False       # one parameter gather per module with parameters
                                          # (DeepSpeed ZeRO-3, AMSP), not one per layer
    memory_reserve: float | None = None   # (reserved - allocated) / reserved of its allocator at
                                          # the peak, measured; None: the hardware's fragmentation
    cp: bool = False                      # context parallelism (ring attention)
    stage_rule: str = "even"              # how pipeline stages are cut (plan.stages)
    logit_bytes: float = 10               # bytes per logit at the loss's peak (plan.peak)
    tp_overlap: bool = False              # TP collectives overlap the GEMMs they feed
    sources: tuple = ()

    def bucket_params(self, dp: int) -> float | None:
        if self.grad_bucket is None:
            return None
        return max(self.grad_bucket, self.bucket_per_rank * dp)

    def specs(self, dp: int, pp: int, per_node: int | None) -> list[Shard]:
        """The (s_p, s_g, s_os) shardings this framework runs over ``dp`` ranks."""
        if self.spec_family == "amsp":
            return shard_specs(dp, per_node)
        if self.spec_family == "zero01":        # DeepSpeed: ZeRO-2/3 refuse pipelines
            stages = (0, 1) if pp > 1 else (0, 1, 2, 3)
            return sorted({zero_shard(z, dp) for z in stages})
        if self.spec_family == "dist-opt":      # Megatron-LM: DDP or distributed optimizer
            return sorted({zero_shard(0, dp), zero_shard(1, dp)})
        if self.spec_family == "fsdp":          # NO_SHARD, SHARD_GRAD_OP, FULL/HYBRID_SHARD
            out = {zero_shard(0, dp), zero_shard(2, dp), zero_shard(3, dp)}
            if per_node and dp > per_node and dp % per_node == 0:
                out.add((per_node, per_node, per_node))
            return sorted(out)
        raise ValueError(self.spec_family)


# Every GPU framework here allocates through PyTorch's CUDA caching allocator; one published
# measurement of what it holds beyond live tensors in LLM training, shared by their profiles
# until one is measured per framework (python -m minipar.bench gpu prints it):
CACHING_ALLOCATOR_RESERVE = 0.115
CACHING_ALLOCATOR_SOURCE = (
    "memory_reserve 0.115, derived: GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156) "
    "measured PyTorch's caching allocator holding 9.2 GB on average (up to 25 GB) of an "
    "A100-80GB beyond the live tensors of eight LLM training workloads; 9.2 / 80")

FRAMEWORKS: dict[str, Framework] = {
    "minipar": Framework(
        "minipar", "this package: every AMSP spec, interleaving, sequence parallelism",
        order="tp,pp,dp", interleaving=True, sp=True, recompute=("none", "selective", "full"),
        spec_family="amsp", grad_bucket=None, grad_overlap=False,
        param_prefetch=True, gather_overlaps_forward=False,
        dp_bucket_bytes=4 * 2**20, dp_overlap=True, cp=True,
        sources=("minipar/cp.py: --cp N, ring attention with the causal load balance",
                 "minipar/zero.py: per-unit flat buffers, gathers prefetched one unit "
                 "ahead, each unit's gradient reduce-scattered when its backward ends "
                 "(a blocking call), the step's collectives unit by unit after backward",
                 "minipar/dp.py: plain DP all-reduces 4 MiB buckets (--bucket-mb) as "
                 "backward fills them (--dp-mode overlapped, the default)")),
    "megatron-lm": Framework(
        "megatron-lm", "Megatron-LM (core DDP, distributed optimizer, overlapped grads and "
        "param gathers)",
        order="tp,dp,pp", interleaving=True, sp=True, recompute=("none", "selective", "full"),
        spec_family="dist-opt", grad_bucket=40e6, grad_overlap=True, 
        param_prefetch=True, gather_overlaps_forward=True, grad_bytes=4,
        reduce_bytes=4, bucket_per_rank=1e6,
        memory_reserve=CACHING_ALLOCATOR_RESERVE, cp=True, stage_rule="megatron",
        logit_bytes=6, tp_overlap=True,
        sources=(CACHING_ALLOCATOR_SOURCE, "rank order tp-cp-ep-dp-pp (megatron/core/parallel_state.py)",
                 "uneven pipeline stages: --decoder-first-pipeline-num-layers and "
                 "--decoder-last-pipeline-num-layers, the middle stages equal "
                 "(megatron/core/transformer/transformer_block.py, get_num_layers_to_build)",
                 "loss: the 16-bit logits cast to fp32 once, the max subtracted and the exp "
                 "taken in place (megatron/core/tensor_parallel/cross_entropy.py): 2 + 4 "
                 "bytes per logit",
                 "--tp-comm-overlap assumed on, as the H100 scaling runs of its README used it "
                 "(TransformerEngine userbuffers overlap TP's all-gathers and "
                 "reduce-scatters with the GEMMs)",
                 "--context-parallel-size: ring attention (TransformerEngine) with the causal "
                 "load balance; the planner prices its ring as minipar's",
                 "buckets of max(40M, 1M x dp) parameters, fp32 main_grad buffers "
                 "(megatron/core/distributed/distributed_data_parallel.py); with bf16 they are "
                 "accumulated and reduced in fp32 (accumulate_allreduce_grads_in_fp32)",
                 "distributed optimizer: 6 + 12/d bytes per parameter with bf16 params and "
                 "fp32 grads (Megatron-LM docs, 'Distributed Optimizer')",
                 "--overlap-grad-reduce --overlap-param-gather assumed on, as in its "
                 "published large-scale recipes")),
    "megatron-deepspeed": Framework(
        "megatron-deepspeed", "Megatron-DeepSpeed (the Frontier study's framework): 1F1B "
        "pipelines without interleaving, no sequence parallelism, ZeRO-0/1 under pipelines "
        "(2 and 3 only without)",
        order="tp,dp,pp", interleaving=False, sp=False, recompute=("none", "full"),
        spec_family="zero01", grad_bucket=5e8, grad_overlap=False,
        param_prefetch=True, gather_overlaps_forward=False, grad_bytes=4,
        gather_per_module=True, stage_rule="uniform", logit_bytes=6,
        memory_reserve=CACHING_ALLOCATOR_RESERVE,
        sources=(CACHING_ALLOCATOR_SOURCE, "topology axes pipe, data, model with model innermost "
                 "(deepspeed/runtime/pipe/topology.py PipeModelDataParallelTopology)",
                 "the pipeline engine reduces gradients after the last micro-batch's "
                 "backward (deepspeed/runtime/pipe/engine.py, ReduceGrads)",
                 "ZeRO stages 2 and 3 are refused with pipeline parallelism (DeepSpeed "
                 "pipeline docs); its ZeRO-3 gathers module by module as deepspeed-zero3's",
                 "reduce/allgather bucket size 5e8 elements (DeepSpeed config docs, "
                 "zero_optimization defaults)",
                 "BF16_Optimizer accumulates gradients in fp32 "
                 "(deepspeed/runtime/bf16_optimizer.py)",
                 "no interleaved schedule in DeepSpeed's PipelineEngine; activation "
                 "checkpointing is full (--checkpoint-activations)",
                 "pipeline stages by PipelineModule(partition_method='type:transformer'): "
                 "layers as evenly as whole layers allow (deepspeed/runtime/utils.py "
                 "partition_uniform); Megatron's vocab-parallel loss (2 + 4 bytes per logit)")),
    "fsdp": Framework(
        "fsdp", "PyTorch FSDP: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD over a node",
        order="tp,dp,pp", interleaving=False, sp=True,
        recompute=("none", "selective", "full"),
        spec_family="fsdp", grad_bucket=None, grad_overlap=True, 
        param_prefetch=True, gather_overlaps_forward=True,
        memory_reserve=CACHING_ALLOCATOR_RESERVE,
        sources=(CACHING_ALLOCATOR_SOURCE, "one all-gather and one reduce-scatter per wrapped unit (a transformer "
                 "block), backward and forward prefetch (torch.distributed.fsdp docs)",
                 "selective activation checkpointing as torchtitan applies it "
                 "(torch.utils.checkpoint with a policy)",
                 "loss: F.cross_entropy on a .float() copy of the logits (torchtitan): 2 + 4 "
                 "+ 4 bytes per logit")),
    "llm-foundry": Framework(
        "llm-foundry", "MosaicML LLM Foundry on PyTorch FSDP (Composer), with its fused "
        "cross-entropy",
        order="tp,dp,pp", interleaving=False, sp=False, recompute=("none", "full"),
        spec_family="fsdp", grad_bucket=None, grad_overlap=True,
        param_prefetch=True, gather_overlaps_forward=True, logit_bytes=4,
        memory_reserve=CACHING_ALLOCATOR_RESERVE,
        sources=(CACHING_ALLOCATOR_SOURCE,
                 "FSDP as the fsdp profile (its benchmark table's Sharding Strategy column)",
                 "loss_fn defaults to fused_crossentropy, flash_attn.losses.cross_entropy."
                 "CrossEntropyLoss (llm_foundry/models/mpt/modeling_mpt.py): the 16-bit "
                 "logits and their 16-bit gradient, no fp32 copy: 2 + 2 bytes per logit")),
    "deepspeed-zero3": Framework(
        "deepspeed-zero3", "DeepSpeed ZeRO stages 0-3 without pipelines: ZeRO-3 gathers "
        "parameters module by module, reduces gradients in buckets",
        order="tp,dp,pp", interleaving=False, sp=False, recompute=("none", "full"),
        spec_family="zero01", grad_bucket=5e8, grad_overlap=True, param_prefetch=True,
        gather_overlaps_forward=False, gather_per_module=True,
        memory_reserve=CACHING_ALLOCATOR_RESERVE,
        sources=(CACHING_ALLOCATOR_SOURCE,
                 "ZeRO-3 fetches each submodule's partitioned parameters in a pre-forward "
                 "hook and prefetches the next ones "
                 "(deepspeed/runtime/zero/partitioned_param_coordinator.py, fetch_sub_module)",
                 "reduce_bucket_size 5e8 elements, overlap_comm on as its ZeRO-3 examples set "
                 "it (DeepSpeed config docs, zero_optimization)")),
    "amsp": Framework(
        "amsp", "AMSP's executor: every (s_p, s_g, s_os) spec, gathers module by module with "
        "prefetch, reduce-scatters overlapped with backward",
        order="tp,pp,dp", interleaving=False, sp=False, recompute=("none", "full"),
        spec_family="amsp", grad_bucket=None, grad_overlap=True, param_prefetch=True,
        gather_overlaps_forward=False, gather_per_module=True,
        memory_reserve=CACHING_ALLOCATOR_RESERVE,
        sources=(CACHING_ALLOCATOR_SOURCE,
                 "Chen et al. 2023 (arXiv 2311.00257), the executor: AllGather prefetching "
                 "and ReduceScatter scheduling overlapped with computation; its gathers are "
                 "issued per module as ZeRO-3's are (the paper compares against DeepSpeed's)")),
    "nanotron": Framework(
        "nanotron", "nanotron (Hugging Face): TP with sequence parallelism, 1F1B pipelines "
        "balanced by cost, ZeRO-0/1, gradients accumulated and reduced in fp32",
        order="tp,dp,pp", interleaving=False, sp=True, recompute=("none", "full"),
        spec_family="dist-opt", grad_bucket=25 * 2**20 / 4, grad_overlap=True,
        param_prefetch=False, gather_overlaps_forward=False, grad_bytes=4, reduce_bytes=4,
        memory_reserve=CACHING_ALLOCATOR_RESERVE, stage_rule="balanced", logit_bytes=8,
        sources=(CACHING_ALLOCATOR_SOURCE,
                 "process grid view(pp, dp, tp), tp innermost (src/nanotron/parallel/"
                 "context.py)",
                 "pipeline stages balanced by cost, any pp that gives every stage a block "
                 "(src/nanotron/models/base.py build_model; models/llama.py "
                 "get_block_compute_costs); engines 1f1b and afab, no interleaving",
                 "ZeRO-1 (optim/zero.py) or none; accumulate_grad_in_fp32 and DDP buckets of "
                 "25 MB as the Ultra-Scale Playbook's sweep set them (huggingface/"
                 "bench_cluster template/base_config.py: ddp_bucket_cap_mb 25, "
                 "accumulate_grad_in_fp32, tp_mode REDUCE_SCATTER, "
                 "tp_linear_async_communication false, recompute_layer false)",
                 "SP's all-gathered GEMM inputs not kept whole: the sweep's measured peaks "
                 "(its 1B rows, 526 runs) say so. Kept whole (2 x 2 s b h (1 - 1/t) per "
                 "layer, as a reading of its column_linear suggested), the predicted peak "
                 "runs 2.2x high at tp 32 and 1.3-2.4x at micro-batches of 32 and more; "
                 "without, the median log error is within 0.17 at every tp and micro-batch "
                 "(tests/test_plan_fit.py)",
                 "loss: cast_to_fp32, then sharded_cross_entropy subtracts the max out of "
                 "place and keeps the fp32 softmax (4 + 4 bytes per logit)")),
}


MODULES_PER_LAYER = {"gpt": 6, "llama": 9}     # modules holding parameters, per layer


def gather_calls(fw: Framework, arch: str, layers: int, ends: int) -> int:
    """Parameter gathers one pass of a stage with ``layers`` layers and ``ends`` end units
    (embedding, head) issues under ``fw``."""
    per_layer = MODULES_PER_LAYER[arch] if fw.gather_per_module else 1
    return layers * per_layer + ends


def load_framework(name: str | Framework) -> Framework:
    if isinstance(name, Framework):
        return name
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise PlanError(f"unknown framework {name!r}; use one of "
                        f"{', '.join(FRAMEWORKS)}") from None


def check_framework(fw: Framework, layout, dp_per_node: int | None = None,
                    shape=None) -> None:
    """PlanError unless ``fw`` can run ``layout`` (schedule, SP, recomputation, stages of
    ``shape`` when given, spec), whatever cp is."""
    if layout.sp and not fw.sp:
        raise PlanError(f"{fw.name} has no sequence parallelism; leave out --sp or choose "
                        f"another --framework")
    if layout.v > 1 and not fw.interleaving:
        raise PlanError(f"{fw.name} has no interleaved schedule; use --chunks 1 or another "
                        f"--framework")
    if layout.recompute not in fw.recompute:
        raise PlanError(f"{fw.name} has no {layout.recompute!r} recomputation; it has "
                        f"{', '.join(fw.recompute)}")
    if layout.cp > 1 and not fw.cp:
        frameworks = ", ".join(f.name for f in FRAMEWORKS.values() if f.cp)
        raise PlanError(f"{fw.name} has no context parallelism in this planner; use --cp 1 or "
                        f"--framework {frameworks.replace(', ', ' or ')}")
    from .stages import split_violation
    why = split_violation(shape, layout.pp, fw.stage_rule, layout.v) if shape else None
    if why:
        raise PlanError(f"{why} ({fw.name})")
    specs = fw.specs(layout.replicas, layout.pp, dp_per_node)
    if fw.spec_family != "amsp" and tuple(layout.shard) not in specs:
        raise PlanError(f"{fw.name} does not run shard spec {tuple(layout.shard)} with "
                        f"dp x cp = {layout.replicas}, pp={layout.pp}; it runs "
                        f"{', '.join(str(s) for s in specs)}")
