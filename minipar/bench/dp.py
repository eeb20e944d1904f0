"""``python -m minipar.bench dp``: minipar's three DP variants against torch DDP.

All four run in one process tree on the same ranks, model and batches, interleaved round by
round (naive, bucketed, overlapped, DDP, naive, ...) so that machine noise hits them alike.
Printed: median step time (slowest rank per step), the ratio to DDP, and the all-reduce bytes
each minipar variant recorded next to the formula 2(d-1)/d x gradient bytes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from ..runtime import cli, trace
from .. import comm, data, dp
from ..model import PRESETS, build, config, num_params
from ..plan.network import ring_bytes
from . import launch, machine, median

VARIANTS = ("naive", "bucketed", "overlapped", "ddp")


def _step(model, opt, engine, x, y):
    if engine is not None:
        engine.zero_grad()
        model(x, y).backward()        # averaged by the end of backward
        opt.step()
    else:
        opt.zero_grad(set_to_none=False)
        model(x, y).backward()
        opt.step()


def measure(model_name="tiny", steps=12, warmup=3, batch_per_rank=8, bucket_mb=1.0,
            variants=VARIANTS):
    """Run on every rank (inside ``dist.launch``); returns one row per variant on each rank."""
    d = tdist.get_world_size()
    cfg = config(model_name)
    tokens = data.ByteTokenizer().encode(data.default_corpus())
    batches = data.Batches(tokens, cfg.seq_len, batch_per_rank * d, seed=0)
    setups = {}
    for v in variants:
        model = build(cfg, seed=0)
        if v == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
            setups[v] = (wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3), None)
        else:
            setups[v] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                         dp.DataParallel(model, group=comm.WORLD, mode=v, bucket_mb=bucket_mb))
    times = {v: [] for v in variants}
    sent = {v: [] for v in variants}
    for step in range(warmup + steps):
        x, y = batches.local_batch(step, tdist.get_rank(), d)
        for v in variants:
            model, opt, engine = setups[v]
            comm.reset()
            tdist.barrier()
            t0 = time.perf_counter()
            with trace.span(f"{v} step {step}"):
                _step(model, opt, engine, x, y)
            elapsed = time.perf_counter() - t0
            slowest, = comm.all_reduce_scalars([elapsed], comm.WORLD, op="max")
            if step >= warmup:
                times[v].append(slowest)
                sent[v].append(comm.stats.bytes_by_op().get("all_reduce", 0))
    grad_bytes = num_params(setups[variants[0]][0]) * 4
    formula = ring_bytes("all_reduce", grad_bytes, d)
    return [dict(variant=v, median_s=median(times[v]), times=times[v],
                 sent=(median(sent[v]) if v != "ddp" else None), formula=formula,
                 grad_bytes=grad_bytes, ranks=d) for v in variants]


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench dp")
    p.add_argument("--nproc", type=cli.positive_int, default=2)
    p.add_argument("--model", default="tiny", choices=list(PRESETS))
    p.add_argument("--steps", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3)
    p.add_argument("--batch-per-rank", type=cli.positive_int, default=8)
    p.add_argument("--bucket-mb", type=cli.positive_float, default=1.0)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write every rank's timeline as a Chrome/Perfetto trace (minipar.runtime.trace)")
    args = p.parse_args(argv)
    if args.trace:
        cli.check_output_file(args.trace, "--trace")
    rows = launch(args.trace, measure, args.nproc, model_name=args.model, steps=args.steps,
                       warmup=args.warmup, batch_per_rank=args.batch_per_rank,
                       bucket_mb=args.bucket_mb, timeout=1800)[0]
    print(f"minipar.bench dp: {args.nproc} gloo ranks, model {args.model}, "
          f"{args.batch_per_rank} sequences per rank, buckets {args.bucket_mb} MB, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"machine: {machine()}")
    ddp = next(r for r in rows if r["variant"] == "ddp")["median_s"]
    print(f"{'variant':<12}{'median step':>14}{'vs DDP':>9}{'all-reduce bytes':>20}"
          f"{'formula 2(d-1)/d*G':>21}{'match':>7}")
    for r in rows:
        sent = "(not ours)" if r["sent"] is None else f"{r['sent']:,.0f}"
        match = "" if r["sent"] is None else ("yes" if abs(r["sent"] - r["formula"]) <= r["ranks"] * 4
                                              else "NO")
        print(f"{r['variant']:<12}{r['median_s'] * 1e3:>11.1f} ms{r['median_s'] / ddp:>8.3f}x"
              f"{sent:>20}{r['formula']:>21,.0f}{match:>7}")


if __name__ == "__main__":
    cli.main_guard(main)
