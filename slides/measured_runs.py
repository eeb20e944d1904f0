"""The runs behind the workshop deck's measured figures and numbers (``make_figures.py`` calls
them; each returns the text of the deck's measured spans it fills, and draws through the
``save`` it is given).

Each uses the function its notebook uses, with the notebook's settings:

* ``scaling_measured``: ``minipar.scaling.sweep`` of DP on ``tiny``, weak and strong, 1, 2, 4
  processes (notebook 06, ``python -m minipar.scaling``);
* ``moe``: notebook 08's three runs (``lab.nb08.three_runs``), its routing of a line of text
  and ``lab.nb08.ep_traffic`` on 4 gloo ranks;
* ``checkpoint_layouts``: the trainer saves ``nano`` in one layout and resumes it in another;
  which rank wrote which box, read from each checkpoint's DCP metadata (notebook 05);
* ``cp_numbers``: notebook 09's counts (``cp.work_per_rank``, ``lab.nb09.activation_bytes``) and
  its section 4 predictions (``lab.nb09.at_scale``, ``lab.nb09.search_long_context``);
* ``write_measured``: rewrite the deck's ``<!-- measured:NAME -->...<!-- /measured -->`` spans.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path


# The spans of the deck these runs write (``<!-- measured:NAME -->...<!-- /measured -->``)
MEASURED = ("scaling", "moe_setup", "moe_table", "moe_balance", "moe_a2a", "cp_scores",
            "cp_activations", "cp_without", "cp_best", "cp_memory", "cp_mfu", "frontier_errors")
SPAN = re.compile(r"(<!-- measured:(\w+) -->)(.*?)(<!-- /measured -->)", re.S)


# --------------------------------------------------------------------------------------
# 1. Scaling, measured here (the scaling tool's sweep)
# --------------------------------------------------------------------------------------
# The same points as ``python -m minipar.scaling weak|strong --nproc-list 1,2,4 --model tiny
# --steps 8 --discard 3`` (slides/README.md), in this interpreter's launcher (notebook 06's)
SCALING = {"weak": ["--model", "tiny", "--batch-size", "8", "--steps", "8"],
           "strong": ["--model", "tiny", "--batch-size", "16", "--steps", "8"]}
SCALING_NPROC, SCALING_DISCARD = [1, 2, 4], 3


def machine_line() -> str:
    from minipar.bench import machine
    return f"{machine()}, load average {os.getloadavg()[0]:.0f}"


def scaling_measured(save, out: Path) -> dict[str, str]:
    import json
    from minipar.train import scaling
    got = {}
    for mode, argv in SCALING.items():
        records = scaling.sweep(mode, SCALING_NPROC, argv, warmup=SCALING_DISCARD,
                                launcher="inprocess", base_repeats=2, timeout=300)
        axes = scaling.draw(records)
        axes[0].figure.suptitle(f"measured on {machine_line()}", fontsize=8)
        axes[0].figure.tight_layout()
        save(axes[0].figure, f"scaling_{mode}.png")
        with open(out / f"scaling_{mode}.jsonl", "w") as f:      # the points (not in git)
            f.write("".join(json.dumps(r) + "\n" for r in records))
        got[mode] = records[1:]

    def pct(records, key):
        return [f"{100 * r[key]:.0f} %" for r in records]

    w, st = got["weak"], got["strong"]
    counts = [r["processes"] for r in w]
    text = (f"weak {pct(w, 'efficiency')[0]} at {counts[0]}, {pct(w, 'efficiency')[1]} at "
            f"{counts[1]} processes (predicted {', '.join(pct(w, 'predicted_efficiency'))}); "
            f"strong {' and '.join(pct(st, 'efficiency'))} (predicted "
            f"{', '.join(pct(st, 'predicted_efficiency'))}), on a {os.cpu_count()}-core machine "
            f"(load average {os.getloadavg()[0]:.0f} when measured)")
    return {"scaling": text}


# --------------------------------------------------------------------------------------
# 2. Mixture of experts: notebook 08's runs, its routing and all-to-all bytes
# --------------------------------------------------------------------------------------
ROUTED_TEXT = "To be, or not to be, that is th"       # notebook 08's


def moe(save) -> dict[str, str]:
    import matplotlib.pyplot as plt
    from minipar.runtime import dist
    from minipar.lab import nb08
    runs = nb08.three_runs(progress=False)              # notebook 08's three runs, its defaults
    summary = nb08.summary(runs)
    # what the slide says: on CPU the MoE step is slower than its dense twin's
    assert all(summary[k]["ms_per_step"] > summary["dense twin"]["ms_per_step"]
               for k in ("MoE + aux", "MoE, no aux")), summary
    rows = []
    for ep in (2, 4):                                   # notebook 08's section 4
        rows += dist.launch(nb08.ep_traffic, 4, ep, "nano", 8, 2, 4, timeout=300)
    assert all(r["measured"] == r["formula"] for r in rows), rows   # the slide says "equal"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.0),
                                      gridspec_kw=dict(height_ratios=[1, 1.1]))
    chars, firsts = nb08.routing_of_text(runs["MoE + aux"]["model"], ROUTED_TEXT)
    nb08.draw_routing(chars, firsts, 8, ax=top,
                      title="first-choice expert of each character, per MoE layer "
                            "(nano, 8 experts, top-2, trained with the aux loss)")
    nb08.draw_traffic(rows, ax=bottom)
    bottom.set_title("all-to-all bytes of one step on 4 gloo ranks: measured = the formula on "
                     "each rank's own routing", fontsize=9)
    fig.tight_layout()
    save(fig, "moe_routing_traffic.png")

    cfg = nb08.three_configs()["MoE + aux"]
    names = {"dense twin": f"dense twin (MLP {cfg.moe_top_k}× wide, same active params)",
             "MoE + aux": f"MoE + aux loss (coef {cfg.moe_aux_coef:g} × {cfg.n_layer} layers)",
             "MoE, no aux": "MoE, no aux loss"}
    table = "\n".join(["| | parameters | cross-entropy (last 10) | ms/step |",
                        "| --- | ---: | ---: | ---: |"] +
                       [f"| {names[k]} | {summary[k]['params']:,} | {summary[k]['final_loss']:.3f} "
                        f"| {summary[k]['ms_per_step']:.0f} |" for k in names])
    a2a = next(r for r in rows if r["ep"] == 4 and r["rank"] == 0)
    steps = len(runs["MoE + aux"]["loss"])
    return {
        "moe_setup": (f"`nano`, {cfg.moe_experts} experts, top-{cfg.moe_top_k}, {steps} steps, "
                      f"one process, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.0f}"),
        "moe_table": "\n\n" + table + "\n\n",
        "moe_balance": (f"(last 20 steps): **{summary['MoE + aux']['imbalance']:.1f}×** with the aux loss, "
                        f"**{summary['MoE, no aux']['imbalance']:.1f}×** without"),
        "moe_a2a": (f"`ep=4` on {len(rows) // 2} ranks, rank 0: {a2a['measured']:,} B; balanced estimate "
                    f"{a2a['balanced']:,.0f} B"),
    }


# --------------------------------------------------------------------------------------
# 3. A checkpoint saved by one layout, resumed by another (the "full run" slide's commands)
# --------------------------------------------------------------------------------------
SAVED_AS = ["--nproc", "4", "--tp", "2", "--dp", "2", "--zero", "1"]
RESUMED_AS = ["--nproc", "2", "--pp", "2"]
SHOWN = ["model.blocks.0.attn.qkv.weight", "model.blocks.0.mlp.fc.weight",
         "optim.state.blocks.0.mlp.fc.weight.exp_avg", "model.blocks.3.mlp.fc.weight",
         "model.head.proj.weight"]


def writers(path: str) -> dict[str, list[tuple[tuple, tuple, int]]]:
    """From a checkpoint's DCP metadata: per key, (offsets, sizes, rank that wrote it)."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(path).read_metadata()
    out: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        md = meta.state_dict_metadata[index.fqn]
        if index.offset is None or not hasattr(md, "chunks"):
            continue                                     # scalars and param groups
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset))
        rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))   # DCP: __<rank>_0.distcp
        out.setdefault(index.fqn, []).append((tuple(chunk.offsets), tuple(chunk.sizes), rank))
    return out


def checkpoint_layouts(save) -> None:
    import matplotlib.pyplot as plt
    from minipar.runtime import dist
    from minipar.train import scaling
    from minipar import train
    common = ["--model", "nano", "--quiet"]
    with tempfile.TemporaryDirectory(prefix="minipar-slides-") as root:
        saved, resumed = os.path.join(root, "a"), os.path.join(root, "b")
        first = train.parse_config(common + SAVED_AS + ["--steps", "1", "--save", saved])
        dist.launch(scaling.quiet_worker, first.world, first, timeout=300)
        second = train.parse_config(common + RESUMED_AS + [
            "--steps", "2", "--resume", os.path.join(saved, "step-000001"), "--save", resumed])
        dist.launch(scaling.quiet_worker, second.world, second, timeout=300)
        before = writers(os.path.join(saved, "step-000001"))
        after = writers(os.path.join(resumed, "step-000002"))
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    fig, axes = plt.subplots(2, len(SHOWN), figsize=(11, 4.2))
    for row, (boxes, label) in enumerate(((before, "saved by\ntp2 x dp2,\nZeRO-1\n(4 ranks)"),
                                          (after, "resumed\nas pp2\n(2 ranks),\nsaved again"))):
        for ax, key in zip(axes[row], SHOWN):
            shape = None
            for offsets, sizes, rank in boxes[key]:
                (r0, c0), (nr, nc) = offsets, sizes
                ax.add_patch(plt.Rectangle((c0, r0), nc, nr, fc=colours[rank], ec="white",
                                           lw=0.6))
                shape = (max(shape[0], r0 + nr), max(shape[1], c0 + nc)) if shape else (r0 + nr, c0 + nc)
            ax.set_xlim(0, shape[1])
            ax.set_ylim(shape[0], 0)
            ax.set_xticks([])
            ax.set_yticks([])
            name = key.replace("model.", "").replace("optim.state.", "Adam ")
            ax.set_title(f"{name}\n{shape[0]} x {shape[1]}", fontsize=7.5)
            ax.text(0.02, 0.02, f"{len(boxes[key])} box{'es' if len(boxes[key]) > 1 else ''}",
                    transform=ax.transAxes, fontsize=7, color="white", va="bottom")
        axes[row][0].set_ylabel(label, fontsize=8, rotation=0, ha="right", va="center")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours],
               labels=[f"written by rank {r}" for r in range(4)], loc="lower center", ncol=4,
               fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.03))
    fig.suptitle("one checkpoint's boxes of the serial tensors, and the rank that wrote each "
                 "(read from DCP's .metadata); loading reads, for every box a rank needs, the "
                 "overlapping parts of the saved ones", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save(fig, "checkpoint_layouts.png")


# --------------------------------------------------------------------------------------
# 4. Context parallelism: notebook 09's counts
# --------------------------------------------------------------------------------------
def cp_numbers():
    from minipar import cp
    from minipar.lab import nb09
    s, n = 2048, 4                                      # notebook 09's
    plain, balanced = cp.work_per_rank(s, n, False), cp.work_per_rank(s, n, True)
    assert len(set(balanced)) == 1                      # the slide says "each"
    row = nb09.activation_bytes([128])[0]               # one process: the ratio is the same
    under = 1 - row["measured"] / row["planned"]        # at every cp (notebook 09)
    # section 4's predictions: the search with and without cp, and one replica per cp
    without = nb09.search_long_context(top=1, cp=1)[0]
    best = nb09.search_long_context(top=1)[0]
    assert without.layout.recompute == "full" and best.layout.recompute == "none"
    assert best.layout.cp > 1 and best.step_time < without.step_time   # what the slide says
    rows = {r["cp"]: r for r in nb09.at_scale(cps=(1, 2, 4, 8, 16))}
    assert all(rows[c]["hidden"] for c in (2, 4)) and not rows[8]["hidden"]
    L = best.layout
    return {"cp_scores": (f"at cp = {n}, $s$ = {s}: " + " / ".join(f"{w / 1e3:.0f}k" for w in plain) + " plain, "
                          f"{balanced[0] / 1e3:.0f}k each balanced"),
            "cp_activations": f"{under:.1%} under the planner's count",
            "cp_without": f"{without.step_time:.1f} s",
            "cp_best": (f"tp {L.tp} x cp {L.cp} x dp {L.dp} keeps them all: "
                        f"{best.step_time:.1f} s, MFU {best.mfu:.1%}"),
            "cp_memory": ", ".join(f"{rows[c]['memory']['total'] / 2**30:.0f}" for c in (1, 2, 4, 8)),
            "cp_mfu": (f"{rows[2]['mfu']:.0%}, {rows[4]['mfu']:.0%}, then {rows[8]['mfu']:.0%} "
                       f"at cp = 8 and {rows[16]['mfu']:.0%} at 16")}


# --------------------------------------------------------------------------------------
# The deck's measured spans
# --------------------------------------------------------------------------------------
def write_measured(values: dict[str, str], deck: Path) -> None:
    """Rewrite each ``<!-- measured:NAME -->...<!-- /measured -->`` span of the deck."""
    text = deck.read_text()
    found = [m.group(2) for m in SPAN.finditer(text)]
    unknown = sorted(set(found) - set(MEASURED))
    missing = sorted(set(values) - set(found))
    if unknown or missing:
        sys.exit(f"{deck}: spans {unknown} are not written by this script, {missing} are not "
                 f"in the deck; MEASURED and the deck must name the same spans")
    text = SPAN.sub(lambda m: m.group(1) + values.get(m.group(2), m.group(3)) + m.group(4), text)
    deck.write_text(text)
    print(f"{deck.name}: rewrote {', '.join(sorted(values))}")
