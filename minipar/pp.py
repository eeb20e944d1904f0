"""Pipeline parallelism: the model cut into stages, and one executor that runs a schedule.

The model ``[embed, block 0, ..., block L-1, head]`` is cut into p stages of contiguous blocks
(the embedding on the first stage; final norm, head and loss on the last), one per rank of the
pipeline group. A batch is split into m micro-batches so that the stages work on different
micro-batches at the same time; gradients add up over the micro-batches and the loss of each
is divided by m, so one step equals the serial step.

What each stage does when is a schedule, data (``minipar.schedules``: GPipe, 1F1B,
interleaved; their bubbles and the checker). ``PipelineRunner`` runs this stage's list in
order: ``comm.recv`` blocks, ``comm.isend`` does not (an activation's send is finished at its
backward, a gradient's at the step's end), and each stashed activation is dropped by its
backward.

Point-to-point volume per step (the only communication; b = micro-batch, s = sequence,
d = model width, w = bytes per element, s/t under sequence parallelism). Virtual stage k
(= c p + r) sends its output activation if k < vp - 1 and its input gradient if k > 0, each
m messages of b s d w bytes::

    stage r sends  m b s d w (a_r + g_r)     a_r = v - [r = p-1],  g_r = v - [r = 0]

e.g. GPipe/1F1B with p = 2: each stage sends B_local s d w per step.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from . import comm, data
from .runtime.errors import UsageError
from .schedules import (COMPUTE, P2P, SCHEDULES, Event, Instr, Timeline, backward,  # noqa: F401
                        forward, gpipe, gpipe_order, ideal_timeline, interleaved,
                        interleaved_order, one_f_one_b, one_f_one_b_order, peak_stash,
                        schedule_lists, simulate, validate_schedule, with_p2p)


# --------------------------------------------------------------------------------------
# Stages of the model
# --------------------------------------------------------------------------------------
class Chunk(nn.Module):
    """A contiguous slice of the GPT: [embedding], blocks, [head + loss].

    Blocks keep their serial index as name ("blocks.3"), so names map back to the GPT's.
    """

    def __init__(self, embed, blocks: dict[int, nn.Module], head):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.head = head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x, targets) if self.head is not None else x


class Stage(nn.Module):
    """Exactly this rank's parameters: its v chunks (``chunks.c.<serial name>``)."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def parts(self) -> list[nn.Module]:
        """The model parts this stage holds, in order (what ZeRO wraps as units, like GPT.parts)."""
        out = []
        for chunk in self.chunks:
            out += [m for m in (chunk.embed, *chunk.blocks.values(), chunk.head) if m is not None]
        return out


def split(model, p: int, r: int, v: int = 1) -> Stage:
    """Stage r's chunks: chunk c holds the (c p + r)-th of v p equal slices of the blocks."""
    parts = model.parts()
    embed, blocks, head = parts[0], parts[1:-1], parts[-1]
    V = p * v
    if len(blocks) % V:
        raise UsageError(f"{len(blocks)} layers do not split into pp={p} x chunks={v} equal "
                         f"stages; use a pp x chunks that divides {len(blocks)}")
    per = len(blocks) // V
    chunks = []
    for c in range(v):
        k = c * p + r
        chunks.append(Chunk(embed if k == 0 else None,
                            {i: blocks[i] for i in range(k * per, (k + 1) * per)},
                            head if k == V - 1 else None))
    return Stage(chunks)


# --------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------
class PipelineRunner:
    """This rank's stage of the pipeline and the executor of its instruction list.

    ``group`` is the pipeline's process group (stage r is its rank r). ``schedule`` is a name
    in SCHEDULES or a function ``f(p, m, r[, v])`` returning stage r's list (``chunks`` = v is
    passed when > 1). The lists of all stages are checked with ``validate_schedule`` first, so
    a bad schedule fails on every rank alike, never hangs. ``seq_split``: the activations
    between stages are (b, s/seq_split, h) (t under sequence parallelism). A layout may add two
    values: ``extra_loss(chunk)``, what a chunk adds to the loss for its last forward (an MoE
    layer's auxiliary losses), and ``scale()``, what every backward starts from is multiplied
    by (fp16's loss scale).
    """

    def __init__(self, model, group, schedule="1f1b", microbatches: int = 1, chunks: int = 1,
                 seq_split: int = 1, extra_loss=None, scale=None):
        self.group, self.m = group, microbatches
        self.p, self.r = comm.size(group), comm.rank(group)
        self.stage_ranks = comm.global_ranks(group) if self.p > 1 else [comm.global_ranks(None)[0]]
        self.v = chunks if (schedule == "interleaved" or callable(schedule)) else 1
        self.V = self.p * self.v
        self.module = split(model, self.p, self.r, self.v)
        self.lists = schedule_lists(schedule, self.p, self.m, self.v)
        problems = validate_schedule(self.lists, self.m, self.v)
        if problems:
            raise ValueError(f"schedule {schedule!r} for p={self.p}, m={self.m}: "
                             + "; ".join(problems[:5]))
        self.instructions = self.lists[self.r]
        self.d_model = model.cfg.d_model
        # under sequence parallelism the activations between stages are (b, s/t, h)
        self.seq_split = seq_split
        self.extra_loss = extra_loss or (lambda chunk: 0.0)
        self.scale = scale or (lambda: 1.0)
        first = next(model.parameters())
        self.device, self.act_dtype = first.device, first.dtype
        self.events: list[Event] = []
        self.peak_stash = 0

    def serial_name(self, local_name: str) -> str:
        """``chunks.1.blocks.3.attn.qkv.weight`` -> ``blocks.3.attn.qkv.weight``."""
        return local_name.split(".", 2)[2]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Run the schedule on the local batch; the sum of loss_i / m (last stage: a 0-d tensor
        on the device; else 0.0), loss_i the cross-entropy (MoE's losses backpropagated, not
        reported here)."""
        self.micro = data.microbatches(x, y, self.m)
        self.shape = (x.shape[0] // self.m, x.shape[1] // self.seq_split, self.d_model)
        self.inputs, self.outputs, self.grad_out, self.grad_in = {}, {}, {}, {}
        self.extras = {}             # extra losses of a non-last stage, until their backward
        self.loss, self.held, self.peak_stash, self.events = 0.0, 0, 0, []
        self.sending = {}            # ("act" | "grad", key) -> (handle, tensor) in flight
        t0 = time.perf_counter()
        for ins in self.instructions:
            t = time.perf_counter()
            getattr(self, "_" + ins.op)(ins, (ins.mb, ins.chunk), ins.chunk * self.p + self.r)
            self.events.append(Event(ins.op, ins.mb, ins.chunk, t - t0, time.perf_counter() - t0))
        for handle, _ in self.sending.values():
            handle.wait()
        self.sending = {}
        return self.loss

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward only (held-out loss): each micro-batch through the virtual stages in order.

        Stage r runs (micro-batch i, chunk c) in the order of (i, c); what it waits for, the
        output of virtual stage c p + r - 1, comes earlier in that same order on the previous
        stage, and two neighbouring stages post their messages to each other in that one order
        too, so no schedule list is needed to stay deadlock-free, even where a send completes
        only with its receive (NCCL; replayed in tests/test_p2p_order.py).
        Returns the mean loss on the last stage, 0 elsewhere.
        """
        shape = (x.shape[0] // self.m, x.shape[1] // self.seq_split, self.d_model)
        loss, sending = 0.0, []
        for xb, yb in data.microbatches(x, y, self.m):
            for c in range(self.v):
                k = c * self.p + self.r
                if k == 0:
                    inp = xb
                else:
                    inp = torch.empty(shape, dtype=self.act_dtype, device=self.device)
                    comm.recv(inp, self.stage_ranks[(k - 1) % self.p])
                out = self.module.chunks[c](inp, yb)
                if k == self.V - 1:
                    loss += out.item() / self.m
                else:
                    out = out.to(self.act_dtype).contiguous()
                    sending.append((comm.isend(out, self.stage_ranks[(k + 1) % self.p]), out))
        for handle, _ in sending:
            handle.wait()
        return loss

    # One method per instruction: (instruction, (micro-batch, chunk), virtual stage)
    def _forward(self, ins, key, k):
        x, y = self.micro[ins.mb]
        inp = x if k == 0 else self.inputs[key]
        chunk = self.module.chunks[ins.chunk]
        out = chunk(inp, y)
        # what this chunk adds to the loss (MoE's aux and z losses) is backpropagated on the
        # stage that owns it
        extra = self.extra_loss(chunk)
        if k == self.V - 1:
            # the loss reported is the last stage's own (stays on the device: no host sync)
            self.loss = self.loss + out.detach() / self.m
            out = (out + extra) / self.m
        elif torch.is_tensor(extra):
            self.extras[key] = extra / self.m
        self.outputs[key] = out      # the activations autograd keeps until the backward
        self.held += 1
        self.peak_stash = max(self.peak_stash, self.held)

    def _backward(self, ins, key, k):
        out = self.outputs.pop(key)
        extra = self.extras.pop(key, None)
        if k == self.V - 1:
            (out * self.scale()).backward()
        elif extra is None:
            torch.autograd.backward(out, self.grad_out.pop(key).to(out.dtype))
        else:    # this stage's extra loss, scaled as the loss is
            torch.autograd.backward([out, extra * self.scale()],
                                    [self.grad_out.pop(key).to(out.dtype), None])
        inp = self.inputs.pop(key, None)
        if k > 0:
            self.grad_in[key] = inp.grad
        self.held -= 1
        sent = self.sending.pop(("act", key), None)
        if sent is not None:     # its gradient came back, so the next stage has it: done
            sent[0].wait()

    # Sends do not block the host (a blocking gloo send would wait for its receive). On NCCL
    # an isend still holds its communicator's queue until the receive is posted; the list's
    # order is deadlock-free under that rule too (``validate_schedule`` replays it so). An
    # activation's send is finished at its backward, a gradient's at the end of the step.
    def _send(self, kind, key, tensor, stage):
        tensor = tensor.contiguous()
        self.sending[(kind, key)] = (comm.isend(tensor, self.stage_ranks[stage % self.p]), tensor)

    def _send_act(self, ins, key, k):
        self._send("act", key, self.outputs[key].detach().to(self.act_dtype), ins.peer)

    def _recv_act(self, ins, key, k):
        buf = torch.empty(self.shape, dtype=self.act_dtype, device=self.device)
        comm.recv(buf, self.stage_ranks[ins.peer])
        self.inputs[key] = buf.requires_grad_()

    def _send_grad(self, ins, key, k):
        self._send("grad", key, self.grad_in.pop(key), ins.peer)

    def _recv_grad(self, ins, key, k):
        buf = torch.empty(self.shape, dtype=self.act_dtype, device=self.device)
        comm.recv(buf, self.stage_ranks[ins.peer])
        self.grad_out[key] = buf

    # -- the timeline of the last step, gathered to the pipeline's first stage -----------
    def gather_timeline(self) -> Timeline | None:
        """Collective over the pipeline group; the first stage gets every stage's events."""
        kinds = COMPUTE + P2P
        rows = [[kinds.index(e.op), e.mb, e.chunk, e.start, e.end] for e in self.events]
        n = int(comm.all_reduce_scalars([len(rows)], self.group, op="max")[0])
        mine = torch.full((n + 1, 5), -1.0, dtype=torch.float64, device=self.device)
        mine[0, 0] = self.peak_stash
        if rows:
            mine[1:len(rows) + 1] = torch.tensor(rows, dtype=torch.float64)
        every = torch.empty((self.p, n + 1, 5), dtype=torch.float64, device=self.device)
        with comm.untracked():
            comm.all_gather(every.view(-1), mine.view(-1), self.group)
        if self.r != 0:
            return None
        stages = [[Event(kinds[int(a)], int(b), int(c), float(s), float(t))
                   for a, b, c, s, t in every[r, 1:].tolist() if a >= 0] for r in range(self.p)]
        return Timeline(stages, [int(every[r, 0, 0]) for r in range(self.p)])
