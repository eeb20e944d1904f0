"""``python -m minipar.bench moe``: minipar's expert-parallel MoE layer against one process.

The twin is the same MoE layer (same seed, so the same router and the same routing) run by a
single process on the whole global batch with all E experts: what EP splits. On n ranks each
rank routes its 1/n of the tokens, sends them to the experts' ranks with an all-to-all, runs
its E/n experts and sends the outputs back. Both run forward + backward on the same tokens,
repetitions alternating so machine noise hits them alike (the other ranks wait in a barrier
while the single process runs). Printed: median time of the slowest EP rank, the single
process's median, their ratio (1/n would be perfect scaling), the outputs' agreement, and
the all-to-all bytes rank 0 recorded next to the formula evaluated on its measured routing.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as tdist

from ..runtime import cli, dist
from .. import comm, moe
from ..model import MLP, GPTConfig
from ..plan import moe as plan_moe
from ..mesh import Mesh
from . import machine, median


def make_layer(d_model: int, experts: int, top_k: int, seq_len: int, capacity: float = 0.0):
    cfg = GPTConfig(d_model=d_model, n_head=4, seq_len=seq_len, moe_experts=experts,
                    moe_top_k=top_k, capacity_factor=capacity)
    torch.manual_seed(0)
    return moe.MoE(cfg, MLP)


def routed_rows(experts: torch.Tensor, keep: torch.Tensor, rank: int, n: int, per_rank: int,
                tokens: int) -> tuple[int, int]:
    """(a_out, a_in) of ``rank``: kept assignments it sends to / receives from other ranks,
    from the routing of every rank's tokens (``experts``, ``keep`` of the global batch)."""
    def rows(src, dst):
        e = experts[src * tokens:(src + 1) * tokens][keep[src * tokens:(src + 1) * tokens]]
        return int(((e // per_rank) == dst).sum())
    return (sum(rows(rank, j) for j in range(n) if j != rank),
            sum(rows(j, rank) for j in range(n) if j != rank))


def measure(d_model: int = 128, experts: int = 8, top_k: int = 2, batch: int = 4,
            seq_len: int = 64, reps: int = 20, warmup: int = 3):
    """On every rank: median step times of the EP layer and of the single-process twin."""
    n, r = tdist.get_world_size(), tdist.get_rank()
    grid = Mesh(dp=n, ep=n)
    serial = make_layer(d_model, experts, top_k, seq_len)
    holder = torch.nn.Sequential(copy.deepcopy(serial))
    moe.expert_parallel(holder, grid.group("ep"))
    layer = holder[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch * n, seq_len, d_model, generator=gen)
    up = torch.randn(batch * n, seq_len, d_model, generator=gen)
    mine = slice(r * batch, (r + 1) * batch)

    def step(m, xs, ups):
        for p in m.parameters():
            p.grad = None
        xs = xs.clone().requires_grad_()
        y = m(xs)
        (y * ups).sum().backward()
        return y.detach()

    ref = step(serial, x, up) if r == 0 else None
    out = step(layer, x[mine], up[mine])
    outs = [torch.empty_like(out) for _ in range(n)]
    with comm.untracked():
        tdist.all_gather(outs, out)
    max_diff = (torch.cat(outs) - ref).abs().max().item() if r == 0 else 0.0
    experts_all, keep_all = serial.routing if r == 0 else (None, None)
    times = {"ep": [], "single": []}
    for i in range(warmup + reps):
        tdist.barrier()
        if r == 0:
            t0 = time.perf_counter()
            step(serial, x, up)
            single = time.perf_counter() - t0
        tdist.barrier()
        comm.reset()
        t0 = time.perf_counter()
        step(layer, x[mine], up[mine])
        elapsed = time.perf_counter() - t0
        slowest, = comm.all_reduce_scalars([elapsed], comm.WORLD, op="max")
        if i >= warmup:
            times["ep"].append(slowest)
            if r == 0:
                times["single"].append(single)
        sent = comm.stats.bytes_by_op()
    result = dict(n=n, rank=r, sent=sent, median={k: median(v) for k, v in times.items() if v})
    if r == 0:
        a_out, a_in = routed_rows(experts_all, keep_all, 0, n, experts // n, batch * seq_len)
        result.update(max_diff=max_diff, a_out=a_out, a_in=a_in,
                      formula=plan_moe.all_to_all_bytes(a_out, a_in, d_model, 4),
                      balanced=plan_moe.all_to_all_bytes_balanced(batch * seq_len, top_k,
                                                                  d_model, n, 4))
    return result


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench moe")
    p.add_argument("--nproc", type=cli.positive_int, default=2, help="EP degree (gloo ranks)")
    p.add_argument("--d-model", type=cli.positive_int, default=128)
    p.add_argument("--experts", type=cli.positive_int, default=8)
    p.add_argument("--top-k", type=cli.positive_int, default=2)
    p.add_argument("--batch", type=cli.positive_int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=cli.positive_int, default=64)
    p.add_argument("--reps", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.experts % args.nproc or args.top_k > args.experts:
        raise dist.UsageError(f"--experts {args.experts} must be a multiple of --nproc "
                              f"{args.nproc} and at least --top-k {args.top_k}")
    print(f"minipar.bench moe: {args.nproc} gloo ranks (ep={args.nproc}), MoE layer E="
          f"{args.experts} top-{args.top_k}, d_model={args.d_model}, expert width "
          f"{4 * args.d_model}, {args.batch} x {args.seq_len} tokens per rank, fp32, dropless, "
          f"forward+backward, median of {args.reps} after {args.warmup} warm-up")
    import os
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} (1 min)")
    res = dist.launch(measure, args.nproc, args.d_model, args.experts, args.top_k, args.batch,
                      args.seq_len, args.reps, args.warmup, timeout=1800)[0]
    ep, single = res["median"]["ep"], res["median"]["single"]
    print(f"{'EP layer':>12}{'1 process':>12}{'ratio':>8}{'ideal':>8}{'max |diff|':>12}"
          f"{'all_to_all B':>15}{'formula':>12}{'balanced':>12}")
    print(f"{ep * 1e3:>9.2f} ms{single * 1e3:>9.2f} ms{ep / single:>7.3f}x"
          f"{1 / args.nproc:>7.3f}x{res['max_diff']:>12.1e}{res['sent'].get('all_to_all', 0):>15,}"
          f"{res['formula']:>12,}{res['balanced']:>12,.0f}")
    print(f"ratio = EP step (slowest rank, its 1/{args.nproc} of the tokens) / one process on "
          f"all tokens; 'formula' = 2 (a_out + a_in) d_model 4 B from rank 0's measured "
          f"routing (a_out={res['a_out']}, a_in={res['a_in']} rows), 'balanced' = "
          f"4 (n-1)/n t k d_model 4 B. Match: "
          f"{'yes' if res['sent'].get('all_to_all') == res['formula'] else 'NO'}")
