"""ex05: the 1F1B pipeline schedule."""
TITLE = "The 1F1B pipeline schedule"
SUMMARY = "the 1F1B schedule generator"
DIFFICULTY = "easy"
MINUTES = 25
NOTEBOOK = "03, section 7 (1F1B: the same bubble, far less activation memory)"
MODULE = "minipar.schedules"
NAMES = ["one_f_one_b_order", "one_f_one_b"]
API = ["minipar.schedules.forward", "minipar.schedules.backward", "minipar.schedules.with_p2p",
       "minipar.schedules.gpipe_order"]
INTRO = """
A pipeline schedule is data: for each of the p stages, the order in which it runs the
forward and backward passes of the m micro-batches. GPipe runs all m forwards and then all
m backwards, so every stage holds the activations of all m micro-batches at once. 1F1B
(PipeDream-flush) keeps the same bubble but holds at most p: stage r first runs
min(p - r - 1, m) warm-up forwards, then alternates one forward and one backward (forward of
the next micro-batch, backward of the oldest one still held), and ends with the cool-down
backwards of the micro-batches it still holds. Write `one_f_one_b_order(p, m, r)`: return
stage r's list of `forward(i)` and `backward(i)` in that order, for any p and m (also m < p,
where 1F1B becomes GPipe, and m = 1, the naive pipeline). `one_f_one_b` then adds the sends
and receives (`with_p2p`) and the checker runs your schedule for real on 2 gloo processes.

For p = 4, m = 6 the three phases of each stage (F3 = forward(3), B0 = backward(0)):

    stage 0   warm-up F0 F1 F2 | steady F3 B0 F4 B1 F5 B2 | cool-down B3 B4 B5
    stage 3   warm-up (none)   | steady F0 B0 F1 B1 ... F5 B5 | cool-down (none)

Notebook 03 shows the timeline (section 3, `schedules.one_f_one_b(2, 4, r)`, is the
answer for p = 2, m = 4; section 7 counts what each stage holds).
"""


def _run_two_stages(student, m):
    """Train one step of the nano GPT through the student's schedule; compare with serial."""
    import torch
    import torch.distributed as tdist
    from minipar.runtime import dist
    from minipar import pp, schedules
    from minipar.model import build
    from minipar.mesh import Mesh
    grid = Mesh(dp=1, pp=2, tp=1)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 256, (8, 17), generator=g)
    x, y = batch[:, :-1], batch[:, 1:]
    serial = build("nano", seed=0)
    serial(x, y).backward()
    runner = pp.PipelineRunner(build("nano", seed=0), grid.group("pp"), student.one_f_one_b, m)
    loss = runner.forward_backward(x, y)
    ref = dict(serial.named_parameters())
    grads_ok = all(torch.allclose(q.grad, ref[runner.serial_name(n)].grad, atol=1e-5)
                   for n, q in runner.module.named_parameters())
    loss_ok = True
    if grid.is_last_stage:
        with torch.no_grad():
            loss_ok = abs(loss - serial(x, y).item()) < 1e-5
    return dict(grads_ok=grads_ok, loss_ok=loss_ok, stash=runner.peak_stash,
                rank=tdist.get_rank())


def _warmup(order, m: int) -> set[int]:
    """The warm-up lengths a compute order is consistent with: the forwards before its first
    backward are the warm-up and the first steady forward (all m of them: m - 1 or m)."""
    ops = [i.op for i in order]
    before = ops[:ops.index("backward")].count("forward") if "backward" in ops else m
    return {before - 1} if before < m else {m - 1, m}


def check(student, report) -> None:
    from minipar import schedules
    from minipar.exercises import launch_student
    from minipar.plan import bubble_fraction
    cases = 0
    for p in (4, 3, 2, 1):            # the richest cases first: they are the ones listed
        for m in range(8, 0, -1):
            where = f"p={p}, m={m}"
            try:
                orders = [student.one_f_one_b_order(p, m, r) for r in range(p)]
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - the student's function, any error
                report.fail(f"{where}: one_f_one_b_order raised {type(e).__name__}: {e}", kind="raised")
                continue
            start = report.count
            everything = sorted([("forward", i) for i in range(m)] + [("backward", i) for i in range(m)])
            for r, order in enumerate(orders):
                got = sorted((i.op, i.mb) for i in order)
                if got != everything:
                    missing = sorted(set(everything) - set(got))
                    extra = [x for x in got if x not in everything or got.count(x) > 1]
                    report.fail(f"{where}, stage {r}: every stage runs forward(i) and backward(i) "
                                f"once for each of the m micro-batches; missing "
                                f"{[f'{op[0].upper()}{i}' for op, i in missing] or 'none'}, extra "
                                f"{[f'{op[0].upper()}{i}' for op, i in extra] or 'none'}"
                                + (" (the cool-down: the backwards still held)" if missing and
                                   all(op == "backward" for op, _ in missing) else ""),
                                kind="missing or extra")
                    break
                if order and order[0].op == "backward":
                    report.fail(f"{where}, stage {r}: starts with a backward ({order[0]}); a "
                                f"micro-batch's backward needs its forward first",
                                kind="backward first")
                    break
                ws, want = _warmup(order, m), min(p - r - 1, m)
                if want not in ws:
                    w = min(ws)
                    report.fail(f"{where}, stage {r}: {w} warm-up forward{'s' if w != 1 else ''} "
                                f"before the first forward-backward pair; 1F1B runs "
                                f"min(p - r - 1, m) = {want}. An off-by-one warm-up"
                                f"{' (one too many)' if w == want + 1 else ' (one too few)' if w == want - 1 else ''}"
                                f": stage {r} got {[str(i) for i in order]}", kind="off-by-one warm-up")
                    break
            if report.count > start:
                continue
            try:
                lists = [student.one_f_one_b(p, m, r) for r in range(p)]
            except Exception as e:   # noqa: BLE001 - with_p2p: some forward or backward can never start
                report.fail(f"{where}: {e} (in the steady phase a stage runs the forward of the "
                            f"next micro-batch, then the backward of the oldest it holds)",
                            kind="cannot run")
                continue
            problems = schedules.validate_schedule(lists, m)
            if problems:
                report.fail(f"{where}: {problems[0]}", kind="not runnable")
                continue
            for r, lst in enumerate(lists):
                held, most = schedules.peak_stash(lst), min(p - r, m)
                if held != most:
                    report.fail(f"{where}: stage {r} holds {held} micro-batches' activations at "
                                f"once; 1F1B holds min(p - r, m) = {most} (warm-up p - r - 1 "
                                f"forwards, then one forward, one backward)", kind="stash")
                    break
            else:
                bubble = schedules.Timeline(schedules.simulate(lists)).bubble
                if abs(bubble - bubble_fraction(p, m)) > 1e-9:
                    report.fail(f"{where}: the ideal bubble is {bubble:.3f}, not (p-1)/(m+p-1) = "
                                f"{bubble_fraction(p, m):.3f}: some stage waits longer than it "
                                f"must (check the order of the backwards)", kind="bubble")
                else:
                    cases += 1
    if cases == 32:
        report.ok("for every p in 1-4 and m in 1-8: the schedule checker runs your lists without "
                  "a deadlock, each stage holds min(p - r, m) micro-batches at most, and the "
                  "ideal bubble is (p-1)/(m+p-1)")
    if report.failures:
        return
    for m in (1, 4):
        bad = [res["rank"] for res in launch_student(_run_two_stages, 2, student, m)
               if not (res["loss_ok"] and res["grads_ok"])]
        if bad:
            report.fail(f"2 stages, m={m}: on rank(s) {bad} the loss or the gradients differ "
                        f"from the serial model's")
        else:
            report.ok(f"2 stages, m={m}: the nano GPT trained through your schedule on two gloo "
                      f"processes gives the serial loss and gradients")
