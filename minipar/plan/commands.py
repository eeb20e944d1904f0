"""What each of the planner's sub-commands computes and prints (``python -m minipar.plan``):
each ``cmd_*`` takes the parsed flags (``__main__.build_parser``); bad input raises
``PlanError`` (a ``UsageError``), which ``__main__`` turns into exit status 2 and one line.
"""
from __future__ import annotations

from . import moe as moe_plan
from ..runtime.cli import emit, text_table
from .sharding import resolve_shard
from .errors import PlanError, raise_if
from .estimate import estimate
from .frameworks import FRAMEWORKS
from .hardware import load_hardware
from .layout import Layout, layout_violation, schedule_violation
from .memory import model_state_bytes
from .search import amsp_reasons, batch_sequences, explain, human_bytes, search
from .arguments import SHAPE_FLAGS, shape_from_args
from .shapes import megatron_flops, megatron_params, training_flops


def data_parallel(args) -> int:
    """dp: ``--dp`` (estimate) or ``--gpus`` over tp x pp x cp, whose product is ``--gpus``
    (memory, estimate: the one place they meet)."""
    inner = args.tp * args.pp * args.cp
    if args.gpus and args.gpus % inner:
        raise PlanError(f"--gpus {args.gpus} is not a multiple of tp*pp*cp = {inner}")
    dp = getattr(args, "dp", None) or args.gpus // inner
    if args.gpus and dp * inner != args.gpus:
        raise PlanError(f"--dp {dp} x tp*pp*cp {inner} makes {dp * inner} GPUs, not --gpus "
                        f"{args.gpus}; leave out --dp or --gpus")
    return dp


def cmd_params(args) -> None:
    shape = shape_from_args(args, need_heads=False)
    data = {"params": shape.params, "arch": shape.arch, "layers": shape.layers,
            "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.groups,
            "vocab": shape.vocab, "seq_len": shape.seq_len, "ffn_hidden": shape.ffn,
            "tied_head": shape.tied_head, "layer_params": shape.layer_params}
    rows = [["parameters (exact count)", f"{shape.params:,}"],
            ["per layer", f"{shape.layer_params:,}"], ["MLP width F", f"{shape.ffn:,}"]]
    if shape.arch == "gpt":
        data["megatron_formula"] = megatron_params(shape.layers, shape.hidden, shape.vocab,
                                                   shape.seq_len)
        rows.append(["12lh^2(1+13/(12h)+(V+s)/(12lh))", f"{data['megatron_formula']:,}"])
    emit(args, data, text_table(rows, ["quantity", "value"]))


def cmd_flops(args) -> None:
    shape = shape_from_args(args, need_heads=False)
    if args.batch and args.global_batch_tokens:
        raise PlanError("give --batch (sequences) or --global-batch-tokens, not both")
    batch = args.batch or batch_sequences(shape, args.global_batch_tokens,
                                          "--batch or --global-batch-tokens")
    moe = moe_plan.from_args(args)                      # MoE: FLOPs follow the active params
    model_f, hardware_f = (training_flops(shape, batch, r) if moe is None
                           else moe_plan.training_flops(shape, moe, batch, r)
                           for r in ("none", args.recompute))
    data = {"batch": batch, "seq_len": shape.seq_len, "recompute": args.recompute,
            "model_flops": model_f, "hardware_flops": hardware_f}
    rows = [["global batch (sequences)", batch],
            ["model FLOPs (no recomputation)", f"{model_f:.4g}"],
            [f"hardware FLOPs (recompute={args.recompute})", f"{hardware_f:.4g}"]]
    if moe is not None:
        data["moe"] = moe_plan.summary(shape, moe)
        rows += [["MoE parameters (total)", f"{data['moe']['total_params']:,}"],
                 ["MoE parameters active per token", f"{data['moe']['active_params']:,}"]]
    if shape.arch == "gpt" and moe is None:
        data["megatron_flops"] = data["flops"] = megatron_flops(
            batch, shape.seq_len, shape.layers, shape.hidden, shape.vocab,
            recompute=args.recompute == "full")
        rows.insert(1, ["Megatron-LM formula", f"{data['flops']:.4g}"])
    else:
        data["flops"] = hardware_f
    if args.step_time:
        if not (args.gpus and args.hardware):
            raise PlanError("--step-time needs --gpus and --hardware to compute utilisation")
        hw = load_hardware(args.hardware)
        per_gpu = data["flops"] / args.step_time / args.gpus
        data.update(flops_per_gpu=per_gpu, percent_of_peak=100 * per_gpu / hw.peak_flops,
                    mfu=model_f / args.step_time / args.gpus / hw.peak_flops)
        rows += [["achieved TFLOP/s per GPU", f"{per_gpu / 1e12:.2f}"],
                 ["percent of peak", f"{data['percent_of_peak']:.2f}%"],
                 ["MFU", f"{data['mfu']:.2%}"]]
    emit(args, data, text_table(rows, ["quantity", "value"]))


def cmd_memory(args) -> None:
    shaped = args.model or any(getattr(args, k) is not None for k in SHAPE_FLAGS)
    if args.params is None and not shaped:
        raise PlanError("give --params N (e.g. 175B), --model NAME|FILE.json or the shape "
                        "flags (--layers --hidden --heads --vocab --seq-len)")
    if args.params is not None and shaped:
        raise PlanError("give --params N or a model shape (--model or the shape flags), not both")
    shape = shape_from_args(args) if args.params is None else None
    n = args.params if shape is None else shape.params
    dp = data_parallel(args)
    if shape is not None:     # the rules estimate applies; even stages, as this prices them
        raise_if(layout_violation(shape, Layout(tp=args.tp, pp=args.pp, cp=args.cp, dp=dp),
                                  hint=False))
    spec = resolve_shard(dp * args.cp, args.shard, args.zero)      # over the dp x cp ranks
    out = model_state_bytes(n if shape is None else shape, dp * args.cp, shard=spec, tp=args.tp,
                            pp=args.pp, dtype=args.dtype)
    moe = moe_plan.from_args(args)                      # MoE: experts split by --ep
    if moe is not None:
        if shape is None:
            raise PlanError("--moe-experts needs the model's shape: give --model NAME or the "
                            "shape flags, not --params")
        out = moe_plan.state_bytes(shape, moe, dp, args.ep, shard=spec, tp=args.tp, pp=args.pp,
                                   dtype=args.dtype, cp=args.cp)
        n = moe_plan.params(shape, moe)["total"]
    parts = ("params", "grads", "optimizer", "total")
    data = {**{f"{k}_bytes": out[k] for k in parts}, "n_params": n, "dp": dp, "tp": args.tp,
            "pp": args.pp, "cp": args.cp, "dtype": args.dtype,
            "shard": {"p": spec[0], "g": spec[1], "os": spec[2]}}
    if moe is not None:
        data["moe"] = dict(moe_plan.summary(shape, moe), ep=args.ep,
                           expert_params_per_device=out["expert_params"])
    rows = [[k, f"{out[k]:,}", f"{out[k] / 2**30:,.2f}"] for k in parts]
    cp = f" cp={args.cp}" if args.cp > 1 else ""
    emit(args, data, f"model states per device: {n:,} parameters, tp={args.tp} pp={args.pp}{cp} "
         f"dp={dp}, shard (s_p, s_g, s_os) = {spec}, {args.dtype}\n"
         + text_table(rows, ["part", "bytes", "GiB"]))


def _results_table(results) -> str:
    rows = []
    for i, e in enumerate(results, 1):
        lay = e.layout
        rows.append([i, lay.tp, lay.pp, lay.v, lay.cp, lay.dp, lay.micro_batch, lay.microbatches,
                     "{},{},{}".format(*lay.shard), lay.recompute, human_bytes(e.memory["total"]),
                     f"{e.step_time:.4g}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}"])
    return (text_table(rows, ["#", "tp", "pp", "v", "cp", "dp", "b", "m", "shard", "recompute",
                              "memory", "step s", "tokens/s", "MFU"]) + "\n" + LEGEND)


LEGEND = ("v: model chunks per pipeline stage (interleaved 1F1B when > 1); cp: ranks each "
          "sequence is split over (context parallelism); b: micro-batch size in sequences; m: "
          "micro-batches per step per pipeline; shard: s_p,s_g,s_os, the data-parallel (dp x "
          "cp) ranks that share parameters, gradients, optimizer states; memory: per device")


def cmd_search(args) -> None:
    moe = moe_plan.from_args(args)
    shape = shape_from_args(args)
    results = search(shape, args.gpus, args.hardware, tp=args.tp, pp=args.pp, cp=args.cp,
                     max_cp=args.max_cp, global_batch_tokens=args.global_batch_tokens,
                     micro_batch=args.micro_batch, shard=args.shard, zero=args.zero,
                     recompute=args.recompute, top=args.top if moe is None else 10**6,
                     max_tp=args.max_tp, order=args.order, overlap=args.overlap,
                     flash=args.flash_attention, dtype=args.dtype, framework=args.framework,
                     sp=args.sp, v=args.chunks, schedule=args.schedule,
                     objective=args.objective, reserve=args.reserve)
    hw, fw = load_hardware(args.hardware), FRAMEWORKS[args.framework]
    order = args.order or fw.order
    if moe is not None:                                 # MoE: re-rank the dense candidates
        results = moe_plan.rerank(results, shape, moe, args.ep, hw, args.top, order, args.dtype)
    why = explain(results[0], results[1] if len(results) > 1 else None)
    data = [e.to_json() for e in results]
    ranked = "predicted step time"
    if args.objective == "amsp":
        ranked = ("AMSP's data-parallel communication time, nothing hidden, each group on the "
                  "fastest links its size allows")
        why += "".join(f"\n  AMSP's partitioner, {line}" for line in amsp_reasons(
            shape, hw, results[0], fw, order, args.dtype or hw.dtype, args.flash_attention,
            args.reserve))
    data[0]["explain"] = why
    header = (f"{shape.name} on {args.gpus} x {args.hardware} with {args.framework}, global "
              f"batch {results[0].layout.global_batch} sequences; ranked by {ranked}, best first\n")
    if args.cp is None and args.max_cp is None and any(e.layout.cp > 1 for e in results):
        header += (f"context parallelism weighed: without it, sequences of {shape.seq_len:,} tokens "
                   f"fit only with full recomputation or not at all, or no layout divides "
                   f"the batch\n")
    emit(args, data, header + _results_table(results) + "\n\n" + why)


def cmd_estimate(args) -> None:
    shape = shape_from_args(args)
    hw = load_hardware(args.hardware)
    if not (args.dp or args.gpus):
        raise PlanError("give --dp or --gpus")
    dp = data_parallel(args)
    spec = resolve_shard(dp * args.cp, args.shard, args.zero)      # over the dp x cp ranks
    if args.microbatches is None:
        batch = args.global_batch or batch_sequences(shape, None,
                                                     "--global-batch or --microbatches")
        if batch % (dp * args.micro_batch):
            raise PlanError(f"the global batch of {batch} sequences does not divide into "
                            f"dp={dp} replicas of micro-batches of {args.micro_batch}; give "
                            f"--microbatches or --global-batch")
        microbatches = batch // (dp * args.micro_batch)
        note = (f"micro-batches: {microbatches} per step, from the global batch of "
                f"{batch} sequences / (dp {dp} x micro-batch {args.micro_batch})")
    else:
        microbatches = args.microbatches
        implied = dp * args.micro_batch * microbatches
        if args.global_batch is not None and args.global_batch != implied:
            raise PlanError(f"--global-batch {args.global_batch} disagrees with --microbatches "
                            f"{microbatches}: dp {dp} x micro-batch {args.micro_batch} x "
                            f"{microbatches} micro-batches = {implied} sequences; give one of "
                            f"the two, or values that agree")
        note = (f"micro-batches: {microbatches} per step (given), so a global batch of "
                f"{implied} sequences")
    raise_if(schedule_violation(args.schedule, args.chunks))
    schedule = "1f1b" if args.schedule == "interleaved" else args.schedule   # v > 1 interleaves
    layout = Layout(tp=args.tp, pp=args.pp, dp=dp, micro_batch=args.micro_batch,
                    microbatches=microbatches, shard=spec, recompute=args.recompute,
                    v=args.chunks, sp=args.sp, schedule=schedule, cp=args.cp)
    fw = FRAMEWORKS[args.framework]
    order = args.order or fw.order
    e = estimate(shape, hw, layout, order=order, overlap=args.overlap,
                 flash=args.flash_attention, dtype=args.dtype, framework=fw, reserve=args.reserve)
    moe = moe_plan.from_args(args)                      # MoE: experts, active FLOPs, all-to-all
    if moe is not None:
        e = moe_plan.adjust(e, shape, moe, args.ep, hw, order, args.dtype)
    data = dict(e.to_json(), explain=explain(e, label="layout"), notes=[note, *e.notes])
    if moe is not None:
        data["moe"] = dict(moe_plan.summary(shape, moe), ep=args.ep, note=e.notes[-1])
    emit(args, data, f"{shape.name} on {layout.gpus} x {args.hardware} with {fw.name}; "
          + note + "\n" + _results_table([e]) + "\n\n" + data["explain"]
          + ("" if e.fits else "\n  DOES NOT FIT in device memory"))
