"""One home per fact: the closed-form volumes live in the planner (minipar.plan), and the
paradigm modules neither carry a copy nor import the planner.

The measured-vs-formula tests are in test_tp.py, test_zero.py, test_plan_measured.py; here
the planner's pieces are held against each other, against formulas written out, and against
the pipeline simulator; and the timeline drawing is checked the way a notebook checks it.
"""
import ast
import itertools
from pathlib import Path

import pytest

from minipar import plan, pp, schedules
from minipar.plan.sharding import divisors, shard_violation

PACKAGE = Path(__file__).resolve().parent.parent / "minipar"
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def test_zero_traffic_by_group_adds_up_to_the_total():
    units = [1000, 4099, 4099, 517]                 # odd sizes: every buffer is padded
    for d in (1, 2, 3, 4, 6, 8):
        for spec in itertools.product(divisors(d), repeat=3):
            if shard_violation(spec, d):
                continue
            for n_params, m in [(units, 1), (units, 3), (sum(units), 2)]:
                groups = plan.zero_comm_bytes_by_group(n_params, d, spec, dtype="fp32",
                                                       microbatches=m)
                total = plan.zero_comm_bytes(n_params, d, spec, dtype="fp32", microbatches=m)
                for op in OPS:
                    assert sum(g.get(op, 0) for g in groups.values()) == total[op], (d, spec, op)


def test_zero_per_unit_padding_written_out():
    # ZeRO-3 over 3 ranks, fp32: each unit padded to a multiple of 3, all-gathered before
    # forward and backward, reduce-scattered once; the G = OS shard needs nothing more.
    units, d = [10, 7], 3
    padded = 12 + 9
    assert plan.padded_params(units, d) == padded
    assert plan.model_state_bytes(units, d, zero=3, dtype="fp32") == {
        "params": 4 * padded // 3, "grads": 4 * padded // 3, "optimizer": 8 * padded // 3,
        "total": 16 * padded // 3}
    sent = plan.zero_comm_bytes(units, d, zero=3, dtype="fp32")
    assert sent["all_gather"] == 2 * (2 * 4 * padded // 3)
    assert sent["reduce_scatter"] == 2 * 4 * padded // 3 and sent["all_reduce"] == 0
    assert plan.zero_group_span("zero_p", d, zero=3) == 3


@pytest.mark.parametrize("sp", [False, True])
def test_tp_block_bytes_are_the_layers_of_the_whole_model(sp):
    b, s, h, t, layers = 2, 16, 32, 4, 3
    block = plan.tp_block_comm_bytes(b * s, h, t, sp, dtype="fp32")
    whole = plan.tp_comm_bytes(b, s, h, t, layers, sp=sp, dtype="fp32")
    for op in OPS:
        per_block = sum(phase.get(op, 0) for phase in block.values())
        assert layers * per_block == whole[op], op
    ring = 2 * (t - 1) * b * s * h * 4 // t            # one all-reduce of (b, s, h) fp32
    if not sp:
        assert block == {"forward": {"all_reduce": 2 * ring}, "backward": {"all_reduce": 2 * ring}}
    assert plan.tp_block_comm_bytes(b * s, h, 1, sp) == {"forward": {}, "backward": {}}


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_bubble_fraction_is_the_simulated_bubble(schedule, v):
    for p in (2, 4):
        for m in (p, 2 * p, 4 * p):
            simulated = schedules.ideal_timeline(schedule, p, m, v).bubble
            assert simulated == pytest.approx(plan.bubble_fraction(p, m, v))
            assert plan.bubble_fraction(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


def test_a_timeline_converted_twice_is_caught():
    """The notebook 03 figure that showed a solid bar: times converted to ms, then drawn
    with unit="ms" (converted again) on an axis sized for the measured timeline."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from minipar.lab import plots
    seconds = schedules.ideal_timeline("1f1b", 2, 4, t_fwd=0.010, t_bwd=0.020)
    fig, ax = plt.subplots()
    plots.pipeline_timeline(seconds, ax, unit="ms")
    plots.check_timeline_drawn(ax, seconds, unit="ms")
    with pytest.raises(AssertionError):              # a box is missing or misplaced
        plots.check_timeline_drawn(ax, schedules.ideal_timeline("1f1b", 2, 8), unit="ms")
    millis = schedules.ideal_timeline("1f1b", 2, 4, t_fwd=10.0, t_bwd=20.0)
    fig2, ax2 = plt.subplots()
    plots.pipeline_timeline(millis, ax2, unit="ms")
    ax2.set_xlim(0, seconds.makespan * 1e3)
    with pytest.raises(AssertionError, match="cut off"):
        plots.check_timeline_drawn(ax2, millis, unit="ms")
    fig3, ax3 = plt.subplots()                       # ms drawn on a seconds-wide axis
    plots.pipeline_timeline(seconds, ax3, unit="ms")
    ax3.set_xlim(0, seconds.makespan * 1e3 * 1e3)
    with pytest.raises(AssertionError, match="squeezed"):
        plots.check_timeline_drawn(ax3, seconds, unit="ms")
    plt.close("all")


@pytest.mark.parametrize("module", ["dp", "tp", "pp", "zero"])
def test_paradigm_modules_do_not_import_the_planner(module):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ("minipar." if node.level else "") + (node.module or "")
            imported.update(f"{base}.{a.name}" for a in node.names)
            imported.add(base)
    assert not any(name.startswith(("minipar.plan", "minipar.lab", "minipar.bench"))
                   for name in imported), imported
