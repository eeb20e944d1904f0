"""``python -m minipar.bench validate``: the planner's predictions against ``minipar.train``'s
measurements on this machine.

``validate_step_time`` runs ``minipar.train`` on a few layouts of a small model and sets
each measured step time (median of the steps after the first, which warms up; so at
least two steps) next to the planner's prediction on
the calibrated hardware (``minipar.bench.calibrate``), marking the calibration point.
Nothing is fitted to the validation runs. ``model_states_vs_plan`` does the same for the
model-state bytes, which must agree exactly.
"""
from __future__ import annotations

import os

from ..runtime.errors import UsageError
from ..runtime.cli import emit, text_table
from .calibrate import _trainer_args, calibrate, train_history


# --------------------------------------------------------------------------------------
# Predictions against minipar.train's measurements
# --------------------------------------------------------------------------------------
VALIDATION_LAYOUTS = {          # name -> minipar.train flags
    "1 rank": ["--nproc", "1"],
    "DP 2": ["--nproc", "2"],
    "TP 2": ["--nproc", "2", "--tp", "2"],
    "PP 2": ["--nproc", "2", "--pp", "2"],
    "ZeRO-3 2": ["--nproc", "2", "--zero", "3"],
}


def _spec(cfg):
    return tuple(cfg.spec) if cfg.spec is not None else (1, 1, 1)


def layout_of(argv: list[str]):
    """The planner's ``Layout`` of a ``minipar.train`` command line."""
    from minipar.plan.layout import Layout
    args = _trainer_args(argv)
    interleaved = args.schedule == "interleaved"
    return Layout(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp,
                  micro_batch=args.batch_size // (args.dp * args.microbatches),
                  microbatches=args.microbatches, shard=_spec(args),
                  v=args.chunks if interleaved else 1, sp=args.sp,
                  schedule="gpipe" if args.schedule == "gpipe" else "1f1b")


def minipar_overlap(argv: list[str]) -> float | None:
    """The fraction of the data-parallel all-reduce that ``minipar.dp`` can hide behind
    backward, for a trainer command line; None for a ZeRO/AMSP engine (the planner's default
    assumption applies).

    Only the ``overlapped`` mode overlaps at all, and only bucket by bucket: a bucket's
    all-reduce starts when backward has finished every gradient in it, and the last bucket
    (the first layers and the embedding) finishes with backward itself, so at most
    (k-1)/k of the traffic of k buckets can hide. The trainer's buckets are 4 MiB; a model
    of under a million fp32 parameters (``tiny``: 3.5 MB of gradients) fills one, so its
    all-reduce starts after backward and none of it hides. (On a CPU even the rest hides
    less than this: gloo's reduction runs on the same cores as the compute.)
    """
    args = _trainer_args(argv)
    if args.spec is not None:
        return None
    if args.dp * args.cp == 1 or args.dp_mode != "overlapped":      # reduced over dp x cp
        return 0.0
    from minipar.dp import make_buckets
    from minipar.model import build
    params = list(build(args.model_cfg).parameters())
    buckets = len(make_buckets(params, int(args.bucket_mb * 2**20)))
    return (buckets - 1) / buckets


def calibration_point(hw, model: str, batch_size: int, argv: list[str]) -> bool:
    """Whether ``argv`` is the run whose step set ``hw``'s compute_efficiency (``calibrate``):
    one process of the same model and global batch, one micro-batch."""
    step = (hw.sources or {}).get("calibration_step")
    if not step or (step["model"], step["batch_size"]) != (model, batch_size):
        return False
    lay = layout_of(argv)
    return (lay.gpus, lay.microbatches) == (1, 1)


def validate_step_time(model: str = "tiny", layouts: dict | None = None, steps: int = 6,
                       batch_size: int = 16, hardware=None, overlap: float | None = None,
                       quick: bool = False) -> dict:
    """Predicted against measured step time of ``minipar.train`` on this machine.

    ``hardware``: a preset, file or ``Hardware``; default: ``calibrate`` this machine now
    (all sizes unless ``quick``: a few seconds, and collectives this noisy need the
    points), with its training step on ``model`` and ``batch_size``. ``layouts``:
    {name: trainer flags}, default ``VALIDATION_LAYOUTS``. ``overlap``: the fraction of
    data-parallel traffic hidden behind compute; default what minipar's engine allows
    (``minipar_overlap``).

    Returns {"machine", "hardware", "load_before", "load_after", "calibration_point" (the
    layout whose step set compute_efficiency, or None), "rows": [{"layout", "argv",
    "predicted_s", "measured_s", "ratio" (predicted / measured), "calibration", "overlap",
    "times"}]}.
    """
    from minipar.bench import machine
    from minipar.plan.estimate import estimate
    from minipar.plan.hardware import hardware_from_dict, load_hardware
    from minipar.plan.shapes import model_preset
    if steps < 2:
        raise UsageError(f"--steps {_STEPS_RULE}, got {steps}")
    load_before = os.getloadavg()
    if hardware is None:
        data = calibrate(nprocs=2, quick=quick, name="laptop-cpu, calibrated here",
                         model=model, batch_size=batch_size)
        hw = hardware_from_dict(data, where="calibration")
    else:
        hw = load_hardware(hardware)
    shape = model_preset(model)
    rows = []
    for name, flags in (layouts or VALIDATION_LAYOUTS).items():
        argv = ["--model", model, "--steps", str(steps), "--batch-size", str(batch_size),
                "--quiet", *flags]
        history = train_history(argv)
        timed = sorted(h["step_time_s"] for h in history[1:])   # step 1 warms up
        measured = timed[len(timed) // 2]
        hides = overlap
        e = estimate(shape, hw, layout_of(argv), dtype="fp32", overlap=hides)
        rows.append({"layout": name, "argv": argv, "predicted_s": e.step_time,
                     "measured_s": measured, "ratio": e.step_time / measured,
                     "calibration": calibration_point(hw, model, batch_size, argv),
                     "overlap": hides, "times": dict(e.times)})
    point = next((r["layout"] for r in rows if r["calibration"]), None)
    return {"machine": machine(), "hardware": hw.to_dict(), "load_before": load_before,
            "load_after": os.getloadavg(), "calibration_point": point, "rows": rows}


def model_states_vs_plan(flags: list[str], model: str = "tiny", steps: int = 2,
                         batch_size: int = 16) -> dict:
    """Model-state bytes per rank: ``minipar.train``'s measurement and the planner's
    prediction (fp32 Adam, Phi = the model's parameter count) for a data-parallel or
    ZeRO/AMSP run (``flags`` such as ["--nproc", "4", "--shard", "1,2,4"]; no TP or PP).

    Returns {"measured": {...}, "predicted": {...}, "spec": (s_p, s_g, s_os), "dp": d}.
    """
    from minipar.plan.memory import model_state_bytes
    from minipar.plan.shapes import model_preset
    argv = ["--model", model, "--steps", str(steps), "--batch-size", str(batch_size),
            "--quiet", *flags]
    args = _trainer_args(argv)
    if args.tp > 1 or args.pp > 1:
        raise ValueError("model_states_vs_plan compares data-parallel runs; leave out --tp, --pp")
    shape = model_preset(model)
    spec = _spec(args)
    sharded = args.zero is not None or args.shard is not None
    # Adam's step counters: minipar.zero gives the optimizer one flat tensor per unit
    # (embedding, each block, head); plain DP one per parameter tensor
    tensors = shape.layers + 2 if sharded else _parameter_tensors(model)
    predicted = model_state_bytes(shape.params, args.dp * args.cp, shard=spec, dtype="fp32",
                                  step_counters=tensors)
    measured = train_history(argv)[-1]["model_state_bytes"]
    return {"measured": measured, "predicted": predicted, "spec": spec, "dp": args.dp}


def _parameter_tensors(model: str) -> int:
    from minipar.model import build
    return len(list(build(model).parameters()))


def cmd_validate(args) -> None:
    unknown = [n for n in args.layouts if n not in _LAYOUT_KEYS]
    if unknown:
        raise UsageError(f"unknown layout {unknown[0]!r}; use some of {', '.join(_LAYOUT_KEYS)}")
    layouts = {_LAYOUT_KEYS[n]: VALIDATION_LAYOUTS[_LAYOUT_KEYS[n]] for n in args.layouts}
    out = validate_step_time(args.model, layouts, steps=args.steps, batch_size=args.batch_size,
                             hardware=args.hardware, overlap=args.overlap)
    hw = out["hardware"]
    rows = [[r["layout"] + (" *" if r["calibration"] else ""),
             " ".join(r["argv"][r["argv"].index("--quiet") + 1:]),
             f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
             f"{r['ratio']:.2f}"] for r in out["rows"]]
    step = hw["sources"].get("calibration_step")
    if out["calibration_point"]:
        point = (f"* the calibration point: its step ({step['seconds'] * 1e3:.1f} ms when "
                 f"calibrated) set step_calibration, so its ratio is 1 by construction up "
                 f"to run-to-run noise; only the other rows test the model")
    elif step:
        point = (f"calibration point: {step['model']}, global batch {step['batch_size']}, "
                 f"one process (not among these rows)")
    else:
        point = f"calibration point: none ({hw['name']}'s constants are assumptions)"
    hidden = sorted({f"{r['times']['dp_hidden'] / r['times']['dp_comm']:.0%}"
                     for r in out["rows"] if r["times"]["dp_comm"] > 0})
    text = (f"{out['machine']}\nload average before {out['load_before'][0]:.2f}, after "
            f"{out['load_after'][0]:.2f} (1 min)\nhardware {hw['name']}: "
            f"{hw['peak_flops'] / 1e9:.1f} GFLOP/s matmul peak per process, "
            f"step_calibration {hw.get('step_calibration', 1.0):.2f}, all-reduce "
            f"{hw['intra_node_bandwidth'] / 1e9:.2f} GB/s, "
            f"{hw['intra_node_latency'] * 1e6:.0f} us per ring step\n"
            f"model {args.model}, global batch {args.batch_size}, median of steps "
            f"2..{args.steps}"
            + (f"; DP all-reduce hidden behind backward: {', '.join(hidden)}" if hidden else "")
            + "\n" + text_table(rows, ["layout", "flags", "predicted ms", "measured ms", "pred/meas"])
            + "\n" + point)
    emit(args, out, text)


_STEPS_RULE = "must be at least 2 (the first step warms up and is not timed)"


def _steps(text: str) -> int:
    """argparse type for --steps, so that the parser names the command: ``_STEPS_RULE``."""
    import argparse
    if not text.lstrip("-").isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{_STEPS_RULE}, got {text}")
    return int(text)


_LAYOUT_KEYS = {"1": "1 rank", "dp2": "DP 2", "tp2": "TP 2", "pp2": "PP 2", "z3": "ZeRO-3 2"}



def build_parser():
    from minipar.runtime.cli import ArgumentParser, fraction
    from minipar.runtime.cli import positive_int as positive
    p = ArgumentParser(prog="python -m minipar.bench validate",
                       description="predicted vs measured step time of minipar.train here")
    p.add_argument("--model", default="tiny", help="a minipar.model preset (default tiny)")
    p.add_argument("--steps", type=_steps, default=6,
                   help="training steps per layout, at least 2 (the first is warm-up)")
    p.add_argument("--batch-size", type=positive, default=16, help="global, in sequences")
    p.add_argument("--layouts", type=lambda t: t.split(","), default=list(_LAYOUT_KEYS),
                   help=f"comma-separated, from {','.join(_LAYOUT_KEYS)} (default: all)")
    p.add_argument("--hardware", help="a preset or file; default: calibrate this machine now")
    p.add_argument("--overlap", type=fraction, default=None,
                   help="fraction of data-parallel traffic hidden behind compute (default: "
                        "what minipar's DP engine allows, 0 for tiny's single bucket)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p



def main(argv=None) -> int:
    import sys
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd_validate(args)
    return 0
