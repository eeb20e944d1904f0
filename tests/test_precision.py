"""Real mixed precision (--dtype bf16): bytes per rank equal the planner's `mixed` layout, and
every layout trains like the bf16 single-process run within a stated tolerance.

Bytes. bf16 parameters (2 B), bf16 gradients (2 B), fp32 master + Adam m + v (12 B), each
divided by its shard factor, on the padded per-unit count Phi' the engine allocates:

    2 Phi'/s_p + 2 Phi'/s_g + 12 Phi'/s_os   + 4 B per tensor the optimizer updates

(torch's Adam keeps a 4-byte ``step`` for each master tensor: one per parameter tensor under
plain DP, one per unit under ZeRO/AMSP; ``plan.model_state_bytes(..., step_counters=k)``).

Tolerance. bf16 keeps 8 bits of mantissa: one rounding moves a value by up to 2^-9 of it
(eps = 2^-8 = 0.0039 between neighbours). A layout rounds in other places than one process
does (each rank's gradient is rounded to bf16 before the sum over ranks, partial sums come in
another order, a G shard is rounded after each reduce-scatter), so gradients differ by about
an ulp per element. Adam divides by sqrt(v), so an element whose gradient is near zero can
flip sign and move by up to 2 lr a step: single elements are not comparable, norms are.

* last-step gradients: ||g - g_serial|| <= 4 eps ||g_serial|| (measured: about 1 eps);
* parameters: ||theta - theta_serial|| <= 5% of ||theta_serial - theta_0||, the distance
  training moved them (measured: 1 to 2%; bf16 against fp32 serial is about 3%); 10% under
  tensor parallelism, which also rounds the forward pass elsewhere (each rank's partial sum
  of a row-parallel matmul is rounded to bf16 before the all-reduce; measured: 5%);
* loss: |loss - serial bf16 loss| <= 2e-3 at every step (measured: up to 3e-4 in 6 steps).

A wrong average, a missing shard or an update lost in bf16 rounding (what the fp32 masters
are for: ``test_master_weights_keep_updates_bf16_would_round_away``) is far outside these.
fp32 is not touched by any of this: it stays the exact reference (tests/test_zero.py,
tests/test_dp.py run unchanged).
"""
import math

import pytest
import torch

from minipar import plan
from minipar.model import build
from minipar.train import parse_config, run_state
from conftest import quick_tier

STEPS = 4
BF16 = ["--model", "nano", "--batch-size", "8", "--steps", str(STEPS), "--quiet", "--lr", "3e-3",
        "--dtype", "bf16"]
LAYOUTS = {  # name -> (flags, ranks, (s_p, s_g, s_os) or None for plain DP)
    "serial": ([], 1, None),
    "dp2": ([], 2, None),
    "dp2-bucketed-m2": (["--dp-mode", "bucketed", "--microbatches", "2"], 2, None),
    "dp2-naive": (["--dp-mode", "naive"], 2, None),
    "zero1": (["--zero", "1"], 4, (1, 1, 4)),
    "zero2": (["--zero", "2"], 4, (1, 4, 4)),
    "zero3": (["--zero", "3"], 4, (4, 4, 4)),
    "shard1,2,4": (["--shard", "1,2,4"], 4, (1, 2, 4)),
}
OTHERS = {  # bf16 under tensor and pipeline parallelism (same tolerance)
    "tp2+sp": (["--tp", "2", "--sp"], 2, None),
    "pp2": (["--pp", "2"], 2, None),
}
_RUNS = {}


def bf16_run(name, *extra):
    key = (name, *extra)
    if key not in _RUNS:
        flags, n, _ = {**LAYOUTS, **OTHERS}[name]
        _RUNS[key] = run_state(BF16 + flags + list(extra), nproc=n)
    return _RUNS[key]


def unit_sizes():
    return [sum(p.numel() for p in part.parameters()) for part in build("nano").parts()]


def distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in b))


def norm(a: dict) -> float:
    return math.sqrt(sum((v.float() ** 2).sum().item() for v in a.values()))


@pytest.mark.parametrize("name", quick_tier(LAYOUTS, ["serial", "dp2", "zero3", "shard1,2,4"]))
def test_bf16_model_state_bytes_equal_the_planners_mixed_layout(name):
    _, d, spec = LAYOUTS[name]
    if spec is None:   # plain DP: every rank a full replica, one master per parameter tensor
        phi, counters, spec = sum(unit_sizes()), len(list(build("nano").parameters())), (1, 1, 1)
    else:              # ZeRO/AMSP: per-unit flat buffers padded to s_os, one master per unit
        phi = sum(math.ceil(n / spec[2]) * spec[2] for n in unit_sizes())
        counters = len(unit_sizes())
    s_p, s_g, s_os = spec
    expected = dict(params=2 * phi // s_p, grads=2 * phi // s_g,
                    optimizer=12 * phi // s_os + 4 * counters)
    expected["total"] = sum(expected.values())
    predicted = plan.model_state_bytes(phi, d, shard=spec, dtype="mixed", step_counters=counters)
    assert predicted == expected
    for record in bf16_run(name)["history"]:
        assert record["model_state_bytes"] == expected, (name, record["step"])


@pytest.mark.parametrize("name", [n for n in {**LAYOUTS, **OTHERS} if n != "serial"])
def test_bf16_layouts_train_like_bf16_serial(name):
    got, ref = bf16_run(name), bf16_run("serial")
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= 2e-3, f"step {step}: loss {a} vs bf16 serial {b}"
    assert all(p.dtype == torch.bfloat16 for p in got["params"].values())
    theta0 = {k: v.detach().to(torch.bfloat16) for k, v in build("nano").named_parameters()}
    moved = 0.10 if name.startswith("tp") else 0.05
    assert distance(got["params"], ref["params"]) <= moved * distance(ref["params"], theta0)
    assert distance(got["grads"], ref["grads"]) <= 4 * 2**-8 * norm(ref["grads"])


def test_bf16_tensor_parallel_bytes_equal_the_planner():
    """Each TP rank keeps the norms, row biases and positions whole (plan.stage_params)."""
    shape = plan.model_preset("nano")
    counters = len(list(build("nano").parameters()))    # TP keeps the serial tensors' count
    predicted = plan.model_state_bytes(shape, 1, tp=2, dtype="mixed", step_counters=counters)
    assert bf16_run("tp2+sp")["history"][-1]["model_state_bytes"] == predicted


def test_master_weights_keep_updates_bf16_would_round_away():
    """1.0 - 1e-4 is 1.0 in bf16 (its neighbours are 2^-8 apart): SGD on bf16 weights alone
    would never move; on the fp32 master, 100 such steps add up to 0.99."""
    from minipar.precision import MixedPrecision
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MixedPrecision([w], lambda ps: torch.optim.SGD(ps, lr=1e-4))
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    sgd = torch.optim.SGD([plain], lr=1e-4)
    for _ in range(100):
        for p in (w, plain):
            p.grad = torch.ones_like(p)
        opt.step()
        sgd.step()
    assert torch.equal(plain, torch.ones_like(plain))
    assert opt.masters[0].dtype == torch.float32
    torch.testing.assert_close(opt.masters[0], torch.full((4,), 0.99), rtol=0, atol=1e-5)
    assert torch.equal(w.detach(), opt.masters[0].to(torch.bfloat16))
    assert opt.masters[0].grad is None            # the fp32 gradient is transient


def test_reduce_dtype_sets_the_gradient_bytes_on_the_wire():
    """fp32 reduction (the default) sends 4-byte gradients, bf16 reduction 2-byte ones; the
    parameter all-gathers carry bf16 either way. The planner's `mixed` traffic is the bf16
    reduction; with fp32 reduction its gradient collectives are the `fp32` ones."""
    d, spec = 4, (1, 2, 4)
    phi = sum(unit_sizes())                 # nano's units divide by 4: no padding
    mixed = plan.zero_comm_bytes(phi, d, shard=spec, dtype="mixed")
    fp32 = plan.zero_comm_bytes(phi, d, shard=spec, dtype="fp32")
    wide = bf16_run("shard1,2,4")["history"][-1]["comm_bytes"]
    narrow = bf16_run("shard1,2,4", "--reduce-dtype", "bf16")["history"][-1]["comm_bytes"]
    assert narrow == {op: mixed[op] for op in ("reduce_scatter", "all_gather")}
    assert wide == {"reduce_scatter": fp32["reduce_scatter"], "all_gather": mixed["all_gather"]}
    got, ref = bf16_run("shard1,2,4", "--reduce-dtype", "bf16"), bf16_run("serial")
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 2e-3
    dp = bf16_run("dp2")["history"][-1]["comm_bytes"]
    assert dp == {"all_reduce": plan.zero_comm_bytes(phi, 2, zero=0, dtype="fp32")["all_reduce"]}


def test_reduce_dtype_bf16_needs_bf16():
    from minipar.runtime.dist import UsageError
    with pytest.raises(UsageError, match="needs --dtype bf16"):
        parse_config(["--reduce-dtype", "bf16"])
    assert parse_config(["--dtype", "bf16"]).reduce_dtype == "fp32"


def test_bf16_clipping_scales_the_fp32_master_gradients_as_serial_does():
    """--clip-grad under bf16 clips the masters' fp32 gradients (the hook runs on the fp32
    optimizer); ZeRO-1 over 2 ranks follows the bf16 serial run, and the norm really clips."""
    from minipar.train import run_state
    flags = ["--model", "nano", "--batch-size", "8", "--steps", "4", "--quiet", "--lr", "3e-3",
             "--dtype", "bf16", "--clip-grad", "0.5"]
    serial = run_state(flags, nproc=1)
    sharded = run_state(flags + ["--zero", "1"], nproc=2)
    assert all(h["grad_norm"] > 0.5 for h in serial["history"])
    unclipped = run_state([f for f in flags if f not in ("--clip-grad", "0.5")], nproc=1)
    # the same deterministic run without clipping ends elsewhere: clipping acted
    assert abs(unclipped["losses"][-1] - serial["losses"][-1]) > 1e-4
    for a, b in zip(sharded["history"], serial["history"]):
        assert abs(a["loss"] - b["loss"]) <= 2e-3
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 0.02 * b["grad_norm"]   # bf16 gradients


# --------------------------------------------------------------------------------------
# fp16: dynamic loss scaling (same bounds as bf16: fp16 keeps 10 mantissa bits to bf16's 7,
# so its rounding differences are smaller; the gradients compared are the 16-bit ones, scaled
# by the same loss scale in every layout)
# --------------------------------------------------------------------------------------
FP16 = [f if f != "bf16" else "fp16" for f in BF16]


def test_fp16_model_state_bytes_equal_the_planners_mixed_layout():
    """fp16 holds what bf16 holds: 2 + 2 + 12 bytes per parameter (plan's `mixed`)."""
    phi, counters = sum(unit_sizes()), len(list(build("nano").parameters()))
    expected = plan.model_state_bytes(phi, 2, shard=(1, 1, 1), dtype="mixed",
                                      step_counters=counters)
    got = run_state(FP16, nproc=2)
    for record in got["history"]:
        assert record["model_state_bytes"] == expected
        assert record["loss_scale"] == 2.0**16 and record["skipped_steps"] == 0
    assert all(p.dtype == torch.float16 for p in got["params"].values())


def _overflow_run(flags, nproc, at):
    from faults import Overflow
    rank, step = map(int, at.split(":"))
    return run_state(FP16 + flags, nproc=nproc, hooks=Overflow(rank, step).hooks())


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(flags):
    """Rank 1 alone gets an inf gradient at step 2 (its TP slice, or the last pipeline stage):
    the found-inf flag reduced over the world makes every rank skip that step and halve the
    scale, so the run follows the serial run that skipped the same step, not one that took it."""
    got = _overflow_run(flags, 2, "1:2")
    skipped_serial = _overflow_run([], 1, "0:2")
    plain_serial = run_state(FP16, nproc=1)
    scales = [h["loss_scale"] for h in got["history"]]
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15]          # used at each step
    assert [h["skipped_steps"] for h in got["history"]] == [0, 1, 1, 1]
    assert got["history"][1]["grad_norm"] is None                  # nothing measured or clipped
    assert [h["loss_scale"] for h in skipped_serial["history"]] == scales
    theta0 = {k: v.detach().to(torch.float16) for k, v in build("nano").named_parameters()}
    moved = distance(skipped_serial["params"], theta0)
    assert distance(got["params"], skipped_serial["params"]) <= 0.10 * moved
    # the skipped step really left its mark: the run that took every step ends elsewhere
    assert distance(plain_serial["params"], skipped_serial["params"]) > 0.10 * moved
    for step, (a, b) in enumerate(zip(got["losses"], skipped_serial["losses"]), 1):
        assert abs(a - b) <= 2e-3, f"step {step}: loss {a} vs serial {b}"
