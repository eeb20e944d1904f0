"""``python -m minipar.runtime.smoke``: one all-reduce on every rank, the first step of a cluster job.

A job on a new machine fails first in the plumbing, not in the model: a process that cannot
reach the master, a GPU another rank already took, an NCCL/RCCL network plugin that does not
load. This command finds those in seconds. Started like the trainer (``srun``, ``torchrun``,
or ``--nproc N`` here), every rank joins the process group the trainer's way
(``minipar.runtime.dist.init``: NCCL/RCCL when every rank owns a GPU, else gloo), all-reduces a small
tensor of its rank + 1 and checks the sum n (n + 1) / 2. Rank 0 prints one line
(``smoke ok: ...``). A rank that fails prints one line naming the stage that failed
(``smoke failed: rank R: <stage>: <error>``) and exits 1; the others stop at the collective
timeout (MINIPAR_TIMEOUT) at the latest. The cluster scripts run it on two ranks (one per node
when there are several) before the real job.
"""
from __future__ import annotations

import sys
import time

import torch

from . import cli, dist


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def check(backend: str = "auto") -> str:
    """On every rank: join, all-reduce, compare. Returns rank 0's line ('' elsewhere); raises
    RuntimeError('smoke failed: ...') naming the stage that failed."""
    stage, rank = "joining the process group", "?"
    try:
        if not torch.distributed.is_initialized():
            backend, device = dist.init(backend)
        else:
            backend, device = dist.init()
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        stage = f"placing a tensor on {device}"
        x = torch.full((1024,), float(rank + 1), device=device)
        stage = f"the all-reduce over {world} ranks ({backend})"
        t0 = time.perf_counter()
        torch.distributed.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        want = world * (world + 1) / 2
        if not torch.all(x == want):
            raise RuntimeError(f"the sum is {x[0].item():g}, not {want:g}")
    except dist.UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure is reported in one line
        raise RuntimeError(f"smoke failed: rank {rank}: {stage}: {_one_line(e)}") from None
    if rank != 0:
        return ""
    library = backend
    if backend == "nccl":
        library = "RCCL" if torch.version.hip else "NCCL"
        try:
            library += " " + ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without the version call
            pass
    return (f"smoke ok: {world} ranks, {library} on {device.type}, all-reduce of 4 KiB gave "
            f"{world * (world + 1) // 2} on every element in {seconds * 1e3:.1f} ms")


def _run(argv) -> int:
    p = cli.ArgumentParser(prog="python -m minipar.runtime.smoke",
                           description="One all-reduce on every rank: does the cluster work?")
    p.add_argument("--nproc", type=cli.positive_int, default=None,
                   help="start N local processes (omit under srun/torchrun)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    a = p.parse_args(argv)
    env = dist.env_from_os()
    if env is None and a.nproc is None:
        raise dist.UsageError("no launcher environment: run it under srun or torchrun, or "
                              "give --nproc N")
    try:
        if env is None:
            dist.resolve(a.backend, a.nproc)        # an impossible backend: exit 2, not a launch
            line = dist.launch(check, a.nproc, backend=a.backend, timeout=120)[0]
        else:
            line = check(a.backend)
    except (RuntimeError, TimeoutError) as e:
        # a rank's own line, else the root cause's last line (minipar.runtime.dist.launch's report)
        lines = [ln.strip() for ln in str(e).split("then what the other ranks saw")[0]
                 .splitlines() if ln.strip()]
        found = next((ln for ln in lines if ln.startswith("smoke failed:")), None)
        print(found or f"smoke failed: {lines[-1] if lines else type(e).__name__}",
              file=sys.stderr, flush=True)
        raise SystemExit(1)
    if line:
        print(line, flush=True)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dist.run_main(_run, argv)


if __name__ == "__main__":
    main()
