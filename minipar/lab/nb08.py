"""Experiments of ``notebooks/08_mixture_of_experts.ipynb`` (mixture of experts, ``minipar.moe``).

* ``train``: a single-process training loop that also records, per step, each MoE layer's
  load (share of the assignments each expert received) and the step time;
* ``three_runs`` and ``summary``: the notebook's three runs (MoE with and without the aux loss,
  the dense twin) and the numbers it prints (the workshop slides quote the same);
* ``routing_of_text``: which experts each character of a text goes to, layer by layer;
* ``ep_traffic``: on every rank of ``dist.launch``, one forward + backward of an MoE model with
  expert parallelism, the all-to-all bytes it recorded and the formula on its own routing;
* the ``draw_*`` functions: the notebook's figures.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from .. import comm, data, moe
from ..runtime import dist
from ..mesh import Mesh
from ..model import build, config
from ..plan import moe as plan_moe


def moe_config(name: str = "tiny", experts: int = 8, top_k: int = 2, **overrides):
    return config(name, moe_experts=experts, moe_top_k=top_k, **overrides)


def dense_twin(cfg):
    """The dense model with the MoE's active parameters per token: an MLP k times as wide."""
    return replace(cfg, moe_experts=0, d_ff=cfg.moe_top_k * cfg.ffn)


def loads(model) -> list[torch.Tensor]:
    """Per MoE layer, the share of the last forward's assignments each expert received."""
    out = []
    for layer in moe.moe_layers(model):
        experts, _ = layer.routing
        counts = torch.bincount(experts.flatten(), minlength=layer.n_experts).float()
        out.append(counts / counts.sum())
    return out


def train(cfg, steps: int = 60, batch: int = 16, lr: float = 3e-3, seed: int = 0,
          progress: bool = True) -> dict:
    """Train ``cfg`` in this process; per step: cross-entropy, aux loss, drop rate, load, time."""
    from tqdm import tqdm          # a text bar, readable in a stored notebook
    torch.manual_seed(seed)
    model = build(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    tokens = data.ByteTokenizer().encode(data.load_text(None))
    batches = data.Batches(tokens, cfg.seq_len, batch, seed=seed)
    hist = dict(loss=[], aux=[], drop=[], load=[], seconds=[])
    for step in tqdm(range(1, steps + 1), disable=not progress, leave=False,
                     desc=f"{'MoE' if cfg.moe_experts else 'dense'} d_ff={cfg.ffn}"):
        x, y = batches.local_batch(step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        hist["seconds"].append(time.perf_counter() - t0)
        st = moe.step_stats(model)
        hist["loss"].append(loss.item() - st["penalty"])
        # the objective sums the layers' aux losses; plotted per layer (1 = balanced)
        hist["aux"].append(st["aux_loss"] / max(1, len(moe.moe_layers(model))))
        hist["drop"].append(st["dropped"] / st["assigned"] if st["assigned"] else 0.0)
        hist["load"].append(loads(model) if cfg.moe_experts else [])
    hist["model"] = model
    hist["params"] = sum(p.numel() for p in model.parameters())
    return hist


# The notebook's three runs (section 1): the slides quote them too (slides/make_figures.py)
def three_configs(aux_coef: float = 0.025) -> dict:
    """MoE with the aux loss, the same without it, and the dense twin of the first: ``nano``,
    8 experts, top-2, 32-character sequences."""
    cfg = moe_config("nano", experts=8, top_k=2, seq_len=32, moe_aux_coef=aux_coef)
    return {"MoE + aux": cfg,
            "MoE, no aux": moe_config("nano", experts=8, top_k=2, seq_len=32, moe_aux_coef=0.0),
            "dense twin": dense_twin(cfg)}


def three_runs(steps: int = 150, batch: int = 16, lr: float = 3e-3, progress: bool = True) -> dict:
    """``train`` each of ``three_configs`` with the same seed and data."""
    return {name: train(c, steps=steps, batch=batch, lr=lr, progress=progress)
            for name, c in three_configs().items()}


def summary(runs: dict, last: int = 10, last_load: int = 20, skip: int = 5) -> dict:
    """Per run: parameters, mean cross-entropy of the ``last`` steps, median ms per step after
    ``skip`` steps, and (MoE) the busiest expert over the fair share, mean of ``last_load`` steps."""
    import statistics
    out = {}
    for name, h in runs.items():
        imb = imbalance(h) if h["load"] and h["load"][-1] else []
        out[name] = dict(params=h["params"], final_loss=sum(h["loss"][-last:]) / last,
                         ms_per_step=statistics.median(h["seconds"][skip:]) * 1e3,
                         imbalance=sum(imb[-last_load:]) / last_load if imb else None,
                         aux=sum(h["aux"][-last_load:]) / last_load if imb else None)
    return out


def routing_of_text(model, text: str) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(characters, top-1 expert (layers, chars), weight of that expert (layers, chars))."""
    ids = data.ByteTokenizer().encode(text)[: model.cfg.seq_len].unsqueeze(0)
    model.eval()
    with torch.no_grad():
        model(ids, ids)
    model.train()
    moe.step_stats(model)                          # not training: forget these statistics
    firsts, weights = [], []
    for layer in moe.moe_layers(model):
        experts, _ = layer.routing
        firsts.append(experts[:, 0])
    chars = [chr(int(i)) if 32 <= int(i) < 127 else "·" for i in ids[0]]
    return chars, torch.stack(firsts)


# --------------------------------------------------------------------------------------
# Expert parallelism: traffic measured against the formula
# --------------------------------------------------------------------------------------
def ep_traffic(ep: int, name: str = "tiny", experts: int = 8, top_k: int = 2,
               batch_per_rank: int = 4, capacity: float = 0.0) -> dict:
    """On every rank: one forward + backward with --ep ``ep`` over all ranks of the world.

    Returns this rank's measured all-to-all bytes, and the formula 2 (a_out + a_in) d_model 4
    summed over the layers from the routing this rank saw (a_out: rows it dispatched to other
    ranks; a_in: rows the other ranks dispatched to it, counted from the all-to-all of counts).
    """
    import torch.distributed as tdist
    n = tdist.get_world_size()
    grid = Mesh(dp=n, ep=ep)
    cfg = moe_config(name, experts, top_k, capacity_factor=capacity)
    model = moe.expert_parallel(build(cfg, seed=0), grid.group("ep"))
    tokens = data.ByteTokenizer().encode(data.load_text(None))
    x, y = data.Batches(tokens, cfg.seq_len, batch_per_rank * n, seed=0).local_batch(1, grid.coord("dp"), n)
    comm.reset()
    model(x, y).backward()
    sent = comm.stats.bytes_by_op()
    per_rank, me = experts // ep, grid.coord("dp") % ep
    a_out = a_in = 0
    for layer in moe.moe_layers(model):
        chosen, keep = layer.routing
        dest = chosen[keep] // per_rank
        a_out += int((dest != me).sum())
    # rows received from the others = what they dispatched here: gather their a_out to us
    counts = torch.zeros(n, n, dtype=torch.long)
    for layer in moe.moe_layers(model):
        chosen, keep = layer.routing
        dest = chosen[keep] // per_rank
        for j in range(ep):
            counts[grid.coord("dp"), grid.coord("dp") - me + j] += int((dest == j).sum())
    with comm.untracked():
        tdist.all_reduce(counts)
    a_in = int(counts[:, grid.coord("dp")].sum() - counts[grid.coord("dp"), grid.coord("dp")])
    return dict(rank=grid.coord("dp"), ep=ep, measured=sent.get("all_to_all", 0),
                counts_bytes=sent.get("all_to_all_counts", 0), a_out=a_out, a_in=a_in,
                formula=plan_moe.all_to_all_bytes(a_out, a_in, cfg.d_model, 4),
                balanced=len(moe.moe_layers(model)) * plan_moe.all_to_all_bytes_balanced(
                    batch_per_rank * cfg.seq_len, top_k, cfg.d_model, ep, 4))


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------
def draw_routing(chars, firsts, n_experts: int, ax=None, title: str = ""):
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    im = ax.imshow(firsts.numpy(), aspect="auto", cmap="tab10", vmin=-0.5, vmax=9.5,
                   interpolation="nearest")
    ax.set_xticks(range(len(chars)))
    ax.set_xticklabels(chars, fontsize=7, family="monospace")
    ax.set_yticks(range(firsts.shape[0]))
    ax.set_yticklabels([f"MoE layer {i}" for i in range(firsts.shape[0])])
    ax.set_xlabel("token (character) of the text")
    ax.set_title(title or "first-choice expert of each token, per layer (colour = expert)")
    cbar = plt.colorbar(im, ax=ax, ticks=range(n_experts), fraction=0.025)
    cbar.set_label("expert")
    cbar.ax.set_ylim(-0.5, n_experts - 0.5)
    return ax


def imbalance(hist) -> list[float]:
    """Per step, the busiest expert's share over the fair share 1/E, worst layer."""
    return [max(float(l.max()) * len(l) for l in step) for step in hist["load"]]


def draw_load_bars(hists: dict, ax=None):
    """Share of the last step's assignments each expert got (layer 0), per run."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    width = 0.8 / len(hists)
    for i, (label, h) in enumerate(hists.items()):
        load = h["load"][-1][0]
        ax.bar([e + i * width for e in range(len(load))], load.numpy(), width, label=label)
    E = len(next(iter(hists.values()))["load"][-1][0])
    ax.axhline(1 / E, color="k", ls="--", lw=1, label="fair share 1/E")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of assignments")
    ax.legend(fontsize=8)
    return ax


def draw_traffic(rows: list[dict], ax=None):
    """``ep_traffic``'s rows: each rank's measured all-to-all bytes, the formula on its own
    routing beside them, and the balanced-routing estimate as a tick."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["measured"] / 1024 for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["formula"] / 1024 for r in rows], 0.4,
           label="2 (a_out + a_in) d 4 B")
    ax.scatter(x, [r["balanced"] / 1024 for r in rows], color="k", marker="_", s=400,
               label="balanced routing")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"ep={r['ep']}\nrank {r['rank']}" for r in rows], fontsize=8)
    ax.set_ylabel("KiB sent per step")
    ax.set_title("all-to-all bytes per rank, one step (forward + backward)")
    ax.legend(fontsize=8)
    return ax
