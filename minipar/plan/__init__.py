"""minipar.plan: analytical models of LLM training at scale, and a strategy search.

Read top to bottom, one module per question:

    shapes      how many parameters, how many FLOPs      (Narayanan et al. 2021)
    sharding    ZeRO stages as AMSP specs, AMSP's rules  (Rajbhandari et al. 2020; Chen et al. 2023)
    memory      what fills a device                      (ZeRO; Korthikanti et al. 2022)
    hardware    what a device computes, holds, sends     (presets: minipar/hardware/*.json)
    frameworks  what a framework runs, how its engine issues collectives
    network     bytes of collectives, per call as engines issue them   (rings and trees)
    timing      time of one collective: NCCL's tuning model or a measured table, and what
                no measurement covers (``coverage``: "unvalidated")
    compute     a step's compute: GEMMs by shape, attention, memory-bound kernels, optimizer
    layout      one tp x cp x pp x dp layout and its legality; the rules the trainer
                shares (tp_violation, pp_violation, interleave_violation, cp_violation)
    stages      pipeline stages as frameworks cut them (even, Megatron-LM, DeepSpeed, nanotron)
    peak        what one device holds at its peak, stage by stage
    cp          context parallelism: the ring's bytes and time        (Liu et al. 2023)
    estimate    step time, tokens/s, MFU of one layout; overlap per collective; scaling
    search      every layout that fits, ranked (sets of allowed values); why the best wins
    published   the published results held against the predictions (notebook 07)
    anchors     published multi-node runs with their layouts, as data
    scorecard   the planner held to them like for like (docs/reference.md's table)
    arguments   the command line's model flags and sets of allowed values
    __main__    the command line, python -m minipar.plan SUB-COMMAND (``commands``: each one)

``python -m minipar.bench calibrate|validate`` (``minipar.bench.calibrate``, ``.validate``)
measures this machine into a hardware file (per-shape GEMM rates, copy bandwidth, a gloo
collective table, ``step_calibration``) and holds predictions against ``minipar.train``; it
is the only part that needs torch, and lives with the benchmarks: ``minipar.plan`` imports
nothing from ``minipar.bench`` or ``minipar.lab`` (tests/test_imports.py).

Python API (sizes in bytes, times in seconds)::

    model_preset(name or FILE.json) -> ModelShape   # gpt-22b, gpt-175b, gpt-1t, llama-7b/13b/30b,
                                          # llama3-8b/70b/405b (kv_heads 8), tiny; load_model
    ModelShape(..., kv_heads=G, dropout=True)   # grouped-query attention, GPT dropout masks
    ModelShape(...).params                # the exact parameter count
    megatron_params(layers, hidden, vocab, seq_len) -> int
    gpt_params(layers, hidden, vocab, seq_len, ffn_hidden=0, tied_head=True, bias=True) -> int
    llama_params(layers, hidden, vocab, ffn_hidden=0) -> int
    megatron_flops(batch, seq_len, layers, hidden, vocab, recompute=True) -> float
    training_flops(shape, batch, recompute="none" | "selective" | "full") -> float
    stage_flops(shape, batch, pp=1, recompute="none") -> float   # the heaviest (last) stage

    zero_shard(stage, dp) -> (s_p, s_g, s_os)
    check_shard((s_p, s_g, s_os), dp, per_node=None, amsp=False)
        # PlanError unless s_p | s_g | s_os | dp (what minipar.zero runs, 1,2,4 included);
        # amsp=True adds AMSP's s_g in {s_p, s_os}
    shard_specs(dp, per_node=None) -> [(s_p, s_g, s_os), ...]   # AMSP's space: the search's

    model_state_bytes(shape or n_params or [unit sizes], dp=1, shard=(s_p, s_g, s_os) or
                      zero=Z, tp=1, pp=1, dtype="mixed" | "fp32", step_counters=0)
        -> {"params", "grads", "optimizer", "total"}
    stage_params(shape, tp=1, pp=1) -> int   # one TP rank of the heaviest stage, exactly
    tp_rank_params(shape, tp=1) -> {"layer", "embedding", "head", "tied_copy"}
    layer_activation_bytes(shape, micro_batch, tp=1, sp=False, recompute="none", flash=False)
    device_memory(shape, layout)
        -> {"params", "grads", "optimizer", "activations", "temporary", "total"}

    zero_comm_bytes(n_params or [unit sizes], dp, shard=(s_p, s_g, s_os) or zero=Z,
                    dtype="mixed", microbatches=1, recompute=False)
        -> {"all_reduce", "reduce_scatter", "all_gather", "total"}
    zero_comm_bytes_by_group(...same...) -> {"zero_p" | "zero_g" | "zero_os" | "zero_rep":
                                             {op: bytes}}      # minipar.zero's mesh groups
    zero_group_span(group, dp, shard) -> consecutive ranks one such group spans
    tp_comm_bytes(micro_batch, seq_len, hidden, tp, layers, microbatches=1,
                  recompute=False, sp=False, ends=False, arch="gpt", bias=True) -> same keys
    tp_block_comm_bytes(tokens, hidden, tp, sp=False, arch="gpt", bias=True)
        -> {"forward": {op: bytes}, "backward": {op: bytes}}   # one layer, one micro-batch
    pp_comm_bytes(micro_batch, seq_len, hidden, pp, microbatches=1, v=1, stage=0, tp=1,
                  split=False) -> {"send", "total"}
    collective_time(op, nbytes, size, stride, hardware) -> float   # one call
    engine_collectives(n_params, dp, shard, framework, units, ...) -> [Collective]
    bubble_fraction(p, m, v=1) -> (p-1)/(v m + p - 1)   # idle share of an ideal pipeline

    load_hardware(name_or_path) -> Hardware
    Layout(tp, pp, dp, micro_batch, microbatches, shard, recompute, v, sp, schedule, cp)
    load_framework(name) -> Framework   # minipar, megatron-lm, megatron-deepspeed, fsdp,
                                        # deepspeed-zero3, amsp (per-module gathers)
    estimate(shape, hardware, layout, order=None, overlap=None, framework="minipar")
        -> Estimate        # overlap None: each collective's window; a number: that fraction
    scaling(shape, hardware, layout, gpus=[...], weak=True) -> [{"gpus", "efficiency", ...}]
    search(model, gpus, hardware, tp=None, pp=None, cp=None, max_cp=None,
           global_batch_tokens=None, framework="minipar", sp=None, v=None, schedule=None,
           objective="step", ...)
        -> [Estimate, ...] best first      # cp weighed where memory forces it (search)
    plan.cp: cp_attention_bytes, cp_comm_bytes, ring_step_times, ring_times   # the ring
    explain(best, runner_up=None) -> str

Bytes "sent" follow ``minipar.comm``: what one rank sends under the ring algorithm. So a
trainer's measured ``comm_bytes`` and ``model_state_bytes`` can be held against
``zero_comm_bytes``, ``tp_comm_bytes(..., ends=True)``, ``pp_comm_bytes`` and
``model_state_bytes(shape, ..., step_counters=...)`` directly, and they agree byte for byte,
under TP, SP and PP too (tests/test_plan_measured.py, tests/test_zero.py). Step times agree
only roughly (``python -m minipar.bench validate``).

These are predictions from first-order models: they count matmuls by shape, memory-bound
bytes, ring and tree collectives call by call (at the measured fraction of the links' rate),
pipeline stages as each framework cuts them, and stored activations stage by stage. What
they cannot know from a datasheet (GEMM and link efficiencies, a per-layer overhead, the
allocator's reserve) a profile fits to measured runs (``fit``) or sets by hand, saying so:
every constant in a preset says where it comes from, and published results are held out,
never fitted (``published``, ``anchors``).
"""
from .errors import PlanError
from .estimate import Estimate, bubble_fraction, estimate, scaled_layout, scaling
from .frameworks import FRAMEWORKS, Framework, load_framework
from .hardware import Hardware, hardware_presets, load_hardware
from .layout import Layout, check_layout
from .memory import (layer_activation_bytes, model_state_bytes, padded_params, stage_params,
                     tp_rank_params)
from .peak import activation_bytes, device_memory
from .network import (collective_time, engine_collectives, pp_comm_bytes, ring_bytes,
                      tp_block_comm_bytes, tp_comm_bytes, zero_collectives, zero_comm_bytes,
                      zero_comm_bytes_by_group, zero_group_span)
from .search import explain, search
from .shapes import (PRESETS, ModelShape, forward_flops, gpt_params, llama_ffn, llama_params,
                     megatron_flops, megatron_params, model_preset, stage_flops, training_flops)
from .sharding import check_shard, parse_shard, shard_specs, zero_shard


__all__ = ["PlanError", "Estimate", "bubble_fraction", "estimate", "scaled_layout", "scaling",
           "Hardware", "hardware_presets", "load_hardware", "Layout", "check_layout",
           "activation_bytes", "device_memory", "layer_activation_bytes", "model_state_bytes",
           "padded_params", "stage_params", "tp_rank_params", "collective_time",
           "engine_collectives", "FRAMEWORKS", "Framework", "load_framework", "pp_comm_bytes",
           "ring_bytes", "tp_block_comm_bytes", "tp_comm_bytes", "zero_collectives",
           "zero_comm_bytes", "zero_comm_bytes_by_group", "zero_group_span", "explain", "search",
           "PRESETS", "ModelShape", "forward_flops", "gpt_params", "llama_ffn", "llama_params",
           "megatron_flops", "megatron_params", "model_preset", "stage_flops", "training_flops",
           "check_shard", "parse_shard", "shard_specs", "zero_shard"]
