"""The code behind notebook 06_scaling_experiments: measured scaling here, predicted at scale.

Three parts, each a function that returns plain data and a ``draw_*`` that turns it into a
figure:

* ``run_sweeps``: weak and strong scaling of data parallelism, ZeRO-1 and one 3D layout,
  each a ``minipar.scaling.sweep`` (the same tool as ``python -m minipar.scaling``), run in
  this interpreter's fast launcher. Every record carries the planner's prediction of the
  same layout beside the measurement.
* ``pipeline_sweep``: one fixed pipeline (pp = 2) trained with m = 1, 2, 4, ... micro-batches
  of a fixed size, so the global batch grows with m: throughput against the bubble
  (p-1)/(m+p-1), and the bubble measured from the pipeline's own timeline
  (``minipar.bench.pp.measure_pipeline``); ``frontier_pipeline`` asks the planner the same
  question for GPT-175B on Frontier.
* ``frontier_scaling``: the planner's weak and strong scaling of GPT 22B, 175B and 1T on
  ``frontier-mi250x``, beside the study's measured 100% weak and 89% / 87% strong scaling
  (Dash et al. 2023).

The layouts at scale are ours, chosen by the study's practices (TP inside a node, a deep
pipeline with many micro-batches, ZeRO-1 over the replicas); they are not the study's exact
configurations.
"""
from __future__ import annotations

import os

from .. import plan
from ..train import scaling


# --------------------------------------------------------------------------------------
# 1. Measured weak and strong scaling on this machine
# --------------------------------------------------------------------------------------
MODEL = ["--model", "tiny", "--lr", "3e-3"]
# name -> (trainer flags of the smallest point, process counts)
SWEEPS = {
    "DP": (["--batch-size", "8"], [1, 2, 4]),
    "ZeRO-1": (["--zero", "1", "--batch-size", "8"], [1, 2, 4]),
    "3D tp2 x pp2 x dp, ZeRO-1": (["--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "4",
                                   "--batch-size", "16"], [4, 8]),
}
# The smallest point runs twice (first and last) and keeps its faster run, so load from other
# programs can only lower an efficiency; what remains above 1 is timing noise, up to this.
NOISE = 0.05


def calibrated_hardware(timeout: float = 90.0, path: str | None = None) -> str:
    """Calibrate this machine (``python -m minipar.bench calibrate --quick``) at the sweeps'
    calibration point (one process of ``tiny``, batch 8); the file's path, or ``laptop-cpu``
    (and one line saying why) when calibrating fails or takes longer than ``timeout``. With no
    ``path`` the file lives in a temporary folder removed when the interpreter exits."""
    import atexit
    import shutil
    import subprocess
    import sys
    import tempfile
    if path is None:
        folder = tempfile.mkdtemp(prefix="minipar-nb06-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)   # gone when the kernel stops
        path = os.path.join(folder, "this-machine.json")
    cmd = [sys.executable, "-m", "minipar.bench", "calibrate", "--quick", "--out", path,
           "--model", "tiny", "--batch-size", "8"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"calibration took longer than {timeout:.0f} s: using the laptop-cpu preset")
        return "laptop-cpu"
    if done.returncode != 0:
        print("calibration failed (" + (done.stderr.strip().splitlines() or ["?"])[-1]
              + "): using the laptop-cpu preset")
        return "laptop-cpu"
    return path


def run_sweeps(steps: int = 5, warmup: int = 2, hardware: str = "laptop-cpu",
               modes=("weak", "strong"), sweeps=None, progress=None) -> dict:
    """Every sweep of ``SWEEPS`` in each mode: ``{(name, mode): [record, ...]}``.

    ``progress`` is a tqdm-like factory; it gets one tick per point (all sweeps together).
    """
    sweeps = sweeps or SWEEPS
    total = sum(len(counts) for _, counts in sweeps.values()) * len(modes)   # + base reruns
    bar = progress(total=total, desc="scaling points") if progress else None
    results = {}
    for mode in modes:
        for name, (flags, counts) in sweeps.items():
            results[(name, mode)] = scaling.sweep(
                mode, counts, MODEL + flags + ["--steps", str(steps)], hardware=hardware,
                launcher="inprocess", warmup=warmup, timeout=300, base_repeats=2,
                on_point=(lambda r: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    return results


def table(results: dict) -> str:
    lines = []
    for (name, mode), records in results.items():
        lines.append(f"{mode} scaling, {name}:")
        lines.append(scaling.table(records))
    return "\n".join(lines)


def check_efficiencies(results: dict, noise: float = NOISE) -> int:
    """Every measured efficiency is in (0, ideal] (up to ``noise``), a prediction beside it."""
    n = 0
    for (name, mode), records in results.items():
        for r in records:
            e, p = r["efficiency"], r["predicted_efficiency"]
            assert 0 < e <= r["ideal"] + noise, f"{mode} {name} at {r['processes']}: {e}"
            assert 0 < p <= r["ideal"] + 1e-9, f"{mode} {name} predicted at {r['processes']}: {p}"
            n += 1
    return n


def takeaway(results: dict, cores: int) -> str:
    """One line: what the weak-scaling sweep of DP shows, inside and beyond the cores."""
    records = results.get(("DP", "weak")) or next(iter(results.values()))
    inside = [r for r in records if r["processes"] <= cores][-1]
    beyond = [r for r in records if r["processes"] > cores]
    text = (f"weak DP: {inside['efficiency']:.0%} at {inside['processes']} processes "
            f"(predicted {inside['predicted_efficiency']:.0%})")
    if beyond:
        text += (f"; {beyond[-1]['efficiency']:.0%} at {beyond[-1]['processes']}, where "
                 f"{beyond[-1]['processes']} processes share {cores} cores")
    return text


def draw_efficiency(results: dict, cores: int | None = None):
    """Efficiency against processes, weak and strong side by side; the points beyond the
    machine's cores are shaded (those processes share cores)."""
    import matplotlib.pyplot as plt
    cores = cores or os.cpu_count()
    modes = sorted({mode for _, mode in results}, key=("weak", "strong").index)
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 3.8), sharey=True)
    axes = [axes] if len(modes) == 1 else list(axes)
    for ax, mode in zip(axes, modes):
        counts = sorted({r["processes"] for (_, m), rs in results.items() if m == mode for r in rs})
        ax.axvspan(cores + 0.5, max(counts) + 0.5, color="grey", alpha=0.12,
                   label=f"more processes than the {cores} cores")
        ax.axhline(1.0, color="black", lw=1, ls=":", label="ideal")
        for i, ((name, m), records) in enumerate(r for r in results.items() if r[0][1] == mode):
            n = [r["processes"] for r in records]
            ax.plot(n, [r["efficiency"] for r in records], "o-", color=f"C{i}",
                    label=f"{name}, measured")
            ax.plot(n, [r["predicted_efficiency"] for r in records], "x--", color=f"C{i}",
                    alpha=0.6, label=f"{name}, predicted")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set(xlabel="processes (gloo, one thread each)", ylim=(0, 1.2),
               title=f"{mode} scaling" + (" (work per process fixed)" if mode == "weak"
                                           else " (global batch fixed)"))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency: tokens/s per process\nrelative to the smallest run")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=7, ncol=4, loc="upper center",
               bbox_to_anchor=(0.5, 0.02))
    return fig


def draw_time_split(results: dict, mode: str = "weak"):
    """Each point's median step time split into rank 0's blocked communication and the rest."""
    import matplotlib.pyplot as plt
    runs = [(name, records) for (name, m), records in results.items() if m == mode]
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.4))
    for ax, (name, records) in zip(axes, runs):
        x = range(len(records))
        comm = [1e3 * (r["comm_s"] or 0.0) for r in records]
        compute = [1e3 * r["step_time_s"] - c for r, c in zip(records, comm)]
        ax.bar(x, compute, color="#4c72b0", label="compute (step - comm)")
        ax.bar(x, comm, bottom=compute, color="#c44e52", label="communication (blocked)")
        for xi, r in zip(x, records):
            ax.text(xi, 1e3 * r["step_time_s"], f"{r['comm_bytes'] / 2**20:.2f} MiB",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [str(r["processes"]) for r in records])
        ax.set(xlabel="processes", ylabel="median step time (ms)", title=f"{name}, {mode}")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------
# 2. The pipeline lesson: micro-batches against bubble and global batch
# --------------------------------------------------------------------------------------
def pipeline_sweep(ms=(1, 2, 4, 8, 16), pp: int = 2, micro_batch: int = 2, steps: int = 5,
                   warmup: int = 2, hardware: str = "laptop-cpu", progress=None,
                   bubble_steps: int = 3) -> list[dict]:
    """One pipeline of ``pp`` stages (``pp`` processes), micro-batches of ``micro_batch``
    sequences, m of them per step: the global batch is micro_batch x m. For each m, the
    trainer's measured and the planner's predicted step time and tokens/s, and the bubble
    measured from the pipeline's own timeline (``measured_bubble``, the median of
    ``bubble_steps`` steps, each in ``measured_bubble_steps``).

    The bubble is ``minipar.bench.pp.measure_pipeline``'s: every stage starts the step after
    a barrier, the ``PipelineRunner`` records the start and end of each forward and backward
    it runs, and the bubble is 1 - (compute time of all stages) / (p x makespan), the ideal
    timeline's definition (notebook 03). With the same time per micro-batch on every stage
    it is (p-1)/(m+p-1); uneven stages, messages, and a stage that waits for a descheduled
    neighbour only add to it.
    """
    from ..runtime import dist
    bubbles = dist.launch(measured_bubbles, pp, list(ms), micro_batch, bubble_steps,
                          timeout=300)[0]                      # one launch for every m
    rows = []
    for m, timed in zip(progress(ms, desc="micro-batch counts") if progress else ms, bubbles):
        records = scaling.sweep(
            "weak", [pp], MODEL + ["--pp", str(pp), "--microbatches", str(m), "--batch-size",
                                   str(micro_batch * m), "--steps", str(steps)],
            hardware=hardware, launcher="inprocess", warmup=warmup, timeout=300)
        r = records[0]
        rows.append(dict(m=m, global_batch=micro_batch * m, step_time_s=r["step_time_s"],
                         tokens_per_s=r["tokens_per_s"], bubble=plan.bubble_fraction(pp, m),
                         predicted_tokens_per_s=r["predicted"]["tokens_per_s"],
                         predicted_bubble_s=r["predicted"]["bubble_s"],
                         predicted_step_s=r["predicted"]["step_time_s"],
                         measured_bubble=timed["bubble"],
                         measured_bubble_steps=[tl.bubble for tl in timed["timelines"]]))
    return rows


def measured_bubbles(ms: list[int], micro_batch: int, steps: int) -> list[dict] | None:
    """On every rank of a pipeline (one stage each): ``bench.pp.measure_pipeline`` of the
    notebook's model for each m; rank 0 gets the results."""
    from ..bench import pp as bench_pp
    return [bench_pp.measure_pipeline(model_name=MODEL[1], microbatches=m,
                                      micro_batch=micro_batch, steps=steps, warmup=1)
            for m in ms]


def draw_pipeline(rows: list[dict], pp: int = 2, title: str = "this machine"):
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    m = [r["m"] for r in rows]
    ax1.plot(m, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    ax1.plot(m, [r["predicted_tokens_per_s"] for r in rows], "x--", label="predicted (planner)")
    ax1.set(xscale="log", xlabel="micro-batches per step m", ylabel="tokens/s",
            title=f"pp={pp} on {title}: throughput")
    ax1.set_xticks(m, [str(k) for k in m])
    ax1.legend(fontsize=8)
    ax2.plot(m, [100 * r["bubble"] for r in rows], "s-", color="C2",
             label="(p-1)/(m+p-1), ideal 1F1B")
    for r in rows:
        ax2.plot([r["m"]] * len(r["measured_bubble_steps"]),
                 [100 * b for b in r["measured_bubble_steps"]], ".", color="C3", alpha=0.35)
    ax2.plot(m, [100 * r["measured_bubble"] for r in rows], "o", color="C3",
             label="measured: 1 - compute / (p x makespan),\nmedian of the steps (dots)")
    ax2.set(xscale="log", xlabel="micro-batches per step m", ylabel="bubble (% of the step)",
            title="the ideal bubble shrinks, the global batch grows")
    ax2.set_xticks(m, [f"{k}\n(B={r['global_batch']})" for k, r in zip(m, rows)])
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def frontier_pipeline(model: str = "gpt-175b", gcds: int = 1024, ms=(8, 16, 32, 64, 128, 256),
                      tp: int = 4, pp: int = 16) -> list[dict]:
    """The planner's bubble and throughput of one pipeline at Frontier scale against m
    (micro-batch of 1 sequence, ZeRO-1 over dp = gcds / (tp pp), full recomputation)."""
    shape = plan.model_preset(model)
    dp = gcds // (tp * pp)
    rows = []
    for m in ms:
        layout = plan.Layout(tp=tp, pp=pp, dp=dp, micro_batch=1, microbatches=m,
                             shard=(1, 1, dp), recompute="full")
        e = plan.estimate(shape, "frontier-mi250x", layout, order="tp,dp,pp", check=False)
        rows.append(dict(m=m, global_batch=layout.global_batch,
                         global_batch_tokens=layout.global_batch * shape.seq_len,
                         bubble=e.times["bubble"] / e.step_time, tokens_per_s=e.tokens_per_s,
                         hfu=e.hfu, fits=e.fits))
    return rows


def draw_frontier_pipeline(rows: list[dict], model: str = "gpt-175b", gcds: int = 1024):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    m = [r["m"] for r in rows]
    ax.plot(m, [100 * r["bubble"] for r in rows], "s-", color="C2", label="bubble, % of step")
    ax.plot(m, [100 * r["hfu"] for r in rows], "o-", color="C0", label="HFU, % of peak")
    ax.set(xscale="log", xlabel="micro-batches per step m (global batch, sequences)",
           ylabel="%", title=f"{model} on {gcds} Frontier GCDs, tp=4 pp=16 (predicted)")
    ax.set_xticks(m, [f"{k}\n({r['global_batch']})" for k, r in zip(m, rows)])
    gpt3 = 1536
    ax.axvline(gpt3 / (rows[0]["global_batch"] / rows[0]["m"]), color="grey", ls=":",
               label="GPT-3's batch, 1536 sequences")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------
# 3. At scale: GPT 22B, 175B, 1T on Frontier
# --------------------------------------------------------------------------------------
# The study's measured scaling (Dash et al. 2023): 100% weak scaling for 175B and 1T,
# 89% (175B, 1024 GCDs) and 87% (1T, 3072 GCDs) strong scaling.
STUDY = {"gpt-175b": dict(gcds=1024, weak=1.00, strong=0.89),
         "gpt-1t": dict(gcds=3072, weak=1.00, strong=0.87)}
# Our layouts, chosen by the study's practices; the base is the smallest dp that fits.
AT_SCALE = {
    "gpt-22b": dict(tp=2, pp=4, dps=[4, 8, 16, 32, 64]),
    "gpt-175b": dict(tp=4, pp=16, dps=[2, 4, 8, 16]),
    "gpt-1t": dict(tp=8, pp=64, dps=[2, 3, 6]),
}
# Every base has dp >= 2: from dp = 1, ``plan.scaled_layout`` cannot tell which shard factor
# was "dp" (all three are 1), so (1, 1, 1) would grow into ZeRO-3, not ZeRO-1.
GLOBAL_BATCH = 1536        # sequences of 2048 tokens, GPT-3's batch


def frontier_scaling(weak: bool) -> dict[str, list[dict]]:
    """Predicted efficiency against GCDs for each model (``plan.scaling``).

    Strong scaling keeps 1536 sequences per step (fewer micro-batches per replica as dp
    grows); weak scaling gives each replica the micro-batches it has at the largest count.
    """
    out = {}
    for model, cfg in AT_SCALE.items():
        shape = plan.model_preset(model)
        tp, pp, dps = cfg["tp"], cfg["pp"], cfg["dps"]
        dp0 = dps[0]
        m = GLOBAL_BATCH // (dps[-1] if weak else dp0)
        layout = plan.Layout(tp=tp, pp=pp, dp=dp0, micro_batch=1, microbatches=m,
                             shard=(1, 1, dp0), recompute="full")
        rows = plan.scaling(shape, "frontier-mi250x", layout, [tp * pp * d for d in dps],
                            weak=weak, order="tp,dp,pp")
        out[model] = [dict(gcds=r["gpus"], efficiency=r["efficiency"], fits=r["fits"])
                      for r in rows]
    return out


def draw_frontier_scaling(weak_rows: dict, strong_rows: dict):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, rows, kind in ((axes[0], weak_rows, "weak"), (axes[1], strong_rows, "strong")):
        ax.axhline(100, color="black", lw=1, ls=":", label="ideal")
        for i, (model, pts) in enumerate(rows.items()):
            pts = [p for p in pts if p["fits"]]
            ax.plot([p["gcds"] for p in pts], [100 * p["efficiency"] for p in pts], "o-",
                    color=f"C{i}", ms=4, label=f"{model} predicted")
            if model in STUDY:
                s = STUDY[model]
                ax.plot([s["gcds"]], [100 * s[kind]], "*", ms=14, color=f"C{i}",
                        label=f"{model} study, {s['gcds']} GCDs")
        ax.set(xscale="log", xlabel="GCDs", title=f"{kind} scaling on Frontier")
        ax.set_xscale("log", base=2)
        ticks = [32, 128, 512, 1024, 3072]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency (% of the smallest run)")
    axes[0].set_ylim(60, 105)
    axes[1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig
