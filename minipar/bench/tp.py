"""``python -m minipar.bench tp``: minipar's tensor parallelism against PyTorch's DTensor TP.

The same serial MLP (and the same transformer block) is split two ways on the same ranks:
minipar's ``ColumnParallelLinear`` -> ``RowParallelLinear`` and DTensor's ``ColwiseParallel``
-> ``RowwiseParallel`` (``parallelize_module`` on a CPU ``DeviceMesh`` over gloo). For the
block, DTensor shards qkv's rows contiguously, so the twin gets qkv's rows reordered from
"(three h d)" to "(t three h/t d)" first: then each rank holds whole heads, as in minipar.
Both run forward + backward on the same inputs, interleaved repetition by repetition so machine
noise hits them alike. Printed: median time of the slowest rank, the ratio, the outputs'
agreement, and the bytes minipar's collectives recorded next to the formula.

The other functions here are the experiments of ``notebooks/02_tensor_parallel.ipynb``; each
runs on every rank inside ``minipar.dist.launch``.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as tdist
from einops import rearrange

from .. import comm, dist, tp
from ..dp import tensor_bytes
from ..model import Block, GPTConfig, MLP, build, config
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


def measure(kind: str = "mlp", d_model: int = 256, batch: int = 8, seq_len: int = 128,
            reps: int = 30, warmup: int = 3):
    """On every rank: median step times of minipar and DTensor TP, bytes, agreement."""
    t, r = tdist.get_world_size(), tdist.get_rank()
    grid = dist.Grid(1, 1, t)
    cfg = GPTConfig(d_model=d_model, n_head=max(t, d_model // 64), seq_len=seq_len)
    torch.manual_seed(0)
    serial = MLP(cfg) if kind == "mlp" else Block(cfg)
    twins = {"minipar": minipar_twin(serial, grid.tp_group), "dtensor": dtensor_twin(serial, t)}
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
    n = batch * seq_len * d_model * 4
    if kind == "mlp":
        formula = {"all_reduce": 2 * (2 * (t - 1) * n // t)}
    else:
        phases = tp.block_comm_bytes(batch * seq_len, cfg, t)
        formula = {"all_reduce": phases["forward"]["all_reduce"] + phases["backward"]["all_reduce"]}
    return dict(kind=kind, t=t, rank=r, median={k: median(v) for k, v in times.items()},
                times=times, sent=sent, formula=formula,
                max_diff=(outs["minipar"] - outs["dtensor"]).abs().max().item(),
                shape=(batch, seq_len, d_model))


def main(argv=None):
    p = dist.ArgumentParser(prog="python -m minipar.bench tp")
    p.add_argument("--nproc", type=dist.positive_int, default=2, help="TP degree (gloo ranks)")
    p.add_argument("--d-model", type=dist.positive_int, default=256)
    p.add_argument("--batch", type=dist.positive_int, default=8)
    p.add_argument("--seq-len", type=dist.positive_int, default=128)
    p.add_argument("--reps", type=dist.positive_int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    print(f"minipar.bench tp: {args.nproc} gloo ranks, activations (b={args.batch}, "
          f"s={args.seq_len}, h={args.d_model}) fp32, forward+backward, median of {args.reps} "
          f"repetitions after {args.warmup} warm-up, slowest rank per repetition")
    print(f"machine: {machine()}")
    print(f"{'layer':<8}{'minipar':>11}{'DTensor':>11}{'ratio':>8}{'max |diff|':>12}"
          f"{'bytes sent':>14}{'formula':>12}{'match':>7}")
    for kind in ("mlp", "block"):
        res = dist.launch(measure, args.nproc, kind, args.d_model, args.batch, args.seq_len,
                          args.reps, args.warmup, timeout=1800)[0]
        mine, native = res["median"]["minipar"], res["median"]["dtensor"]
        sent, formula = sum(res["sent"].values()), sum(res["formula"].values())
        print(f"{kind:<8}{mine * 1e3:>8.2f} ms{native * 1e3:>8.2f} ms{mine / native:>7.3f}x"
              f"{res['max_diff']:>12.1e}{sent:>14,}{formula:>12,}"
              f"{'yes' if res['sent'] == res['formula'] else 'NO':>7}")
    print("ratio = minipar / DTensor median step time (below 1: minipar faster). Bytes: what "
          "each minipar rank sent (ring accounting), 2 all-reduces per block each way.")


# --------------------------------------------------------------------------------------
# Experiments for notebooks/02_tensor_parallel.ipynb
# --------------------------------------------------------------------------------------
def block_bytes_experiment(shapes: list[tuple[int, int, int]]):
    """For each (b, s, h), without and with SP: bytes and calls of one block's collectives."""
    t = tdist.get_world_size()
    grid = dist.Grid(1, 1, t)
    rows = []
    for sp in (False, True):
        for b, s, h in shapes:
            cfg = GPTConfig(d_model=h, n_head=t, seq_len=s)
            torch.manual_seed(0)
            block = tp.parallelize_block(Block(cfg), grid.tp_group, sequence_parallel=sp)
            x = torch.randn(b, s // t if sp else s, h, requires_grad=True)
            comm.reset()
            y = block(x)
            forward = comm.stats.table()
            comm.reset()
            y.sum().backward()
            backward = comm.stats.table()
            rows.append(dict(b=b, s=s, h=h, t=t, sp=sp, forward=forward, backward=backward,
                             formula=tp.block_comm_bytes(b * s, cfg, t, sp), block=repr(block)))
    return rows


def memory_experiment(model_name: str = "tiny", batch: int = 8, sps=(False, True)):
    """Per rank, measured: parameter, gradient and Adam state bytes after one step, and the
    bytes of activations saved for backward during one forward.

    Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``, each
    storage once, parameters excluded.
    """
    from ..dp import optimizer_state_bytes
    t = tdist.get_world_size() if tdist.is_initialized() else 1
    grid = dist.Grid(1, 1, t)
    cfg = config(model_name)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len),
                      generator=torch.Generator().manual_seed(0))
    rows = []
    for sp in sps if t > 1 else (False,):
        model = build(cfg, seed=0)
        if t > 1:
            model = tp.parallelize(model, grid, sequence_parallel=sp)
        params = set(map(id, model.parameters()))
        seen, saved = set(), [0]

        def pack(tensor):
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if key not in seen and id(tensor) not in params:
                seen.add(key)
                saved[0] += tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(x, x)
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        rows.append(dict(t=t, sp=sp, params=tensor_bytes(model.parameters()),
                         grads=tensor_bytes(p.grad for p in model.parameters()),
                         optimizer=optimizer_state_bytes(opt), activations=saved[0]))
    return rows


def step_time_experiment(model_name: str = "tiny", batch: int = 8, reps: int = 5,
                         sequence_parallel: bool = False):
    """Median training-step time (forward + backward) and the part spent in TP collectives."""
    t = tdist.get_world_size()
    grid = dist.Grid(1, 1, t)
    cfg = config(model_name)
    model = tp.parallelize(build(cfg, seed=0), grid, sequence_parallel=sequence_parallel)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len),
                      generator=torch.Generator().manual_seed(0))
    steps, comm_s = [], []
    for i in range(reps + 1):
        model.zero_grad(set_to_none=True)
        comm.reset()
        tdist.barrier()
        t0 = time.perf_counter()
        model(x, x).backward()
        elapsed = time.perf_counter() - t0
        if i:
            steps.append(elapsed)
            comm_s.append(sum(comm.stats.seconds.values()))
    return dict(t=t, step_s=median(steps), comm_s=median(comm_s),
                sent=sum(comm.stats.bytes_by_op().values()))


def allreduce_bandwidth_experiment(sizes_bytes: list[int], reps: int = 5):
    """Median seconds of one all-reduce of each size over the world, and bus bandwidth."""
    n = tdist.get_world_size()
    rows = []
    for nbytes in sizes_bytes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for i in range(reps + 1):
            tdist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(buf, comm.WORLD)
            if i:
                times.append(time.perf_counter() - t0)
        s = median(times)
        rows.append(dict(bytes=nbytes, seconds=s, busbw=2 * (n - 1) / n * nbytes / s))
    return rows


if __name__ == "__main__":
    main()
