"""ex05: the 1F1B pipeline schedule."""
TITLE = "The 1F1B pipeline schedule"
MODULE = "minipar.schedules"
NAMES = ["one_f_one_b_order", "one_f_one_b"]
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


def check(student) -> list[str]:
    from minipar import pp, schedules
    from minipar.exercises import launch_student
    from minipar.plan import bubble_fraction
    failures = []
    for p in (1, 2, 3, 4):
        for m in range(1, 9):
            where = f"p={p}, m={m}"
            try:
                lists = [student.one_f_one_b(p, m, r) for r in range(p)]
            except ValueError as e:   # with_p2p: some forward or backward can never start
                failures.append(f"{where}: {e}")
                return failures
            problems = schedules.validate_schedule(lists, m)
            if problems:
                failures.append(f"{where}: {problems[0]}")
                return failures
            for r, lst in enumerate(lists):
                held, most = schedules.peak_stash(lst), min(p - r, m)
                if held != most:
                    failures.append(f"{where}: stage {r} holds {held} micro-batches' activations "
                                    f"at once; 1F1B holds min(p - r, m) = {most} (warm-up "
                                    f"p - r - 1 forwards, then one forward, one backward)")
                    return failures
            bubble = schedules.Timeline(schedules.simulate(lists)).bubble
            if abs(bubble - bubble_fraction(p, m)) > 1e-9:
                failures.append(f"{where}: the ideal bubble is {bubble:.3f}, not (p-1)/(m+p-1) = "
                                f"{bubble_fraction(p, m):.3f}: some stage waits longer than "
                                f"it must (check the order of the backwards)")
                return failures
    for m in (1, 4):
        for res in launch_student(_run_two_stages, 2, student, m):
            if not res["loss_ok"]:
                failures.append(f"2 stages, m={m}: the pipeline's loss differs from the serial one")
            if not res["grads_ok"]:
                failures.append(f"2 stages, m={m}: rank {res['rank']}'s gradients differ from "
                                f"the serial model's")
    return failures
