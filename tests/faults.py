"""Fault injection for the reliability tests, installed from here as ``Hooks`` values (the
package carries no fault code).

* ``Crash(rank, step)``: that rank raises after the step's backward;
* ``Overflow(rank, step)``: that rank's gradient of its first parameter is inf in the step's
  backward, before any engine sees it, as a real fp16 overflow on one rank;
* ``CrashWhileSaving(rank, step)``: that rank raises while saving step ``step``, after the DCP
  files and before the manifest and the completion marker.

As a command, the trainer with one fault (its ranks must import this module: the tests run it
with ``tests/`` on PYTHONPATH)::

    python tests/faults.py crash|save RANK:STEP -- [trainer flags]
"""
import sys

import torch


class Crash:
    def __init__(self, rank: int, step: int):
        self.rank, self.step, self.me = rank, step, None

    def begin(self, mesh, runner, engine):
        self.me = mesh.rank

    def after_backward(self, step):
        if (self.me, step) == (self.rank, self.step):
            raise RuntimeError(f"injected crash on rank {self.me} at step {step}")

    def hooks(self):
        from minipar.train import Hooks
        return Hooks(begin=self.begin, after_backward=self.after_backward)


class Overflow:
    def __init__(self, rank: int, step: int):
        self.rank, self.step, self.armed = rank, step, False

    def begin(self, mesh, runner, engine):
        if mesh.rank == self.rank:
            first = next(p for p in runner.module.parameters() if p.requires_grad)
            first.register_hook(lambda g: torch.full_like(g, float("inf")) if self.armed else g)

    def before_step(self, step):
        self.armed = step == self.step

    def hooks(self):
        from minipar.train import Hooks
        return Hooks(begin=self.begin, before_step=self.before_step)


class CrashWhileSaving:
    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def begin(self, mesh, runner, engine):
        from minipar.train import checkpoint
        if mesh.rank != self.rank:
            return
        write = checkpoint._fsync_write

        def failing(path, text):
            if path.endswith(checkpoint.MANIFEST) and f".step-{self.step:06d}" in path:
                raise RuntimeError(f"injected crash on rank {self.rank} while saving step {self.step}")
            write(path, text)
        checkpoint._fsync_write = failing       # in this rank's process only

    def hooks(self):
        from minipar.train import Hooks
        return Hooks(begin=self.begin)


KINDS = {"crash": Crash, "save": CrashWhileSaving, "overflow": Overflow}


def main(argv):
    from minipar.runtime import dist
    from minipar.train import run
    kind, at, sep, *flags = argv
    assert sep == "--", "usage: python tests/faults.py crash|save|overflow RANK:STEP -- [flags]"
    rank, step = map(int, at.split(":"))
    hooks = KINDS[kind](rank, step).hooks()
    dist.run_main(lambda args: run(args, hooks), flags)


if __name__ == "__main__":
    import faults       # the ranks unpickle the hooks from the module, not from __main__
    faults.main(sys.argv[1:])
