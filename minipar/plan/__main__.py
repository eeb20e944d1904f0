"""The planner's command line: python -m minipar.plan SUB-COMMAND [--json] ...

Sub-commands: memory, params, flops, search, estimate. ``calibrate`` and ``validate`` measure
this machine and need torch: they live in ``minipar.bench`` and ``python -m minipar.plan
calibrate|validate ...`` runs ``python -m minipar.bench calibrate|validate ...`` in a child process.

Every sub-command prints a readable table, or with ``--json`` one JSON document on stdout.
Bad input ends with exit status 2 and one line on stderr saying what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..runtime.cli import ArgumentParser, count, fraction, positive_float
from ..runtime.cli import positive_int as positive
from ..runtime.errors import UsageError
from ..rules import add_moe_flags
from .arguments import add_shape, int_set, mode_set
from .commands import cmd_estimate, cmd_flops, cmd_memory, cmd_params, cmd_search
from .fit import add_fit_parser
from .frameworks import FRAMEWORKS
from .layout import ORDERS
from .search import OBJECTIVES, SCHEDULES
from .shapes import RECOMPUTE_MODES


def _add_spec(p, searching: bool = False) -> None:
    if searching:
        p.add_argument("--zero", type=int_set("--zero", 0, 3), metavar="Z",
                       help="ZeRO stages allowed: one (1), or a set (0,1) or range (0-3) of "
                            "them (default: every spec the framework runs)")
    else:
        p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 0)")
    space = (" Unless fixed here, the search enumerates only AMSP's space, s_g in {s_p, s_os}."
             if searching else "")
    p.add_argument("--shard", metavar="P,G,OS",
                   help="shard-group sizes s_p,s_g,s_os over the data-parallel ranks, e.g. "
                        "1,8,8: any 1 <= s_p <= s_g <= s_os <= dp, each dividing the next and "
                        "dp (1,2,4 included, as minipar.zero runs it)." + space)


def _add_costs(p) -> None:
    p.add_argument("--framework", choices=list(FRAMEWORKS), default="minipar",
                   help="what runs the layout: its rank order, schedules, shardings and how "
                        "its engine issues data-parallel collectives")
    p.add_argument("--order", choices=ORDERS, default=None, metavar="ORDER",
                   help="how the grid maps onto devices, innermost axis first: tp,pp,dp "
                        "(minipar's Grid) or tp,dp,pp (Megatron-LM's, DeepSpeed's); "
                        "default: the framework's")
    p.add_argument("--overlap", type=fraction, default=None,
                   help="replace each collective's overlap window by a fraction of what it "
                        "could hide: 0 hides nothing, 1 everything hideable; default: the "
                        "engine's windows (backward, prefetch, next forward)")
    p.add_argument("--flash-attention", action="store_true",
                   help="a fused attention kernel: scores never stored, the core timed at "
                        "the hardware's attention_efficiency")
    p.add_argument("--dtype", choices=["mixed", "fp32"], default=None,
                   help="default: the hardware's")
    p.add_argument("--reserve", type=fraction, default=None,
                   help="fraction of device memory the allocator holds beyond live tensors, "
                        "(reserved - allocated) / reserved as 'python -m minipar.bench gpu' "
                        "measures it; default: a fitted profile's 'fragmentation', else the "
                        "framework's measured reserve, else the hardware's 'fragmentation'")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m minipar.plan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    p = sub.add_parser("memory", help="model-state bytes per device")
    p.add_argument("--params", type=count, help="parameter count, e.g. 175e9 or 175B "
                   "(split evenly over tp*pp)")
    add_shape(p, model_help="take the shape of a preset or model JSON file (split exactly over "
              "tp and pp: norms, row biases and positions stay whole on every TP rank); or "
              "give the shape flags")
    p.add_argument("--gpus", type=positive, required=True,
                   help="devices in all (tp x pp x cp x dp)")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive, default=1, help="pipeline-parallel degree")
    p.add_argument("--cp", type=positive, default=1,
                   help="context-parallel degree: parameters replicated over it, ZeRO/AMSP "
                        "shards over the dp x cp ranks")
    _add_spec(p)
    p.add_argument("--dtype", choices=["mixed", "fp32"], default="mixed", help="mixed: bf16 + fp32 Adam (2+2+12 bytes); fp32: 4+4+8")

    p = sub.add_parser("params", help="parameter count of a shape")
    add_shape(p)

    p = sub.add_parser("flops", help="training FLOPs per iteration")
    add_shape(p)
    p.add_argument("--batch", type=positive, help="global batch in sequences")
    p.add_argument("--global-batch-tokens", type=count, help="global batch in tokens (instead of --batch)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="full",
                   help="default full, as Megatron-LM's formula assumes")
    p.add_argument("--step-time", type=positive_float, help="measured seconds per iteration")
    p.add_argument("--gpus", type=positive, help="devices, with --step-time")
    p.add_argument("--hardware", help="a preset or JSON file, with --step-time (its peak)")

    p = sub.add_parser("search", help="rank the layouts that fit")
    add_shape(p)
    p.add_argument("--gpus", type=positive, required=True, help="devices in all")
    p.add_argument("--hardware", required=True, help="a preset name or a JSON file")
    p.add_argument("--tp", type=int_set("--tp"), metavar="T",
                   help="tensor-parallel degrees allowed: one (4), a set (1,2,4) or a range "
                        "(1-8); default: divisors of the heads up to a node")
    p.add_argument("--pp", type=int_set("--pp"), metavar="P",
                   help="pipeline-parallel degrees allowed (one, a set or a range); default: "
                        "every one the framework can cut the layers into")
    p.add_argument("--cp", type=int_set("--cp"), metavar="C",
                   help="context-parallel degrees allowed (default: cp > 1 weighed only where "
                        "memory forces it: nothing fits with cp = 1, or only with full "
                        "recomputation)")
    p.add_argument("--max-cp", type=positive,
                   help="search every context-parallel degree up to this, ranked by step time "
                        "like the rest (default: cp only where memory forces it)")
    p.add_argument("--global-batch-tokens", type=count,
                   help="default: the preset's sequences a batch (at any --seq-len)")
    p.add_argument("--micro-batch", type=int_set("--micro-batch"), metavar="B",
                   help="micro-batch sizes allowed (one, a set or a range); default: 1 to 16, "
                        "each dividing the batch per replica")
    p.add_argument("--top", type=positive, default=5, help="how many layouts to list")
    p.add_argument("--max-tp", type=positive, help="largest TP degree to try (default: one node)")
    p.add_argument("--recompute", type=mode_set, metavar="MODE",
                   help=f"recomputation allowed: one of {', '.join(RECOMPUTE_MODES)}, or a "
                        f"set of them (none,full)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="force sequence parallelism on or off (default: on whenever tp > 1 "
                        "and the framework has it)")
    p.add_argument("--chunks", type=int_set("--chunks"), default=None, metavar="V",
                   help="model chunks per stage allowed, v (interleaving when > 1)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="fix the pipeline schedule (default: 1f1b, interleaved where the "
                        "framework has it)")
    p.add_argument("--objective", choices=OBJECTIVES, default="step",
                   help="rank by step time, or as AMSP's partitioner does: data-parallel "
                        "communication time with nothing hidden, each group on the fastest "
                        "links its size allows, under the memory limit (one line per group "
                        "says why not the next size)")
    _add_spec(p, searching=True)
    _add_costs(p)

    p = sub.add_parser("estimate", help="predict one given layout")
    add_shape(p)
    p.add_argument("--hardware", required=True, help="a preset name or a JSON file")
    p.add_argument("--gpus", type=positive, help="devices in all (or give --dp)")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive, default=1, help="pipeline-parallel degree")
    p.add_argument("--cp", type=positive, default=1,
                   help="context-parallel degree: each sequence split over cp ranks, ring "
                        "attention (frameworks minipar and megatron-lm)")
    p.add_argument("--dp", type=positive,
                   help="data-parallel degree (default: gpus / (tp x pp x cp))")
    p.add_argument("--chunks", "--v", type=positive, default=1, dest="chunks",
                   help="model chunks per stage, v (needs --schedule interleaved when > 1)")
    p.add_argument("--micro-batch", type=positive, default=1, help="sequences per micro-batch")
    p.add_argument("--microbatches", type=positive, default=None,
                   help="micro-batches per step per pipeline; default: the preset's global "
                        "batch / (dp x micro-batch), printed")
    p.add_argument("--global-batch", type=positive, default=None,
                   help="global batch in sequences (default: the preset's)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none", help="activation recomputation")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (interleaved needs --chunks >= 2)")
    _add_spec(p)
    _add_costs(p)
    for name, func in (("memory", cmd_memory), ("params", cmd_params), ("flops", cmd_flops),
                       ("search", cmd_search), ("estimate", cmd_estimate)):
        sub.choices[name].set_defaults(func=func)
        if name != "params":            # the MoE flags come last, in all but params
            add_moe_flags(sub.choices[name].add_argument_group("mixture of experts"))
    add_fit_parser(sub)

    for action in sub.choices.values():
        action.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] in (["calibrate"], ["validate"]):     # minipar.bench's (module docstring)
            return subprocess.run([sys.executable, "-m", "minipar.bench", *argv]).returncode
        args = build_parser().parse_args(argv)
        args.func(args)
    except UsageError as e:              # PlanError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:              # the reader left early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
