"""The collectives minipar uses, with their bytes and time recorded.

Every paradigm calls these thin wrappers instead of ``torch.distributed`` so that the
trainer's metrics and the notebooks can show, per op and per group, how many bytes each
rank sent and how long it waited.

Convention: ``group=None`` means *a group of one rank* (the grid hands out ``None`` for an
axis of size 1), so every op is then a no-op that records nothing. Pass ``WORLD`` for the
whole world. Torch-style APIs whose default ``group=None`` means the world (``dp.DataParallel``,
``zero.ShardedOptimizer``) take ``SOLO`` for an explicit group of one.

What "bytes sent" means. gloo and NCCL do not report wire traffic, so each call records the
bytes this rank sends under the bandwidth-optimal ring algorithm for the tensor it was
given; N is that tensor's size in bytes and n the group size:

=================  ==========================  ==================================
op                 this rank sends             note
=================  ==========================  ==================================
all_reduce         2 (n-1)/n * N               reduce-scatter + all-gather
reduce_scatter     (n-1)/n * N                 N = full input, each rank keeps N/n
all_gather         (n-1)/n * N                 N = full output
broadcast          N on the source, 0 else     a tree/ring may spread it, same total
all_to_all         sum of the rows it sends    exact: the rows it keeps are not
                   to the other ranks          counted (uneven splits allowed)
send               N                           point-to-point, exact payload
recv               0                           (received bytes are in ``received``)
=================  ==========================  ==================================

So a measured total equals a closed-form volume exactly when the code hands each
collective exactly the tensors the formula assumes: that is what the tests check.

gloo has no AVG for every collective, so ``op="avg"`` is a sum followed by a division.

What "seconds" means (``clock()`` names the clock). On gloo (``"host"``) a call blocks the
host until the op is done, so ``time.perf_counter`` around it is the time spent in it. On
NCCL/RCCL a call only enqueues the op on the GPU and returns at once, so host time would be
about 0; there (``"cuda-events"``) a pair of CUDA events on the current stream brackets the
op: a blocking op's seconds are how long the compute stream waited for it (the collective,
and the peers it waits for), an asynchronous op's how long the stream stalled in ``wait()``
(its exposed part, as on the host). The events are read when the seconds are asked for,
after the step's ``torch.cuda.synchronize()``, so timing adds no host sync of its own; and
they are recorded only while ``stats.device_timing`` is on (the trainer: its logging steps).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from .runtime import trace



class _World:
    """Sentinel for the whole world (``dist.group.WORLD`` is None until init)."""

    def __repr__(self):
        return "WORLD"


WORLD = _World()


class _Solo:
    """Sentinel for a group of one rank where an API's default (None) means the whole world."""

    def __repr__(self):
        return "SOLO"


SOLO = _Solo()


def _alone(group) -> bool:
    return group is None or group is SOLO or not dist.is_initialized()


def _pg(group):
    return None if group is WORLD else group  # torch's own spelling of "the world"

# name of each group we created, for per-group accounting
_GROUP_NAMES: dict[int, str] = {}


def name_group(group, name: str) -> None:
    _GROUP_NAMES[id(group)] = name


def group_name(group) -> str:
    if isinstance(group, str):
        return group
    if group is None or group is SOLO:
        return "solo"
    if group is WORLD:
        return "world"
    return _GROUP_NAMES.get(id(group), "group")


def size(group) -> int:
    """Ranks in ``group``; 1 for ``None``/``SOLO`` (a group of one) or without a process group."""
    if _alone(group):
        return 1
    return dist.get_world_size(_pg(group))


def rank(group) -> int:
    if _alone(group):
        return 0
    return dist.get_rank(_pg(group))


def global_ranks(group) -> list[int]:
    if _alone(group):
        return [dist.get_rank() if dist.is_initialized() else 0]
    if group is WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def communicator(group) -> str:
    """The process group an op on ``group`` runs on, as an order recording names it: its name
    and global ranks, ``world[0, 1, 2, 3]`` for the default group (``WORLD``, or torch's own
    default group object). The point-to-point ops below run on the default group, so they are
    filed under this same name as the world's collectives: under eager init NCCL runs them on
    one communicator, in one queue."""
    pg = _pg(group)
    if pg is None or pg is dist.group.WORLD:
        return f"world{list(range(dist.get_world_size()))}"
    return f"{group_name(pg)}{dist.get_process_group_ranks(pg)}"


# --------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------
class Stats:
    """Bytes sent, bytes received, calls and seconds, keyed by (op, group name).

    ``device_timing`` (NCCL only): whether ops are bracketed by CUDA events; the trainer turns
    it on for its logging steps alone (two events per op on every step cost launch time, and
    only a logging step reports seconds). Off, an op still counts its bytes and calls.
    """

    def __init__(self):
        self.device_timing = True
        self.reset()

    def reset(self):
        self.sent = defaultdict(int)
        self.received = defaultdict(int)
        self.calls = defaultdict(int)
        self._seconds = defaultdict(float)
        self.pending = []              # [(key, start event, end event)]: read on demand

    def add(self, op, group, sent, received, seconds):
        """``seconds``: a float (host clock) or a (start, end) pair of CUDA events."""
        key = (op, group_name(group))
        self.sent[key] += int(sent)
        self.received[key] += int(received)
        self.calls[key] += 1
        if isinstance(seconds, tuple):
            self.pending.append((key, *seconds))
        else:
            self._seconds[key] += seconds

    def _read_events(self):
        for key, start, end in self.pending:
            end.synchronize()          # already done after the step's synchronize
            self._seconds[key] += start.elapsed_time(end) / 1e3
        self.pending = []

    @property
    def seconds(self) -> dict:
        """Seconds by (op, group name), on ``clock()``'s clock."""
        self._read_events()
        return self._seconds

    def bytes_by_op(self) -> dict[str, int]:
        out = defaultdict(int)
        for (op, _), b in self.sent.items():
            out[op] += b
        return dict(out)

    def seconds_by_op(self) -> dict[str, float]:
        """Seconds this rank spent blocked in each kind of op (waiting on async ones), on
        ``clock()``'s clock."""
        out = defaultdict(float)
        for (op, _), s in self.seconds.items():
            out[op] += s
        return dict(out)

    def bytes_by_group(self) -> dict[str, int]:
        out = defaultdict(int)
        for (_, g), b in self.sent.items():
            out[g] += b
        return dict(out)

    def table(self) -> list[dict]:
        seconds = self.seconds
        return [dict(op=op, group=g, calls=self.calls[(op, g)], bytes_sent=self.sent[(op, g)],
                     bytes_received=self.received[(op, g)], seconds=seconds[(op, g)])
                for (op, g) in sorted(self.calls)]


stats = Stats()
_tracking = [True]


def reset() -> None:
    stats.reset()


@contextlib.contextmanager
def untracked():
    """Run collectives that are bookkeeping (e.g. gathering metrics), not training traffic."""
    _tracking.append(False)
    try:
        yield
    finally:
        _tracking.pop()


# Recording the order of ops, for ``minipar.p2p_order`` to replay under NCCL's rule: while a
# ``recording(recorder)`` block runs, every op issued here is posted to the recorder, tracked
# or not (bookkeeping collectives run on the same communicators as training traffic).
_recorders: list = []


@contextlib.contextmanager
def recording(recorder):
    """Inside: every op this rank issues through this module is also told to ``recorder``:
    ``recorder.post(kind, name, comm, peer, members, nbytes)`` when it is issued (returns an
    id) and ``recorder.wait(id)`` when this rank waits for it (at once for a blocking op)."""
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


def _post(op, group, nbytes, peer=None) -> list:
    """Tell the recorders (if any) about an op being issued; their ids, for ``_waited``."""
    if not _recorders:
        return []
    if peer is not None:      # point-to-point, on the default group (torch's dist.send)
        arrow = "->" if op == "send" else "<-"
        kind, name, comm, members = op, f"{op} {group_name(group)} {arrow}{peer}", \
            communicator(WORLD), None
    else:
        kind, name = "collective", f"{op} {group_name(group)}"
        members, comm = tuple(global_ranks(group)), communicator(group)
    return [(r, r.post(kind, name, comm, peer, members, nbytes)) for r in _recorders]


def _waited(posted: list) -> None:
    for recorder, op_id in posted:
        recorder.wait(op_id)


def _record(op, group, sent, received, seconds, start=None, issued=None):
    """Count one op; with ``--trace`` also put it on the timeline in host time (``start``: when
    this rank began blocking on it, ``issued``: when an async op was issued; it ends now)."""
    if _tracking[-1]:
        stats.add(op, group, sent, received, seconds)
        if trace.active is not None and start is not None:
            trace.active.comm(op, group_name(group), sent, start if issued is None else issued,
                              start, time.perf_counter())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def clock() -> str:
    """How collectives are timed: ``"cuda-events"`` on NCCL/RCCL, ``"host"`` otherwise."""
    return "cuda-events" if dist.is_initialized() and dist.get_backend() == "nccl" else "host"


def scalar_device() -> torch.device:
    """Where a collective's small host-born tensor must live: NCCL reduces GPU tensors only."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


_UNTIMED = object()   # NCCL with device timing off: the op counts bytes, not seconds


def _start_timer():
    """A host time stamp, or a CUDA event recorded on the current stream (NCCL)."""
    if clock() == "host":
        return time.perf_counter()
    if not stats.device_timing:
        return _UNTIMED
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(start):
    """Seconds since ``start`` (host), or the (start, end) event pair to be read later."""
    if isinstance(start, float):
        return time.perf_counter() - start
    if start is _UNTIMED:
        return 0.0
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    return (start, end)


class Handle:
    """An asynchronous op in flight; ``wait()`` finishes it and records its waiting time."""

    def __init__(self, work, op, group, sent, received, after=None, posted=()):
        self.work, self.op, self.group = work, op, group
        self.sent, self.received, self.after = sent, received, after
        self.posted = posted                     # (recorder, id) of an order recording
        self.t0 = time.perf_counter()
        self.done = False

    def wait(self):
        if self.done:
            return
        t = _start_timer() if _tracking[-1] else None
        host = time.perf_counter()               # the trace's clock (minipar.runtime.trace)
        if self.work is not None:
            self.work.wait()
        _waited(self.posted)
        if self.after is not None:
            self.after()
        if t is not None:
            _record(self.op, self.group, self.sent, self.received, _elapsed(t),
                    start=host, issued=self.t0)
        self.done = True
        self.work = self.after = None    # release the backend's work object now, not at exit


def _run(op, group, sent, received, call, async_op, after=None, nbytes=0, peer=None):
    """Issue ``call(async_op)``; return a Handle (async) or finish and record (sync).
    ``nbytes`` and ``peer`` (point-to-point) are for an order recording only."""
    posted = _post(op, group, nbytes, peer)
    if async_op:
        return Handle(call(True), op, group, sent, received, after, posted)
    t = _start_timer() if _tracking[-1] else None
    host = time.perf_counter()
    call(False)
    _waited(posted)
    if after is not None:
        after()
    if t is not None:
        _record(op, group, sent, received, _elapsed(t), start=host)
    return None


_DONE = Handle(None, "noop", None, 0, 0)
_DONE.done = True


# --------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------
# The flat-tensor collectives: torch 2.6 has only the *_tensor names; newer releases add the
# *_single names and warn (FutureWarning) on the old ones.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_op(op: str):
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN}[op]


def all_reduce(t: torch.Tensor, group=None, op: str = "sum", async_op: bool = False):
    """In place: every rank ends with the reduction of all ranks' ``t``. Sends 2(n-1)/n N."""
    n = size(group)
    if n == 1:
        return _DONE if async_op else None
    volume = 2 * (n - 1) * _nbytes(t) // n
    after = (lambda: t.div_(n)) if op == "avg" else None
    return _run("all_reduce", group, volume, volume,
                lambda a: dist.all_reduce(t, op=_reduce_op(op), group=_pg(group), async_op=a),
                async_op, after)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, op: str = "sum",
                   async_op: bool = False):
    """Rank i gets shard i of the reduction of every rank's flat ``inp``. Sends (n-1)/n N."""
    n = size(group)
    if n == 1:
        out.copy_(inp.view_as(out))
        return _DONE if async_op else None
    assert inp.numel() == out.numel() * n, "reduce_scatter: input must be n x output"
    volume = (n - 1) * _nbytes(inp) // n
    after = (lambda: out.div_(n)) if op == "avg" else None
    return _run("reduce_scatter", group, volume, volume,
                lambda a: _REDUCE_SCATTER(out, inp, op=_reduce_op(op), group=_pg(group), async_op=a),
                async_op, after)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Flat ``out`` (n x inp) gets every rank's ``inp`` in rank order. Sends (n-1)/n N."""
    n = size(group)
    if n == 1:
        out.copy_(inp.view_as(out))
        return _DONE if async_op else None
    assert out.numel() == inp.numel() * n, "all_gather: output must be n x input"
    volume = (n - 1) * _nbytes(out) // n
    return _run("all_gather", group, volume, volume,
                lambda a: _ALL_GATHER(out, inp, group=_pg(group), async_op=a), async_op)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Every rank gets the global rank ``src``'s ``t``. The source sends N."""
    if size(group) == 1:
        return _DONE if async_op else None
    me = dist.get_rank()
    sent = _nbytes(t) if me == src else 0
    return _run("broadcast", group, sent, _nbytes(t) - sent,
                lambda a: dist.broadcast(t, src=src, group=_pg(group), async_op=a), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None, group=None, op: str = "all_to_all"):
    """Rank i sends rows ``in_splits[j]`` of ``inp`` (its j-th block, dim 0) to rank j and
    receives rank j's block for it into ``out``; None means n equal blocks.

    Sends exactly the rows addressed to other ranks (the block for itself stays local).
    ``op`` names the record (e.g. ``all_to_all_counts`` for routing metadata); it keeps
    ``all_to_all`` in it so the trainer's metrics group every all-to-all together.
    """
    n = size(group)
    if n == 1:
        out.copy_(inp)
        return None
    me = rank(group)
    row = math.prod(inp.shape[1:]) * inp.element_size()      # bytes of one row
    sends = in_splits if in_splits is not None else [inp.shape[0] // n] * n
    gets = out_splits if out_splits is not None else [out.shape[0] // n] * n
    sent = row * (sum(sends) - sends[me])
    received = row * (sum(gets) - gets[me])
    return _run(op, group, sent, received,
                lambda a: dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits,
                                                 group=_pg(group), async_op=a), False)


# Point-to-point ops. On NCCL/RCCL a send completes only together with its receive, and a
# rank's ops on one communicator run in the order it posted them: two neighbours that both
# post their receive (or both their send) first wait for each other forever, whether the ops
# are blocking or not. gloo's threads hide this. ``minipar.p2p_order`` checks every exchange
# of the package against that rule, from the order these functions record.
def send(t: torch.Tensor, dst: int) -> None:
    """Blocking point-to-point send to global rank ``dst``. Sends N."""
    _run("send", "p2p", _nbytes(t), 0, lambda a: dist.send(t.contiguous(), dst), False,
         nbytes=_nbytes(t), peer=dst)


def recv(t: torch.Tensor, src: int) -> None:
    """Blocking point-to-point receive from global rank ``src`` into ``t``."""
    _run("recv", "p2p", 0, _nbytes(t), lambda a: dist.recv(t, src), False,
         nbytes=_nbytes(t), peer=src)


def isend(t: torch.Tensor, dst: int, label: str = "p2p") -> Handle:
    """Asynchronous send to global rank ``dst``; ``label`` files its bytes (e.g. ``"cp"``)."""
    return _run("send", label, _nbytes(t), 0, lambda a: dist.isend(t, dst), True,
                nbytes=_nbytes(t), peer=dst)


def irecv(t: torch.Tensor, src: int, label: str = "p2p") -> Handle:
    """Asynchronous receive from global rank ``src`` into ``t`` (valid after ``wait()``)."""
    return _run("recv", label, 0, _nbytes(t), lambda a: dist.irecv(t, src), True,
                nbytes=_nbytes(t), peer=src)


def barrier(group=None) -> None:
    if size(group) > 1:
        posted = _post("barrier", group, 0)
        dist.barrier(group=_pg(group))
        _waited(posted)


def all_reduce_scalars(values: list[float], group=None, op: str = "sum") -> list[float]:
    """Reduce a few Python floats (metrics, not training traffic: not recorded)."""
    # float64 keeps byte counts exact
    t = torch.tensor(values, dtype=torch.float64, device=scalar_device())
    if size(group) > 1:
        posted = _post("all_reduce", group, _nbytes(t))
        with untracked():
            dist.all_reduce(t, op=_reduce_op(op), group=_pg(group))
        _waited(posted)
        if op == "avg":
            t /= size(group)
    return t.cpu().tolist()


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: (n, *x.shape) (the collectives here are flat)."""
    out = x.new_empty(size(group) * x.numel())
    all_gather(out, x.contiguous().view(-1), group)
    return out.view(size(group), *x.shape)


def resolve_group(group):
    """torch's meaning of ``group`` in comm's convention (where None is a group of one): None
    is the whole world (one process without a process group: itself), ``SOLO`` one rank."""
    if group is SOLO:
        return None
    if group is None:
        return WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return group


def broadcast_from_first(tensors, group) -> None:
    """Overwrite each tensor, in place, with the first rank of ``group``'s (one broadcast each):
    what DDP, ZeRO and FSDP do when they are built, so that ranks may start from different
    weights."""
    if size(group) == 1:
        return
    src = global_ranks(group)[0]
    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous():
                broadcast(t.detach(), src, group)
            else:                                  # a contiguous copy, copied back
                c = t.detach().contiguous()
                broadcast(c, src, group)
                t.detach().copy_(c)
