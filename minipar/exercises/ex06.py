"""ex06: ZeRO-1, the sharded optimizer step."""
TITLE = "ZeRO-1 sharded optimizer step"
MODULE = "minipar.zero"
NAMES = ["sharded_optimizer_step"]
INTRO = """
ZeRO-1 keeps the whole model and its whole gradient on every rank but only 1/d of Adam's
state: each rank owns one slice of every flat parameter buffer. At the step, each unit's
gradient buffer `u.grad_shard` (with ZeRO-1 the whole local gradient) is reduce-scattered over
`mesh.os_group`, so each rank receives the sum of its slice only (`reduce_scatter_down`); the
replicas in `mesh.rep_group` (ranks owning the same slice in other groups, if any) all-reduce
it; divide by `mesh.d` (gloo has no AVG) and put it in `u.os_grad`, the gradient the optimizer
sees. `optimizer.step()` then updates every `u.os_param` in place. Finally every rank needs
the whole updated model again: all-gather the slices over `mesh.os_group` into `u.g_slice`,
then over `mesh.g_group` into `u.p_shard` (`all_gather_in_place` fetches the other ranks'
chunks around your own). The checker trains the nano model with `--zero 1` and
`--shard 1,1,2` on 4 ranks and compares with one process, bytes sent and memory.
"""

ARGV = ["--model", "nano", "--batch-size", "8", "--steps", "6", "--quiet", "--lr", "3e-3"]


def _train(student, argv, patch):
    """One rank: the trainer, with the student's function in place of the package's."""
    import contextlib
    import io
    from minipar import train, zero
    setattr(zero, patch, getattr(student, patch))
    with contextlib.redirect_stdout(io.StringIO()):
        return train.worker(train.parse_config(argv), train.Hooks(end=train.with_state))


def check_training(student, patch: str, runs) -> list[str]:
    """Train with each (flags, expect) in ``runs`` on 4 ranks; compare with one process."""
    import torch
    from minipar import train
    from minipar.exercises import launch_student
    from minipar.model import build
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        ref = train.run_state(ARGV, 1)
    sizes = [sum(p.numel() for p in part.parameters()) for part in build("nano").parts()]
    psi = 4 * sum(sizes)
    failures = []
    for flags, expect in runs:
        where = " ".join(flags)
        out = launch_student(_train, 4, student, ARGV + flags, patch)
        losses = [h["loss"] for h in out[0]["history"]]
        if len(losses) != len(ref["losses"]):
            failures.append(f"{where}: {len(losses)} steps ran, {len(ref['losses'])} expected")
        for step, (a, b) in enumerate(zip(losses, ref["losses"]), 1):
            if abs(a - b) > 1e-5:
                failures.append(f"{where}: the loss at step {step} is {a:.6f}, one process gets "
                                f"{b:.6f}: the gradient or the update is wrong")
                break
        for rank, r in enumerate(out):
            bad = [n for n, p in r["params"].items()
                   if not torch.allclose(p, ref["params"][n], atol=1e-4, rtol=1e-4)]
            if bad and not failures:
                failures.append(f"{where}: after training rank {rank} holds different weights "
                                f"than one process (e.g. {bad[0]}): check the average (sum, "
                                f"then divide by d) and that every rank gets every updated slice")
        failures += expect(where, out[0]["history"][-1], psi, len(sizes))
        if failures:
            return failures
    return failures


def _expect(d_os, replicas):
    def expect(where, record, psi, units):
        sent, state, failures = record["comm_bytes"], record["model_state_bytes"], []
        want = {"reduce_scatter": (d_os - 1) * psi // d_os, "all_gather": (d_os - 1) * psi // d_os}
        if replicas > 1:
            want["all_reduce"] = 2 * (replicas - 1) * (psi // d_os) // replicas
        for op, b in want.items():
            if sent.get(op, 0) != b:
                what = "the updated parameter slices" if op == "all_gather" else "the gradients"
                failures.append(f"{where}: sent {sent.get(op, 0):,} bytes in {op}; ZeRO-1 sends "
                                f"{b:,} per step (one {op} of {what})")
        extra = sorted(set(sent) - set(want))
        if extra:
            failures.append(f"{where}: unexpected collectives {extra}")
        if state["optimizer"] != 2 * psi // d_os + 4 * units:
            failures.append(f"{where}: Adam holds {state['optimizer']:,} bytes; a rank should "
                            f"keep state for its slice only ({2 * psi // d_os + 4 * units:,})")
        return failures
    return expect


def check(student) -> list[str]:
    return check_training(student, "sharded_optimizer_step",
                          [(["--zero", "1"], _expect(4, 1)), (["--shard", "1,1,2"], _expect(2, 2))])
