"""Pipeline parallelism: schedules as data, one executor, measured timelines.

The model ``[embed, block 0, ..., block L-1, head]`` is cut into p stages of contiguous
blocks (the embedding on the first stage; final norm, head and loss on the last), one per
rank of the pipeline group. A batch is split into m micro-batches so that the stages work
on different micro-batches at the same time; gradients add up over the micro-batches and
the loss of each is divided by m, so one step equals the serial step.

A *schedule* is data (as in ShallowSpeed): for each stage an ordered list of instructions
``forward(i)``, ``backward(i)``, ``send_act/recv_act(i)``, ``send_grad/recv_grad(i)``.

* GPipe: all m forwards, then all m backwards. Holds m micro-batches' activations.
* 1F1B (PipeDream-flush): p-r-1 warm-up forwards, then one forward one backward, then
  the cool-down backwards. Same bubble as GPipe, but stage r holds at most p-r.
* interleaved 1F1B (Megatron-LM): each stage holds v model chunks; chunk c of stage r is
  the (c p + r)-th of v p slices. The bubble shrinks v-fold, the messages grow v-fold.

A schedule function only decides the order of forwards and backwards on each stage; the
sends and receives follow from it (``with_p2p``). The ordering of blocking sends and
receives is where pipelines hang: two neighbours that both send first wait for each other
forever. ``with_p2p`` puts every message, on both of its ends, at the tick its consumer
starts in the ideal timeline, so all stages meet their messages in one global order: no
cycle of waits can form. ``validate_schedule`` checks any list set without a process.
``PipelineRunner`` runs a stage's list in order: ``comm.recv`` blocks, ``comm.isend`` does
not (an activation's send is finished at its backward, a gradient's at the step's end), and
each stashed activation is dropped by its backward.

Ideal bubble (idle fraction of p stages x the step time, equal stage times; the closed form
is the planner's ``minipar.plan.bubble_fraction``, ``Timeline.bubble`` measures it)::

    GPipe, 1F1B:   (p-1) / (m + p - 1)          interleaved:  (p-1) / (v m + p - 1)

Point-to-point volume per step (the only communication; b = micro-batch, s = sequence,
d = model width, w = bytes per element, s/t with sequence-parallel TP). Virtual stage k
(= c p + r) sends its output activation if k < vp - 1 and its input gradient if k > 0,
each m messages of b s d w bytes::

    stage r sends  m b s d w (a_r + g_r)     a_r = v - [r = p-1],  g_r = v - [r = 0]

e.g. GPipe/1F1B with p = 2: each stage sends B_local s d w per step.

Mixture of experts: each stage adds the aux and z losses of its own MoE layers for each
micro-batch (divided by m) to what it backpropagates, so the objective is the serial one
with no extra message; the trainer sums the ``aux_loss`` and ``drop_rate`` counts over stages.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import comm, data, moe
from .dist import UsageError

COMPUTE = ("forward", "backward")
P2P = ("send_act", "recv_act", "send_grad", "recv_grad")


# --------------------------------------------------------------------------------------
# Instructions
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instr:
    """One step of a stage's schedule: ``op`` on micro-batch ``mb`` of local model ``chunk``.

    For sends and receives ``peer`` is the other stage.
    """
    op: str
    mb: int
    chunk: int = 0
    peer: int = -1

    def __repr__(self):
        c = f".{self.chunk}" if self.chunk else ""
        if self.op in COMPUTE:
            return f"{self.op[0].upper()}{self.mb}{c}"
        arrow = "->" if self.op.startswith("send") else "<-"
        return f"{self.op}({self.mb}{c}){arrow}{self.peer}"


def forward(i: int, chunk: int = 0) -> Instr:
    return Instr("forward", i, chunk)


def backward(i: int, chunk: int = 0) -> Instr:
    return Instr("backward", i, chunk)


# --------------------------------------------------------------------------------------
# Schedules: the order of forwards and backwards on stage r of p, for m micro-batches
# --------------------------------------------------------------------------------------
def gpipe_order(p: int, m: int, r: int) -> list[Instr]:
    """GPipe: every forward, then every backward."""
    return [forward(i) for i in range(m)] + [backward(i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, r: int) -> list[Instr]:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then cool down."""
    # EXERCISE ex05 begin
    # warm-up: min(p - r - 1, m) forwards; steady: forward, backward; cool-down: the rest
    warmup = min(p - r - 1, m)
    order = [forward(i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(m - warmup, m)]
    return order
    # EXERCISE ex05 end


def interleaved_order(p: int, m: int, r: int, v: int) -> list[Instr]:
    """Megatron's interleaved 1F1B: micro-batches in groups of p go through chunk 0, 1, ...

    The k-th forward of the stage is micro-batch ``(k // (p v)) p + k % p`` of chunk
    ``(k // p) % v``; backwards visit the chunks in reverse. Needs m to be a multiple of p.
    """
    total = m * v

    def pick(k, reverse):
        c = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - c) if reverse else c

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    order = [forward(*pick(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(*pick(warmup + k, False)), backward(*pick(k, True))]
    order += [backward(*pick(k, True)) for k in range(total - warmup, total)]
    return order


def gpipe(p: int, m: int, r: int) -> list[Instr]:
    """Stage r's GPipe instruction list, sends and receives included."""
    return with_p2p([gpipe_order(p, m, s) for s in range(p)])[r]


def one_f_one_b(p: int, m: int, r: int) -> list[Instr]:
    """Stage r's 1F1B instruction list, sends and receives included."""
    return with_p2p([one_f_one_b_order(p, m, s) for s in range(p)])[r]


def interleaved(p: int, m: int, r: int, v: int = 2) -> list[Instr]:
    """Stage r's interleaved 1F1B instruction list (v chunks per stage)."""
    return with_p2p([interleaved_order(p, m, s, v) for s in range(p)])[r]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def schedule_lists(schedule, p: int, m: int, v: int = 1) -> list[list[Instr]]:
    """Every stage's list for a schedule name or function ``f(p, m, r[, v])``."""
    fn = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    return [fn(p, m, r) if v == 1 and fn is not interleaved else fn(p, m, r, v)
            for r in range(p)]


# --------------------------------------------------------------------------------------
# The ideal timeline, and the sends and receives that follow from it
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """An instruction as it ran (or would run): seconds (or ticks) from the step's start."""
    op: str
    mb: int
    chunk: int
    start: float
    end: float


def _needs(ins: Instr, k: int, V: int):
    """The compute result that ``ins`` on virtual stage k waits for (None: none)."""
    if ins.op == "forward":
        return ("forward", ins.mb, k - 1) if k > 0 else None
    return ("backward", ins.mb, k + 1) if k < V - 1 else ("forward", ins.mb, k)


def simulate(lists: list[list[Instr]], t_fwd: float = 1.0, t_bwd: float = 2.0):
    """Run the compute instructions with fixed durations and instant messages.

    Returns every stage's compute ``Event`` list. Raises ValueError when the order cannot
    run at all (some stage waits for a result that can only come after its own wait).
    """
    p = len(lists)
    v = 1 + max((i.chunk for lst in lists for i in lst), default=0)
    ops = [[i for i in lst if i.op in COMPUTE] for lst in lists]
    done: dict[tuple, float] = {}
    free, pos = [0.0] * p, [0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                ins = ops[r][pos[r]]
                k = ins.chunk * p + r
                need = _needs(ins, k, p * v)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need else 0.0)
                free[r] = start + (t_fwd if ins.op == "forward" else t_bwd)
                done[(ins.op, ins.mb, k)] = free[r]
                events[r].append(Event(ins.op, ins.mb, ins.chunk, start, free[r]))
                pos[r] += 1
                progress = True
    stuck = [f"stage {r} waits forever at {ops[r][pos[r]]!r}"
             for r in range(p) if pos[r] < len(ops[r])]
    if stuck:
        raise ValueError("the compute order cannot run: " + ", ".join(stuck))
    return events


def with_p2p(orders: list[list[Instr]], t_fwd: float = 1.0, t_bwd: float = 2.0):
    """Add the sends and receives to every stage's compute order.

    A forward on virtual stage k < vp-1 sends its output to k+1; a backward on k > 0 sends
    the input gradient to k-1. Each message is placed on both of its ends at the tick its
    consumer starts in the ideal timeline (receives before computes at the same tick), and
    each list is sorted by tick: one global order, so blocking sends cannot deadlock.
    """
    p = len(orders)
    timeline = simulate(orders, t_fwd, t_bwd)
    V = p * (1 + max((i.chunk for o in orders for i in o), default=0))
    starts = {(e.op, e.mb, e.chunk * p + r): e.start for r, evs in enumerate(timeline) for e in evs}
    keyed: list[list] = [[] for _ in range(p)]
    for r, evs in enumerate(timeline):
        for e in evs:
            k = e.chunk * p + r
            keyed[r].append(((e.start, 1, k), Instr(e.op, e.mb, e.chunk)))
            if e.op == "forward" and k < V - 1:
                kind, dst = "act", k + 1
            elif e.op == "backward" and k > 0:
                kind, dst = "grad", k - 1
            else:
                continue
            tick = starts[(e.op, e.mb, dst)]
            key = (tick, 0, k, e.mb, kind)
            keyed[r].append((key, Instr(f"send_{kind}", e.mb, e.chunk, peer=dst % p)))
            keyed[dst % p].append((key, Instr(f"recv_{kind}", e.mb, dst // p, peer=r)))
    return [[ins for _, ins in sorted(lst, key=lambda kv: kv[0])] for lst in keyed]


# --------------------------------------------------------------------------------------
# The checker: any instruction lists, no process needed
# --------------------------------------------------------------------------------------
def _message(ins: Instr, r: int, p: int):
    """(kind, micro-batch, from virtual stage, to virtual stage) of a send or receive."""
    kind = ins.op.split("_")[1]
    k = ins.chunk * p + r
    step = 1 if kind == "act" else -1
    return (kind, ins.mb, k, k + step) if ins.op.startswith("send") else (kind, ins.mb, k - step, k)


def validate_schedule(lists: list[list[Instr]], m: int | None = None, v: int | None = None):
    """Every problem of a set of stage lists, in plain words (empty list: runnable).

    Checks that each (micro-batch, chunk) is forwarded then backwarded exactly once per
    stage, that its input is received before and its output sent after, that every send
    is matched by a receive with the right peer, and finally simulates the lists with
    blocking (rendezvous) sends and receives: a send and its receive complete together,
    so a set that finishes here finishes with any buffering.
    """
    p = len(lists)
    seen = [i for lst in lists for i in lst]
    m = m if m is not None else 1 + max((i.mb for i in seen), default=-1)
    v = v if v is not None else 1 + max((i.chunk for i in seen), default=0)
    V = p * v
    problems = []
    for r, lst in enumerate(lists):
        pos: dict[tuple, int] = {}
        for n, ins in enumerate(lst):
            if ins.op not in COMPUTE + P2P:
                problems.append(f"stage {r}: unknown instruction {ins!r}")
                continue
            if not (0 <= ins.mb < m and 0 <= ins.chunk < v):
                problems.append(f"stage {r}: {ins!r} is outside m={m} micro-batches, "
                                f"v={v} chunks")
                continue
            if ins.op in P2P:
                kind, mb, src, dst = _message(ins, r, p)
                if not 0 <= min(src, dst) <= max(src, dst) < V:
                    problems.append(f"stage {r}: {ins!r} has no stage to talk to")
                    continue
                other = dst if ins.op.startswith("send") else src
                if ins.peer != other % p:
                    problems.append(f"stage {r}: {ins!r} should talk to stage {other % p}")
            key = (ins.op, ins.mb, ins.chunk)
            if key in pos:
                problems.append(f"stage {r}: {ins!r} appears twice")
            pos[key] = n
        for c in range(v):
            k = c * p + r
            for i in range(m):
                f, b = pos.get(("forward", i, c)), pos.get(("backward", i, c))
                where = f"stage {r}, micro-batch {i}" + (f", chunk {c}" if v > 1 else "")
                if f is None or b is None:
                    problems.append(f"{where}: needs one forward and one backward")
                    continue
                if b < f:
                    problems.append(f"{where}: backward before its forward")
                for op, needed, before, at in (("recv_act", k > 0, True, f),
                                               ("send_act", k < V - 1, False, f),
                                               ("recv_grad", k < V - 1, True, b),
                                               ("send_grad", k > 0, False, b)):
                    n = pos.get((op, i, c))
                    if needed and n is None:
                        problems.append(f"{where}: missing {op}")
                    elif not needed and n is not None:
                        problems.append(f"{where}: {op} has no stage to talk to")
                    elif n is not None and (n > at if before else n < at):
                        when = "before" if before else "after"
                        problems.append(f"{where}: {op} must come {when} its "
                                        f"{'forward' if 'act' in op else 'backward'}")
    if problems:
        return problems
    return _deadlocks(lists)


def _deadlocks(lists):
    """Replay with blocking sends and receives under NCCL's rendezvous rule
    (``minipar.p2p_order``); [] if every stage reaches its end."""
    from .p2p_order import Op, blocking, replay
    p = len(lists)
    traces = []
    for r, lst in enumerate(lists):
        events = []
        for ins in lst:
            if ins.op in P2P:
                kind = "send" if ins.op.startswith("send") else "recv"
                events += blocking(Op(kind, repr(ins), peer=ins.peer, tag=_message(ins, r, p)),
                                   len(events))
        traces.append(events)
    return replay(traces, who="stage")


def peak_stash(lst: list[Instr]) -> int:
    """Most micro-batches (x chunks) whose activations a stage holds at once."""
    held = peak = 0
    for ins in lst:
        held += {"forward": 1, "backward": -1}.get(ins.op, 0)
        peak = max(peak, held)
    return peak


# --------------------------------------------------------------------------------------
# Timelines (ideal or measured)
# --------------------------------------------------------------------------------------
@dataclass
class Timeline:
    """Every stage's events; ``peak_stash[r]`` the most activations stage r held."""
    stages: list[list[Event]]
    peak_stash: list[int] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((e.end for evs in self.stages for e in evs), default=0.0)

    def busy(self, r: int) -> float:
        return sum(e.end - e.start for e in self.stages[r] if e.op in COMPUTE)

    @property
    def bubble(self) -> float:
        """Idle share of p stages x makespan: time spent waiting or messaging, not computing."""
        total = len(self.stages) * self.makespan
        return 1.0 - sum(self.busy(r) for r in range(len(self.stages))) / total if total else 0.0


def ideal_timeline(schedule, p: int, m: int, v: int = 1, t_fwd: float = 1.0,
                   t_bwd: float = 2.0) -> Timeline:
    """The schedule run with a stage's forward taking t_fwd, its backward t_bwd (a chunk: /v)."""
    lists = schedule_lists(schedule, p, m, v)
    return Timeline(simulate(lists, t_fwd / v, t_bwd / v), [peak_stash(lst) for lst in lists])


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

    ``schedule`` is a name in SCHEDULES or a function ``f(p, m, r[, v])`` returning stage
    r's list (``chunks`` = v is passed when > 1). The lists of all stages are checked with
    ``validate_schedule`` first, so a bad schedule fails on every rank alike, never hangs.
    """

    def __init__(self, model, grid, schedule="1f1b", microbatches: int = 1, chunks: int = 1,
                 autocast=contextlib.nullcontext, seq_split: int = 1, loss_scaler=None):
        self.grid, self.m, self.autocast = grid, microbatches, autocast
        self.p, self.r = grid.pp, grid.pp_rank
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
        self.loss_scaler = loss_scaler   # fp16: the last stage's backward starts from loss * scale
        first = next(model.parameters())
        self.device, self.act_dtype = first.device, first.dtype
        self.profile = False     # True: on a GPU, synchronise around each instruction
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
        self.penalties = {}          # MoE losses of a non-last stage, until their backward
        self.loss, self.held, self.peak_stash, self.events = 0.0, 0, 0, []
        self.sending = {}            # ("act" | "grad", key) -> (handle, tensor) in flight
        sync = self.profile and self.device.type == "cuda"
        t0 = time.perf_counter()
        for ins in self.instructions:
            if sync:
                torch.cuda.synchronize()
            t = time.perf_counter()
            getattr(self, "_" + ins.op)(ins, (ins.mb, ins.chunk), ins.chunk * self.p + self.r)
            if sync:
                torch.cuda.synchronize()
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
                    comm.recv(inp, self.grid.stage_rank(k - 1))
                with self.autocast():
                    out = self.module.chunks[c](inp, yb)
                if k == self.V - 1:
                    loss += out.item() / self.m
                else:
                    out = out.to(self.act_dtype).contiguous()
                    sending.append((comm.isend(out, self.grid.stage_rank(k + 1)), out))
        for handle, _ in sending:
            handle.wait()
        return loss

    # One method per instruction: (instruction, (micro-batch, chunk), virtual stage)
    def _forward(self, ins, key, k):
        x, y = self.micro[ins.mb]
        inp = x if k == 0 else self.inputs[key]
        chunk = self.module.chunks[ins.chunk]
        with self.autocast():
            out = chunk(inp, y)
        # MoE: this chunk's layers add their aux and z losses of this micro-batch here, on
        # the stage that owns them (0.0 for a dense chunk)
        extra = moe.penalty(chunk)
        if k == self.V - 1:
            # the loss reported is the cross-entropy (stays on the device: no host sync)
            self.loss = self.loss + out.detach() / self.m
            out = (out + extra) / self.m
        elif torch.is_tensor(extra):
            self.penalties[key] = extra / self.m
        self.outputs[key] = out      # the activations autograd keeps until the backward
        self.held += 1
        self.peak_stash = max(self.peak_stash, self.held)

    def _backward(self, ins, key, k):
        out = self.outputs.pop(key)
        extra = self.penalties.pop(key, None)
        if k == self.V - 1:
            (out if self.loss_scaler is None else out * self.loss_scaler.scale).backward()
        elif extra is None:
            torch.autograd.backward(out, self.grad_out.pop(key).to(out.dtype))
        else:    # this stage's MoE losses, scaled as the loss is (fp16)
            scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
            torch.autograd.backward([out, extra * scale],
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
        self.sending[(kind, key)] = (comm.isend(tensor, self.grid.stage_rank(stage)), tensor)

    def _send_act(self, ins, key, k):
        self._send("act", key, self.outputs[key].detach().to(self.act_dtype), ins.peer)

    def _recv_act(self, ins, key, k):
        buf = torch.empty(self.shape, dtype=self.act_dtype, device=self.device)
        comm.recv(buf, self.grid.stage_rank(ins.peer))
        self.inputs[key] = buf.requires_grad_()

    def _send_grad(self, ins, key, k):
        self._send("grad", key, self.grad_in.pop(key), ins.peer)

    def _recv_grad(self, ins, key, k):
        buf = torch.empty(self.shape, dtype=self.act_dtype, device=self.device)
        comm.recv(buf, self.grid.stage_rank(ins.peer))
        self.grad_out[key] = buf

    # -- the timeline of the last step, gathered to the pipeline's first stage -----------
    def gather_timeline(self) -> Timeline | None:
        """Collective over the pipeline group; the first stage gets every stage's events."""
        kinds = COMPUTE + P2P
        rows = [[kinds.index(e.op), e.mb, e.chunk, e.start, e.end] for e in self.events]
        n = int(comm.all_reduce_scalars([len(rows)], self.grid.pp_group, op="max")[0])
        mine = torch.full((n + 1, 5), -1.0, dtype=torch.float64, device=self.device)
        mine[0, 0] = self.peak_stash
        if rows:
            mine[1:len(rows) + 1] = torch.tensor(rows, dtype=torch.float64)
        every = torch.empty((self.p, n + 1, 5), dtype=torch.float64, device=self.device)
        with comm.untracked():
            comm.all_gather(every.view(-1), mine.view(-1), self.grid.pp_group)
        if self.r != 0:
            return None
        stages = [[Event(kinds[int(a)], int(b), int(c), float(s), float(t))
                   for a, b, c, s, t in every[r, 1:].tolist() if a >= 0] for r in range(self.p)]
        return Timeline(stages, [int(every[r, 0, 0]) for r in range(self.p)])


# --------------------------------------------------------------------------------------
# The trainer's checks
# --------------------------------------------------------------------------------------
def validate(cfg, pp: int, microbatches: int, chunks: int = 1, schedule: str = "1f1b") -> None:
    """Reject, before any process starts, a pipeline that cannot run."""
    p, m = pp, microbatches
    v = chunks if schedule == "interleaved" else 1
    if schedule == "interleaved" and m % p:
        near = [k for k in (m - m % p, m - m % p + p) if k >= p]
        raise UsageError(f"--schedule interleaved runs micro-batches in groups of pp={p}, so "
                         f"--microbatches {m} must be a multiple of {p}; use --microbatches "
                         f"{' or '.join(map(str, near))}, or --schedule 1f1b")
    if cfg.n_layer % (p * v):
        what = f"pp={p} x chunks={v} = {p * v}" if v > 1 else f"pp={p}"
        raise UsageError(f"the model has {cfg.n_layer} layers, which do not split into "
                         f"{what} equal stages; use a pp{' x chunks' if v > 1 else ''} that "
                         f"divides {cfg.n_layer}")
