"""The planner's predictions against minipar's own measurements on this machine.

Each test runs the real trainer (``minipar.train``, nano model, 2 steps, 2 or 4 gloo ranks)
and holds its measured ``model_state_bytes`` and ``comm_bytes`` metrics against the
planner's closed forms, byte for byte. The planner never sees the run: it gets only the
shape (parameter count, b, s, h, layers) and the layout.

tests/test_zero.py already holds every ZeRO stage and AMSP spec (1,2,4 and 2,2,4 included)
against ``plan.model_state_bytes`` and ``plan.zero_comm_bytes`` exactly; this file covers
what it does not: plain data parallelism (``minipar.dp``, no --zero), tensor parallelism
(with and without sequence parallelism), pipeline parallelism and both together. The
trainer's byte vocabulary (256) divides every legal t, so one more test parallelizes small
GPTs with an odd vocabulary and no biases over 3 ranks and counts what they hold and send.
Step *times* are compared only in ``python -m minipar.bench validate`` (a shared 2-core
machine is too noisy for a test); here they get a sanity bound.
"""
import dataclasses
import functools

import pytest
import torch

from minipar import plan
from minipar.model import build
from minipar.runtime.errors import UsageError
from minipar.bench.validate import minipar_overlap, model_states_vs_plan, validate_step_time
from minipar.train import run

MODEL = "nano"
SHAPE = plan.model_preset(MODEL)
B = 8                                     # global batch, sequences
ARGS = ["--model", MODEL, "--batch-size", str(B), "--steps", "2", "--quiet", "--lr", "3e-3"]
OPS = ("all_reduce", "reduce_scatter", "all_gather")


@functools.lru_cache(maxsize=None)
def last_step(*flags):
    """Rank 0's metrics of the last step (a run shared by the tests that read it)."""
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


def test_tensor_parallel_model_states_per_rank():
    """Every TP rank keeps the norms, row biases and position table whole: Phi/t is short."""
    t = 2
    got = last_step("--nproc", str(t), "--tp", str(t))
    predicted = plan.model_state_bytes(SHAPE, 1, tp=t, dtype="fp32",
                                       step_counters=tensors(build(MODEL)))
    assert got["model_state_bytes"] == predicted
    assert predicted["params"] == 4 * plan.stage_params(SHAPE, tp=t) == 4 * 34_560
    even = plan.model_state_bytes(SHAPE.params, 1, tp=t, dtype="fp32")
    assert even["params"] == 4 * 33_888 < predicted["params"]     # what a bare count gives


def test_sequence_parallel_bytes_include_the_replicated_gradients():
    """With --sp the partial gradients of the replicated parameters are all-reduced every
    micro-batch: 2 micro-batches tell per micro-batch from per step."""
    t, m = 2, 2
    got = last_step("--nproc", str(t), "--tp", str(t), "--sp", "--microbatches", str(m))
    planned = plan.tp_comm_bytes(B // m, SHAPE.seq_len, SHAPE.hidden, t, SHAPE.layers, m,
                                 sp=True, dtype="fp32", ends=True)
    sent = got["comm_bytes"]
    assert {op: sent.get(op, 0) for op in OPS} == {op: planned[op] for op in OPS}, (sent,
                                                                                      planned)
    # beyond the loss's 3 all-reduces of b s fp32 values, per micro-batch: 6 h-vectors a
    # layer, the final LayerNorm's 2, the position table (ring factor 2(t-1)/t = 1 for t = 2)
    h, s = SHAPE.hidden, SHAPE.seq_len
    assert sent["all_reduce"] == m * (3 * (B // m) * s * 4 + (6 * SHAPE.layers + 2) * h * 4
                                      + s * h * 4)


def test_tensor_and_pipeline_parallel_heaviest_stage():
    t, p, m = 2, 2, 2
    got = last_step("--nproc", str(t * p), "--tp", str(t), "--pp", str(p),
                    "--microbatches", str(m))
    model = build(MODEL)
    first = [model.embed, *model.blocks[:SHAPE.layers // p]]       # heavier than the last
    predicted = plan.model_state_bytes(SHAPE, 1, tp=t, pp=p, dtype="fp32",
                                       step_counters=tensors(*first))
    assert got["model_state_bytes"] == predicted
    # rank 0 (stage 0, TP rank 0) sends m activations, whole (minipar splits them only
    # under SP), and the layers' and the embedding's all-reduces
    assert got["comm_bytes"].get("send") == plan.pp_comm_bytes(
        B // m, SHAPE.seq_len, SHAPE.hidden, p, m, dtype="fp32")["send"]
    layers = plan.tp_comm_bytes(B // m, SHAPE.seq_len, SHAPE.hidden, t, SHAPE.layers // p, m,
                                dtype="fp32")
    assert got["comm_bytes"]["all_reduce"] == layers["all_reduce"] + m * (B // m) * (
        SHAPE.seq_len * SHAPE.hidden * 4)


ODD = [dict(vocab_size=250, seq_len=6, n_layer=2, n_head=3, d_model=24, bias=True),
       dict(vocab_size=250, seq_len=6, n_layer=2, n_head=3, d_model=24, bias=False)]


def _held_and_sent(t, configs, b):
    """On each of t ranks: the parameters this TP rank holds, and the bytes one SP forward
    and backward of b sequences sends, for each config."""
    from minipar import comm, tp
    from minipar.mesh import Mesh as Grid
    from minipar.model import GPTConfig
    torch.set_num_threads(1)
    grid, out = Grid(1, 1, t), []
    for kw in configs:
        cfg = GPTConfig(**kw)
        model = tp.parallelize(build(cfg, seed=0), grid.group("tp"), sequence_parallel=True)
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1),
                            generator=torch.Generator().manual_seed(0))
        comm.reset()
        model(idx[:, :-1], idx[:, 1:]).backward()
        out.append((sum(p.numel() for p in model.parameters()), comm.stats.bytes_by_op()))
    return out


def test_padded_vocabulary_and_no_biases_over_three_ranks():
    from minipar.runtime.dist import launch
    t, b = 3, 2
    for rank_result in launch(_held_and_sent, t, t=t, configs=ODD, b=b):
        for kw, (held, sent) in zip(ODD, rank_result):
            shape = plan.ModelShape("odd", "gpt", kw["n_layer"], kw["d_model"], kw["n_head"],
                                    kw["vocab_size"], kw["seq_len"], tied_head=False,
                                    bias=kw["bias"])
            assert held == plan.stage_params(shape, tp=t), kw       # 250 rows padded to 252
            planned = plan.tp_comm_bytes(b, shape.seq_len, shape.hidden, t, shape.layers,
                                         sp=True, dtype="fp32", ends=True, bias=kw["bias"])
            assert {op: sent.get(op, 0) for op in OPS} == {op: planned[op] for op in OPS}, kw


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
    """Only a sanity bound: the figures are reported by ``python -m minipar.bench validate``.
    A preset's constants are assumptions: no row is a calibration point."""
    out = validate_step_time(MODEL, {"1 rank": ["--nproc", "1"]}, steps=3, batch_size=B,
                             hardware="laptop-cpu")
    (row,) = out["rows"]
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    assert 1e-4 < row["ratio"] < 1e4
    assert out["calibration_point"] is None and row["calibration"] is False


def test_validation_marks_the_calibration_point():
    """Hardware whose step_calibration came from a one-process step of this model and batch:
    that row is the calibration point, the data-parallel one is not. With the calibration
    step's time over the model's prediction as the factor, the 1-rank prediction is that
    time exactly."""
    from minipar.plan.compute import compute_parts
    hw = plan.load_hardware("laptop-cpu")
    seconds = 0.05
    step = {"model": MODEL, "batch_size": B, "seconds": seconds}
    predicted = compute_parts(SHAPE, hw, plan.Layout(micro_batch=B), "fp32")["total"]
    hw = dataclasses.replace(hw, step_calibration=seconds / predicted,
                             sources={"calibration_step": step})
    out = validate_step_time(MODEL, {"1 rank": ["--nproc", "1"], "DP 2": ["--nproc", "2"]},
                             steps=2, batch_size=B, hardware=hw)
    one, two = out["rows"]
    assert out["calibration_point"] == "1 rank"
    assert (one["calibration"], two["calibration"]) == (True, False)
    assert one["predicted_s"] == pytest.approx(seconds)
    other = dataclasses.replace(hw, sources={"calibration_step": {**step, "batch_size": 2 * B}})
    out = validate_step_time(MODEL, {"1 rank": ["--nproc", "1"]}, steps=2, batch_size=B,
                             hardware=other)
    assert out["calibration_point"] is None
    # the first step warms up and is not timed: one step leaves nothing to time
    with pytest.raises(UsageError, match="--steps must be at least 2"):
        validate_step_time(MODEL, {"1 rank": ["--nproc", "1"]}, steps=1, batch_size=B,
                           hardware=other)


def test_dp_overlap_is_what_the_buckets_allow():
    """tiny's 3.5 MB of fp32 gradients fill one 4 MiB bucket: its all-reduce starts after
    backward, nothing hides. Smaller buckets: all but the last bucket can hide."""
    from minipar.dp import make_buckets
    tiny = ["--model", "tiny", "--batch-size", "16", "--nproc", "2"]
    assert 4 * plan.model_preset("tiny").params < 4 * 2**20
    assert minipar_overlap(tiny) == 0.0
    k = len(make_buckets(list(build("tiny").parameters()), int(0.5 * 2**20)))
    assert k >= 7                                    # 3.5 MB in half-MiB buckets
    assert minipar_overlap(tiny + ["--bucket-mb", "0.5"]) == pytest.approx((k - 1) / k)
    assert minipar_overlap(tiny + ["--bucket-mb", "0.5", "--dp-mode", "bucketed"]) == 0.0
    assert minipar_overlap(["--model", "tiny", "--nproc", "1"]) == 0.0
    assert minipar_overlap(tiny + ["--zero", "1"]) is None        # the planner's assumption
