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

import os
import time

import torch
import torch.distributed as tdist

from ..runtime import cli, dist, trace
from .. import comm, data, rules, zero
from ..wrappers.zero_optimizer import full_parameters
from ..model import PRESETS, build, config
from ..plan.memory import model_state_bytes
from ..plan.network import zero_comm_bytes
from ..mesh import Mesh
from . import launch, machine, median

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
            spec = (rules.parse_shard(name[len("shard"):]) if name.startswith("shard")
                    else zero.zero_spec(int(name[4]), d))
            grid = Mesh(dp=d)
            self.net = self.model
            self.engine = zero.ShardedEngine(self.model, grid.axis("dp"), spec, lambda ps: _adamw(ps, lr),
                                             units=self.model.parts(),   # as FSDP2's above
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
            return full_parameters(self.engine)
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


def train_twins(kinds, **kwargs) -> dict:
    """``train_twin`` for several kinds in one launch (torch's start-up is paid once)."""
    return {kind: train_twin(kind, **kwargs) for kind in kinds}


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
            with trace.span(f"{name} step {step}"):
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
            units, spec = [u.numel for u in v.engine.units], tuple(v.engine.spec)
            row["sent"] = sum(sent[name].values())
            row["formula"] = zero_comm_bytes(units, d, spec, dtype="fp32")["total"]
            row["state_formula"] = model_state_bytes(units, d, spec, dtype="fp32")["total"]
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


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench zero")
    p.add_argument("--nproc", type=cli.positive_int, nargs="+", default=[2, 4],
                   help="rank counts to measure (default: 2 then 4)")
    p.add_argument("--model", default="tiny", choices=list(PRESETS))
    p.add_argument("--steps", type=cli.positive_int, default=10)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3)
    p.add_argument("--batch-per-rank", type=cli.positive_int, default=8)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write every rank's timeline as a Chrome/Perfetto trace (minipar.runtime.trace); "
                        "with several --nproc, one file each: FILE with -nN before its extension")
    args = p.parse_args(argv)
    paths = {n: _per_count(args.trace, n, len(args.nproc)) for n in args.nproc}
    for path in paths.values():
        if path:
            cli.check_output_file(path, "--trace")
    for n in args.nproc:
        rows = launch(paths[n], measure, n, model_name=args.model, steps=args.steps,
                           warmup=args.warmup, batch_per_rank=args.batch_per_rank,
                           timeout=3600)[0]
        print(report(rows, args), flush=True)
        print()


def _per_count(path, n: int, counts: int):
    if path is None or counts == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-n{n}{ext}"


if __name__ == "__main__":
    cli.main_guard(main)
