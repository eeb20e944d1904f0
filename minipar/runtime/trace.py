"""A timeline of every rank's step, written as a Chrome / Perfetto trace (``--trace FILE``).

Where the time of a step goes, and what overlaps what, is the lesson of DP's buckets, ZeRO-3's
prefetch and the pipeline's schedule. This module records it from minipar's own bookkeeping
(no profiler, so it costs a few microseconds per event and runs the same on gloo and NCCL):

* compute spans the trainer marks: each step, its forward and backward, its optimizer step;
  and the forward and backward of every transformer block and micro-batch (module and tensor
  hooks), so the pipeline's micro-batches and ZeRO-3's gathers under backward show;
* every collective and point-to-point op that goes through ``minipar.comm`` (bookkeeping in
  ``comm.untracked()`` is left out): a blocking op is a span from its call to its return; an
  asynchronous op (``async_op=True``) is a span from its issue to the end of its ``wait()``,
  drawn on its own track, and the wait itself is a span on the compute track. An op issued
  during backward and waited for at the optimizer step is the overlap you are looking for.

The file is JSON in the Trace Event Format (``{"traceEvents": [...]}``, times in
microseconds): open it at https://ui.perfetto.dev (drag the file in) or in Chrome's
chrome://tracing. One process row per rank (pid = rank), a "compute" thread (tid 0) and a
"comm" thread (tid 1) each; asynchronous ops appear as async slices under the rank. Every
rank's clock starts at the same barrier, so ranks line up to within that barrier's skew
(on one machine the clocks are the same; across nodes, to a barrier's latency). Rank 0
gathers the events and writes the one file.

Every time is the host's (``time.perf_counter``). On gloo that is when the work happened: a
collective blocks the host until it is done. On NCCL/RCCL an op only enqueues work on the GPU
and returns, so its span is the host's launch (and, for a wait, the host's wait), not the GPU
time, and compute spans are launch times too. Such a trace says so: each rank's "comm" row is
named "comm (host launch times, not GPU time)", and the file's ``otherData.clock`` says which
clock it holds. For the GPU's own timeline use ``torch.profiler``; the metrics' ``comm_seconds``
are CUDA-event times on NCCL (``minipar.comm``).
"""
from __future__ import annotations

import contextlib
import json
import time

import torch

COMPUTE, COMM = 0, 1


HOST_CLOCK = "host: time.perf_counter, when the work ran (gloo blocks until an op is done)"
LAUNCH_CLOCK = ("host launch times: time.perf_counter when each op and kernel was issued to the "
                "GPU (NCCL/RCCL are asynchronous), not GPU time")


class Tracer:
    """One rank's events, in microseconds from ``t0`` (perf_counter seconds). ``launches``: the
    ops run asynchronously on a GPU (NCCL), so the times are the host's launches."""

    def __init__(self, rank: int, t0: float | None = None, launches: bool = False):
        self.rank = rank
        self.clock = LAUNCH_CLOCK if launches else HOST_CLOCK
        self.t0 = time.perf_counter() if t0 is None else t0
        self.events: list[dict] = []
        self._next_id = 0

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def complete(self, name: str, start: float, end: float, tid: int = COMPUTE,
                 cat: str = "compute", **args) -> None:
        """A span from ``start`` to ``end`` (perf_counter seconds) on one thread row."""
        self.events.append(dict(name=name, ph="X", pid=self.rank, tid=tid, cat=cat,
                                ts=self._us(start), dur=round((end - start) * 1e6, 3),
                                args=args))

    def comm(self, op: str, group: str, sent: int, issued: float, start: float,
             end: float) -> None:
        """A communication op: blocking (issued == start) or asynchronous."""
        label = f"{op} {group} {_size(sent)}"
        args = dict(op=op, group=group, bytes_sent=int(sent))
        if issued < start:   # async: in flight from issue to the end of its wait
            self._next_id += 1
            common = dict(name=label, cat="comm", id=self._next_id, pid=self.rank, tid=COMM)
            self.events.append(dict(common, ph="b", ts=self._us(issued), args=args))
            self.events.append(dict(common, ph="e", ts=self._us(end)))
            self.complete(f"wait {op}", start, end, tid=COMPUTE, cat="wait", **args)
        else:
            self.complete(label, start, end, tid=COMM, cat="comm", **args)

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute"):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, start, time.perf_counter(), cat=cat)

    def metadata(self) -> list[dict]:
        meta = [dict(name="process_name", ph="M", pid=self.rank, args=dict(name=f"rank {self.rank}")),
                dict(name="process_sort_index", ph="M", pid=self.rank, args=dict(sort_index=self.rank))]
        comm_row = "comm (host launch times, not GPU time)" if self.clock == LAUNCH_CLOCK else "comm"
        for tid, name in ((COMPUTE, "compute"), (COMM, comm_row)):
            meta.append(dict(name="thread_name", ph="M", pid=self.rank, tid=tid, args=dict(name=name)))
        return meta


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 1024 else f"{n} B"


# The tracer of this process while a traced run is on; None otherwise (then every hook is
# a single ``is None`` test).
active: Tracer | None = None


def start(rank: int = 0) -> Tracer:
    """Begin recording on this rank. In a process group, call it on every rank: the clocks
    start at a common barrier."""
    global active
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    active = Tracer(rank, launches=dist.is_initialized() and dist.get_backend() == "nccl")
    return active


def stop() -> Tracer | None:
    global active
    tracer, active = active, None
    return tracer


@contextlib.contextmanager
def span(name: str, cat: str = "compute"):
    """A compute span on this rank's timeline; nothing when no trace is being recorded."""
    if active is None:
        yield
        return
    with active.span(name, cat):
        yield


def instrument(module, kind) -> list:
    """Record the forward of every submodule of type ``kind`` (the trainer: the transformer
    ``Block``) of ``module``, one span per call.

    Returns the hook handles (``handle.remove()`` to take them off).
    """
    handles = []
    for name, sub in module.named_modules():
        if isinstance(sub, kind):
            handles += _time_forward(sub, f"forward {name}")
    return handles


def _time_forward(module, label: str) -> list:
    """Forward spans from module hooks; backward spans from tensor hooks: the block's backward
    starts when its output's gradient arrives and ends when its input's is computed."""
    starts = []

    def before(mod, args):
        if active is not None:
            starts.append(time.perf_counter())

    def after(mod, args, output):
        if active is None or not starts:
            return
        active.complete(label, starts.pop(), time.perf_counter(), cat="forward")
        x = args[0] if args and torch.is_tensor(args[0]) else None
        if (torch.is_tensor(output) and output.requires_grad and x is not None and x.requires_grad
                and torch._C._current_graph_task_id() == -1):     # not a recompute in backward
            began = []
            output.register_hook(lambda g: began.append(time.perf_counter()))
            x.register_hook(lambda g: active is not None and began and active.complete(
                label.replace("forward", "backward", 1), began.pop(), time.perf_counter(),
                cat="backward"))

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def traced_call(path: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on this rank with a trace recorded, written to ``path`` by rank 0
    (the benches' ``--trace``: ``minipar.bench.launch``)."""
    import torch.distributed as dist
    tracer = start(dist.get_rank() if dist.is_initialized() else 0)
    try:
        result = fn(*args, **kwargs)
    finally:
        stop()
    gather_and_write(path, tracer)      # torch's gather_object: not minipar.comm's bytes
    return result


def gather_and_write(path: str, tracer: Tracer) -> int:
    """Collect every rank's events on rank 0 and write ``path`` there; returns the number of
    events written (0 on the other ranks)."""
    import torch.distributed as dist
    events = tracer.metadata() + tracer.events
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(events, everyone, dst=0)
        if dist.get_rank() != 0:
            return 0
        events = [e for part in everyone for e in part]
    write(path, events, tracer.clock)
    return len(events)


def write(path: str, events: list[dict], clock: str = HOST_CLOCK) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"clock": clock}}, f)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def in_flight(events: list[dict], rank: int, op: str | None = None) -> list[tuple[float, float]]:
    """(start, end) in ms of every asynchronous op of ``rank`` (of kind ``op`` if given),
    from its issue to the end of its wait."""
    opened, out = {}, []
    for e in events:
        if e.get("pid") != rank or e["ph"] not in ("b", "e"):
            continue
        if e["ph"] == "b" and (op is None or e["args"]["op"] == op):
            opened[e["id"]] = e["ts"]
        elif e["ph"] == "e" and e["id"] in opened:
            out.append((opened.pop(e["id"]) / 1e3, e["ts"] / 1e3))
    return sorted(out)


def spans(events: list[dict], rank: int, name: str) -> list[tuple[float, float]]:
    """(start, end) in ms of ``rank``'s compute spans called ``name``."""
    return sorted((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events
                  if e.get("pid") == rank and e["ph"] == "X" and e["name"] == name)


def overlap_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Milliseconds during which some interval of ``a`` and some interval of ``b`` both run."""
    def union(iv):
        merged = []
        for s, e in sorted(iv):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return merged
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in union(a) for s2, e2 in union(b))


def plot(events: list[dict], ax=None, title: str | None = None, ranks=None):
    """Draw a trace with matplotlib (the notebooks' view of what Perfetto shows): one row
    of compute spans and one of communication spans per rank, time in milliseconds."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3))
    ranks = sorted({e["pid"] for e in events if "pid" in e}) if ranks is None else list(ranks)
    colors = {"compute": "#c7c7c7", "forward": "#4c72b0", "backward": "#55a868", "wait": "#c44e52",
              "comm": "#dd8452"}
    opened = {}
    rows = {}
    for i, r in enumerate(ranks):
        rows[(r, "compute")] = 2 * i
        rows[(r, "comm")] = 2 * i + 1
    for e in sorted(events, key=lambda e: e.get("ts", 0)):
        if e.get("pid") not in ranks or e["ph"] == "M":
            continue
        if e["ph"] == "X" and e["cat"] == "step":
            row = rows[(e["pid"], "compute")]
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (row - 0.45, 0.9), facecolor="none",
                           edgecolor="k", linewidth=0.6)
        elif e["ph"] == "X":
            row = rows[(e["pid"], "comm" if e["cat"] == "comm" else "compute")]
            height = 0.8 if e["cat"] in ("compute",) else 0.5
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (row - height / 2, height),
                           color=colors.get(e["cat"], "#8172b2"), alpha=0.9 if height < 0.8 else 0.5)
        elif e["ph"] == "b":
            opened[(e["pid"], e["id"])] = e
        elif e["ph"] == "e" and (e["pid"], e["id"]) in opened:
            b = opened.pop((e["pid"], e["id"]))
            row = rows[(e["pid"], "comm")]
            ax.broken_barh([(b["ts"] / 1e3, (e["ts"] - b["ts"]) / 1e3)], (row - 0.2, 0.4),
                           color=colors["comm"], alpha=0.45, edgecolor="k", linewidth=0.3)
    ax.set_yticks(range(2 * len(ranks)),
                  [f"rank {r} {kind}" for r in ranks for kind in ("compute", "comm")])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colors["forward"], label="block forward"),
                       Patch(color=colors["backward"], label="block backward"),
                       Patch(color=colors["compute"], alpha=0.5, label="step phase"),
                       Patch(color=colors["wait"], label="waiting for an async op"),
                       Patch(color=colors["comm"], label="collective / in flight")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
