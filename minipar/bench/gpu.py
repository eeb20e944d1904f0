"""``python -m minipar.bench gpu``: minipar's trainer against a plain PyTorch loop, one GPU.

Both train the same model (``--model``, default the gpt2-size preset) on the same batches,
one after the other in this process:

* **plain**: nanoGPT's loop: ``build(cfg)`` on the GPU, ``torch.autocast`` to bf16 over fp32
  parameters, fused AdamW, ``torch.compile(model)`` with ``--compile``; ``loss.backward()``,
  ``opt.step()``;
* **minipar**: ``minipar.train``'s own loop (``train.worker``) with the same flags: real bf16
  parameters and fp32 masters (``minipar.precision``), the DP engine of one rank, each Block
  compiled with ``--compile``, and everything the trainer does per step (metrics included).

Printed: median step time after warm-up, tokens/s, MFU (the planner's model FLOPs over the
GPU's dense peak, ``minipar.train.mfu``) and the ratio minipar / plain (the goal: <= 1.05). Each
step ends with ``torch.cuda.synchronize()`` in both, so the times are comparable.

Without a GPU it refuses (exit 2) rather than time a CPU; ``--device cpu`` runs it on the
CPU on purpose, as a smoke test (no MFU unless ``--peak-tflops`` is given).

``--check`` is what to run once when a GPU is lent: the suite's GPU tests
(``tests/test_gpu.py``, in a fresh pytest), this comparison, and a checkpoint round trip in
``--dtype`` (bf16 by default: save at step 2, resume, steps 3..4 bit for bit), two fresh
processes training ``--model`` 10 steps with ``--deterministic`` (their losses bit for bit),
then a summary naming the machine, the device and torch's build, to paste into a note. Exit
status 0 when every check passed, 1 otherwise.

``--deterministic`` also times the trainer with ``--deterministic`` and prints its step time
against the default's (the cost of repeatable runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..runtime import cli
from .. import data, train
from ..train import mfu
from ..train.loop import CUBLAS_WORKSPACE, to_device
from ..runtime.errors import UsageError
from ..model import PRESETS, build
from . import machine, median


def plain_loop(cfg: train.RunConfig, device: torch.device, steps: int) -> list[float]:
    """nanoGPT-style training of ``cfg``'s model; the time of each step (seconds)."""
    model = build(cfg.model_cfg, seed=cfg.seed).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, **fused)
    step_fn = torch.compile(model) if cfg.compile else model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16"
                else contextlib.nullcontext())
    tokens = data.ByteTokenizer().encode(data.load_text(cfg.data))
    batches = data.Batches(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    times = []
    for step in range(1, steps + 1):
        x, y = batches.local_batch(step, 0, 1)
        x, y = to_device(x, device), to_device(y, device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def peak_memory(history: list[dict]) -> int:
    """The trainer's peak GPU memory: on its logging steps' records (``--log-every K``: the
    peak over each interval), not on the other steps'."""
    return max(h["peak_memory_bytes"] for h in history if "peak_memory_bytes" in h)


def compare(args, out=print) -> dict:
    """Both loops on ``args``' model and batches; prints the table, returns its figures."""
    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--dtype", args.dtype,
             "--recompute", args.recompute, "--steps", str(args.steps), "--quiet",
             "--backend", "gloo" if args.device == "cpu" else "auto",
             "--log-every", str(getattr(args, "log_every", 1))]
    flags += ["--compile"] if args.compile else []
    flags += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    cfg = train.parse_config(flags)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    plain = plain_loop(cfg, device, args.steps)[args.warmup:]
    plain_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # what the caching allocator holds beyond the live tensors at their peak: the planner's
    # memory reserve for a PyTorch framework profile (python -m minipar.plan ... --reserve)
    plain_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    with contextlib.redirect_stdout(io.StringIO()):      # the trainer's summary: not here
        history = train.worker(dataclasses.replace(cfg, quiet=True))
    ours = [h["step_time_s"] for h in history][args.warmup:]

    peak = args.peak_tflops or (mfu.peak_tflops(torch.cuda.get_device_name(device), args.dtype)
                                if device.type == "cuda" else None)
    flops = mfu.step_flops(cfg.model_cfg, cfg.batch_size, cfg.recompute)
    tokens = cfg.batch_size * cfg.seq_len
    out(f"minipar.bench gpu: model {args.model}, {args.batch_size} x {cfg.seq_len} tokens a "
        f"step, {args.dtype}, recompute {args.recompute}, compile {args.compile}, "
        f"median of {len(ours)} steps after {args.warmup} warm-up, on {device}")
    out(f"machine: {machine()}; peak {peak or 'unknown'} TFLOP/s")
    out(f"{'loop':<10}{'median step':>14}{'tokens/s':>14}{'MFU':>8}")
    rows = [("plain", median(plain)), ("minipar", median(ours))]
    result = dict(model=args.model, seq_len=cfg.seq_len, ratio=rows[1][1] / rows[0][1])
    for name, t in rows:
        u = mfu.utilisation(flops, t, peak, 1)["mfu"]
        result[name] = dict(step_s=t, mfu=u)
        out(f"{name:<10}{t * 1e3:>11.1f} ms{tokens / t:>14,.0f}"
            f"{'' if u is None else f'{u:.1%}':>8}")
    out(f"minipar / plain step time: {result['ratio']:.3f}x (goal <= 1.05)")
    if getattr(args, "deterministic", False):
        with contextlib.redirect_stdout(io.StringIO()):
            again = train.worker(dataclasses.replace(cfg, quiet=True, deterministic=True))
        slow = median([h["step_time_s"] for h in again][args.warmup:])
        result["deterministic"] = dict(step_s=slow, cost=slow / rows[1][1])
        out(f"minipar --deterministic: {slow * 1e3:.1f} ms a step, {slow / rows[1][1]:.3f}x "
            f"the default's {rows[1][1] * 1e3:.1f} ms")
    if plain_memory is not None:
        ours_memory = peak_memory(history)
        out(f"peak GPU memory: plain {plain_memory / 2**30:.2f} GiB, minipar "
            f"{ours_memory / 2**30:.2f} GiB (torch.cuda.max_memory_allocated)")
        held = (plain_reserved - plain_memory) / plain_reserved if plain_reserved else 0.0
        out(f"allocator reserve of the plain loop: (max reserved - max allocated) / max "
            f"reserved = {held:.3f} (the planner's --reserve for this profile)")
    return result


# --------------------------------------------------------------------------------------
# --check: what to run, once, when a GPU is lent
# --------------------------------------------------------------------------------------
GPU_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tests", "test_gpu.py")


def gpu_test_command(extra: tuple[str, ...] = ()) -> list[str]:
    """The pytest command for tests/test_gpu.py, with its own options: ``-o addopts=`` drops
    the repository's (``-n 2 --nbval-lax``: pytest-xdist and nbval, the ``[test]`` extras),
    and ``-rfEs`` lists every failure, error and skip by name in the summary."""
    return [sys.executable, "-m", "pytest", GPU_TESTS, "-o", "addopts=", "-q", "-rfEs",
            "-p", "no:cacheprovider", *extra]


def run_gpu_tests(timeout: float = 1500.0, extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """The suite's GPU tests (tests/test_gpu.py of a source checkout) in a fresh pytest: the
    summary line, then each FAILED/ERROR line (the test's name and its error)."""
    if not os.path.isfile(GPU_TESTS):
        return False, f"not found ({GPU_TESTS}: run from a source checkout)"
    root = os.path.dirname(os.path.dirname(GPU_TESTS))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run(gpu_test_command(extra), cwd=root, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"did not finish in {timeout:.0f} s"
    if "No module named pytest" in r.stderr:
        return False, "pytest is not installed (pip install pytest)"
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    last = lines[-1].strip("= ") if lines else _last_line(r.stderr) or "(no output)"
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return r.returncode == 0, last + "".join(f"\n      {ln}" for ln in failed)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def checkpoint_round_trip(device: str, dtype: str) -> tuple[bool, str]:
    """Train nano 4 steps saving at 2, resume from 2: steps 3..4 must repeat bit for bit."""
    from ..train import checkpoint
    flags = ["--model", "nano", "--batch-size", "8", "--quiet", "--dtype", dtype,
             "--backend", "gloo" if device == "cpu" else "auto"]
    with tempfile.TemporaryDirectory(prefix="minipar-check-") as tmp:
        root = os.path.join(tmp, "run")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                full = train.run_state(flags + ["--steps", "4", "--save", root,
                                                "--save-every", "2"], nproc=1)
                again = train.run_state(flags + ["--steps", "4", "--resume",
                                                 checkpoint.step_dir(root, 2)], nproc=1)
        except UsageError as e:
            return False, f"refused: {e}"
    diff = max(abs(a - b) for a, b in zip(again["losses"], full["losses"][2:]))
    same = again["losses"] == full["losses"][2:] and all(
        torch.equal(again["params"][n], p) for n, p in full["params"].items())
    return same, (f"losses and parameters of steps 3..4 {'bit-identical' if same else 'differ'}"
                  f" (max |dloss| {diff:.2e})")


def repeat_runs(args, steps: int = 10, timeout: float = 1200.0) -> tuple[bool, str]:
    """Two fresh processes train ``args``' model ``--deterministic`` for ``steps`` steps (the
    same seed and batches); their losses at every step must be bit-identical."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "minipar.train", "--model", args.model, "--batch-size",
           str(args.batch_size), "--dtype", args.dtype, "--steps", str(steps), "--quiet",
           "--deterministic", "--backend", "gloo" if args.device == "cpu" else "auto"]
    cmd += ["--compile"] if args.compile else []
    losses = []
    with tempfile.TemporaryDirectory(prefix="minipar-check-") as tmp:
        for run in (1, 2):
            path = os.path.join(tmp, f"run{run}.jsonl")
            try:
                r = subprocess.run(cmd + ["--metrics", path], capture_output=True, text=True,
                                   env=env, cwd=root, timeout=timeout)
            except subprocess.TimeoutExpired:
                return False, f"run {run} did not finish in {timeout:.0f} s"
            if r.returncode != 0:
                return False, f"run {run} failed: {_last_line(r.stderr) or 'no message'}"
            with open(path) as f:
                losses.append([json.loads(line)["loss"] for line in f if line.strip()])
    what = f"{args.model}, {args.dtype}, {steps} steps"
    if losses[0] == losses[1] and len(losses[0]) == steps:
        return True, f"{what}: losses bit-identical (step {steps}: {losses[0][-1]:.6f})"
    first = next((i for i, (a, b) in enumerate(zip(*losses), 1) if a != b), None)
    diff = max(abs(a - b) for a, b in zip(*losses))
    return False, f"{what}: losses differ from step {first}, max |dloss| {diff:.3g}"


def check(args) -> int:
    """``--check``: the GPU tests, trainer vs plain loop (MFU), a checkpoint round trip; a
    summary to paste into a note. Exit status 0 when every check passed, else 1."""
    t0 = time.perf_counter()
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0)
    backend = "gloo"
    if args.device == "cuda":
        try:
            version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL's version call: say so
            version = "version unknown"
        backend = f"{'RCCL' if torch.version.hip else 'NCCL'} {version}"
    build = (f"HIP {torch.version.hip}" if torch.version.hip else
             f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build")
    rows = []
    if args.device == "cuda":
        ok, text = run_gpu_tests()
    else:
        ok, text = True, "not run (--device cpu: they need a GPU)"
    rows.append(("GPU tests (tests/test_gpu.py)", ok, text))
    figures = compare(args, out=lambda *a, **k: None)
    mfu_of = {k: figures[k]["mfu"] for k in ("plain", "minipar")}
    text = (f"model {figures['model']}, {args.dtype}, {args.batch_size} x {figures['seq_len']} "
            f"tokens: plain {figures['plain']['step_s'] * 1e3:.1f} ms"
            + (f" (MFU {mfu_of['plain']:.1%})" if mfu_of["plain"] is not None else "")
            + f", minipar {figures['minipar']['step_s'] * 1e3:.1f} ms"
            + (f" (MFU {mfu_of['minipar']:.1%})" if mfu_of["minipar"] is not None else "")
            + f", ratio {figures['ratio']:.3f}x (goal <= 1.05"
            + (", met)" if figures["ratio"] <= 1.05 else ", not met)")
            + (f"; --deterministic {figures['deterministic']['cost']:.3f}x the default"
               if "deterministic" in figures else ""))
    rows.append(("trainer vs plain loop", True, text))
    ok, text = checkpoint_round_trip(args.device, args.dtype)
    rows.append((f"{args.dtype} checkpoint round trip", ok, text))
    ok, text = repeat_runs(args)
    rows.append(("two fresh --deterministic runs", ok, text))
    lines = ["minipar GPU check: python -m minipar.bench gpu --check"
             + (" --device cpu (a smoke test, no GPU figures)" if args.device == "cpu" else ""),
             f"  machine: {machine()}",
             f"  device: {device}; torch {torch.__version__} ({build}); {backend}"]
    for name, ok, text in rows:
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {name}: {text}")
    passed = all(ok for _, ok, _ in rows)
    lines.append(f"  {'all checks passed' if passed else 'some checks FAILED'} "
                 f"in {time.perf_counter() - t0:.0f} s")
    print("\n".join(lines))
    return 0 if passed else 1


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench gpu")
    p.add_argument("--model", default="gpt2", choices=list(PRESETS))
    p.add_argument("--batch-size", type=cli.positive_int, default=16, help="sequences")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--compile", action="store_true", help="torch.compile both")
    p.add_argument("--steps", type=cli.positive_int, default=30)
    p.add_argument("--log-every", type=cli.positive_int, default=1,
                   help="the trainer's --log-every: its host syncs and metric collectives on "
                        "every K-th step only (the plain loop has none)")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=5, help="steps left out of the medians")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test on purpose (no GPU timing)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak (default: from the GPU's name)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time the trainer with --deterministic and print its cost "
                        "against the default")
    p.add_argument("--check", action="store_true",
                   help="the one-command GPU check: the suite's GPU tests, this comparison and "
                        "a checkpoint round trip in --dtype, as a summary to paste into a note")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"python -m minipar.bench gpu{' --check' if args.check else ''} needs a "
                         f"GPU and none is visible (--device cpu runs it on the CPU as a smoke test)")
    if args.warmup < 0 or args.warmup >= args.steps:
        raise UsageError(f"--warmup must be between 0 and --steps - 1, got {args.warmup}")
    if args.deterministic:   # before this process's first matmul: cuBLAS reads it once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if args.check:
        return check(args)
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
