"""What the trainer records of each step, and when it pays for it (``--log-every``, ``--metrics``).

Reading a number off a GPU waits for the GPU (a host sync), and agreeing on it across ranks is
a collective; a plain PyTorch loop does neither on most steps. So the trainer does both only
on *logging steps*: every ``--log-every``-th step, the last step, and any step that evaluates
or saves. With the default ``--log-every 1`` every step is one, as before.

* A **non-logging step** costs no host sync and no collective: its loss stays on the device
  (a 0-d tensor on the rank that holds it), and the gradient norm is not computed unless
  ``--clip-grad`` needs it (``minipar.train.optim``).
* A **logging step** synchronizes once, reduces the losses of every step since the previous
  logging step in one all-reduce (and the step time, model-state bytes and peak memory in one
  max-reduce), and returns one record per step. Every record holds
  ``step``, ``loss``, ``lr``, ``comm_bytes`` (rank 0's bytes, counted on the host: free),
  ``step_time_s`` (the mean wall time per step since the previous logging step: its own time
  when every step logs), ``tokens_per_s`` and ``model_state_bytes``; the logging step's record
  adds the rest (docs/reference.md, "Metrics line"): ``comm_seconds`` and ``grad_norm`` of that
  step, MFU, and on CUDA ``peak_memory_bytes`` and ``peak_reserved_bytes`` (the most any rank
  allocated, and held in the caching allocator) over the interval.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from .. import comm, moe
from ..model import Block
from ..runtime import trace
from . import mfu, report


class StepLog:
    """The records of the steps since the last logging step; ``end_step`` hands them out."""

    def __init__(self, log_every: int, last_step: int, tokens_per_step: int, flops: float,
                 peak_tflops: float | None, world: int, dp: int, device: torch.device):
        self.log_every, self.last_step = log_every, last_step
        self.tokens, self.flops, self.peak, self.world, self.dp = (tokens_per_step, flops,
                                                                   peak_tflops, world, dp)
        self.device = device
        self.pending: list[dict] = []          # records waiting for their loss
        self.losses: list = []                 # this rank's loss of each (tensor or 0.0)
        self.t0 = None

    def is_logging(self, step: int, also: bool = False) -> bool:
        """A step that reports (``also``: the trainer evaluates or saves at it)."""
        return also or step % self.log_every == 0 or step == self.last_step

    def begin_step(self) -> None:
        """Start the clock and the peak-memory window at the first step of an interval."""
        if self.t0 is None:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.t0 = time.perf_counter()

    def end_step(self, step: int, lr: float, loss, holds_loss: bool, logging: bool,
                 engine, grad_norm) -> list[dict]:
        """Keep this step's loss; on a logging step, return the records since the last one.

        ``loss``: this rank's share of the global loss (a device tensor or a number; counted
        only if ``holds_loss``). ``grad_norm``: a callable giving the norm (or None); it is
        called on logging steps only.
        """
        self.pending.append(dict(step=step, loss=None, lr=lr, comm_bytes=comm.stats.bytes_by_op()))
        # a copy: a runner may hand back a buffer it reuses next step (no sync either way)
        local = loss.detach().clone() if torch.is_tensor(loss) else torch.tensor(float(loss))
        self.losses.append(local if holds_loss else torch.zeros_like(local))
        if not logging:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = (time.perf_counter() - self.t0) / len(self.pending)
        cuda = self.device.type == "cuda"
        memory = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        reserved = torch.cuda.max_memory_reserved(self.device) if cuda else 0
        on = comm.scalar_device()
        losses = torch.stack([t.to(on, torch.float64) for t in self.losses])
        state = engine.model_state_bytes()
        peaks = torch.tensor([state["params"], state["grads"], state["optimizer"],
                              state["total"], step_time, memory, reserved], dtype=torch.float64,
                             device=on)
        with comm.untracked():                 # metrics bookkeeping, not training traffic
            comm.all_reduce(losses, comm.WORLD)
            comm.all_reduce(peaks, comm.WORLD, op="max")
        losses, peaks = (losses / self.dp).tolist(), peaks.tolist()
        records, self.pending, self.losses, self.t0 = self.pending, [], [], None
        for record, value in zip(records, losses):
            record["loss"] = value
        for record in records:                 # the interval's mean, on every line
            record.update(step_time_s=peaks[4], tokens_per_s=self.tokens / peaks[4],
                          model_state_bytes=dict(params=int(peaks[0]), grads=int(peaks[1]),
                                                 optimizer=int(peaks[2]), total=int(peaks[3])))
        records[-1].update(
            comm_seconds=comm.stats.seconds_by_op(), comm_clock=comm.clock(),
            grad_norm=grad_norm(), **mfu.utilisation(self.flops, peaks[4], self.peak, self.world))
        if cuda:            # allocated: live tensors; reserved: what the caching allocator held
            records[-1].update(peak_memory_bytes=int(peaks[5]), peak_reserved_bytes=int(peaks[6]))
        return records


class Recorder:
    """Everything the loop reports, as a few named calls: what a run prints (the banner, a line
    per logging step, the summary), records (``history``, ``--metrics``), traces (``--trace``)
    and adds to a logging step's record (MoE's routing, fp16's loss scale).

    ``with recorder:`` opens the metrics file and the trace and, at the end, writes the trace
    and prints the summary; ``begin_step``/``end_step`` bracket each step."""

    def __init__(self, cfg, mesh, policy, device, runner, banner: str):
        self.cfg, self.mesh, self.policy, self.runner = cfg, mesh, policy, runner
        self.rank0 = mesh.rank == 0
        self.history: list[dict] = []
        self.progress = report.Progress(cfg.start_step, cfg.steps,
                                        show_eta=self.rank0 and sys.stdout.isatty())
        peak = cfg.peak_tflops or (mfu.peak_tflops(torch.cuda.get_device_name(device), cfg.dtype)
                                   if device.type == "cuda" else None)
        self.steps = StepLog(cfg.log_every, cfg.steps, cfg.batch_size * cfg.seq_len,
                             mfu.step_flops(cfg.model_cfg, cfg.batch_size, cfg.recompute), peak,
                             cfg.world, mesh.dp * mesh.cp, device)
        self.say(banner)

    def say(self, line: str) -> None:
        if self.rank0 and not self.cfg.quiet:
            print(line)

    def __enter__(self):
        # a resumed run appends to its metrics file; a fresh one starts it
        self.metrics = (open(self.cfg.metrics, "a" if self.cfg.resume else "w")
                        if self.cfg.metrics and self.rank0 else None)
        self.tracer = trace.start(self.mesh.rank) if self.cfg.trace else None
        if self.tracer:
            trace.instrument(self.runner.module, Block)
        return self

    def __exit__(self, kind, error, tb):
        comm.stats.device_timing = True
        if self.metrics:
            self.metrics.close()
        trace.stop()
        if error is not None:
            return False
        if self.tracer:
            with comm.untracked():
                trace.gather_and_write(self.cfg.trace, self.tracer)
            self.say(f"trace of every rank written to {self.cfg.trace} (open it at ui.perfetto.dev)"
                     + ("; its times are the host's launch times, not GPU time (NCCL runs "
                        "asynchronously)" if comm.clock() == "cuda-events" else ""))
        if self.rank0:
            print(report.summary(self.history))
        return False

    def begin_step(self, step: int, clip) -> bool:
        """Whether this step logs (also when it evaluates or saves); the clock, counters and
        norm of a new step."""
        self.logging = self.steps.is_logging(step, also=self.evaluates(step) or self.saves(step))
        clip.measure, clip.grad_norm = self.logging, None   # the norm: when clipping or logging
        comm.stats.device_timing = self.logging             # NCCL: CUDA events on logging steps
        comm.reset()
        self.steps.begin_step()
        self.t_step = time.perf_counter()
        self.scale = self.policy.loss_scaler.scale if self.policy.loss_scaler else None
        return self.logging

    def evaluates(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    def saves(self, step: int) -> bool:
        return bool(self.cfg.save) and (step == self.cfg.steps or
                                        bool(self.cfg.save_every and step % self.cfg.save_every == 0))

    def end_step(self, step: int, lr: float, loss, engine, clip) -> dict | None:
        """This step's records; on a logging step the last one, to add to (else None)."""
        routing = moe.step_stats(self.runner.module)       # MoE: aux loss and drops since last
        if self.tracer:                                     # host time: no sync for the trace
            self.tracer.complete(f"step {step}", self.t_step, time.perf_counter(), cat="step")
        # the loss lives on the last stage and every TP rank has it: one per replica counts
        self.records = self.steps.end_step(step, lr, loss, self.mesh.holds_loss, self.logging, engine,
                                           lambda: clip.grad_norm)
        if not self.logging:
            return None
        record = self.records[-1]
        if self.cfg.model_cfg.moe_experts:
            # each rank holds its share (its stage's layers, its TP slice of the tokens) of its
            # replica's batch: summed over the world, averaged over the dp x cp replicas
            aux, z, dropped, assigned = comm.all_reduce_scalars(
                [routing[k] for k in ("aux_loss", "z_loss", "dropped", "assigned")], comm.WORLD)
            replicas = self.cfg.dp * self.cfg.cp
            record.update(aux_loss=aux / replicas, z_loss=z / replicas, drop_rate=dropped / assigned)
        if self.policy.loss_scaler is not None:
            record.update(loss_scale=self.scale, skipped_steps=self.policy.loss_scaler.skipped_steps)
        return record

    def write(self) -> None:
        """A logging step's records: rank 0's history, metrics file and progress line."""
        if not self.logging or not self.rank0:
            return
        self.history.extend(self.records)
        if self.metrics:
            self.metrics.write("".join(json.dumps(r) + "\n" for r in self.records))
            self.metrics.flush()
        self.say(report.step_line(self.records[-1], self.cfg.steps, self.progress))
