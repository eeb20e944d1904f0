"""``python -m minipar.bench pp``: measured pipeline bubbles, and minipar vs torch pipelining.

1. For p = 2 stages and m = 1, 2, 4, 8 micro-batches of a fixed size, the bubble measured
   from the gathered timeline (1 - busy / (p x step time)) next to (p-1)/(m+p-1).
2. minipar's executor against ``torch.distributed.pipelining`` (PipelineStage with
   ScheduleGPipe and Schedule1F1B) on the same stages and batches, alternating step by step
   (and which one goes first) so that machine noise hits both alike: median step times,
   their ratio, and the median of the back-to-back (paired) ratios.

``compare_with_torch`` is also what tests/test_pp.py uses to check that both pipelines
compute the same losses and gradients; ``measure_pipeline`` (one rank per stage, inside
``minipar.runtime.dist.launch``) is what the bubble rows, notebook 03 and tests/test_pp.py time.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as tdist
import torch.nn as nn

from ..runtime import cli, dist
from .. import comm, pp
from ..model import PRESETS, CrossEntropy, build, config
from ..plan import bubble_fraction
from ..mesh import Mesh
from . import machine, median


class TorchStage(nn.Module):
    """A minipar chunk as torch pipelining wants it: the last stage returns logits."""

    def __init__(self, chunk: pp.Chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        c = self.chunk
        if c.embed is not None:
            x = c.embed(x)
        for block in c.blocks.values():
            x = block(x)
        return c.head.proj(c.head.ln(x)) if c.head is not None else x


def torch_schedule(chunk: pp.Chunk, p: int, r: int, m: int, schedule: str):
    """torch's own pipeline (PipelineStage + ScheduleGPipe / Schedule1F1B) on the same chunk."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(TorchStage(chunk), r, p, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # every stage gets the loss function: without one, torch runs that stage forward-only
    return cls(stage, n_microbatches=m, loss_fn=CrossEntropy())


def torch_step(sched, r: int, p: int, x, y) -> float:
    """One torch pipelining step; the mean micro-batch loss on the last stage (else 0).

    The inputs are made contiguous: ``batch[:, :-1]`` is a strided view, and torch pipelining
    (2.11 at least) checks each micro-batch's strides against the contiguous ones it inferred.
    """
    x, y = x.contiguous(), y.contiguous()
    if r == 0:
        sched.step(x)
    elif r == p - 1:
        losses = []
        sched.step(target=y, losses=losses)
        return float(sum(l.item() for l in losses) / len(losses))
    else:
        sched.step()
    return 0.0


def compare_with_torch(schedule="1f1b", microbatches=4, model_name="nano", micro_batch=2,
                       steps=3, warmup=0, seed=0, lr=3e-3):
    """Inside ``dist.launch`` (one rank per stage): train both pipelines side by side.

    Returns per rank ``dict(mine=[loss...], torch=[...], t_mine=[s...], t_torch=[...],
    grad_diff=max |grad difference| after the last step)``; losses live on the last stage.
    """
    p, r = tdist.get_world_size(), tdist.get_rank()
    grid = Mesh(dp=1, pp=p, tp=1)
    cfg = config(model_name)
    model = build(cfg, seed)
    runner = pp.PipelineRunner(model, grid.group("pp"), schedule, microbatches)
    theirs = copy.deepcopy(runner.module.chunks[0])
    sched = torch_schedule(theirs, p, r, microbatches, schedule)
    opt_mine = torch.optim.AdamW(runner.module.parameters(), lr=lr, betas=(0.9, 0.95))
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    out = dict(mine=[], torch=[], t_mine=[], t_torch=[])
    for step in range(warmup + steps):
        batch = torch.randint(0, cfg.vocab_size, (micro_batch * microbatches, cfg.seq_len + 1),
                              generator=g)
        x, y = batch[:, :-1], batch[:, 1:]
        for who in (("mine", "torch") if step % 2 == 0 else ("torch", "mine")):
            opt = opt_mine if who == "mine" else opt_theirs
            opt.zero_grad(set_to_none=True)
            comm.barrier(comm.WORLD)
            t = time.perf_counter()
            if who == "mine":
                loss = float(runner.forward_backward(x, y))
            else:
                loss = torch_step(sched, r, p, x, y)
            elapsed = time.perf_counter() - t
            if step >= warmup:
                out[who].append(loss)
                out["t_" + who].append(comm.all_reduce_scalars([elapsed], comm.WORLD, op="max")[0])
            if step < warmup + steps - 1:
                opt.step()
    mine = dict(runner.module.chunks[0].named_parameters())
    out["grad_diff"] = max((mine[n].grad - q.grad).abs().max().item() if q.grad is not None
                           else float("inf") for n, q in theirs.named_parameters())
    return out


def measure_pipeline(model_name: str = "tiny", schedule: str = "1f1b", microbatches: int = 4,
                     micro_batch: int = 2, steps: int = 3, chunks: int = 2, seed: int = 0,
                     warmup: int = 1):
    """Inside ``dist.launch``, one rank per stage: time ``warmup + steps`` pipeline steps.

    Each step starts after a barrier (t = 0 on every stage) and its timeline is gathered.
    Returns on rank 0 ``dict(timeline=..., bubble=..., step_times=[...], timelines=[...])``:
    the timed steps' timelines, the median bubble and the median step's timeline.
    """
    grid = Mesh(dp=1, pp=tdist.get_world_size(), tp=1)
    cfg = config(model_name)
    runner = pp.PipelineRunner(build(cfg, seed), grid.group("pp"), schedule, microbatches, chunks)
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, cfg.vocab_size, (micro_batch * microbatches, cfg.seq_len + 1),
                          generator=g)
    timelines = []
    for _ in range(warmup + steps):
        runner.module.zero_grad(set_to_none=True)
        comm.barrier(grid.group("pp"))   # every stage starts the step together: t = 0
        runner.forward_backward(batch[:, :-1], batch[:, 1:])
        timelines.append(runner.gather_timeline())
    if grid.rank != 0:
        return None
    timed = timelines[warmup:]
    by_time = sorted(timed, key=lambda tl: tl.makespan)
    return dict(timeline=by_time[len(by_time) // 2], timelines=timed,
                bubble=median([tl.bubble for tl in timed]),
                step_times=[tl.makespan for tl in timed])


def bubbles(p=2, ms=(1, 2, 4, 8), model_name="small", micro_batch=2, steps=4,
            schedule="1f1b"):
    """Measured bubble (median over the timed steps) for each m; micro-batch size fixed."""
    rows = []
    for m in ms:
        res = dist.launch(measure_pipeline, p, model_name=model_name, schedule=schedule,
                          microbatches=m, micro_batch=micro_batch, steps=steps)[0]
        rows.append(dict(m=m, bubble=res["bubble"], formula=bubble_fraction(p, m),
                         step_s=median(res["step_times"]), peak_stash=res["timeline"].peak_stash))
    return rows


def main(argv=None):
    ap = cli.ArgumentParser(prog="python -m minipar.bench pp")
    ap.add_argument("--model", default="small", choices=list(PRESETS), help="model preset (default small: 8 layers)")
    ap.add_argument("--micro-batch", type=cli.positive_int, default=2, help="sequences per micro-batch")
    ap.add_argument("--bubble-steps", type=cli.positive_int, default=5, help="timed steps per bubble point")
    ap.add_argument("--steps", type=cli.positive_int, default=20, help="timed steps of the torch comparison")
    ap.add_argument("--microbatches", type=cli.positive_int, default=4, help="m for the torch comparison")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(machine())
    cfg = config(args.model)
    print(f"model {args.model}: {cfg.n_layer} layers, d={cfg.d_model}, seq {cfg.seq_len}; "
          f"micro-batch {args.micro_batch} sequences; p = 2 stages on gloo, 1 thread each")
    print("\nbubble fraction (1F1B), measured from the gathered timeline vs (p-1)/(m+p-1):")
    print(f"{'m':>4} {'measured':>9} {'formula':>8} {'step ms':>8}  peak stash per stage")
    for row in bubbles(2, (1, 2, 4, 8), args.model, args.micro_batch, args.bubble_steps):
        print(f"{row['m']:>4} {row['bubble']:>9.3f} {row['formula']:>8.3f} "
              f"{row['step_s'] * 1e3:>8.1f}  {row['peak_stash']}")
    print(f"\nminipar vs torch.distributed.pipelining, m={args.microbatches}, median of "
          f"{args.steps} steps after 2 warm-up steps, the two alternating step by step;\n"
          f"paired = median over steps of minipar / torch, each pair run back to back:")
    print(f"{'schedule':>9} {'minipar ms':>11} {'torch ms':>9} {'ratio':>6} {'paired':>7} "
          f"{'|dloss|':>8}")
    for schedule in ("gpipe", "1f1b"):
        res = dist.launch(compare_with_torch, 2, schedule=schedule,
                          microbatches=args.microbatches, model_name=args.model,
                          micro_batch=args.micro_batch, steps=args.steps, warmup=2)[1]
        a, b = median(res["t_mine"]), median(res["t_torch"])
        paired = median([u / v for u, v in zip(res["t_mine"], res["t_torch"])])
        dloss = max(abs(u - v) for u, v in zip(res["mine"], res["torch"]))
        print(f"{schedule:>9} {a * 1e3:>11.1f} {b * 1e3:>9.1f} {a / b:>6.2f} {paired:>7.2f} "
              f"{dloss:>8.1e}")


if __name__ == "__main__":
    cli.main_guard(main)
