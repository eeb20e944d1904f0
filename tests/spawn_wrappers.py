"""A user's own script: minipar's wrappers under ``torch.multiprocessing.spawn``, ending normally.

No minipar launcher (which ends its ranks with ``os._exit``): each rank returns from its
function and its interpreter shuts down as any Python program does, with whatever async
work minipar might still hold. One run is a pair of ranks (2-rank gloo world) that trains a
tiny model a few steps with ``dp.DataParallel`` (overlapped buckets), ``zero.ShardedOptimizer``
(stage 2) and ``fsdp.fully_shard`` (per layer then the root: prefetching gathers, and torch's clip through
DTensor), then ends; ``PAIRS`` independent
pairs share one spawn. Each rank ends with ``torch.distributed.destroy_process_group()``, the
one finalizer a user calls (as with torch's DDP: in torch 2.13 on gloo, a DDP script that
leaves the process group to the interpreter's exit can hang there; ``--no-destroy`` shows it).

    python tests/spawn_wrappers.py RUNS PAIRS [--no-destroy]  ->  "runs R aborted A failed F"

A run aborts when a rank dies by a signal (e.g. "terminate called without an active
exception": SIGABRT) and fails when it exits non-zero or does not end within the time limit.
"""
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

LIMIT_S = 300            # per spawn of PAIRS pairs (a loaded machine starts them slowly)
DESTROY = "--no-destroy" not in sys.argv


def worker(i, folder):
    try:
        train(*divmod(i, 2), folder)
    except BaseException:                    # spawn keeps the traceback to itself: say it
        traceback.print_exc()
        raise


def train(pair, rank, folder):
    from minipar import dp, fsdp, zero
    torch.set_num_threads(1)
    # a file store per pair: no free port to pick and lose to another process in a race
    tdist.init_process_group("gloo", init_method=f"file://{folder}/pair{pair}",
                             rank=rank, world_size=2)
    torch.manual_seed(rank)
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 4))

    model = dp.DataParallel(net(), bucket_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bare = net()
    zopt = zero.ShardedOptimizer(bare.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    sharded = net()
    for layer in sharded[::2]:                # FSDP2's habit: each layer, then the root
        fsdp.fully_shard(layer)
    fsdp.fully_shard(sharded)
    fopt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    for _ in range(3):
        for m, o in ((model, opt), (bare, zopt), (sharded, fopt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            if m is sharded:                  # DTensor's own all-reduce, too
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    if DESTROY:
        tdist.destroy_process_group()


def main(runs: int, pairs: int) -> None:
    done = aborted = failed = 0
    while done < runs:
        k = min(pairs, runs - done)
        folder = tempfile.mkdtemp(prefix="minipar_spawn_")
        ctx = mp.spawn(worker, args=(folder,), nprocs=2 * k, join=False)
        deadline = time.monotonic() + LIMIT_S
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for j in range(k):
            codes = []
            for p in ctx.processes[2 * j:2 * j + 2]:
                if p.exitcode is None:            # still running past the limit
                    p.kill()
                    p.join()
                    codes.append("hung")
                else:
                    codes.append(p.exitcode)
            if any(isinstance(c, int) and c < 0 for c in codes):
                aborted += 1
                print(f"run {done + j}: exit codes {codes}", flush=True)
            elif any(c != 0 for c in codes):
                failed += 1
                print(f"run {done + j}: exit codes {codes}", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        done += k
    print(f"runs {done} aborted {aborted} failed {failed}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
