"""``python -m minipar.bench tp``: minipar's tensor parallelism against PyTorch's DTensor TP.

The same serial MLP (and the same transformer block) is split two ways on the same ranks:
minipar's ``ColumnParallelLinear`` -> ``RowParallelLinear`` and DTensor's ``ColwiseParallel``
-> ``RowwiseParallel`` (``parallelize_module`` on a CPU ``DeviceMesh`` over gloo). For the
block, DTensor shards qkv's rows contiguously, so the twin gets qkv's rows reordered from
"(three h d)" to "(t three h/t d)" first: then each rank holds whole heads, as in minipar.
Both run forward + backward on the same inputs, interleaved repetition by repetition so machine
noise hits them alike. Printed: median time of the slowest rank, the ratio, the outputs'
agreement, and the bytes minipar's collectives recorded next to the formula.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as tdist
from einops import rearrange

from ..runtime import cli, dist
from .. import comm, tp
from ..runtime.errors import UsageError
from ..model import Block, GPTConfig, MLP
from ..plan.network import ring_bytes, tp_block_comm_bytes
from ..mesh import Mesh
from . import machine, median


# --------------------------------------------------------------------------------------
# The two twins
# --------------------------------------------------------------------------------------
def minipar_twin(serial: torch.nn.Module, group, sequence_parallel: bool = False):
    m = copy.deepcopy(serial)
    if isinstance(m, Block):
        return tp.parallelize_block(m, group, sequence_parallel=sequence_parallel)
    m.fc = tp.ColumnParallelLinear.from_serial(m.fc, group, sequence_parallel=sequence_parallel)
    m.proj = tp.RowParallelLinear.from_serial(m.proj, group, sequence_parallel=sequence_parallel)
    return m


def dtensor_twin(serial: torch.nn.Module, t: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    m = copy.deepcopy(serial)
    mesh = init_device_mesh("cpu", (t,))
    plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if isinstance(m, Block):
        with torch.no_grad():   # contiguous row shards must hold whole heads of q, k and v
            hd = m.attn.head_dim
            for p in (m.attn.qkv.weight, m.attn.qkv.bias):
                p.copy_(rearrange(p, "(three t h d) ... -> (t three h d) ...", three=3, t=t, d=hd))
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return parallelize_module(m, mesh, plan)


def _fwd_bwd(m, x, up):
    for p in m.parameters():
        p.grad = None
    y = m(x)
    (y * up).sum().backward()
    return y


def bench_heads(d_model: int, t: int) -> int:
    """The heads of the benchmarked block: one per 64 channels, at least one per rank."""
    return max(t, d_model // 64)


def check_split(d_model: int, t: int) -> None:
    """UsageError unless ``t`` ranks split the block's heads, width and MLP evenly."""
    heads = bench_heads(d_model, t)
    if d_model % heads or heads % t or (4 * d_model) % t:
        raise UsageError(f"--nproc {t} does not split the benchmarked block evenly (d_model "
                         f"{d_model}, {heads} heads, MLP width {4 * d_model}); use a --nproc "
                         f"that divides {heads} and {d_model}, e.g. 2 or 4")


def measure(kind: str = "mlp", d_model: int = 256, batch: int = 8, seq_len: int = 128,
            reps: int = 30, warmup: int = 3):
    """On every rank: median step times of minipar and DTensor TP, bytes, agreement."""
    t, r = tdist.get_world_size(), tdist.get_rank()
    grid = Mesh(1, 1, t)
    cfg = GPTConfig(d_model=d_model, n_head=bench_heads(d_model, t), seq_len=seq_len)
    torch.manual_seed(0)
    serial = MLP(cfg) if kind == "mlp" else Block(cfg)
    twins = {"minipar": minipar_twin(serial, grid.group("tp")), "dtensor": dtensor_twin(serial, t)}
    gen = torch.Generator().manual_seed(1)
    # the input wants a gradient too (as inside a model): f's backward all-reduce then runs
    x = torch.randn(batch, seq_len, d_model, generator=gen).requires_grad_()
    up = torch.randn(batch, seq_len, d_model, generator=gen)
    times = {k: [] for k in twins}
    outs = {k: _fwd_bwd(m, x, up).detach() for k, m in twins.items()}
    for i in range(warmup + reps):
        for name, m in twins.items():
            comm.reset()
            tdist.barrier()
            t0 = time.perf_counter()
            _fwd_bwd(m, x, up)
            elapsed = time.perf_counter() - t0
            slowest, = comm.all_reduce_scalars([elapsed], comm.WORLD, op="max")
            if i >= warmup:
                times[name].append(slowest)
            if name == "minipar":
                sent = comm.stats.bytes_by_op()
    if kind == "mlp":   # one g forward, one f backward, each an all-reduce of b s h
        n = batch * seq_len * d_model * 4
        formula = {"all_reduce": 2 * ring_bytes("all_reduce", n, t)}
    else:
        phases = tp_block_comm_bytes(batch * seq_len, d_model, t, dtype="fp32", bias=cfg.bias)
        formula = {"all_reduce": phases["forward"]["all_reduce"] + phases["backward"]["all_reduce"]}
    return dict(kind=kind, t=t, rank=r, median={k: median(v) for k, v in times.items()},
                times=times, sent=sent, formula=formula,
                max_diff=(outs["minipar"] - outs["dtensor"]).abs().max().item(),
                shape=(batch, seq_len, d_model))


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.bench tp")
    p.add_argument("--nproc", type=cli.positive_int, default=2, help="TP degree (gloo ranks)")
    p.add_argument("--d-model", type=cli.positive_int, default=256)
    p.add_argument("--batch", type=cli.positive_int, default=8)
    p.add_argument("--seq-len", type=cli.positive_int, default=128)
    p.add_argument("--reps", type=cli.positive_int, default=30)
    p.add_argument("--warmup", type=cli.nonnegative_int, default=3)
    args = p.parse_args(argv)
    check_split(args.d_model, args.nproc)
    print(f"minipar.bench tp: {args.nproc} gloo ranks, activations (b={args.batch}, "
          f"s={args.seq_len}, h={args.d_model}) fp32, forward+backward, median of {args.reps} "
          f"repetitions after {args.warmup} warm-up, slowest rank per repetition")
    print(f"machine: {machine()}")
    print(f"{'layer':<8}{'minipar':>11}{'DTensor':>11}{'ratio':>8}{'max |diff|':>12}"
          f"{'bytes sent':>14}{'formula':>12}{'match':>7}")
    for kind in ("mlp", "block"):
        res = dist.launch(measure, args.nproc, kind=kind, d_model=args.d_model,
                          batch=args.batch, seq_len=args.seq_len, reps=args.reps,
                          warmup=args.warmup, timeout=1800)[0]
        mine, native = res["median"]["minipar"], res["median"]["dtensor"]
        sent, formula = sum(res["sent"].values()), sum(res["formula"].values())
        print(f"{kind:<8}{mine * 1e3:>8.2f} ms{native * 1e3:>8.2f} ms{mine / native:>7.3f}x"
              f"{res['max_diff']:>12.1e}{sent:>14,}{formula:>12,}"
              f"{'yes' if res['sent'] == res['formula'] else 'NO':>7}")
    print("ratio = minipar / DTensor median step time (below 1: minipar faster). Bytes: what "
          "each minipar rank sent (ring accounting), 2 all-reduces per block each way.")


if __name__ == "__main__":
    cli.main_guard(main)
