"""``python -m minipar.bench zero``: the ZeRO presets and AMSP specs against torch's own.

Every variant runs in one process tree on the same ranks, model and batches, interleaved
step by step (ZeRO-0, ZeRO-1, ..., DDP, ZeroRedundancyOptimizer, FSDP2, ZeRO-0, ...) so
that machine noise hits them alike. The torch twins:

* ``ddp``     DistributedDataParallel (gradient_as_bucket_view) + AdamW: plain DP;
* ``zro``     DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``: ZeRO-1;
* ``fsdp2``   ``torch.distributed.fsdp.fully_shard`` on every block, the embedding, the
              head and the root, over a CPU DeviceMesh: ZeRO-3.

Printed per variant: median step time (slowest rank per step) and its ratio to the twin,
model-state bytes one rank holds between steps and at its peak during a step (sampled when
each part of the model starts its forward and its backward: gathered parameters count,
communication buffers do not), and for minipar the bytes sent next to the formula.
``train_twin`` is what the tests compare minipar's ZeRO-1 and ZeRO-3 with.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from .. import comm, data, dist, zero
from ..model import PRESETS, build, config
from . import machine, median

TWINS = {"zero0": "ddp", "zero1": "zro", "zero2": "zro", "zero3": "fsdp2",
         "zero3-noprefetch": "fsdp2"}


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _optimizer_tensors(opt):
    inner = getattr(opt, "optim", opt)       # ZeroRedundancyOptimizer wraps the local one
    return [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params


class Variant:
    """One way to train the same model: minipar's engine with a spec, or a torch twin."""

    def __init__(self, name: str, lr: float = 1e-3, model_name: str = "tiny", seed: int = 0):
        self.name = name
        d = tdist.get_world_size()
        self.model = build(config(model_name), seed=seed)
        self.engine = self.opt = None
        if name in ("ddp", "zro"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.net = DDP(self.model, gradient_as_bucket_view=True)
            if name == "ddp":
                self.opt = _adamw(self.model.parameters(), lr)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer
                self.opt = ZeroRedundancyOptimizer(self.model.parameters(),
                                                   optimizer_class=torch.optim.AdamW, lr=lr,
                                                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        elif name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (d,))
            for part in self.model.parts():
                fully_shard(part, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.net, self.opt = self.model, _adamw(self.model.parameters(), lr)
        else:
            spec = (zero.parse_shard(name[len("shard"):]) if name.startswith("shard")
                    else zero.zero_spec(int(name[4]), d))
            grid = dist.Grid(dp=d)
            self.net = self.model
            self.engine = zero.ShardedEngine(self.model, grid, spec, lambda ps: _adamw(ps, lr),
                                             prefetch=not name.endswith("noprefetch"))
        self.peak = 0
        for part in self.model.parts():
            part.register_forward_pre_hook(lambda m, a: self._sample())
            part.register_forward_hook(lambda m, a, out: self._on_output(out))

    def _on_output(self, out):
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda g: self._sample())

    def _sample(self):
        self.peak = max(self.peak, self.state_bytes()["total"])

    def state_bytes(self) -> dict[str, int]:
        """Allocated model-state storage on this rank now (params, grads, optimizer, total)."""
        if self.engine is not None:
            return self.engine.model_state_bytes()
        if self.name == "fsdp2":
            fps = list(_fsdp_params(self.model))
            unsharded = [getattr(fp, "_unsharded_param", None) for fp in fps]
            params = unique_storage_bytes([fp.sharded_param for fp in fps] + unsharded +
                                          [t for fp in fps for t in fp.all_gather_outputs])
            grads = unique_storage_bytes([fp.sharded_param.grad for fp in fps] +
                                         [u.grad for u in unsharded if u is not None])
        else:
            params = unique_storage_bytes(self.model.parameters())
            grads = unique_storage_bytes(p.grad for p in self.model.parameters())
        optimizer = unique_storage_bytes(_optimizer_tensors(self.opt))
        return dict(params=params, grads=grads, optimizer=optimizer,
                    total=params + grads + optimizer)

    def step(self, x, y, microbatches: int = 1) -> float:
        """One optimizer step on this rank's batch, in ``microbatches`` backward passes."""
        if self.engine is not None:
            self.engine.zero_grad()
            self.engine.begin_step(microbatches)
        else:
            self.opt.zero_grad(set_to_none=self.name == "fsdp2")
        total = 0.0
        for xb, yb in data.microbatches(x, y, microbatches):
            loss = self.net(xb, yb) / microbatches
            loss.backward()
            total += loss.item()
        (self.engine or self.opt).step()
        return total

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (collective)."""
        if self.engine is not None:
            return {n: p.clone() for n, (p, _) in self.engine.full_named_parameters().items()}
        with comm.untracked():
            return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in self.model.named_parameters()}


# --------------------------------------------------------------------------------------
# For the tests: train like the trainer, with a torch twin
# --------------------------------------------------------------------------------------
def train_twin(kind: str, model_name: str = "nano", steps: int = 20, batch: int = 8,
               lr: float = 3e-3, seed: int = 0, microbatches: int = 1) -> dict:
    """The trainer's loop (same data, model, AdamW) for any ``Variant`` name: a torch twin
    (ddp, zro, fsdp2) or a minipar one (zero3-noprefetch, shard2,2,4, ...).

    Runs on every rank (inside ``dist.launch``); returns the losses (mean over ranks, per
    step), the final full parameters in the serial model's names, this rank's model-state
    bytes and the bytes it sent in the last step (minipar's collectives only).
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    train_tokens, _ = data.split(data.ByteTokenizer().encode(data.load_text(None)))
    batches = data.Batches(train_tokens, cfg.seq_len, batch, seed=seed)   # the trainer's batches
    v = Variant(kind, lr=lr, model_name=model_name, seed=seed)
    losses = []
    for step in range(1, steps + 1):
        x, y = batches.local_batch(step, r, d)
        comm.reset()
        loss, = comm.all_reduce_scalars([v.step(x, y, microbatches)], comm.WORLD)
        losses.append(loss / d)
    return dict(losses=losses, params=v.full_params(), state=v.state_bytes(),
                comm_bytes=comm.stats.bytes_by_op())


def train_twins(kinds, *args) -> dict:
    """``train_twin`` for several kinds in one launch (torch's start-up is paid once)."""
    return {kind: train_twin(kind, *args) for kind in kinds}


# --------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------
def variants_for(d: int) -> list[str]:
    names = ["zero0", "zero1", "zero2", "zero3", "zero3-noprefetch"]
    if d == 4:
        names += ["shard1,2,4", "shard2,2,4", "shard2,2,2"]
    return names + ["ddp", "zro", "fsdp2"]


def measure(model_name="tiny", steps=10, warmup=3, batch_per_rank=8, variants=None):
    """Run on every rank (inside ``dist.launch``); one row per variant."""
    r, d = tdist.get_rank(), tdist.get_world_size()
    variants = variants or variants_for(d)
    cfg = config(model_name)
    tokens = data.ByteTokenizer().encode(data.default_corpus())
    batches = data.Batches(tokens, cfg.seq_len, batch_per_rank * d, seed=0)
    runs = {name: Variant(name, model_name=model_name) for name in variants}
    times = {name: [] for name in variants}
    sent = {name: {} for name in variants}
    for step in range(warmup + steps):
        x, y = batches.local_batch(step, r, d)
        for name, v in runs.items():
            comm.reset()
            tdist.barrier()
            t0 = time.perf_counter()
            v.step(x, y)
            slowest, = comm.all_reduce_scalars([time.perf_counter() - t0], comm.WORLD, op="max")
            if step >= warmup:
                times[name].append(slowest)
                sent[name] = comm.stats.bytes_by_op()
    rows = []
    for name, v in runs.items():
        state = v.state_bytes()
        peak, = comm.all_reduce_scalars([max(v.peak, state["total"])], comm.WORLD, op="max")
        row = dict(variant=name, median_s=median(times[name]), state=state, peak=int(peak),
                   ranks=d)
        if v.engine is not None:
            numels = [u.numel for u in v.engine.units]
            row["sent"] = sum(sent[name].values())
            row["formula"] = zero.comm_bytes_formula(numels, d, v.engine.spec)["total"]
            row["state_formula"] = zero.state_bytes_formula(numels, v.engine.spec)["total"]
        rows.append(row)
    return rows


def report(rows, args) -> str:
    by = {r["variant"]: r for r in rows}
    d = rows[0]["ranks"]
    out = [f"minipar.bench zero: {d} gloo ranks, model {args.model}, {args.batch_per_rank} "
           f"sequences per rank, median of {args.steps} steps after {args.warmup} warm-up",
           f"machine: {machine()}",
           f"{'variant':<18}{'step':>9}{'twin':>7}{'ratio':>8}{'state/rank':>12}{'peak/rank':>12}"
           f"{'peak ratio':>11}{'sent/step':>12}{'formula':>12}"]
    for r in rows:
        twin = TWINS.get(r["variant"])
        ratio = f"{r['median_s'] / by[twin]['median_s']:.2f}x" if twin in by else ""
        peak_ratio = f"{r['peak'] / by[twin]['peak']:.2f}x" if twin in by else ""
        sent = f"{r['sent']:,}" if "sent" in r else ""
        formula = f"{r['formula']:,}" if "formula" in r else ""
        out.append(f"{r['variant']:<18}{r['median_s'] * 1e3:>6.1f} ms{twin or '':>7}{ratio:>8}"
                   f"{r['state']['total']:>12,}{r['peak']:>12,}{peak_ratio:>11}{sent:>12}"
                   f"{formula:>12}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# Experiments and pictures for notebook 04_zero_and_amsp
# --------------------------------------------------------------------------------------
def census(model_name: str = "tiny", batch: int = 8) -> dict[str, int]:
    """Where the memory of one serial training step goes, measured (one process).

    Parameters, gradients and Adam's state are the storages of the tensors themselves;
    activations are the tensors autograd saves for backward during the forward pass (caught
    with ``saved_tensors_hooks``, parameters and shared storages counted once, not at all).
    """
    cfg = config(model_name)
    model = build(cfg, seed=0)
    x, y = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                        batch).global_batch_at(1)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    opt = _adamw(model.parameters(), 1e-3)
    opt.step()
    return dict(params=unique_storage_bytes(model.parameters()),
                grads=unique_storage_bytes(p.grad for p in model.parameters()),
                optimizer=unique_storage_bytes(_optimizer_tensors(opt)),
                activations=sum(saved.values()),
                n_params=sum(p.numel() for p in model.parameters()), tokens=batch * cfg.seq_len)


def walkthrough(names, model_name: str = "tiny", batch_per_rank: int = 4) -> list[dict]:
    """On every rank: two steps of each variant in ``names``; what the second one held and sent.

    Rows (rank 0's): ``state`` (measured bytes), ``state_formula``, ``sent`` by op,
    ``by_group`` (zero_p, zero_g, zero_os, zero_rep), ``comm_formula`` by op, ``spec``.
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    batches = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                           batch_per_rank * d, seed=0)
    rows = []
    for name in names:
        v = Variant(name, model_name=model_name)
        for step in range(2):
            comm.reset()
            v.step(*batches.local_batch(step, r, d))
        numels = [u.numel for u in v.engine.units]
        rows.append(dict(variant=name, spec=tuple(v.engine.spec), state=v.state_bytes(),
                         state_formula=zero.state_bytes_formula(numels, v.engine.spec),
                         sent=comm.stats.bytes_by_op(), by_group=comm.stats.bytes_by_group(),
                         comm_formula=zero.comm_bytes_formula(numels, d, v.engine.spec),
                         psi=4 * sum(numels), ranks=d))
    return rows


def prefetch_effect(model_name: str = "tiny", steps: int = 6, warmup: int = 2) -> list[dict]:
    """On every rank: ZeRO-3 with and without prefetching, interleaved step by step.

    Per variant: median step time (slowest rank) and the median time a step spends *waiting*
    in all-gathers (``Handle.wait``: with prefetching part of it overlaps computation).
    """
    r, d = tdist.get_rank(), tdist.get_world_size()
    cfg = config(model_name)
    batches = data.Batches(data.ByteTokenizer().encode(data.default_corpus()), cfg.seq_len,
                           8 * d, seed=0)
    runs = {name: Variant(name, model_name=model_name) for name in ("zero3", "zero3-noprefetch")}
    times = {name: [] for name in runs}
    waits = {name: [] for name in runs}
    for step in range(warmup + steps):
        x, y = batches.local_batch(step, r, d)
        for name, v in runs.items():
            comm.reset()
            tdist.barrier()
            t0 = time.perf_counter()
            v.step(x, y)
            slowest, = comm.all_reduce_scalars([time.perf_counter() - t0], comm.WORLD, op="max")
            wait = sum(sec for (op, _), sec in comm.stats.seconds.items() if op == "all_gather")
            if step >= warmup:
                times[name].append(slowest)
                waits[name].append(wait)
    return [dict(variant=name, median_s=median(times[name]), gather_wait_s=median(waits[name]),
                 peak=max(v.peak, v.state_bytes()["total"])) for name, v in runs.items()]


def amsp_space(n_params: float, d: int, gpus_per_node: int = 8, dtype: str = "mixed") -> list[dict]:
    """Every spec minipar runs over d ranks: memory per rank, and the bytes a rank sends per
    step inside its node and across nodes (a group spanning more than ``gpus_per_node``
    consecutive ranks runs at the inter-node link's speed: what AMSP minimises)."""
    sizes = [k for k in range(1, d + 1) if d % k == 0]
    psi = int(n_params) * zero.BYTES_PER_PARAM[dtype][0]
    points = []
    for s_p in sizes:
        for s_g in sizes:
            for s_os in sizes:
                spec = zero.Spec(s_p, s_g, s_os)
                if zero.spec_violation(spec, d):
                    continue
                groups = zero.comm_bytes_by_group(int(n_params), d, spec, dtype=dtype)
                inter = sum(sum(ops.values()) for g, ops in groups.items()
                            if zero.span_of(g, d, spec) > gpus_per_node)
                total = sum(sum(ops.values()) for ops in groups.values())
                preset = next((f"ZeRO-{z}" for z in range(4) if zero.zero_spec(z, d) == spec), "")
                mem = zero.state_bytes_formula(int(n_params), spec, dtype)
                points.append(dict(spec=spec, memory=mem["total"], mem=mem, groups=groups,
                                   inter_psi=inter / psi, intra_psi=(total - inter) / psi,
                                   amsp=s_g in (s_p, s_os), preset=preset))
    return points


def draw_state_bars(rows, ax=None):
    """Measured model-state bytes per rank (stacked) next to the formula (black ticks)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    colors = dict(params="#3b6fb6", grads="#e07b39", optimizer="#6aa84f")
    for i, row in enumerate(rows):
        bottom = 0
        for key, color in colors.items():
            b = row["state"][key] / 2**20
            ax.bar(i, b, bottom=bottom, color=color, label=key if i == 0 else None)
            bottom += b
        ax.plot([i - 0.4, i + 0.4], [row["state_formula"]["total"] / 2**20] * 2, "k-", lw=2,
                label="formula" if i == 0 else None)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['variant']}\n{r['spec']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=8)
    return ax


def draw_comm_bars(rows, ax=None):
    """Measured bytes sent per step, by op, in units of Psi, with the formula (black ticks)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    colors = dict(all_reduce="#8e7cc3", reduce_scatter="#e07b39", all_gather="#3b6fb6")
    for i, row in enumerate(rows):
        bottom = 0.0
        for op, color in colors.items():
            b = row["sent"].get(op, 0) / row["psi"]
            ax.bar(i, b, bottom=bottom, color=color, label=op if i == 0 else None)
            bottom += b
        ax.plot([i - 0.4, i + 0.4], [row["comm_formula"]["total"] / row["psi"]] * 2, "k-",
                lw=2, label="formula" if i == 0 else None)
    d = rows[0]["ranks"]
    for k in (2, 3):
        ax.axhline(k * (d - 1) / d, color="grey", ls=":", lw=1)
        ax.text(len(rows) - 0.5, k * (d - 1) / d, f" {k}Ψ(d-1)/d", va="center", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['variant']}\n{r['spec']}" for r in rows], fontsize=8)
    ax.set_ylabel("bytes sent per step / Ψ")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def draw_amsp(points, current=None, ax=None, unit: float = 2**30):
    """AMSP's space: memory per rank against inter-node traffic, ZeRO presets named; blue
    points keep AMSP's rule s_g in {s_p, s_os}, grey ones do not."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for pt in points:
        ax.scatter(pt["inter_psi"], pt["memory"] / unit, s=30,
                   c="#3b6fb6" if pt["amsp"] else "#bbbbbb", zorder=2)
        if pt["preset"]:
            ax.annotate(pt["preset"], (pt["inter_psi"], pt["memory"] / unit), fontsize=8,
                        xytext=(4, 4), textcoords="offset points", color="#9c4a17")
    if current is not None:
        ax.scatter(current["inter_psi"], current["memory"] / unit, s=160, facecolors="none",
                   edgecolors="red", linewidths=2, zorder=3)
    ax.set_xlabel("bytes a rank sends across nodes per step / Ψ")
    ax.set_ylabel("model states per rank (GiB)" if unit == 2**30 else "model states per rank")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    return ax


def main(argv=None):
    p = dist.ArgumentParser(prog="python -m minipar.bench zero")
    p.add_argument("--nproc", type=dist.positive_int, nargs="+", default=[2, 4],
                   help="rank counts to measure (default: 2 then 4)")
    p.add_argument("--model", default="tiny", choices=list(PRESETS))
    p.add_argument("--steps", type=dist.positive_int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-per-rank", type=dist.positive_int, default=8)
    args = p.parse_args(argv)
    for n in args.nproc:
        rows = dist.launch(measure, n, args.model, args.steps, args.warmup,
                           args.batch_per_rank, timeout=3600)[0]
        print(report(rows, args), flush=True)
        print()


if __name__ == "__main__":
    main()
