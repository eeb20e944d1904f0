"""Point to point: a ring all-reduce from send/recv, and the order of sends and receives NCCL can run.

``ring_all_reduce`` is what an all-reduce does inside, written with ``comm.isend`` and
``comm.recv`` (exercise ex01, notebook 00). Whether such an order runs on NCCL is the rest of
this module: record it on gloo, replay it under NCCL's rule.

On gloo a rank that waits in a send (a blocking ``send``, or ``isend(...).wait()``) before
posting its receive hangs once every rank does it; gloo finishes either order only when each
rank posts both ops before it waits on either. NCCL (and RCCL on ROCm) promise much less:

* **rendezvous**: a send may complete only together with the peer's matching receive
  (NVIDIA/nccl#783: "send(x1) is allowed to block until the corresponding recv() is
  called"). Small messages often slip through a buffer; large ones do not, so a program must
  be correct without the buffer;
* **one queue per communicator**: a rank's operations on one communicator run one after
  the other, in the order it posted them, on one stream. An ``isend`` does not block the
  host, but it blocks every later operation of the same communicator (NVIDIA/nccl#479: two
  ranks that each post a send before their receive hang);
* which communicator an operation uses depends on how torch created them. With *eager init*
  (``init_process_group(device_id=...)``, as ``minipar.runtime.dist`` does) a process group has one
  communicator, and its unbatched sends and receives share it with its collectives. With
  *lazy init* every pair of ranks gets its own two-rank communicator at its first
  point-to-point message (a blocking handshake of both ranks), and a batch
  (``batch_isend_irecv``) runs on the group's communicator. A batch starts as one unit.

This module makes that checkable without a GPU. ``record()`` collects, on each rank, the
operations the rank issues through ``minipar.comm`` (the point-to-point ones and every
collective, in posting order, with the points where the rank waits for them); ``replay``
runs the ranks' recordings together under the rules above and returns what would hang::

    with p2p_order.record() as log:        # on every rank of a gloo run
        ...                                 # ring attention, a training step, ...
    problems = p2p_order.replay([log.events for each rank], mode="eager")   # [] if it runs

A host that waits for an op (a blocking call, ``Handle.wait()``) stops there until it
completes; on a GPU the stream waits instead, which delays every later op just the same.
The pipeline's schedule checker (``minipar.schedules.validate_schedule``) replays its instruction
lists with the same function. Ops that bypass ``minipar.comm`` (torch's DDP, the DTensor
all-reduce in ``clip_grad_norm_`` under ``fully_shard``, checkpoint and trace bookkeeping)
cannot be replayed: ``record()`` counts them per process group and ``replay`` names them in a
``"not replayed: ..."`` line. Left out of the model: kernels of different communicators
competing for the GPU (NCCL's advice: one order of communicators on every rank).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed

from . import comm

MODES = ("eager", "lazy")


# --------------------------------------------------------------------------------------
# A ring all-reduce from send/recv (what all_reduce does inside, for teaching)
# --------------------------------------------------------------------------------------
def ring_all_reduce(t: torch.Tensor, group=comm.WORLD) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place with 2(n-1) neighbour exchanges of N/n bytes each.

    The tensor is cut into n chunks. Reduce-scatter: at step k, rank r sends chunk (r-k) to
    its right neighbour and adds the chunk (r-k-1) arriving from its left; after n-1 steps rank r
    holds the full sum of chunk (r+1). All-gather: n-1 more steps pass the finished chunks
    around the ring. Each rank sends 2(n-1)/n N bytes whatever n is: that is why the ring is
    bandwidth-optimal. ``t.numel()`` must divide by n.

    The order of each exchange matters. NCCL completes a send only together with the matching
    receive, and runs a rank's sends and receives in the order it posted them. If every rank
    sent first, every rank would wait in its send for a neighbour that also waits in its send:
    a cycle, and a hang (on gloo too if each send is waited for before the receive is posted; the
    isend posted here first passes on gloo, not on NCCL). So even ranks send
    first and odd ranks receive first: every send meets a posted receive, and with n odd the
    two even neighbours (n-1 and 0) are served once the others have moved on
    (``replay`` below checks this order under NCCL's rule). The chunk in flight is never
    the one being written, and each send is waited for before the next step: no copy needed.
    """
    n, r = comm.size(group), comm.rank(group)
    if n == 1:
        return t
    if t.numel() % n:
        raise ValueError(f"ring_all_reduce cuts the tensor into {n} equal chunks, but it has "
                         f"{t.numel()} elements; pad it to a multiple of {n}")
    peers = comm.global_ranks(group)
    right, left = peers[(r + 1) % n], peers[(r - 1) % n]
    chunks = t.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    # EXERCISE ex01 begin
    # reduce-scatter phase (n-1 steps), then all-gather phase (n-1 steps); in every step
    # even ranks send first and odd ranks receive first (NCCL pairs each send with its
    # receive in the order posted: if all sent first, all would wait)
    def exchange(outgoing):
        if r % 2 == 0:
            handle = comm.isend(outgoing, right)
            comm.recv(incoming, left)
        else:
            comm.recv(incoming, left)
            handle = comm.isend(outgoing, right)
        handle.wait()

    for k in range(n - 1):
        exchange(chunks[(r - k) % n])
        chunks[(r - k - 1) % n] += incoming
    for k in range(n - 1):
        exchange(chunks[(r + 1 - k) % n])
        chunks[(r - k) % n].copy_(incoming)
    # EXERCISE ex01 end
    return t



@dataclass(frozen=True)
class Op:
    """One operation as a rank posted it.

    ``kind`` is ``"send"``, ``"recv"`` or ``"collective"``; ``name`` labels it in reports
    (e.g. ``"send cp ->1"``, ``"all_reduce dp"``);
    ``comm`` names the process group it was issued on (``"world"`` for torch's default
    group); ``peer`` is the other rank (point-to-point), ``members`` the group's ranks
    (collective; None: every rank); ``batch`` groups the ops of one ``batch_isend_irecv``;
    ``tag``, when given on both ends, must be equal for a send and a receive to match (the
    pipeline checker's message identity; NCCL itself matches on peer and order alone).
    """
    kind: str
    name: str
    comm: str = "world"
    peer: int = -1
    members: tuple[int, ...] | None = None
    nbytes: int = 0
    batch: int | None = None
    tag: object = None

    def __str__(self):
        return self.name + (f" ({self.nbytes:,} B)" if self.nbytes else "")


class Recorder:
    """One rank's recording: ``events`` is a list of ``("post", id, Op)`` and ``("wait", id)``."""

    def __init__(self):
        self.events: list[tuple] = []
        self._posted = 0
        self._batch = None
        self._batches = 0

    def post(self, kind, name, comm="world", peer=None, members=None, nbytes=0,
             tag=None) -> int:
        """Note an op being issued; returns its id (for ``wait``)."""
        self._posted += 1
        self.events.append(("post", self._posted,
                            Op(kind, name, comm, -1 if peer is None else peer,
                               None if members is None else tuple(members), int(nbytes),
                               self._batch, tag)))
        return self._posted

    def wait(self, op_id: int) -> None:
        self.events.append(("wait", op_id))

    @contextlib.contextmanager
    def batch(self):
        """Ops posted inside are one batch (``batch_isend_irecv``): they start together."""
        self._batches += 1
        self._batch = self._batches
        try:
            yield
        finally:
            self._batch = None


@contextlib.contextmanager
def record():
    """Record this rank's operations through ``minipar.comm`` while the block runs.

    Ops that bypass ``minipar.comm`` cannot be replayed, so they are counted instead: torch
    numbers every op a process group issues (``_get_sequence_number_for_group``: collectives
    and point-to-point, from Python, DDP's C++ reducer or DTensor's functional collectives),
    and each group's count beyond the ops recorded on it ends the recording as an
    ``("unseen", communicator, count, names)`` event. ``names`` counts the calls of
    torch.distributed's Python functions (and its functional collectives) made outside
    ``minipar.comm`` meanwhile; C++ callers (DDP) have none. ``replay`` reports them."""
    recorder = Recorder()
    before = _issued()
    with comm.recording(recorder), _outside_calls() as names:
        yield recorder
    posted = defaultdict(int)
    for event in recorder.events:
        if event[0] == "post":
            posted[event[2].comm] += 1
    for name, count in _issued().items():
        unseen = count - before.get(name, 0) - posted[name]
        if unseen > 0:
            recorder.events.append(("unseen", name, unseen, dict(names)))


def _issued() -> dict[str, int]:
    """Ops issued so far by each process group this rank belongs to, by communicator name."""
    if not torch.distributed.is_initialized():
        return {}
    c10d = torch.distributed.distributed_c10d
    groups = list(getattr(c10d._world, "pg_map", {})) or [c10d._get_default_group()]
    return {comm.communicator(pg): pg._get_sequence_number_for_group() for pg in groups}


# torch's Python entry points to its collectives, named in the report of unseen ops
_ENTRY_POINTS = {
    "torch.distributed": (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
        "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
        "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
        "send", "recv", "isend", "irecv", "batch_isend_irecv"),
    "torch.distributed._functional_collectives": (
        "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
        "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced"),
}


@contextlib.contextmanager
def _outside_calls():
    """Count, by name, the outermost calls of ``_ENTRY_POINTS`` not made by ``minipar.comm``."""
    import importlib
    import sys
    counts: dict[str, int] = defaultdict(int)
    depth = [0]

    def wrap(module, name, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0 and sys._getframe(1).f_globals.get("__name__") != comm.__name__:
                counts[f"{module}.{name}"] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    saved = []
    for module_name, names in _ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrap(module_name, name, getattr(module, name)))
    try:
        yield counts
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def blocking(op: Op, op_id: int) -> list[tuple]:
    """The events of a blocking call of ``op``: post it, wait for it."""
    return [("post", op_id, op), ("wait", op_id)]


# --------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------
def _queue(r: int, op: Op, mode: str):
    """The communicator an op runs on, as the replay's queue key (the same on every member)."""
    if op.kind == "collective" or mode == "eager" or op.batch is not None:
        return (op.comm,)
    return (op.comm, min(r, op.peer), max(r, op.peer))       # lazy: a two-rank communicator


def _members(key, op: Op, n: int) -> tuple[int, ...]:
    if len(key) == 3:
        return key[1:]
    return op.members if op.members is not None else tuple(range(n))


def replay(traces: list[list[tuple]], mode: str = "eager", who: str = "rank") -> list[str]:
    """Run every rank's recorded events together under NCCL's rule; ``[]`` when all finish.

    ``traces[r]`` is rank r's ``Recorder.events``. ``mode``: ``"eager"`` (one queue per rank
    and process group) or ``"lazy"`` (unbatched point-to-point ops on a two-rank communicator
    per pair, made by a blocking handshake at the pair's first message). Otherwise one line,
    ``"deadlock: ..."``, naming where each stuck rank (``who``) waits, and, for a rank that
    ended with operations still queued, which ones never completed; and one line
    ``"not replayed: ..."`` when a recording counted ops that bypassed ``minipar.comm``
    (``record``), by rank, group, count and the names it saw: the replay cannot vouch for them.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = len(traces)
    pc = [0] * n
    queues: dict[tuple, deque] = defaultdict(deque)   # (rank, key) -> entries [[id, op, matched]]
    done: set[tuple[int, int]] = set()
    posted: dict[tuple[int, int], tuple] = {}          # (rank, id) -> (key, op)
    made: set = set()                                  # lazy: communicators created
    joining: dict[int, tuple] = {}                     # lazy: rank -> key of its handshake
    problems: list[str] = []
    unseen: list[tuple] = []                           # (rank, communicator, count, names)

    def advance(r) -> bool:
        moved = False
        while pc[r] < len(traces[r]):
            event = traces[r][pc[r]]
            if event[0] == "post":
                _, op_id, op = event
                key = _queue(r, op, mode)
                if mode == "lazy" and key not in made:
                    joining[r] = (key, _members(key, op, n))
                    return moved
                q = queues[(r, key)]
                if op.batch is not None and q and q[-1][0][1].batch == op.batch:
                    q[-1].append([op_id, op, False])           # the same batch: one entry
                else:
                    q.append([[op_id, op, False]])
                posted[(r, op_id)] = (key, op)
            elif event[0] == "unseen":
                unseen.append((r, *event[1:]))
            elif (r, event[1]) not in done:
                return moved
            pc[r] += 1
            moved = True
        return moved

    def handshakes() -> bool:
        moved = False
        for key, members in {v for v in joining.values()}:
            if all(joining.get(m, (None,))[0] == key for m in members):
                made.add(key)
                for m in members:
                    del joining[m]
                moved = True
        return moved

    def head(r, key):
        q = queues.get((r, key))
        return q[0] if q else None

    def match() -> bool:
        moved = False
        for (r, key), q in list(queues.items()):
            if not q:
                continue
            for item in q[0]:
                op_id, op, matched = item
                if matched:
                    continue
                if op.kind == "collective":
                    group = _members(key, op, n)
                    found = []
                    for m in group:
                        entry = head(m, key) or []
                        hit = next((x for x in entry if not x[2] and x[1].kind == "collective"),
                                   None)
                        if hit is None or hit[1].name != op.name:
                            break
                        found.append(hit)
                    else:
                        for x in found:
                            x[2] = True
                        moved = True
                    continue
                want = "recv" if op.kind == "send" else "send"
                entry = head(op.peer, key) if op.peer != r else None
                hit = next((x for x in entry or [] if not x[2] and x[1].kind == want
                            and x[1].peer == r and (op.tag is None or x[1].tag is None
                                                    or x[1].tag == op.tag)), None)
                if hit is None:
                    continue
                if hit[1].nbytes != op.nbytes:
                    problems.append(f"size mismatch: {who} {r} {op} meets {who} {op.peer} "
                                    f"{hit[1]}")
                item[2] = hit[2] = True
                moved = True
        for (r, key), q in queues.items():
            while q and all(x[2] for x in q[0]):
                for x in q.popleft():
                    done.add((r, x[0]))
                moved = True
        return moved

    progress = True
    while progress:
        progress = False
        for r in range(n):
            progress |= advance(r)
        if mode == "lazy":
            progress |= handshakes()
        progress |= match()

    stuck = []
    for r in range(n):
        if pc[r] < len(traces[r]):
            event = traces[r][pc[r]]
            if event[0] == "post":      # lazy: waiting for the peer to make the communicator
                key, members = joining[r]
                named = key[0] if key[0].endswith("]") else f"{key[0]} {list(members)}"
                which = (f"the pair communicator of {key[1]} and {key[2]}" if len(key) == 3
                         else f"the communicator of {named}")
                stuck.append(f"{who} {r} waits to create {which} for {event[2]}")
                continue
            key, op = posted[(r, event[1])]
            first = queues[(r, key)][0][0][1]
            behind = "" if first is op else f", queued behind {first}"
            stuck.append(f"{who} {r} waits in {op}{behind}")
        else:
            left = [x[1] for (q_r, _), q in queues.items() if q_r == r for e in q for x in e]
            if left:
                stuck.append(f"{who} {r} ends with {', '.join(map(str, left))} never completed")
    if stuck:
        problems.append("deadlock: " + "; ".join(stuck))
    if unseen:
        problems.append("not replayed: " + "; ".join(
            f"{who} {r}: {count} op{'s' * (count > 1)} on {name} outside minipar.comm"
            + (f" ({', '.join(f'{k} x{v}' for k, v in sorted(names.items()))})" if names else "")
            for r, name, count, names in unseen))
    return problems


def check(traces: list[list[tuple]]) -> dict[str, list[str]]:
    """``replay`` under both ways torch makes NCCL communicators: {mode: problems}."""
    return {mode: replay(traces, mode) for mode in MODES}
