"""``python -m minipar.bench cp``: minipar's ring attention against one process's attention.

The same causal attention (b sequences of s tokens, a heads of d) forward and backward, three
ways, in one run:

* **one process**: ``scaled_dot_product_attention`` on the whole sequence (rank 0; the
  others wait at a barrier);
* **minipar's ring** (``minipar.cp``) over the N gloo ranks, each holding its load-balanced
  s/N tokens: the slowest rank's time, and the bytes each rank sent next to the planner's
  ``cp_attention_bytes``;
* **torch's** ``torch.distributed.tensor.experimental.context_parallel`` on a DeviceMesh over
  the same ranks, where this torch has it and it runs: it dispatches SDPA's CUDA kernels
  (flash, memory-efficient, cuDNN) to its ring; on a CPU its attention kernel has no sharding
  rule, and the bench prints the reason in one line instead of a time.

Printed: median times, the ring/one-process time ratio (on one machine's cores the ring cannot
be faster: it computes the same scores, with N-1 hops of messages, on cores the one process
shares), the ring's bytes against the formula, the largest output difference, and each rank's
score memory against the one process's.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from ..runtime import cli, dist
from .. import comm, cp, rules
from ..runtime.errors import UsageError
from ..plan.cp import cp_attention_bytes
from . import machine, median


def _torch_context_parallel(q, k, v, dout, reps: int):
    """Median seconds of torch's context_parallel (forward + backward), or the reason it cannot."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        return None, f"this torch has no context_parallel ({e})"
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    times = []
    try:
        for _ in range(reps):
            bufs = [x.clone() for x in (q, k, v, dout)]
            tdist.barrier()
            t0 = time.perf_counter()
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
                leaves = [x.detach().requires_grad_() for x in bufs[:3]]
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(bufs[3])
            times.append(comm.all_reduce_scalars([time.perf_counter() - t0], comm.WORLD, "max")[0])
    except Exception as e:     # noqa: BLE001  reported, not hidden: the reason is the result
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return median(times), ""


def measure(batch: int = 1, seq_len: int = 1024, heads: int = 8, head_dim: int = 64,
            reps: int = 10, warmup: int = 2) -> dict:
    """On every rank: the one-process SDPA time (rank 0), the ring's, torch's if it runs."""
    n, r = tdist.get_world_size(), tdist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(4))
    ring = cp.Ring.of(comm.WORLD)
    mine = [cp.shard_sequence(x, n, ring.index, dim=2) for x in (q, k, v, dout)]
    times = {"sdpa": [], "ring": []}
    for i in range(warmup + reps):
        tdist.barrier()
        t0 = time.perf_counter()
        if r == 0:
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
            ref.backward(dout)
        one = time.perf_counter() - t0
        tdist.barrier()
        leaves = [x.clone().requires_grad_() for x in mine[:3]]
        comm.reset()
        t0 = time.perf_counter()
        out = cp.ring_attention(*leaves, ring)
        out.backward(mine[3])
        elapsed = time.perf_counter() - t0
        sent = comm.stats.sent[("send", "cp")]
        slowest, = comm.all_reduce_scalars([elapsed], comm.WORLD, op="max")
        if i >= warmup:
            times["sdpa"].append(one)
            times["ring"].append(slowest)
    with torch.no_grad():
        want = cp.shard_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), n,
                                 ring.index, dim=2)
    native, reason = _torch_context_parallel(q, k, v, dout, max(2, reps // 2))
    return dict(rank=r, n=n, sdpa=median(times["sdpa"]) if r == 0 else None,
                ring=median(times["ring"]), sent=sent,
                formula=cp_attention_bytes(batch, seq_len, heads * head_dim, n)["total"],
                max_diff=(out.detach() - want).abs().max().item(), torch_cp=native,
                torch_cp_reason=reason)


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench cp")
    p.add_argument("--nproc", type=cli.positive_int, default=2, help="cp degree (gloo ranks)")
    p.add_argument("--batch", type=cli.positive_int, default=1)
    p.add_argument("--seq-len", type=cli.positive_int, default=1024)
    p.add_argument("--heads", type=cli.positive_int, default=8)
    p.add_argument("--head-dim", type=cli.positive_int, default=64)
    p.add_argument("--reps", type=cli.positive_int, default=10)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=2)
    args = p.parse_args(argv)
    why = rules.cp_violation(args.seq_len, args.nproc)
    if why:
        raise UsageError(why)
    print(f"minipar.bench cp: causal attention, b={args.batch} s={args.seq_len} "
          f"a={args.heads} d={args.head_dim} fp32, forward+backward, median of {args.reps} "
          f"repetitions after {args.warmup} warm-up")
    print(f"machine: {machine()}")
    res = dist.launch(measure, args.nproc, batch=args.batch, seq_len=args.seq_len,
                      heads=args.heads, head_dim=args.head_dim, reps=args.reps,
                      warmup=args.warmup, timeout=1800)
    first = res[0]
    sent = max(x["sent"] for x in res)
    print(f"{'one process (SDPA)':<28}{first['sdpa'] * 1e3:>9.2f} ms")
    print(f"{f'minipar ring, cp={args.nproc}':<28}{first['ring'] * 1e3:>9.2f} ms   "
          f"time ratio ring/SDPA {first['ring'] / first['sdpa']:.2f}x   "
          f"max |diff| {max(x['max_diff'] for x in res):.1e}")
    print(f"{'':<28}bytes sent per rank {sent:,} = formula {first['formula']:,}: "
          f"{'yes' if all(x['sent'] == x['formula'] for x in res) else 'NO'} "
          f"(bytes ratio {sent / first['formula']:.3f}; one process sends 0)")
    print(f"{'':<28}score memory per rank: 1/{args.nproc ** 2} of the one process's "
          f"(an (s/{args.nproc})^2 block at a time)")
    if first["torch_cp"] is not None:
        print(f"{'torch context_parallel':<28}{first['torch_cp'] * 1e3:>9.2f} ms   "
              f"ratio minipar/torch {first['ring'] / first['torch_cp']:.2f}x")
    else:
        print(f"{'torch context_parallel':<28}cannot run here: {first['torch_cp_reason']}")


if __name__ == "__main__":
    cli.main_guard(main)
