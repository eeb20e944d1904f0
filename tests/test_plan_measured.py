"""The planner's predictions against minipar's own measurements on this machine.

Each test runs the real trainer (``minipar.train``, nano model, 2 steps, 2 or 4 gloo ranks)
and holds its measured ``model_state_bytes`` and ``comm_bytes`` metrics against the
planner's closed forms, byte for byte. The planner never sees the run: it gets only the
shape (parameter count, b, s, h, layers) and the layout.

tests/test_zero.py already holds every ZeRO stage and AMSP spec (1,2,4 and 2,2,4 included)
against ``plan.model_state_bytes`` and ``plan.zero_comm_bytes`` exactly; this file covers
what it does not: plain data parallelism (``minipar.dp``, no --zero), tensor parallelism
and pipeline parallelism. Step *times* are compared only in ``python -m minipar.plan
validate`` (a shared 2-core machine is too noisy for a test); here they get a sanity bound.
"""
import pytest

from minipar import plan
from minipar.model import build
from minipar.plan.measure import model_states_vs_plan, validate_step_time
from minipar.train import run

MODEL = "nano"
SHAPE = plan.model_preset(MODEL)
B = 8                                     # global batch, sequences
ARGS = ["--model", MODEL, "--batch-size", str(B), "--steps", "2", "--quiet", "--lr", "3e-3"]
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def last_step(*flags):
    """Rank 0's metrics of the last step."""
    return run(ARGS + list(flags))[-1]


def tensors(*modules):
    """Parameter tensors: torch's Adam keeps a 4-byte step counter for each it updates."""
    return sum(len(list(m.parameters())) for m in modules)


def test_plain_data_parallel_states_and_all_reduce():
    d = 4
    got = last_step("--nproc", str(d))
    predicted = plan.model_state_bytes(SHAPE.params, d, zero=0, dtype="fp32",
                                       step_counters=tensors(build(MODEL)))
    assert got["model_state_bytes"] == predicted
    planned = plan.zero_comm_bytes(SHAPE.params, d, zero=0, dtype="fp32")
    assert planned["all_reduce"] > 0
    assert got["comm_bytes"] == {"all_reduce": planned["all_reduce"]}


def test_tensor_parallel_bytes_with_the_vocab_parallel_ends():
    t = 2
    got = last_step("--nproc", str(t), "--tp", str(t))
    planned = plan.tp_comm_bytes(B, SHAPE.seq_len, SHAPE.hidden, t, SHAPE.layers,
                                 dtype="fp32", ends=True)
    sent = got["comm_bytes"]
    for op in OPS:
        assert sent.get(op, 0) == planned[op], (op, sent, planned)
    # the layers alone leave out the embedding's g, the head's f and the loss's all-reduces
    layers_only = plan.tp_comm_bytes(B, SHAPE.seq_len, SHAPE.hidden, t, SHAPE.layers,
                                     dtype="fp32")
    assert sent["all_reduce"] - layers_only["all_reduce"] == (
        2 * B * SHAPE.seq_len * SHAPE.hidden * 4 + 3 * B * SHAPE.seq_len * 4)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_point_to_point_bytes_and_stage_states(schedule, v):
    p, m = 2, 4
    got = last_step("--nproc", str(p), "--pp", str(p), "--microbatches", str(m),
                    "--schedule", schedule, "--chunks", str(v))
    planned = plan.pp_comm_bytes(B // m, SHAPE.seq_len, SHAPE.hidden, p, m, v=v, stage=0,
                                 dtype="fp32")
    assert got["comm_bytes"].get("send") == planned["send"] > 0      # rank 0 is stage 0
    assert not any(got["comm_bytes"].get(op) for op in OPS + ("recv",))
    # the heaviest stage is the first: the embedding and L/p blocks (which blocks, with
    # interleaving, does not matter: they are alike); the metric is the max over ranks
    model = build(MODEL)
    first = [model.embed, *model.blocks[:SHAPE.layers // p]]
    predicted = plan.model_state_bytes(plan.stage_params(SHAPE, pp=p), 1, dtype="fp32",
                                       step_counters=tensors(*first))
    assert got["model_state_bytes"] == predicted


def test_notebook_helper_agrees_for_zero1():
    out = model_states_vs_plan(["--nproc", "2", "--zero", "1"], model=MODEL, batch_size=B)
    assert out["spec"] == (1, 1, 2)
    assert out["measured"] == out["predicted"]


def test_step_time_validation_runs():
    """Only a sanity bound: the figures are reported by ``python -m minipar.plan validate``."""
    out = validate_step_time(MODEL, {"1 rank": ["--nproc", "1"]}, steps=3, batch_size=B,
                             hardware="laptop-cpu")
    (row,) = out["rows"]
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert 1e-4 < row["ratio"] < 1e4
