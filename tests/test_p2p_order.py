"""Point-to-point order under NCCL's rule (``minipar.p2p_order``), without a GPU.

The replay itself on small hand-made orders (rings, batches, mismatched collectives), then the
orders every p2p exchange of the package really posts on gloo ranks, replayed under both ways
torch makes NCCL communicators: the ring all-reduce on 2 to 4 ranks, ring attention with cp 2,
3 and 4, and whole training steps with cp, cp x pp, pp (2, 3 and 4 stages) with each schedule
and MoE with EP. The recording keys world p2p and world collectives by one communicator and
names the ops that bypass ``minipar.comm``. The
old ring orders (every rank receives first; every rank sends first) pass on gloo and must fail
the replay: that keeps the checker honest.
"""
import pytest
import torch

from minipar import comm, cp, model, p2p_order, schedules, train
from minipar.runtime import dist
from minipar.p2p_order import Op, Recorder, replay

from conftest import NANO


# --------------------------------------------------------------------------------------
# The replay on hand-made orders
# --------------------------------------------------------------------------------------
def _ring(n, order, batched=False):
    """Every rank of a ring sends 8 bytes right and receives from the left, in ``order``."""
    traces = []
    for r in range(n):
        rec = Recorder()
        right, left = (r + 1) % n, (r - 1) % n

        def send():
            return rec.post("send", f"send ->{right}", peer=right, nbytes=8)

        def recv():
            return rec.post("recv", f"recv <-{left}", peer=left, nbytes=8)

        first_send = {"send first": True, "receive first": False, "even/odd": r % 2 == 0}[order]
        if batched:
            with rec.batch():
                ids = [send(), recv()] if first_send else [recv(), send()]
        else:
            ids = [send(), recv()] if first_send else [recv(), send()]
        for i in ids:
            rec.wait(i)
        traces.append(rec.events)
    return traces


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("mode", p2p_order.MODES)
def test_the_old_ring_orders_hang_and_even_odd_runs(n, mode):
    for order in ("send first", "receive first"):
        problems = replay(_ring(n, order), mode)
        assert len(problems) == 1 and problems[0].startswith("deadlock"), (order, problems)
        for r in range(n):
            assert f"rank {r} waits" in problems[0]
    assert replay(_ring(n, "even/odd"), mode) == []


def test_a_batch_starts_together():
    """batch_isend_irecv: the ops of one batch have no order among themselves. Under lazy init
    a batch runs on the group's communicator, which every rank must join at its first batch."""
    for order in ("send first", "receive first"):
        assert p2p_order.check(_ring(4, order, batched=True)) == {"eager": [], "lazy": []}
    mixed = _ring(2, "receive first", batched=True)[:1] + _ring(2, "receive first")[1:]
    assert replay(mixed, "eager") == []          # one communicator: the batch meets the ops
    assert "deadlock" in replay(mixed, "lazy")[0]   # two communicators: they never meet


def _trace(*ops):
    """Blocking ops, each (kind, name, peer or members, comm)."""
    rec = Recorder()
    for kind, name, who, comm_name in ops:
        if kind == "collective":
            op_id = rec.post(kind, name, comm_name, members=who)
        else:
            op_id = rec.post(kind, name, comm_name, peer=who, nbytes=4)
        rec.wait(op_id)
    return rec.events


def test_collectives_on_two_communicators_in_opposite_orders_hang():
    a = ("collective", "all_reduce a", (0, 1), "a")
    b = ("collective", "all_reduce b", (0, 1), "b")
    assert p2p_order.check([_trace(a, b), _trace(a, b)]) == {"eager": [], "lazy": []}
    problems = replay([_trace(a, b), _trace(b, a)])
    assert problems == ["deadlock: rank 0 waits in all_reduce a; rank 1 waits in all_reduce b"]


def test_eager_init_queues_p2p_behind_the_world_collectives():
    """Eager init: unbatched p2p shares the process group's communicator with its collectives,
    so an isend in flight holds up a barrier; lazy init gives the pair a communicator of its
    own (made at the pair's first message, a handshake both ranks wait in)."""
    rec0, rec1 = Recorder(), Recorder()
    rec0.wait(rec0.post("send", "send ->1", peer=1, nbytes=4))       # makes the pair's
    in_flight = rec0.post("send", "send ->1", peer=1, nbytes=4)
    rec0.wait(rec0.post("collective", "barrier world"))
    rec0.wait(in_flight)
    rec1.wait(rec1.post("recv", "recv <-0", peer=0, nbytes=4))
    rec1.wait(rec1.post("collective", "barrier world"))
    rec1.wait(rec1.post("recv", "recv <-0", peer=0, nbytes=4))
    assert replay([rec0.events, rec1.events], "eager") == [
        "deadlock: rank 0 waits in barrier world, queued behind send ->1 (4 B); "
        "rank 1 waits in barrier world"]
    assert replay([rec0.events, rec1.events], "lazy") == []
    # lazy: a rank blocked in making a pair's communicator cannot join the group's
    t0 = _trace(("send", "send ->1", 1, "world"), ("collective", "barrier world", None, "world"))
    t1 = _trace(("collective", "barrier world", None, "world"), ("recv", "recv <-0", 0, "world"))
    assert replay([t0, t1], "lazy") == [
        "deadlock: rank 0 waits to create the pair communicator of 0 and 1 for send ->1 (4 B); "
        "rank 1 waits to create the communicator of world [0, 1] for barrier world"]


def test_an_async_send_blocks_its_queue_not_its_host():
    """isend posted, then a blocking recv from the same peer: fine if the peer receives first."""
    rec0, rec1 = Recorder(), Recorder()
    s = rec0.post("send", "send ->1", peer=1, nbytes=4)
    rec0.wait(rec0.post("recv", "recv <-1", peer=1, nbytes=4))
    rec0.wait(s)
    rec1.wait(rec1.post("recv", "recv <-0", peer=0, nbytes=4))
    rec1.wait(rec1.post("send", "send ->0", peer=0, nbytes=4))
    assert p2p_order.check([rec0.events, rec1.events]) == {"eager": [], "lazy": []}
    # an isend nobody receives: the rank ends with it still queued
    rec1 = Recorder()
    problems = replay([[("post", 1, Op("send", "send ->1", peer=1, nbytes=4))], rec1.events])
    assert problems == ["deadlock: rank 0 ends with send ->1 (4 B) never completed"]


def test_sizes_must_match():
    t0 = _trace(("send", "send ->1", 1, "world"))
    rec = Recorder()
    rec.wait(rec.post("recv", "recv <-0", peer=0, nbytes=8))
    assert any("size mismatch" in p for p in replay([t0, rec.events]))


def test_the_pipeline_checker_replays_through_it():
    lists = schedules.schedule_lists("1f1b", 2, 4)
    assert schedules._deadlocks(lists) == []
    swapped = [lists[0], [i for i in lists[1] if i.op != "send_grad"] +
               [i for i in lists[1] if i.op == "send_grad"]]
    assert schedules._deadlocks(swapped)[0].startswith("deadlock: stage 0 waits in recv_grad(0)<-1")


# --------------------------------------------------------------------------------------
# What the package really posts, recorded on gloo ranks
# --------------------------------------------------------------------------------------
def _old_order_shift(self, send, into):
    """Ring.shift before the fix: every rank posts its receive first."""
    return [comm.irecv(into, self.left, label="cp"), comm.isend(send, self.right, label="cp")]


def _old_ring_all_reduce(t, group):
    """p2p_order.ring_all_reduce before the fix: every rank sends first (isend, then a blocking recv)."""
    n, r = comm.size(group), comm.rank(group)
    peers = comm.global_ranks(group)
    right, left = peers[(r + 1) % n], peers[(r - 1) % n]
    chunks, incoming = t.view(n, -1), torch.empty(t.numel() // n, dtype=t.dtype)
    for k in range(n - 1):
        handle = comm.isend(chunks[(r - k) % n], right)
        comm.recv(incoming, left)
        chunks[(r - k - 1) % n] += incoming
        handle.wait()
    for k in range(n - 1):
        handle = comm.isend(chunks[(r + 1 - k) % n], right)
        comm.recv(incoming, left)
        chunks[(r - k) % n].copy_(incoming)
        handle.wait()
    return t


def _ring_all_reduce_orders():
    r, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name, fn in (("now", p2p_order.ring_all_reduce), ("old", _old_ring_all_reduce)):
        t = torch.arange(4.0 * n) * (r + 1)
        with p2p_order.record() as log:
            fn(t, comm.WORLD)
        assert torch.equal(t, torch.arange(4.0 * n) * n * (n + 1) / 2)   # right on gloo either way
        out[name] = log.events
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_order_runs_on_nccl_and_the_old_one_would_hang(n):
    results = dist.launch(_ring_all_reduce_orders, n, timeout=120)
    assert p2p_order.check([res["now"] for res in results]) == {"eager": [], "lazy": []}
    for mode, problems in p2p_order.check([res["old"] for res in results]).items():
        assert problems and problems[0].startswith("deadlock"), mode
        assert "send p2p ->1" in problems[0], problems


def _ring_attention_orders():
    """cp = 2 (rings {0,1}, {2,3}), cp = 3 (an odd ring, {0,1,2}: rank 3 sits out) and cp = 4
    on 4 ranks, forward and backward, now and old."""
    me = torch.distributed.get_rank()
    three = dist.new_group([0, 1, 2])
    groups = {2: [dist.new_group(r) for r in ([0, 1], [2, 3])][me // 2],
              3: three if me < 3 else None, 4: dist.new_group([0, 1, 2, 3])}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=g) for _ in range(3))
    out = {}
    for order in ("now", "old"):
        if order == "old":
            cp.Ring.shift = _old_order_shift
        for n, group in groups.items():
            if group is None:
                out[(order, n)] = []
                continue
            ring = cp.Ring.of(group)
            mine = [cp.shard_sequence(x, n, ring.index, dim=2).requires_grad_() for x in (q, k, v)]
            with p2p_order.record() as log:
                cp.ring_attention(*mine, ring).sum().backward()
            out[(order, n)] = log.events
    return out


def test_ring_attention_order_runs_on_nccl_and_the_old_one_would_hang():
    results = dist.launch(_ring_attention_orders, 4, timeout=120)
    for n in (2, 3, 4):
        assert p2p_order.check([res[("now", n)] for res in results]) == {"eager": [], "lazy": []}
        for mode, problems in p2p_order.check([res[("old", n)] for res in results]).items():
            assert problems and "recv cp <-" in problems[0], (n, mode, problems)


def _p2p_ahead_of_a_world_collective():
    """Rank 0: isend ->1, all_reduce(WORLD), wait; rank 1: all_reduce(WORLD), recv <-0, after
    one exchange of each (both communicators made under lazy init). gloo runs it."""
    me = torch.distributed.get_rank()
    t, x = torch.ones(4), torch.ones(2)
    with p2p_order.record() as log:
        comm.all_reduce(x, comm.WORLD)
        (comm.send if me == 0 else comm.recv)(t, 1 - me)
        if me == 0:
            handle = comm.isend(t, 1)
            comm.all_reduce(x, comm.WORLD)
            handle.wait()
        else:
            comm.all_reduce(x, comm.WORLD)
            comm.recv(t, 0)
    assert torch.equal(x, torch.full((2,), 4.0))
    return log.events


def test_world_p2p_queues_with_the_world_collectives_in_the_recording():
    """The recorder files world p2p and world collectives under one communicator: eager init
    runs them in one queue, where rank 0's all_reduce waits behind its isend, and rank 1's
    receive behind its all_reduce. Lazy init gives the pair its own communicator: it runs."""
    traces = dist.launch(_p2p_ahead_of_a_world_collective, 2, timeout=60)
    assert p2p_order.check(traces) == {"eager": [
        "deadlock: rank 0 waits in all_reduce world, queued behind send p2p ->1 (16 B); "
        "rank 1 waits in all_reduce world"], "lazy": []}


def _ops_beside_comm():
    """One collective through comm, three beside it: torch.distributed's, a functional
    collective (what DTensor runs) and DDP's bucket all-reduce (from C++)."""
    import torch.distributed._functional_collectives as funcol
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # its broadcasts
    x = torch.ones(4)
    with p2p_order.record() as log:
        comm.all_reduce(x, comm.WORLD)
        torch.distributed.all_reduce(x)
        funcol.wait_tensor(funcol.all_reduce(x, "sum", torch.distributed.group.WORLD))
        ddp(torch.ones(2, 4)).sum().backward()
    return log.events


def test_the_replay_names_the_ops_it_did_not_see():
    traces = dist.launch(_ops_beside_comm, 2, timeout=60)
    named = ("torch.distributed._functional_collectives.all_reduce x1, "
             "torch.distributed.all_reduce x1")
    assert p2p_order.check(traces) == {mode: [
        f"not replayed: rank 0: 3 ops on world[0, 1] outside minipar.comm ({named}); "
        f"rank 1: 3 ops on world[0, 1] outside minipar.comm ({named})"] for mode in p2p_order.MODES}


SHORT = NANO[:NANO.index("--steps")] + ["--steps", "2"]

# (flags) on 4 ranks; every p2p exchange of the trainer and the collectives around it
TRAINING = [
    ["--cp", "4"],
    ["--cp", "2"],                                            # two rings, dp 2
    ["--cp", "2", "--pp", "2"],
    ["--cp", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "4"],
    ["--pp", "2", "--schedule", "gpipe", "--eval-every", "2"],
    ["--pp", "2", "--schedule", "1f1b"],
    ["--pp", "2", "--schedule", "interleaved", "--microbatches", "4", "--eval-every", "2"],
    ["--pp", "4", "--model", "nano8", "--schedule", "interleaved", "--microbatches", "4"],
    ["--pp", "4"],
    ["--moe-experts", "4", "--ep", "2"],
    ["--moe-experts", "4", "--ep", "2", "--pp", "2"],
]


def _training_orders(cases):
    out = []
    for flags in cases:
        cfg = train.parse_config(SHORT + flags + ["--nproc", str(torch.distributed.get_world_size())])
        with p2p_order.record() as log:
            train.worker(cfg)
        out.append(log.events)
    return out


# on 3 ranks: an odd pipeline, of nano with 6 layers (a preset made for the test, in the ranks)
TRAINING_3 = [
    ["--pp", "3", "--model", "nano6", "--microbatches", "4"],
    ["--pp", "3", "--model", "nano6", "--schedule", "gpipe", "--microbatches", "4",
     "--eval-every", "2"],
    ["--pp", "3", "--model", "nano6", "--schedule", "interleaved", "--microbatches", "3",
     "--batch-size", "6"],
]


def _odd_pipeline_orders(cases):
    model.PRESETS["nano6"] = model.config("nano", n_layer=6)
    return _training_orders(cases)


@pytest.mark.parametrize("nproc,cases,fn", [(4, TRAINING, _training_orders),
                                            (3, TRAINING_3, _odd_pipeline_orders)],
                         ids=["4 ranks", "pp 3"])
def test_every_training_exchange_runs_under_nccls_rule(nproc, cases, fn):
    results = dist.launch(fn, nproc, cases, timeout=240)   # 6 s at load 1
    for i, flags in enumerate(cases):
        traces = [res[i] for res in results]
        kinds = {e[2].kind for t in traces for e in t if e[0] == "post"}
        assert "collective" in kinds, flags               # the DP/TP/EP collectives are there
        if "--cp" in flags or "--pp" in flags:
            assert {"send", "recv"} <= kinds, flags
        assert p2p_order.check(traces) == {"eager": [], "lazy": []}, flags
