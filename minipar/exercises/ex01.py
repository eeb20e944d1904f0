"""ex01: a ring all-reduce from point-to-point send and receive."""
import torch

TITLE = "Ring all-reduce from send and recv"
SUMMARY = "a ring all-reduce from isend/recv"
DIFFICULTY = "medium"
MINUTES = 40
NOTEBOOK = "00, section 2 (The ring all-reduce)"
MODULE = "minipar.p2p_order"
NAMES = ["ring_all_reduce"]
API = ["minipar.comm.isend", "minipar.comm.recv", "minipar.comm.size", "minipar.comm.rank"]
INTRO = """
All-reduce sums a tensor over every rank. The bandwidth-optimal way does it on a ring:
cut the tensor into n chunks; in n-1 reduce-scatter steps each rank passes a chunk to its
right neighbour and adds the one arriving from its left, so that each rank ends up owning one
fully summed chunk; in n-1 all-gather steps the finished chunks travel once more around the
ring. Use `comm.isend(tensor, dst)` (returns a handle: call `.wait()`), `comm.recv(tensor, src)` and the
`chunks`, `incoming`, `left`, `right`, `r`, `n` already prepared for you.

Which chunk, at step k (0-based), on rank r (notebook 00, section 2, derives it by hand):

    reduce-scatter  send chunk (r - k) mod n,     add the incoming one into chunk (r - k - 1) mod n
    all-gather      send chunk (r + 1 - k) mod n, copy the incoming one into chunk (r - k) mod n

`chunks` is `t.view(n, -1)`: row c is a view of t, so `chunks[c] += incoming` and
`chunks[c].copy_(incoming)` write into t itself. `c = chunks[i]; c = c + incoming` does not:
it only gives the name `c` a new tensor (a rebound name, not an in-place write).

The order of each step's send and receive matters. A send waited for before the receive is
posted (`comm.isend(...).wait()`, then `comm.recv`) returns only once the neighbour receives,
on gloo as on NCCL: if every rank does that, every rank waits in its send for a neighbour that
is also sending, and nothing moves (the checker stops it and says so). gloo finishes either
order only when each rank posts both ops before it waits on either (isend, recv, then the
send's wait). GPUs (NCCL, RCCL) ask more: a send completes only together with the matching receive,
and a rank's sends and receives run in the order it posted them, so even that order hangs if
every rank sends first. The checker replays the order your ranks used under NCCL's rule
(`minipar.p2p_order`) and fails it if it could hang: let even ranks send first and odd ranks
receive first.
"""

HARD_INTRO = """
The harder track of ex01: the same checker, without the index table. Write
`ring_all_reduce(t, group)`: sum `t` over the n ranks of `group` in place, with point-to-point
messages to your ring neighbours only (`comm.isend` to `right`, `comm.recv` from `left`), in
2(n-1) steps of one chunk of N/n elements each: n-1 steps after which every rank holds one
chunk summed over every rank, then n-1 steps that pass the finished chunks around until every
rank has all of them. Which chunk rank r sends, and which one it writes, at step k of each
phase is yours to derive (notebook 00, section 2, works it out by hand on four tensors).

`chunks = t.view(n, -1)`: its rows are views of t, so write into them in place. The order of
each step's send and receive is yours too: a send waited for before the receive is posted
hangs once every rank does it, on gloo as on NCCL, and NCCL runs a rank's sends and receives
in the order it posted them. The checker runs 2, 3 and 4 ranks and replays your order under
NCCL's rule. Return t.
"""

CHUNK = 3   # elements per chunk in the checks


def _start(n: int, r: int) -> torch.Tensor:
    """Rank r's tensor: element i is 2^r + 2^n i. Any sum over a set of ranks reads back as
    (which ranks, which element): the low n bits name the ranks, the rest the position."""
    return (2.0 ** r + 2.0 ** n * torch.arange(n * CHUNK, dtype=torch.float64))


def describe(values: torch.Tensor, n: int) -> str:
    """What a chunk of the checks' tensors holds, in words: "ranks {0, 2} of chunk 1"."""
    v = [int(x) for x in values.tolist()]
    if any(float(x) != y for x, y in zip(v, values.tolist())):
        return "values no sum of the ranks' tensors gives"
    masks = {x % 2 ** n for x in v}
    if len(masks) != 1 or 0 in masks:
        return "values no sum of the ranks' tensors gives"
    mask = masks.pop()
    ranks = [k for k in range(n) if mask >> k & 1]
    positions = [(x >> n) / len(ranks) for x in v]
    if any(p != int(p) for p in positions) or int(positions[0]) % CHUNK or \
            positions != [positions[0] + i for i in range(CHUNK)]:
        return f"the sum of ranks {set(ranks)} over elements that are not one chunk"
    c = int(positions[0]) // CHUNK
    if len(ranks) == 1:
        return f"chunk {c} of rank {ranks[0]} alone"
    return f"chunk {c} summed over {'every rank' if len(ranks) == n else f'ranks {set(ranks)}'}"


HANG_S = 5.0     # a ring of a few elements takes milliseconds: a rank still inside it is stuck


def _run(student, n, hang_dir):
    """One rank: the student's ring on the encoded tensor. Every send and receive is noted as
    it is posted, with the whole tensor at that moment (and a send's payload), and the order
    of ops is recorded for the NCCL replay. A rank still inside the ring after ``HANG_S``
    writes where it waits (a blocking send, a send's wait, a receive) to ``hang_dir`` and exits."""
    import json
    import os
    import threading
    from minipar import comm, p2p_order
    from minipar.plan import ring_bytes
    r = comm.rank(comm.WORLD)
    x = _start(n, r)
    ops, waiting = [], []
    real = {name: getattr(comm, name) for name in ("isend", "send", "recv", "irecv")}

    def blocking(what, fn, *args):
        waiting.append(what)
        try:
            return fn(*args)
        finally:
            waiting.pop()

    def spy(name):
        def call(t, peer, *args, **kwargs):
            kind = "send" if "send" in name else "recv"
            ops.append((kind, x.clone(), t.detach().clone() if kind == "send" else None))
            if name in ("send", "recv"):
                return blocking(f"a blocking {name}", real[name], t, peer, *args, **kwargs)
            handle = real[name](t, peer, *args, **kwargs)
            wait = handle.wait
            handle.wait = lambda: blocking(f"the wait of an {name}", wait)
            return handle
        return call

    def stuck():
        import time
        with open(os.path.join(hang_dir, f"rank{r}.json.tmp"), "w") as f:
            json.dump({"waiting": waiting[-1] if waiting else "",
                       "posted": [kind for kind, _, _ in ops]}, f)
        os.replace(os.path.join(hang_dir, f"rank{r}.json.tmp"), os.path.join(hang_dir, f"rank{r}.json"))
        deadline = time.monotonic() + HANG_S / 2     # the others' watchdogs fire too: wait for
        while time.monotonic() < deadline and \
                sum(name.endswith(".json") for name in os.listdir(hang_dir)) < n:   # their words
            time.sleep(0.05)
        os._exit(3)

    watchdog = threading.Timer(HANG_S, stuck)
    watchdog.daemon = True
    comm.reset()
    try:
        for name in real:
            setattr(comm, name, spy(name))
        watchdog.start()
        with p2p_order.record() as log:
            out = student.ring_all_reduce(x, comm.WORLD)
    finally:
        watchdog.cancel()
        for name, fn in real.items():
            setattr(comm, name, fn)
    sent = comm.stats.bytes_by_op()
    kinds = [kind for kind, _, _ in ops]
    paired = len(kinds) % 2 == 0 and all(sorted(kinds[i:i + 2]) == ["recv", "send"]
                                         for i in range(0, len(kinds), 2))
    return dict(sends=[p for kind, _, p in ops if kind == "send"], paired=paired,
                states=[state for _, state, _ in ops[::2]] + [x.clone()] if paired else [],
                final=x.clone(), order=log.events, out=out.detach().clone() if torch.is_tensor(out) else None,
                out_is_t=out is x, sent=sent.get("send", 0),
                other=sorted(op for op in sent if op not in ("send", "recv")),
                expected_sent=ring_bytes("all_reduce", x.numel() * 8, n))


def hang_message(hang_dir, n: int) -> str:
    """Why the ranks stopped moving, from what each stuck rank wrote: in a send whose receive
    it had not posted yet, on every rank, is the send-first cycle."""
    import json
    import os
    stuck = {}
    for r in range(n):
        path = os.path.join(hang_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                stuck[r] = json.load(f)
    if not stuck:
        return ""
    send_first = [r for r, s in stuck.items() if "send" in s["waiting"]
                  and s["posted"].count("send") > s["posted"].count("recv")]
    if len(send_first) == n:
        how = sorted({stuck[r]["waiting"] for r in send_first})
        return (f"every rank waited in a send ({' or '.join(how)}) before posting its receive: "
                f"this hangs on gloo and on NCCL, since no rank ever reaches the receive its "
                f"left neighbour's send waits for. Let even ranks send first and odd ranks "
                f"receive first")
    where = "; ".join(f"rank {r} in {s['waiting'] or 'its own code (a loop?)'} after posting "
                      f"{s['posted'].count('send')} sends and {s['posted'].count('recv')} "
                      f"receives" for r, s in sorted(stuck.items()))
    return f"the ranks stopped moving: {where}"


def expected_chunk(phase: str, k: int, r: int, n: int) -> tuple[int, int]:
    """(chunk sent, chunk written) at step k of a phase on rank r."""
    return ((r - k) % n, (r - k - 1) % n) if phase == "reduce-scatter" else ((r + 1 - k) % n, (r - k) % n)


def diagnose(results: list[dict], n: int) -> dict[int, tuple[str, str]]:
    """Walk every rank's steps: what it sent, what it wrote. For each rank whose ring went
    wrong: (the bug in a few words, the first wrong step in the student's terms)."""
    full = sum(_start(n, k) for k in range(n))
    chunks = lambda t: t.view(n, CHUNK)                          # noqa: E731
    steps, found = 2 * (n - 1), {}
    for r, res in enumerate(results):
        left = results[(r - 1) % n]
        if len(res["sends"]) != steps or not res["paired"]:
            found[r] = ("wrong number of sends", f"rank {r} posted {len(res['sends'])} sends; "
                        f"the ring posts 2(n-1) = {steps}, n-1 in each phase, each step one send "
                        f"and one receive")
            continue
        for s in range(steps if len(left["sends"]) == steps else 0):
            phase, k = ("reduce-scatter", s) if s < n - 1 else ("all-gather", s - (n - 1))
            step = f"{phase} step {k}, rank {r}"
            want_sent, want_written = expected_chunk(phase, k, r, n)
            before, after = chunks(res["states"][s]), chunks(res["states"][s + 1])
            payload, incoming = res["sends"][s].reshape(-1), left["sends"][s].reshape(-1)
            if payload.numel() != CHUNK or not torch.equal(payload, before[want_sent]):
                same = [c for c in range(n) if payload.numel() == CHUNK and torch.equal(payload, before[c])]
                formula = "(r - k)" if phase == "reduce-scatter" else "(r + 1 - k)"
                if same:
                    found[r] = (f"wrong ring index in the {phase} phase",
                                f"{step}: sent chunk {same[0]} ({describe(payload, n)}); the ring "
                                f"sends chunk {formula} mod n = {want_sent} "
                                f"({describe(before[want_sent], n)}). Wrong ring index in the "
                                f"{phase} phase (the chunk you send)")
                else:
                    got = describe(payload, n) if payload.numel() == CHUNK else f"{payload.numel()} elements"
                    found[r] = ("sent something that is no chunk",
                                f"{step}: sent {got}, which is no chunk of t at that moment; "
                                f"send chunks[{formula} % n] = chunk {want_sent} "
                                f"({describe(before[want_sent], n)})")
                break
            if incoming.numel() != CHUNK:
                break
            want = before.clone()
            want[want_written] = before[want_written] + incoming if phase == "reduce-scatter" else incoming
            if torch.equal(after, want):
                continue
            changed = [c for c in range(n) if not torch.equal(after[c], before[c])]
            if not changed:
                found[r] = ("rebound buffer", f"{step}: the incoming chunk "
                            f"({describe(incoming, n)}) was never written into t: every chunk "
                            f"is as before. A rebound buffer instead of an in-place write: "
                            f"`c = c + incoming` (or `c = incoming`) only renames; write into "
                            f"the view: `chunks[i] += incoming`, `chunks[i].copy_(incoming)`")
            elif changed != [want_written]:
                formula = "(r - k - 1)" if phase == "reduce-scatter" else "(r - k)"
                found[r] = (f"wrong ring index in the {phase} phase",
                            f"{step}: the incoming chunk ({describe(incoming, n)}) went into chunk "
                            f"{changed[0]}; it belongs in {formula} mod n = {want_written}. Wrong "
                            f"ring index in the {phase} phase (the chunk you write)")
            elif phase == "reduce-scatter" and torch.equal(after[want_written], incoming):
                found[r] = ("copied instead of added", f"{step}: chunk {want_written} holds only "
                            f"the incoming {describe(incoming, n)}: it was copied over rank {r}'s "
                            f"own part. In the reduce-scatter phase add it (`+=`): expected "
                            f"{describe(want[want_written], n)}")
            elif phase == "all-gather" and torch.equal(after[want_written], before[want_written] + incoming):
                found[r] = ("added instead of copied", f"{step}: the finished chunk "
                            f"{want_written} was added to the stale one; in the all-gather phase "
                            f"copy it (`copy_`): expected {describe(want[want_written], n)}")
            else:
                found[r] = ("wrong chunk value", f"{step}: chunk {want_written} holds "
                            f"{describe(after[want_written], n)}, expected "
                            f"{describe(want[want_written], n)}")
            break
        final = res["final"]
        if r in found or torch.equal(final, full) and res["out_is_t"]:
            continue
        wrong = [c for c in range(n) if not torch.equal(chunks(final)[c], chunks(full)[c])]
        if not wrong:
            found[r] = ("another tensor returned", f"rank {r} returned another tensor than t: "
                        f"return t itself, summed in place")
        elif res["out"] is not None and torch.equal(res["out"], full):
            found[r] = ("rebound buffer", f"rank {r} returned the sum, but t itself is unchanged "
                        f"(chunks {wrong}): a rebound buffer instead of an in-place write. "
                        f"ring_all_reduce works in place: write into `chunks` (views of t)")
        else:
            found[r] = ("wrong final sum", f"at the end rank {r}'s chunks {wrong} are wrong "
                        f"(chunk {wrong[0]} holds {describe(chunks(final)[wrong[0]], n)}; each "
                        f"should be summed over every rank)")
    return found


def check(student, report) -> None:
    import tempfile
    from minipar import p2p_order
    from minipar.runtime.dist import RankFailed
    from minipar.exercises import launch_student
    good = {"order": [], "steps": [], "bytes": []}
    for n in (2, 3, 4):
        where = f"on {n} ranks"
        with tempfile.TemporaryDirectory(prefix="minipar-ex01-") as hang_dir:
            try:
                results = launch_student(_run, n, student, n, hang_dir, timeout=30)
            except (RankFailed, TimeoutError):
                why = hang_message(hang_dir, n)
                if not why:
                    raise
                report.fail(f"{where}: {why}", kind="hang")
                break                           # more ranks would wait as long, to say the same
        verdict = p2p_order.check([res["order"] for res in results])
        mode, problems = next(((m, p) for m, p in verdict.items() if p), (None, None))
        if problems:
            report.fail(f"{where} your order of sends and receives would hang on NCCL ({mode} "
                        f"init: a send completes only with its receive, in the order posted): "
                        f"{problems[0]}; let even ranks send first and odd ranks receive first",
                        kind="would hang on NCCL")
        else:
            good["order"].append(n)
        other = sorted({op for res in results for op in res["other"]})
        if other:
            report.fail(f"{where} you called {other}: build it from isend/recv only")
        by_bug: dict[str, list[int]] = {}
        found = diagnose(results, n)
        for r, (bug, _) in sorted(found.items()):
            by_bug.setdefault(bug, []).append(r)
        for bug, ranks in by_bug.items():
            also = f" (the same on rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))})" \
                if len(ranks) > 1 else ""
            report.fail(f"{where}, {found[ranks[0]][1]}{also}", kind=bug)
        if not found:
            good["steps"].append(n)
        wrong_bytes = [(r, res["sent"]) for r, res in enumerate(results) if res["sent"] != res["expected_sent"]]
        if wrong_bytes:
            r, sent = wrong_bytes[0]
            report.fail(f"{where}, rank {r} sent {sent} bytes; a ring sends 2(n-1)/n x N = "
                        f"{results[0]['expected_sent']}", kind="bytes")
        else:
            good["bytes"].append(n)
    ns = lambda ns: " and ".join(", ".join(map(str, ns)).rsplit(", ", 1)) + " ranks"   # noqa: E731
    if good["steps"]:
        report.ok(f"on {ns(good['steps'])}: every step of both phases sends and writes the right "
                  f"chunk, and every rank ends with the sum of every rank's tensor, in place")
    if good["order"]:
        report.ok(f"on {ns(good['order'])}: your order of sends and receives replays under NCCL's "
                  f"rule (eager and lazy init) without a hang")
    if good["bytes"]:
        report.ok(f"on {ns(good['bytes'])}: each rank sent 2(n-1)/n x N bytes, from isend/recv only")
