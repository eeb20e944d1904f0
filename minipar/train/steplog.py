"""What the trainer records of each step, and when it pays for it (``--log-every``, ``--metrics``).

Reading a number off a GPU waits for the GPU (a host sync), and agreeing on it across ranks is
a collective; a plain PyTorch loop does neither on most steps. So the trainer does both only
on *logging steps*: every ``--log-every``-th step, the last step, and any step that evaluates
or saves. With the default ``--log-every 1`` every step is one, as before.

* A **non-logging step** costs no host sync and no collective: its loss stays on the device
  (a 0-d tensor on the rank that holds it), and the gradient norm is not computed unless
  ``--clip-grad`` needs it (``minipar.optim``).
* A **logging step** synchronizes once, reduces the losses of every step since the previous
  logging step in one all-reduce (and the step time, model-state bytes and peak memory in one
  max-reduce), and returns one record per step. Every record holds
  ``step``, ``loss``, ``lr``, ``comm_bytes`` (rank 0's bytes, counted on the host: free),
  ``step_time_s`` (the mean wall time per step since the previous logging step: its own time
  when every step logs), ``tokens_per_s`` and ``model_state_bytes``; the logging step's record
  adds the rest (docs/reference.md, "Metrics line"): ``comm_seconds`` and ``grad_norm`` of that
  step, MFU, and ``peak_memory_bytes`` over the interval.
"""
from __future__ import annotations

import time

import torch

from .. import comm
from . import mfu


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
        memory = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        on = self.device if comm.clock() == "cuda-events" else torch.device("cpu")
        losses = torch.stack([t.to(on, torch.float64) for t in self.losses])
        state = engine.model_state_bytes()
        peaks = torch.tensor([state["params"], state["grads"], state["optimizer"],
                              state["total"], step_time, memory], dtype=torch.float64, device=on)
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
        if self.device.type == "cuda":
            records[-1]["peak_memory_bytes"] = int(peaks[5])
        return records
