"""Scaling sweeps: the same trainer run at several process counts, measured and predicted.

    python -m minipar.scaling weak   --nproc-list 1,2,4 [trainer flags] [--out results.jsonl]
    python -m minipar.scaling strong --nproc-list 1,2,4 [trainer flags] [--plot scaling.png] [--json]
    python -m minipar.scaling weak   --nproc-list 1,2,4 [trainer flags] --runs runs.csv

Every flag the sweep does not know is a trainer flag (``python -m minipar.train --help``):
``--tp``, ``--pp``, ``--zero``, ``--model``, ``--steps``, ``--batch-size``... They describe the
*smallest* point; the sweep varies only the number of data-parallel replicas,
dp = N / (tp pp), so every N must be a multiple of tp x pp.

* **weak scaling** keeps the work per process: the global batch grows with N
  (batch at N = batch x N / N0, micro-batches per replica unchanged);
* **strong scaling** keeps the global batch: each replica gets a smaller share
  (the micro-batch count m is kept, so each micro-batch has batch / (dp m) sequences).

Efficiency is throughput per process against the smallest point N0, so 1 is ideal:

    efficiency(N) = (tokens/s at N / N) / (tokens/s at N0 / N0)

For weak scaling that is T(N0) / T(N), for strong scaling T(N0) N0 / (T(N) N), with T the step
time. Each point's step time is the median over the steps after ``--discard`` (the first steps
pay for connections and allocator growth). Communication is what rank 0 spent inside
``minipar.comm``'s collectives per step (the trainer's ``comm_seconds``): time blocked in
collectives, which includes waiting for slower ranks; the rest of the step is called compute.

Where each point runs:

* locally (default outside Slurm): ``python -m minipar.train --nproc N ... --metrics FILE
  --quiet`` as a subprocess with a timeout; one thread per process (OMP_NUM_THREADS=1), so a
  process is one core, as the planner's ``laptop-cpu`` device is;
* inside a Slurm allocation (SLURM_JOB_ID set and ``srun`` on the PATH): each point is its own
  job step, ``srun -N ceil(N/K) -n N --ntasks-per-node K [--srun-args] python -m minipar.train
  ...`` with K = ``--tasks-per-node`` (so N ranks fill whole nodes and TP groups stay inside
  one), a fresh MASTER_PORT per step, and the metrics in ``--workdir`` (shared by the nodes);
* ``launcher="inprocess"`` (used by the notebooks): ``train.worker`` on N ranks started by
  ``minipar.runtime.dist.launch`` from this interpreter's preloaded fork server (fast), with the
  trainer's summary lines silenced.

Beside each measured point the planner predicts the same layout
(``minipar.plan.estimate`` on ``--hardware``, the ``laptop-cpu`` preset unless a calibrated
file from ``python -m minipar.bench calibrate`` is given), and its efficiency by the same rule.
Bad input (a count that is not a multiple of tp x pp, a batch that does not divide, a flag the
trainer rejects at some point) exits with status 2 and one line before any point runs.

``--runs FILE.csv`` appends one row per point to FILE.csv in the planner's measured-runs schema
(``minipar.plan.runs``: ``write_runs``, read back by ``read_runs``; the input of ``python -m
minipar.plan fit``): the model's shape (the trainer's preset with its ``--seq-len``), where it
ran (locally one node of N processes; under srun ceil(N/K) nodes of K = ``--tasks-per-node``
ranks, so every N must be at most K or a multiple of it), the layout (dp, tp, pp, cp, the
shard spec of ``--zero``/``--shard``, micro-batch size, micro-batches as grad_acc, recompute,
schedule, chunks, sp: the layout the prediction uses), ``flash`` (minipar's attention is
``F.scaled_dot_product_attention``, a fused kernel, except the ring attention of cp > 1, which
is not), framework ``minipar``, status ``ok`` with tokens/s per process and the trainer's
measured peak memory (``peak_reserved_bytes``, CUDA's max reserved, what the caching allocator
held and so what runs out: NaN on CPU). A point that
fails still appends the rows of the points before it and its own, status ``oom`` when its
output says it ran out of memory, else ``crashed`` (a timeout too), and the sweep then stops
with status 1 as before. A row's dtype is the trainer's: fp32, or mixed for bf16 and fp16
(16-bit weights and gradients, fp32 Adam states). The schema has no MoE column: an MoE
model is refused (status 2). An existing FILE.csv must be a runs CSV (its header the schema's),
else status 2 before any point runs.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

from ..runtime.errors import UsageError

MODES = ("weak", "strong")
LAUNCHERS = ("auto", "local", "srun", "inprocess")
# flags the sweep sets itself at every point
OWNED = ("--nproc", "--dp", "--metrics", "--batch-size", "--quiet", "--log-every")


# --------------------------------------------------------------------------------------
# The points of a sweep
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One run of the sweep: N processes in a (dp, pp, cp, tp) mesh with its batch."""
    processes: int
    dp: int
    tp: int
    pp: int
    batch_size: int            # global, in sequences
    microbatches: int          # per replica per step
    micro_batch: int           # sequences per micro-batch
    seq_len: int
    shard: tuple | None        # (s_p, s_g, s_os), None for plain data parallelism
    zero: int | None
    argv: tuple                # the trainer's flags for this point (no --nproc, no --metrics)
    cp: int = 1                # context parallel: each sequence over cp ranks
    recompute: str = "none"

    @property
    def layout(self) -> dict:
        return dict(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero=self.zero,
                    shard=list(self.shard) if self.shard else None,
                    microbatches=self.microbatches, micro_batch=self.micro_batch,
                    batch_size=self.batch_size)


def parse_nproc_list(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UsageError(f"--nproc-list wants process counts such as 1,2,4; got {text!r}")
    if len(set(counts)) != len(counts):
        raise UsageError(f"--nproc-list {text}: a count appears twice")
    return sorted(counts)


def strip_flags(argv: list[str], flags=OWNED) -> list[str]:
    """``argv`` without ``flags`` (and their values): the sweep sets those per point."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            takes_value = name not in ("--quiet",) and "=" not in a
            skip = takes_value and i + 1 < len(argv)
            continue
        out.append(a)
    return out


def trainer_config(argv: list[str]):
    """The trainer's own parsing and validation of ``argv`` (raises UsageError)."""
    from . import loop as train
    return train.parse_config(list(argv))


def plan_points(mode: str, nproc_list: list[int], trainer_argv: list[str]) -> list[Point]:
    """Every point of the sweep, each validated by the trainer, before anything runs."""
    if mode not in MODES:
        raise UsageError(f"unknown sweep {mode!r}; use weak or strong")
    for name in ("--nproc", "--dp", "--metrics"):
        if any(a.split("=", 1)[0] == name for a in trainer_argv):
            raise UsageError(f"{name} is set by the sweep at each point; leave it out "
                             f"(--nproc-list gives the process counts)")
    for name in ("--save", "--resume"):          # every point trains from step 0 to --steps
        if any(a.split("=", 1)[0] == name for a in trainer_argv):
            raise UsageError(f"{name} does not fit a sweep (each point is a fresh run of "
                             f"--steps steps, and the second would meet the first's "
                             f"checkpoint); leave it out")
    argv = strip_flags(list(trainer_argv))
    base_n = nproc_list[0]
    base = trainer_config(strip_flags(list(trainer_argv), ("--quiet", "--log-every"))
                          + ["--nproc", str(base_n), "--backend", "gloo"])
    per_replica = base.tp * base.pp * base.cp
    bad = [n for n in nproc_list if n % per_replica]
    if bad:
        raise UsageError(f"{bad[0]} processes do not divide into tp={base.tp} x pp={base.pp} x "
                         f"cp={base.cp}; use multiples of {per_replica} in --nproc-list")
    points = []
    for n in nproc_list:
        if mode == "weak":
            if (base.batch_size * n) % base_n:
                raise UsageError(f"weak scaling: batch {base.batch_size} x {n}/{base_n} is not a "
                                 f"whole number of sequences; use a batch divisible by {base_n}")
            batch = base.batch_size * n // base_n
        else:
            batch = base.batch_size
        point_argv = argv + ["--batch-size", str(batch)]
        try:
            cfg = trainer_config(point_argv + ["--nproc", str(n), "--backend", "gloo"])
        except UsageError as e:
            raise UsageError(f"{mode} scaling at {n} processes: {e}") from None
        points.append(Point(processes=n, dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, batch_size=batch,
                            microbatches=cfg.microbatches,
                            micro_batch=batch // (cfg.dp * cfg.microbatches),
                            seq_len=cfg.model_cfg.seq_len,
                            shard=tuple(cfg.spec) if cfg.spec is not None else None,
                            zero=cfg.zero, argv=tuple(point_argv), cp=cfg.cp,
                            recompute=cfg.recompute))
    return points


# --------------------------------------------------------------------------------------
# Running one point
# --------------------------------------------------------------------------------------
def _procs(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


class PointFailed(RuntimeError):
    """A point's trainer exited non-zero; the message has its command and last lines.
    ``returncode``: the trainer's exit status (2: it refused its flags); ``oom``: its output
    says a rank ran out of memory."""

    def __init__(self, message: str, returncode: int | None = None, oom: bool = False):
        super().__init__(message)
        self.returncode, self.oom = returncode, oom


# what PyTorch (CUDA, HIP, CPU) prints when an allocation fails
OOM = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory", re.IGNORECASE)


def in_slurm() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


def resolve_launcher(launcher: str) -> str:
    if launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    if launcher == "auto":
        return "srun" if in_slurm() else "local"
    if launcher == "srun" and not in_slurm():
        raise UsageError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID) and srun "
                         "on the PATH; run inside salloc/sbatch or use --launcher local")
    return launcher


def command(point: Point, launcher: str, metrics: str, srun_args: str = "",
            timeout: float = 600.0, tasks_per_node: int = 8) -> list[str]:
    """The command line that runs ``point`` (local subprocess or an srun step).

    An srun step names its nodes and tasks per node (otherwise a step inherits every node of
    the allocation), so N ranks fill ceil(N / tasks_per_node) nodes, TP groups inside them.
    """
    trainer = [sys.executable, "-m", "minipar.train", *point.argv, "--metrics", metrics,
               "--quiet"]
    if launcher == "srun":
        nodes = -(-point.processes // tasks_per_node)
        return ["srun", "-N", str(nodes), "-n", str(point.processes), "--ntasks-per-node",
                str(min(point.processes, tasks_per_node)), *shlex.split(srun_args), *trainer]
    return trainer[:3] + ["--nproc", str(point.processes), "--timeout", str(timeout)] + trainer[3:]


def run_point(point: Point, launcher: str = "local", timeout: float = 600.0,
              workdir: str | None = None, srun_args: str = "", tasks_per_node: int = 8,
              index: int = 0) -> list[dict]:
    """Run one point; return rank 0's metrics records (one per step)."""
    if launcher == "inprocess":
        return _run_inprocess(point, timeout)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="minipar-scaling-") as workdir:
            return run_point(point, launcher, timeout, workdir, srun_args, tasks_per_node, index)
    metrics = os.path.join(os.path.abspath(workdir), f"metrics-n{point.processes}.jsonl")
    cmd = command(point, launcher, metrics, srun_args, timeout, tasks_per_node)
    env = dict(os.environ)
    if launcher == "local":
        env.setdefault("OMP_NUM_THREADS", "1")   # one process = one core
    else:
        # a fresh rendezvous port per step: the last step's may still be closing
        base = int(os.environ.get("MASTER_PORT", 29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 1000))
        env["MASTER_PORT"] = str(base + 1 + index)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the point with {_procs(point.processes)} ran past {timeout:.0f} s: "
                           f"{shlex.join(cmd)}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        raise PointFailed(f"the point with {_procs(point.processes)} failed "
                          f"(exit {done.returncode}): {shlex.join(cmd)}\n" + "\n".join(tail),
                          returncode=done.returncode,
                          oom=bool(OOM.search(done.stderr or "") or OOM.search(done.stdout or "")))
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_inprocess(point: Point, timeout: float) -> list[dict]:
    from ..runtime import dist
    from . import loop as train
    cfg = train.parse_config([*point.argv, "--nproc", str(point.processes), "--quiet",
                              "--timeout", str(timeout)])
    if point.processes == 1:
        return quiet_worker(cfg, threads=1)
    return dist.launch(quiet_worker, cfg.nproc, cfg, backend=cfg.backend, timeout=timeout)[0]


def quiet_worker(cfg, threads: int | None = None):
    """``train.worker`` without its summary lines (they would fill a notebook's output)."""
    import io
    import torch
    from . import loop as train
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)   # a single process here: one core, like each rank
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return train.worker(cfg)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------
# From step records to a point's record
# --------------------------------------------------------------------------------------
def measure(point: Point, history: list[dict], warmup: int) -> dict:
    """Median step time after ``warmup`` steps, split into communication and the rest."""
    timed = history[warmup:] or history
    step = statistics.median(h["step_time_s"] for h in timed)
    comm = [sum(h["comm_seconds"].values()) for h in timed if "comm_seconds" in h]
    comm_s = statistics.median(comm) if comm else None
    last = timed[-1]
    peaks, held = ([h[k] for h in history if h.get(k)]
                   for k in ("peak_memory_bytes", "peak_reserved_bytes"))
    return dict(step_time_s=step, tokens_per_s=point.batch_size * point.seq_len / step,
                comm_s=comm_s, compute_s=step - comm_s if comm_s is not None else None,
                comm_bytes=sum(last["comm_bytes"].values()), comm_bytes_by_op=last["comm_bytes"],
                model_state_bytes=last["model_state_bytes"]["total"], loss=last["loss"],
                timed_steps=len(timed), peak_memory_bytes=max(peaks) if peaks else None,
                peak_reserved_bytes=max(held) if held else None)


def node_shape(processes: int, launcher: str, tasks_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) a point runs on: under srun ceil(N / K) nodes of K ranks (N <=
    K: one node of N, ``command``); local and inprocess, this machine's N processes."""
    if launcher == "srun":
        return -(-processes // tasks_per_node), min(processes, tasks_per_node)
    return 1, processes


def predict(point: Point, model: str, hardware: str, chunks: int = 1, schedule: str = "1f1b",
            sp: bool = False, dtype: str = "fp32", per_node: int | None = None) -> dict:
    """The planner's step time and tokens/s for the layout that ``point`` runs, on nodes of
    ``per_node`` ranks (``node_shape``; None: the hardware's), as ``plan fit`` prices its row."""
    from .. import plan
    shape = plan.model_preset(model, seq_len=point.seq_len)
    layout = plan_layout(point, chunks, schedule, sp)
    hw = plan.load_hardware(hardware)
    e = plan.estimate(shape, replace(hw, gpus_per_node=per_node or hw.gpus_per_node), layout,
                      check=False,
                      dtype="fp32" if dtype == "fp32" else "mixed")   # bf16, fp16: 2+2+12 bytes
    return dict(step_time_s=e.step_time, tokens_per_s=e.tokens_per_s,
                comm_s=e.times["tp_comm"] + e.times["pp_comm"] + e.times["dp_exposed"],
                bubble_s=e.times["bubble"], hardware=e.hardware, notes=list(e.notes))


def plan_layout(point: Point, chunks: int = 1, schedule: str = "1f1b", sp: bool = False):
    """The planner's ``Layout`` of ``point`` (what ``predict`` estimates and ``--runs`` writes):
    the shard spec is the trainer's (``--zero``/``--shard`` over dp x cp; plain DP none), the
    micro-batch count is gradient accumulation, interleaving is ``chunks`` model chunks."""
    from ..plan.layout import Layout
    return Layout(tp=point.tp, pp=point.pp, dp=point.dp, micro_batch=point.micro_batch,
                  microbatches=point.microbatches, shard=point.shard or (1, 1, 1),
                  v=chunks if schedule == "interleaved" else 1, sp=sp,
                  schedule="gpipe" if schedule == "gpipe" else "1f1b", cp=point.cp,
                  recompute=point.recompute)


def model_shape(cfg):
    """The trainer's model (``cfg.model_cfg``: its preset with ``--seq-len``) as the planner's
    ``ModelShape``."""
    from ..plan.shapes import trainer_presets, with_seq_len
    m = cfg.model_cfg
    shape = with_seq_len(trainer_presets()[cfg.model], m.seq_len)
    return replace(shape, layers=m.n_layer, hidden=m.d_model, heads=m.n_head,
                   vocab=m.vocab_size, ffn_hidden=m.ffn, bias=m.bias)


def run_row(point: Point, measured: dict | None, cfg, launcher: str, tasks_per_node: int,
            status: str = "ok"):
    """``point`` as a row of the planner's measured runs (``minipar.plan.runs.Run``):
    ``measured`` is its ``measure`` (None unless status is ok)."""
    from ..plan.runs import Run
    n = point.processes
    nodes, per_node = node_shape(n, launcher, tasks_per_node)
    ok = status == "ok"
    peak = measured.get("peak_reserved_bytes") if ok else None     # what runs out: held
    return Run(shape=model_shape(cfg), layout=plan_layout(point, cfg.chunks, cfg.schedule, cfg.sp),
               nodes=nodes, gpus_per_node=per_node, framework="minipar",
               # model.CausalSelfAttention.core is F.scaled_dot_product_attention (fused); the
               # ring attention of cp > 1 (minipar.cp) computes its blocks with plain matmuls
               flash=point.cp == 1, dtype="fp32" if cfg.dtype == "fp32" else "mixed",
               status=status,
               tokens_per_s_gpu=measured["tokens_per_s"] / n if ok else math.nan,
               peak_mem_gib=peak / 2**30 if peak else math.nan)


def failure_status(error: BaseException) -> str | None:
    """The runs status of a point that raised ``error``: oom, crashed, or None where the
    trainer refused its flags (exit 2: nothing about the layout was measured)."""
    if isinstance(error, PointFailed):
        if error.returncode == 2:
            return None
        return "oom" if error.oom else "crashed"
    return "oom" if OOM.search(str(error)) else "crashed"


def check_runs_file(path: str) -> None:
    """``--runs``: a file that can be written and, if it holds anything, a runs CSV (rows are
    appended under its header)."""
    from ..plan.runs import COLUMNS
    from ..runtime.cli import check_output_file
    if not path:
        raise UsageError("--runs needs a file name, e.g. --runs runs.csv")
    check_output_file(path, "--runs")
    if os.path.exists(path) and os.path.getsize(path):
        try:
            with open(path, newline="") as f:
                header = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--runs {path}: cannot be read ({e})") from None
        if header.split(",") != list(COLUMNS):
            raise UsageError(f"--runs {path} is not a runs CSV (its first line is not the "
                             f"header {','.join(COLUMNS[:3])},...); give a new file or one "
                             f"--runs wrote")


def efficiencies(records: list[dict], key: str) -> None:
    """Add ``efficiency`` (per-process throughput against the first record) in place."""
    base = records[0][key]["tokens_per_s"] / records[0]["processes"]
    for r in records:
        r[key]["efficiency"] = r[key]["tokens_per_s"] / r["processes"] / base


# --------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------
def sweep(mode: str, nproc_list: list[int] | str, trainer_argv: list[str] = (),
          hardware: str = "laptop-cpu", launcher: str = "auto", warmup: int = 1,
          timeout: float = 600.0, workdir: str | None = None, srun_args: str = "",
          tasks_per_node: int | None = None, base_repeats: int = 1, progress=None,
          on_point=None, runs: str | None = None) -> list[dict]:
    """Run (or, with ``launcher="srun"``, submit step by step) a scaling sweep.

    Returns one record per point, smallest first::

        {"mode", "processes", "layout": {dp, tp, pp, cp, zero, shard, microbatches, micro_batch,
         batch_size}, "model", "step_time_s", "tokens_per_s", "efficiency", "ideal": 1.0,
         "compute_s", "comm_s", "comm_bytes", "comm_bytes_by_op", "model_state_bytes",
         "loss", "timed_steps", "predicted": {"step_time_s", "tokens_per_s", "efficiency",
         "comm_s", "bubble_s", "hardware"}, "predicted_efficiency", "launcher", "machine"}

    ``progress`` wraps the list of points (e.g. ``tqdm.auto.tqdm``); ``on_point(record)`` is
    called after each point. ``base_repeats`` > 1 runs the smallest point again after the
    others and keeps its fastest run: on a shared machine, load from other programs then can
    only lower an efficiency, never raise it above the ideal.

    ``runs``: append one row per point to this CSV (``minipar.plan.runs``; module docstring),
    also when a point fails (the points before it, and it as oom or crashed) before raising.
    """
    from .. import plan
    if isinstance(nproc_list, str):
        nproc_list = parse_nproc_list(nproc_list)
    nproc_list = sorted(nproc_list)
    launcher = resolve_launcher(launcher)
    if warmup < 0:
        raise UsageError(f"--discard must be >= 0, got {warmup}")
    if base_repeats < 1:
        raise UsageError(f"--base-repeats must be >= 1, got {base_repeats}")
    points = plan_points(mode, nproc_list, list(trainer_argv))
    cfg = trainer_config([*points[0].argv, "--nproc", str(points[0].processes),
                          "--backend", "gloo"])
    if cfg.steps <= warmup:
        raise UsageError(f"--steps {cfg.steps} leaves no step after --discard {warmup}; "
                         f"use --steps {warmup + 3} or more")
    try:
        plan.load_hardware(hardware)
    except (UsageError, OSError, ValueError) as e:
        raise UsageError(f"--hardware {hardware}: {e}") from None
    if tasks_per_node is None:
        env_tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        tasks_per_node = int(env_tasks) if env_tasks.isdigit() else 8
    if runs is not None:
        check_runs_file(runs)
        if cfg.model_cfg.moe_experts:
            raise UsageError("--runs: the runs schema has no mixture-of-experts columns (an MoE "
                             "row would read as its dense model); leave out --runs or "
                             "--moe-experts")
        uneven = [n for n in nproc_list if launcher == "srun" and n > tasks_per_node
                  and n % tasks_per_node]
        if uneven:
            raise UsageError(f"--runs: {uneven[0]} ranks do not fill whole nodes of "
                             f"--tasks-per-node {tasks_per_node}, and a runs row says nodes x "
                             f"gpus_per_node; use counts up to {tasks_per_node} or multiples "
                             f"of it")
    if workdir is None and launcher == "srun":
        workdir = f"minipar-scaling-{os.environ.get('SLURM_JOB_ID', 'job')}"  # shared by nodes
    if workdir is not None:
        os.makedirs(workdir, exist_ok=True)
    records, current = [], None
    try:
        for i, point in enumerate(progress(points) if progress else points):
            current = point
            history = run_point(point, launcher, timeout, workdir, srun_args, tasks_per_node, i)
            current = None
            record = dict(mode=mode, processes=point.processes, layout=point.layout,
                          model=cfg.model, launcher=launcher, machine=machine(launcher),
                          measured=measure(point, history, warmup),
                          predicted=predict(point, cfg.model, hardware, cfg.chunks,
                                            cfg.schedule, cfg.sp, cfg.dtype, node_shape(
                                                point.processes, launcher, tasks_per_node)[1]))
            records.append(record)
            efficiencies(records, "measured")
            efficiencies(records, "predicted")
            if on_point:
                on_point(record)
        base = records[0]
        for _ in range(base_repeats - 1):     # a failed re-run: the point's row is its first run's
            again = measure(points[0], run_point(points[0], launcher, timeout, workdir, srun_args,
                                                 tasks_per_node, len(points)), warmup)
            base.setdefault("base_runs_s", [base["measured"]["step_time_s"]]).append(
                again["step_time_s"])
            if again["step_time_s"] < base["measured"]["step_time_s"]:
                base["measured"] = again
    except BaseException as e:              # Ctrl-C too: the points done keep their rows
        if runs is not None:
            status = (failure_status(e) if current is not None and isinstance(e, Exception)
                      else None)
            failed = ([run_row(current, None, cfg, launcher, tasks_per_node, status)]
                      if status else [])
            _write_runs(runs, points, records, cfg, launcher, tasks_per_node, failed)
        raise
    efficiencies(records, "measured")
    if runs is not None:
        _write_runs(runs, points, records, cfg, launcher, tasks_per_node)
    return [flatten(r) for r in records]


def _write_runs(path: str, points: list[Point], records: list[dict], cfg, launcher: str,
                tasks_per_node: int, failed: list = ()) -> None:
    from ..plan.runs import write_runs
    write_runs(path, [run_row(p, r["measured"], cfg, launcher, tasks_per_node)
                      for p, r in zip(points, records)] + list(failed))


def flatten(r: dict) -> dict:
    """One flat record: the measured numbers at the top, the prediction beside them."""
    out = {k: v for k, v in r.items() if k not in ("measured",)}
    out.update(r["measured"])
    out["ideal"] = 1.0
    out["predicted_efficiency"] = r["predicted"]["efficiency"]
    return out


def machine(launcher: str) -> str:
    if launcher == "srun":
        return f"Slurm job {os.environ.get('SLURM_JOB_ID')} ({os.environ.get('SLURM_CLUSTER_NAME', 'cluster')})"
    import platform
    return f"{platform.node() or 'this host'} ({os.cpu_count()} CPU cores)"


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------
def table(records: list[dict]) -> str:
    lines = [f"{'N':>3} {'dp':>3} {'tp':>3} {'pp':>3} {'batch':>6} {'step ms':>8} "
             f"{'comm ms':>8} {'tokens/s':>9} {'MiB sent':>9} {'eff':>6} {'predicted':>9}"]
    for r in records:
        lay = r["layout"]
        comm = f"{r['comm_s'] * 1e3:8.1f}" if r["comm_s"] is not None else f"{'-':>8}"
        lines.append(f"{r['processes']:3d} {lay['dp']:3d} {lay['tp']:3d} {lay['pp']:3d} "
                     f"{lay['batch_size']:6d} {r['step_time_s'] * 1e3:8.1f} {comm} "
                     f"{r['tokens_per_s']:9.0f} {r['comm_bytes'] / 2**20:9.3f} "
                     f"{r['efficiency']:6.1%} {r['predicted_efficiency']:9.1%}")
    return "\n".join(lines)


def draw(records: list[dict], axes=None, label: str | None = None, color=None):
    """Efficiency against processes (measured, predicted, ideal) and each point's step time
    split into compute and communication. Returns the two axes."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_eff, ax_time = axes
    n = [r["processes"] for r in records]
    mode = records[0]["mode"]
    name = label or describe(records[0])
    ax_eff.plot(n, [r["efficiency"] for r in records], "o-", color=color, label=f"{name} measured")
    ax_eff.plot(n, [r["predicted_efficiency"] for r in records], "x--", color=color,
                alpha=0.7, label=f"{name} predicted ({records[0]['predicted']['hardware']})")
    if not any(line.get_label() == "ideal" for line in ax_eff.lines):
        ax_eff.axhline(1.0, color="grey", lw=1, ls=":", label="ideal")
    ax_eff.set(xlabel="processes", ylabel="efficiency (1 = ideal)", xticks=n,
               title=f"{mode} scaling: throughput per process vs {n[0]}")
    ax_eff.set_ylim(0, 1.15)
    ax_eff.legend(fontsize=7)
    x = range(len(records))
    comm = [1e3 * (r["comm_s"] or 0.0) for r in records]
    compute = [1e3 * r["step_time_s"] - c for r, c in zip(records, comm)]
    ax_time.bar(x, compute, color="#4c72b0", label="compute (step - comm)")
    ax_time.bar(x, comm, bottom=compute, color="#c44e52", label="communication (rank 0, blocked)")
    ax_time.set_xticks(list(x), [str(k) for k in n])
    ax_time.set(xlabel="processes", ylabel="median step time (ms)", title=f"{name}: step time")
    ax_time.legend(fontsize=7)
    return axes


def describe(record: dict) -> str:
    lay = record["layout"]
    parts = [f"tp{lay['tp']}"] if lay["tp"] > 1 else []
    parts += [f"pp{lay['pp']}"] if lay["pp"] > 1 else []
    if lay["zero"] is not None:
        parts.append(f"ZeRO-{lay['zero']}")
    elif lay["shard"]:
        parts.append("shard {},{},{}".format(*lay["shard"]))
    else:
        parts.append("DP")
    return " x ".join(parts)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def parser():
    from ..runtime.cli import ArgumentParser
    p = ArgumentParser(prog="python -m minipar.scaling",
                       description="Weak or strong scaling sweep of the trainer, measured and "
                                   "predicted. Unknown flags go to python -m minipar.train.")
    p.add_argument("mode", choices=MODES, help="weak: work per process fixed; strong: global "
                                               "batch fixed")
    p.add_argument("--nproc-list", required=True, metavar="N,N,...",
                   help="process counts, e.g. 1,2,4 (multiples of tp x pp)")
    p.add_argument("--out", default=None, help="write one JSON line per point")
    p.add_argument("--runs", default=None, metavar="FILE.csv",
                   help="append one row per point to this measured-runs CSV (the planner's "
                        "schema, minipar.plan.runs; python -m minipar.plan fit reads it); a "
                        "failed point is appended as oom or crashed")
    p.add_argument("--plot", default=None, help="save the efficiency figure (PNG)")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list")
    p.add_argument("--hardware", default="laptop-cpu",
                   help="planner hardware preset or calibrated JSON file for the prediction")
    p.add_argument("--discard", type=int, default=1, metavar="K",
                   help="steps left out of the median step time (warm-up); the trainer's "
                        "--warmup is its learning-rate warm-up and passes through")
    p.add_argument("--base-repeats", type=int, default=1,
                   help="run the smallest point this many times (again after the others) "
                        "and keep its fastest run; 2 on a shared machine")
    p.add_argument("--launcher", default="auto", choices=LAUNCHERS,
                   help="auto: srun inside a Slurm allocation, else local subprocesses")
    p.add_argument("--srun-args", default="",
                   help='extra srun options for each step, e.g. "--gpus-per-task 1 --gpu-bind closest"')
    p.add_argument("--tasks-per-node", type=int, default=None,
                   help="srun: ranks per node (default $SLURM_NTASKS_PER_NODE, else 8)")
    p.add_argument("--point-timeout", type=float, default=600.0,
                   help="seconds before a point is killed")
    p.add_argument("--workdir", default=None, help="folder for each point's metrics file "
                                                   "(must be shared by the nodes under srun)")
    return p


def _check_figure_format(path: str) -> None:
    """matplotlib is there and can write this file type (it picks the type by extension)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise UsageError(f"--plot needs matplotlib ({e}); pip install matplotlib") from None
    ext = os.path.splitext(path)[1][1:].lower()
    types = FigureCanvasBase.get_supported_filetypes()
    if ext not in types:
        raise UsageError(f"--plot {path}: give a figure file ending in one of "
                         f"{', '.join('.' + t for t in ('png', 'pdf', 'svg') if t in types)}")


def _check_workdir(folder: str) -> None:
    """--workdir can be created and written (each point writes its metrics file there)."""
    from ..runtime.cli import check_output_file
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--workdir {folder}: cannot be created ({e.strerror or e})") from None
    check_output_file(os.path.join(folder, "metrics-n1.jsonl"), "--workdir")


def main(argv=None):
    from ..runtime.cli import main_guard
    try:
        main_guard(_main, sys.argv[1:] if argv is None else argv)
    except PointFailed as e:
        print(str(e), file=sys.stderr)
        sys.exit(1)


def _main(argv: list[str]) -> list[dict]:
    from ..runtime.cli import check_output_file
    args, trainer_argv = parser().parse_known_args(argv)
    # Every output is checked now, not after the last point has run.
    for path, flag in ((args.out, "--out"), (args.plot, "--plot")):
        if path:
            check_output_file(path, flag)   # a folder, a missing folder, not writable
    if args.plot:
        _check_figure_format(args.plot)
    if args.runs is not None:
        check_runs_file(args.runs)          # writable, and a runs CSV if it holds anything
    if args.workdir:
        _check_workdir(args.workdir)
    if args.tasks_per_node is not None and args.tasks_per_node < 1:
        raise UsageError(f"--tasks-per-node must be >= 1, got {args.tasks_per_node}")
    if not 0 < args.point_timeout < float("inf"):
        raise UsageError(f"--point-timeout must be positive, got {args.point_timeout}")
    nproc_list = parse_nproc_list(args.nproc_list)

    def report(r):
        if not args.json:
            n = r["processes"]
            print(f"{n} process{'es' if n != 1 else ''}: "
                  f"{r['measured']['step_time_s'] * 1e3:.1f} ms/step, "
                  f"efficiency {r['measured']['efficiency']:.1%} "
                  f"(predicted {r['predicted']['efficiency']:.1%})", file=sys.stderr, flush=True)

    records = sweep(args.mode, nproc_list, trainer_argv, hardware=args.hardware,
                    launcher=args.launcher, warmup=args.discard, timeout=args.point_timeout,
                    workdir=args.workdir, srun_args=args.srun_args,
                    tasks_per_node=args.tasks_per_node, base_repeats=args.base_repeats,
                    on_point=report, runs=args.runs)
    if args.out:
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        axes = draw(records)
        axes[0].figure.tight_layout()
        axes[0].figure.savefig(args.plot, dpi=120)
        plt.close(axes[0].figure)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(f"{args.mode} scaling of {describe(records[0])}, model {records[0]['model']}, "
              f"on {records[0]['machine']}; predicted on {records[0]['predicted']['hardware']}")
        print(table(records))
        print(f"predicted: {records[0]['predicted']['notes'][0]}")   # unfitted, or its error bar
        crowded = [r for r in records if r["predicted"]["notes"][1:]]
        if crowded:         # one line: where the prediction time-slices the cores
            print("predicted: " + "; ".join(f"N={r['processes']}: {r['predicted']['notes'][1]}"
                                            for r in crowded))
    return records


if __name__ == "__main__":
    main()
