"""Pipeline parallelism: the schedules (no process), the executor against the serial run and
against torch.distributed.pipelining, stashed activations, and bad input."""
import time

import pytest
from conftest import NANO, assert_same_training, cli, quick_tier, serial_state

from minipar.mesh import Mesh
from minipar.runtime import dist
from minipar import pp, schedules
from minipar.schedules import Instr, backward, forward
from minipar.train import run_state


# --------------------------------------------------------------------------------------
# Schedules as data: checked without any process
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_pass_the_checker_with_the_textbook_bubble_and_stash(name):
    for p in range(1, 7):
        for m in range(1, 13):
            lists = schedules.schedule_lists(name, p, m)
            assert schedules.validate_schedule(lists, m) == [], (name, p, m)
            timeline = schedules.ideal_timeline(name, p, m)
            assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1)), (name, p, m)
            stash = [schedules.peak_stash(lst) for lst in lists]
            assert stash == ([m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)])


def test_interleaved_passes_the_checker_and_shrinks_the_bubble_v_fold():
    for p in range(2, 6):
        for m in range(p, 3 * p + 1, p):
            for v in (1, 2, 3):
                lists = schedules.schedule_lists("interleaved", p, m, v)
                assert schedules.validate_schedule(lists, m, v) == [], (p, m, v)
                assert schedules.ideal_timeline("interleaved", p, m, v).bubble == \
                    pytest.approx((p - 1) / (v * m + p - 1)), (p, m, v)
                # chunk c of stage r is virtual stage c p + r: the wrap-around goes p-1 -> 0
                sends = [i for i in lists[p - 1] if i.op == "send_act"]
                assert all(i.peer == 0 for i in sends) and len(sends) == m * (v - 1)


def _naive_p2p(orders):
    """The obvious placement: receive right before a compute, send right after it."""
    p, out = len(orders), []
    for r, order in enumerate(orders):
        lst = []
        for ins in order:
            if ins.op == "forward" and r > 0:
                lst.append(Instr("recv_act", ins.mb, 0, r - 1))
            if ins.op == "backward" and r < p - 1:
                lst.append(Instr("recv_grad", ins.mb, 0, r + 1))
            lst.append(ins)
            if ins.op == "forward" and r < p - 1:
                lst.append(Instr("send_act", ins.mb, 0, r + 1))
            if ins.op == "backward" and r > 0:
                lst.append(Instr("send_grad", ins.mb, 0, r - 1))
        out.append(lst)
    return out


def test_checker_finds_the_send_send_deadlock_of_naive_1f1b():
    orders = [schedules.one_f_one_b_order(2, 4, r) for r in range(2)]
    problems = schedules.validate_schedule(_naive_p2p(orders))
    assert len(problems) == 1 and problems[0].startswith("deadlock")
    assert "send_act(1)->1" in problems[0] and "send_grad(0)->0" in problems[0]
    # GPipe has no such exchange: the same naive placement runs
    assert schedules.validate_schedule(_naive_p2p([schedules.gpipe_order(2, 4, r) for r in range(2)])) == []


def _edit(lists, r, fn):
    out = [list(lst) for lst in lists]
    out[r] = fn(out[r])
    return out


@pytest.mark.parametrize("breakage,expected", [
    (lambda L: _edit(L, 1, lambda l: [i for i in l if i != Instr("recv_act", 2, 0, 0)]),
     "missing recv_act"),
    (lambda L: _edit(L, 0, lambda l: [i for i in l if i != Instr("send_act", 2, 0, 1)]),
     "missing send_act"),
    (lambda L: _edit(L, 1, lambda l: [Instr(i.op, i.mb, i.chunk, 3) if i.op == "send_grad"
                                      else i for i in l]), "should talk to stage 0"),
    (lambda L: _edit(L, 0, lambda l: l + [forward(0)]), "appears twice"),
    (lambda L: _edit(L, 0, lambda l: [backward(0)] + [i for i in l if i != backward(0)]),
     "backward before its forward"),
    (lambda L: _edit(L, 1, lambda l: [i for i in l if i != Instr("recv_act", 0, 0, 0)][:2]
                     + [Instr("recv_act", 0, 0, 0)] + [i for i in l if i != Instr("recv_act", 0, 0, 0)][2:]),
     "recv_act must come before its forward"),
    (lambda L: _edit(L, 0, lambda l: l + [Instr("send_grad", 0, 0, 1)]), "no stage to talk to"),
    (lambda L: _edit(L, 0, lambda l: l + [forward(7)]), "outside m=4"),
    (lambda L: [L[0], [i for i in L[1] if i.op != "backward"]], "needs one forward and one backward"),
])
def test_checker_rejects_broken_lists(breakage, expected):
    lists = schedules.schedule_lists("1f1b", 2, 4)
    problems = schedules.validate_schedule(breakage(lists), m=4)
    assert any(expected in p for p in problems), problems


def test_checker_finds_a_wait_cycle():
    # stage 0 waits for the gradient before sending the activation it depends on
    lists = [[forward(0), Instr("recv_grad", 0, 0, 1), Instr("send_act", 0, 0, 1), backward(0)],
             [Instr("recv_act", 0, 0, 0), forward(0), backward(0), Instr("send_grad", 0, 0, 0)]]
    problems = schedules.validate_schedule(lists)
    assert problems and "deadlock" in problems[0] and "recv_grad(0)<-1" in problems[0]
    with pytest.raises(ValueError, match="cannot run"):   # an impossible compute order
        schedules.with_p2p([[backward(0), forward(0)], [forward(0), backward(0)]])


# --------------------------------------------------------------------------------------
# The executor: every layout equals the single-process run (losses, params, gradients)
# --------------------------------------------------------------------------------------
def _p2p_bytes_rank0(v, batch, dp, seq_len, d, seq_split=1):
    """Stage 0 sends v m activations and (v-1) m gradients of (b, s, d) fp32 per step."""
    return (2 * v - 1) * (batch // dp) * (seq_len // seq_split) * d * 4


LAYOUTS = {
    "pp2-gpipe": (2, ["--pp", "2", "--schedule", "gpipe", "--microbatches", "4"], []),
    "pp2-1f1b": (2, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"], []),
    "pp2-interleaved": (2, ["--pp", "2", "--schedule", "interleaved", "--microbatches", "4",
                            "--chunks", "2"], []),
    "pp4-gpipe": (4, ["--pp", "4", "--schedule", "gpipe", "--microbatches", "8"], []),
    "pp4-1f1b": (4, ["--pp", "4", "--schedule", "1f1b", "--microbatches", "8"], []),
    "pp4-interleaved": (4, ["--pp", "4", "--schedule", "interleaved", "--microbatches", "4",
                            "--chunks", "2"], ["--model", "nano8"]),
    "pp2xdp2": (4, ["--pp", "2", "--dp", "2", "--microbatches", "2"], []),
    "pp2xtp2-sp-interleaved": (4, ["--pp", "2", "--tp", "2", "--sp", "--schedule", "interleaved",
                                   "--microbatches", "2"], []),
    "pp2-m1-naive": (2, ["--pp", "2", "--microbatches", "1"], []),
    "pp4-m2-gpipe": (4, ["--pp", "4", "--schedule", "gpipe", "--microbatches", "2"], []),
    "pp4-m2-1f1b": (4, ["--pp", "4", "--schedule", "1f1b", "--microbatches", "2"], []),
}


@pytest.mark.parametrize("layout", quick_tier(LAYOUTS, ["pp2-1f1b", "pp2-gpipe", "pp2-interleaved",
                                                      "pp2-m1-naive", "pp2xdp2"]))
def test_pipeline_equals_serial_run(layout):
    nproc, flags, model = LAYOUTS[layout]
    got = run_state(NANO + model + flags, nproc=nproc)
    assert_same_training(got, serial_state(model))
    p = int(flags[flags.index("--pp") + 1])
    t = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    v = int(flags[flags.index("--chunks") + 1]) if "--chunks" in flags else (
        2 if "interleaved" in flags else 1)
    sent = got["history"][-1]["comm_bytes"].get("send", 0)
    assert sent == _p2p_bytes_rank0(v, 8, nproc // (p * t), 16, 32, t if "--sp" in flags else 1)


def test_same_loss_and_gradients_as_torch_pipelining():
    from minipar.bench.pp import compare_with_torch
    for schedule in ("gpipe", "1f1b"):
        ranks = dist.launch(compare_with_torch, 2, schedule=schedule, microbatches=4,
                            model_name="nano", micro_batch=2, steps=3)
        last = ranks[1]
        assert len(last["mine"]) == 3
        for mine, theirs in zip(last["mine"], last["torch"]):
            assert mine == pytest.approx(theirs, abs=1e-6), schedule
        assert all(r["grad_diff"] < 1e-6 for r in ranks), schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_timeline_and_stashed_activations(schedule):
    p, m = 4, 6
    from minipar.lab.nb03 import measure_pipeline
    res = dist.launch(measure_pipeline, p, model_name="nano", schedule=schedule, microbatches=m,
                      micro_batch=1, steps=2)[0]
    tl = res["timeline"]
    expected = [m] * p if schedule == "gpipe" else [min(p - r, m) for r in range(p)]
    assert tl.peak_stash == expected
    lists = schedules.schedule_lists(schedule, p, m)
    for r in range(p):   # every instruction, in the schedule's order, with start <= end
        assert [(e.op, e.mb) for e in tl.stages[r]] == [(i.op, i.mb) for i in lists[r]]
        assert all(0 <= e.start <= e.end for e in tl.stages[r])
    assert 0.0 < tl.bubble < 1.0


def _deadlocking_schedule(p, m, r):
    return _naive_p2p([schedules.one_f_one_b_order(p, m, s) for s in range(p)])[r]


def _run_with(schedule):
    grid = Mesh(dp=1, pp=2, tp=1)
    from minipar.model import build
    pp.PipelineRunner(build("nano"), grid.group("pp"), schedule, 4)


def test_a_deadlocking_schedule_is_refused_on_every_rank_not_run():
    t = time.monotonic()
    with pytest.raises(dist.RankFailed, match="deadlock"):
        dist.launch(_run_with, 2, _deadlocking_schedule, timeout=60)
    assert time.monotonic() - t < 30


# --------------------------------------------------------------------------------------
# Bad input: exit 2, one line, before any process starts
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,words", [
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "3",
      "--batch-size", "6"], "multiple of 2"),
    (["--nproc", "3", "--pp", "3", "--batch-size", "6"], "do not split into pp=3"),
    (["--nproc", "4", "--pp", "4", "--schedule", "interleaved"], "pp=4 x chunks=2"),
])
@pytest.mark.slow
def test_impossible_pipelines_exit_2_fast(flags, words):
    t = time.monotonic()
    out = cli("minipar.train", "--model", "nano", "--steps", "2", *flags)
    elapsed = time.monotonic() - t
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
    assert elapsed < 30
