"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B, checked and timed without a process.

A *schedule* is data (as in ShallowSpeed): for each stage an ordered list of instructions
``forward(i)``, ``backward(i)``, ``send_act/recv_act(i)``, ``send_grad/recv_grad(i)``, which
one executor runs (``minipar.pp``), a checker checks and a timeline draws.

* GPipe: all m forwards, then all m backwards. Holds m micro-batches' activations.
* 1F1B (PipeDream-flush): p-r-1 warm-up forwards, then one forward one backward, then the
  cool-down backwards. Same bubble as GPipe, but stage r holds at most p-r.
* interleaved 1F1B (Megatron-LM): each stage holds v model chunks; chunk c of stage r is the
  (c p + r)-th of v p slices. The bubble shrinks v-fold, the messages grow v-fold.

A schedule function decides only the order of forwards and backwards on each stage; the
sends and receives follow from it (``with_p2p``). The order of blocking sends and receives is
where pipelines hang: two neighbours that both send first wait for each other forever (on
NCCL a send completes only with its peer's receive). ``with_p2p`` puts every message, on both
of its ends, at the tick its consumer starts in the ideal timeline, so all stages meet their
messages in one global order: no cycle of waits can form. ``validate_schedule`` checks any
list set with rendezvous sends and receives.

Ideal bubble (idle fraction of p stages x the step time, equal stage times; the closed form is
the planner's ``minipar.plan.bubble_fraction``, ``Timeline.bubble`` measures it)::

    GPipe, 1F1B:   (p-1) / (m + p - 1)          interleaved:  (p-1) / (v m + p - 1)
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
