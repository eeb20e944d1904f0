"""What ex06 and ex07 share: train the nano model on 4 ranks with the student's function in
place of the package's, wrapped in a spy that compares, call by call, what the function did
with what it should have done (the gradient Adam reads, the buffers written, the slices every
rank holds), so that a failure names the step, the micro-batch, the unit and the shard."""
import torch

ARGV = ["--model", "nano", "--batch-size", "8", "--steps", "6", "--quiet", "--lr", "3e-3"]


def _unit_name(units, u) -> str:
    return f"unit {units.index(u)} ({type(u.module).__name__})"


def _close(a, b):
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Training with the spy, against one process
# --------------------------------------------------------------------------------------
def _train(student, argv, patch, spy, wrap_step):
    """One rank: the trainer, with the student's function (inside ``spy``) in place of the
    package's; ``wrap_step`` (or None) wraps the package's optimizer step too."""
    import contextlib
    import io
    from minipar import train, zero
    findings: list = []
    real = {name: getattr(zero, name) for name in ("sharded_optimizer_step", "reduce_scatter_gradient")}
    try:
        if wrap_step is not None:
            setattr(zero, "sharded_optimizer_step", wrap_step(real["sharded_optimizer_step"], findings))
        watched, calls = spy(getattr(student, patch), findings), [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return watched(*args, **kwargs)
        setattr(zero, patch, counted)
        with contextlib.redirect_stdout(io.StringIO()):
            out = train.worker(train.parse_config(argv), train.Hooks(end=train.with_state))
    finally:
        for name, fn in real.items():
            setattr(zero, name, fn)
    if not calls[0]:       # a check that never ran the student's code must not pass
        findings.insert(0, ("not called", f"zero.{patch} was never called during training, so "
                            f"nothing of yours was checked (a checker fault: please report it)"))
    out["findings"] = findings
    return out


def check_training(student, report, patch: str, runs, hint_wrong_weights: str, spy,
                   wrap_step=None) -> None:
    """Train with each (flags, expect, verified) in ``runs`` on 4 ranks with ``patch`` the
    student's (inside ``spy``); compare with one process and report in the student's terms.
    The first configuration that fails ends the check: its findings name the bug, and the
    later ones would only repeat them (a bug that shows only in a later one is found there)."""
    from minipar import train
    from minipar.exercises import launch_student
    from minipar.model import build
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        ref = train.run_state(ARGV, 1)
    sizes = [sum(p.numel() for p in part.parameters()) for part in build("nano").parts()]
    psi = 4 * sum(sizes)
    for flags, expect, verified in runs:
        where = " ".join(flags)
        start = report.count
        out = launch_student(_train, 4, student, ARGV + flags, patch, spy, wrap_step)
        found = {r: res["findings"][0] for r, res in enumerate(out) if res["findings"]}
        report.fail_ranks(where, found, 4)
        losses = [h["loss"] for h in out[0]["history"]]
        if len(losses) != len(ref["losses"]):
            report.fail(f"{where}: {len(losses)} steps ran, {len(ref['losses'])} expected")
        for step, (a, b) in enumerate(zip(losses, ref["losses"]), 1):
            if abs(a - b) > 1e-5:
                report.fail(f"{where}: the loss at step {step} is {a:.6f}, one process gets "
                            f"{b:.6f}" + ("" if found else ": the gradient or the update is wrong"))
                break
        if report.count == start:
            for rank, r in enumerate(out):
                bad = [n for n, p in r["params"].items()
                       if not torch.allclose(p, ref["params"][n], atol=1e-4, rtol=1e-4)]
                if bad:
                    report.fail(f"{where}: after training rank {rank} holds different weights "
                                f"than one process (e.g. {bad[0]}): {hint_wrong_weights}")
                    break
        for problem in expect(where, out[0]["history"][-1], psi, len(sizes)):
            report.fail(problem)
        if report.count == start:
            report.ok(f"{where}: {verified}")
        elif (flags, expect, verified) != runs[-1]:
            left = ", ".join(" ".join(f) for f, _, _ in runs[runs.index((flags, expect, verified)) + 1:])
            report.fail(f"not run yet: {left} (fix {where} first)")
            return
