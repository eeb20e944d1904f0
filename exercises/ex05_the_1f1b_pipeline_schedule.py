"""Exercise ex05: The 1F1B pipeline schedule

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

What you may call, each written as this file calls it (signatures from the package):

    forward(i: int, chunk: int = 0) -> Instr
    backward(i: int, chunk: int = 0) -> Instr
    with_p2p(orders: list[list[Instr]], t_fwd: float = 1.0, t_bwd: float = 2.0)
        Add the sends and receives to every stage's compute order.
    gpipe_order(p: int, m: int, r: int) -> list[Instr]
        GPipe: every forward, then every backward.

Fill in every block marked `# TODO ex05`, then run:

    python -m minipar.exercises check ex05

Generated from minipar.schedules by `python -m minipar.exercises make ex05`; the
solution is the package's own code, so peek only when stuck.
"""
from minipar.schedules import *  # noqa: F401,F403  everything else, as the package has it


def one_f_one_b_order(p: int, m: int, r: int) -> list[Instr]:
    """1F1B: warm-up forwards, then alternate one forward and one backward, then cool down."""
    # TODO ex05: write this part
    # warm-up: min(p - r - 1, m) forwards; steady: forward, backward; cool-down: the rest
    raise NotImplementedError("ex05: this part is yours to write")


def one_f_one_b(p: int, m: int, r: int) -> list[Instr]:
    """Stage r's 1F1B instruction list, sends and receives included."""
    return with_p2p([one_f_one_b_order(p, m, s) for s in range(p)])[r]
