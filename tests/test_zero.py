"""ZeRO-1/2/3 and AMSP's partial specs (minipar.zero) on 4 gloo ranks with the nano model.

Every run is compared with something independent of minipar.zero: the single-process run
(losses, final parameters, last-step gradients), closed-form formulas written out here for
memory and traffic, and torch's own ZeroRedundancyOptimizer and FSDP2 on the same model.
"""
import math

import pytest

import torch

from conftest import NANO, assert_same_training, cli, quick_tier, serial_state
from minipar import dp, zero
from minipar.runtime import dist
from minipar.runtime.errors import UsageError
from minipar.model import build
from minipar.train import parse_config, run_state

D = 4
SPECS = {  # name -> (trainer flags, (s_p, s_g, s_os))
    "zero0": (["--zero", "0"], (1, 1, 1)),
    "zero1": (["--zero", "1"], (1, 1, D)),
    "zero2": (["--zero", "2"], (1, D, D)),
    "zero3": (["--zero", "3"], (D, D, D)),
    "shard1,2,4": (["--shard", "1,2,4"], (1, 2, 4)),
    "shard2,2,4": (["--shard", "2,2,4"], (2, 2, 4)),
}
_RUNS = {}


def sharded_run(name):
    if name not in _RUNS:
        _RUNS[name] = run_state(NANO + SPECS[name][0], nproc=D)
    return _RUNS[name]


def unit_sizes(model_name="nano"):
    """Parameters of each unit the engine shards: the model's parts (embedding, blocks, head)."""
    return [sum(p.numel() for p in part.parameters()) for part in build(model_name).parts()]


def padded_phi(s_os, sizes):
    """Phi': each unit's flat buffer is padded up to a multiple of s_os (the largest group)."""
    return sum(math.ceil(n / s_os) * s_os for n in sizes)


def formula_state_bytes(spec, sizes):
    """fp32 Adam: 4 Phi'/s_p + 4 Phi'/s_g + 8 Phi'/s_os, plus Adam's 4-byte step counter per
    unit (the optimizer sees one flat tensor per unit)."""
    s_p, s_g, s_os = spec
    phi = padded_phi(s_os, sizes)
    out = dict(params=4 * phi // s_p, grads=4 * phi // s_g,
               optimizer=8 * phi // s_os + 4 * len(sizes))
    out["total"] = sum(out.values())
    return out


def formula_comm_bytes(spec, d, sizes, m=1):
    """Bytes one rank sends per step (ring volumes, Psi = 4 Phi' bytes, m micro-batches):

    all_gather      2m (s_p-1)/s_p Psi (forward + backward)  +  (s_os-s_p)/s_os Psi/s_p (after step)
    reduce_scatter  m (s_g-1)/s_g Psi (G group)  +  (s_os-s_g)/s_os Psi/s_g (down to the OS shard)
    all_reduce      2 (r-1)/r Psi/s_os across the r = d/s_os replica groups
    """
    s_p, s_g, s_os = spec
    psi = 4 * padded_phi(s_os, sizes)
    r = d // s_os
    return dict(all_gather=2 * m * (s_p - 1) / s_p * psi + (s_os - s_p) / s_os * psi / s_p,
                reduce_scatter=m * (s_g - 1) / s_g * psi + (s_os - s_g) / s_os * psi / s_g,
                all_reduce=2 * (r - 1) / r * psi / s_os)


def close(measured, expected, rel=0.01):
    return abs(measured - expected) <= rel * expected


@pytest.mark.parametrize("name", quick_tier(SPECS, ["zero1", "zero3", "shard1,2,4"]))
def test_same_training_as_one_process(name):
    assert_same_training(sharded_run(name), serial_state())


@pytest.mark.parametrize("name", quick_tier(SPECS, ["zero1", "zero3", "shard1,2,4"]))
def test_model_state_bytes_equal_the_formula(name):
    spec = SPECS[name][1]
    expected = formula_state_bytes(spec, unit_sizes())
    for record in sharded_run(name)["history"]:
        got = record["model_state_bytes"]
        for key in expected:
            assert close(got[key], expected[key]), (
                f"{name} step {record['step']} {key}: {got} vs {expected}")
    # the ZeRO paper's per-rank numbers, fp32 (16 Phi for plain DP)
    phi, s_p, s_g, s_os = sum(unit_sizes()), *spec
    paper = 4 * phi / s_p + 4 * phi / s_g + 8 * phi / s_os
    assert close(got["total"], paper)
    if name == "zero0":
        assert close(got["total"], 16 * phi)
    try:  # the planner, when it is there, must agree
        from minipar.plan.memory import model_state_bytes as plan_bytes
    except ImportError:
        return
    # every spec minipar runs (1,2,4 too), byte for byte: fp32, Adam's step counter per unit
    assert plan_bytes(phi, D, shard=spec, dtype="fp32", step_counters=len(unit_sizes())) == got
    assert plan_bytes(unit_sizes(), D, shard=spec, dtype="fp32",
                      step_counters=len(unit_sizes())) == got


@pytest.mark.parametrize("name", SPECS)
def test_communication_bytes_equal_the_formula(name):
    spec = SPECS[name][1]
    expected = formula_comm_bytes(spec, D, unit_sizes())
    for record in sharded_run(name)["history"]:
        sent = record["comm_bytes"]
        assert set(sent) == {op for op, b in expected.items() if b > 0}, sent
        for op, b in sent.items():
            assert close(b, expected[op]), (
                f"{name} step {record['step']} {op}: {b} vs {expected[op]}")
    # the ZeRO paper's volumes: 2 Psi (d-1)/d for DP, ZeRO-1 and ZeRO-2, 3 Psi (d-1)/d for ZeRO-3
    psi = 4 * sum(unit_sizes())
    paper = {"zero0": 2, "zero1": 2, "zero2": 2, "zero3": 3}
    if name in paper:
        assert close(sum(sent.values()), paper[name] * psi * (D - 1) / D)
    if name == "zero0":
        assert set(sent) == {"all_reduce"}
    elif name in ("zero1", "zero2"):
        assert set(sent) == {"reduce_scatter", "all_gather"}
    try:  # the planner, when it is there, must agree
        from minipar.plan.network import zero_comm_bytes
    except ImportError:
        return
    for n_params in (sum(unit_sizes()), unit_sizes()):   # one buffer, or the engine's units
        planned = zero_comm_bytes(n_params, D, shard=spec, dtype="fp32")
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            assert sent.get(op, 0) == planned[op], f"{name} {op}: measured {sent} planned {planned}"


_TWINS = {}


def torch_twin(kind):
    """torch's ZeroRedundancyOptimizer (over DDP) and FSDP2 fully_shard, trained like the
    trainer on the same ranks, data and model (one launch for both)."""
    if not _TWINS:
        from minipar.bench.zero import train_twins
        _TWINS.update(dist.launch(train_twins, D, kinds=["zro", "fsdp2"], timeout=240)[0])
    return _TWINS[kind]


@pytest.mark.slow
def test_zero1_equals_torch_zero_redundancy_optimizer():
    assert_same_training(dict(torch_twin("zro"), grads={}), sharded_run("zero1"),
                         check_grads=False)


@pytest.mark.slow
def test_zero3_equals_torch_fsdp2():
    assert_same_training(dict(torch_twin("fsdp2"), grads={}), sharded_run("zero3"),
                         check_grads=False)


def test_padding_uneven_shards_and_no_prefetch():
    """3 ranks: the units do not divide by 3, so every flat buffer is padded; ZeRO-3 without
    prefetching and with two micro-batches still trains exactly like one process."""
    from minipar.bench.zero import train_twin
    out = dist.launch(train_twin, 3, kind="zero3-noprefetch", model_name="nano", steps=20,
                      batch=6, lr=3e-3, seed=0, microbatches=2, timeout=240)
    ref = serial_state(["--batch-size", "6"])
    assert_same_training(dict(out[0], grads={}), ref, check_grads=False)
    sizes = unit_sizes()
    assert padded_phi(3, sizes) > sum(sizes)
    expected = formula_state_bytes((3, 3, 3), sizes)
    for r in out:
        assert r["state"] == expected
    for op, b in formula_comm_bytes((3, 3, 3), 3, sizes, m=2).items():
        assert close(out[0]["comm_bytes"].get(op, 0), b) if b else op not in out[0]["comm_bytes"]
    # the planner, given the engine's units, pads each as the engine does: byte for byte
    from minipar.plan import model_state_bytes, zero_comm_bytes
    assert model_state_bytes(sizes, 3, shard=(3, 3, 3), dtype="fp32",
                             step_counters=len(sizes)) == out[0]["state"]
    planned = zero_comm_bytes(sizes, 3, shard=(3, 3, 3), dtype="fp32", microbatches=2)
    assert {op: b for op, b in planned.items() if b and op != "total"} == out[0]["comm_bytes"]


def _check(*flags, nproc=D):
    return parse_config(["--nproc", str(nproc), "--model", "nano", "--batch-size", "8", *flags])


@pytest.mark.parametrize("flags,message", [
    (["--shard", "4,2,1"], "s_p <= s_g <= s_os"),
    (["--shard", "1,2,8"], "s_p <= s_g <= s_os <= dp=4"),
    (["--shard", "3,3,3"], "does not divide dp=4"),
    (["--shard", "1,2"], "three integers"),
    (["--shard", "a,b,c"], "three integers"),
    (["--shard", "0,1,1"], "1 <= s_p"),
    (["--zero", "1", "--shard", "1,1,4"], "not both"),
])
def test_invalid_specs_are_usage_errors(flags, message):
    with pytest.raises(dist.UsageError, match=message):
        _check(*flags)


def test_nested_factors_are_required():
    with pytest.raises(dist.UsageError, match="s_p must divide s_g"):
        _check("--shard", "2,3,6", "--batch-size", "12", nproc=12)


@pytest.mark.parametrize("flags", [
    ["--tp", "2", "--sp", "--zero", "3"],                                # ZeRO-3 inside TP
    ["--pp", "2", "--schedule", "interleaved", "--shard", "2,2,2"],      # P sharding under PP
])
@pytest.mark.slow
def test_composes_with_tensor_and_pipeline_parallelism(flags):
    """dp = 2 lines of 2 ranks each: the shard groups live inside each DP line of the grid."""
    got = run_state(NANO + flags, nproc=D)
    assert_same_training(got, serial_state())
    assert got["history"][-1]["comm_bytes"]["reduce_scatter"] > 0


@pytest.mark.slow
def test_zero3_under_tensor_and_pipeline_parallelism():
    """All three at once (dp2 x pp2 x tp2): the TP embedding is a unit of the stage too."""
    got = run_state(NANO + ["--tp", "2", "--pp", "2", "--dp", "2", "--zero", "3"], nproc=8)
    assert_same_training(got, serial_state())
    assert got["history"][-1]["comm_bytes"]["all_gather"] > 0


@pytest.mark.slow
def test_invalid_spec_exits_2_with_one_line():
    res = cli("minipar.train", "--nproc", "4", "--model", "nano", "--shard", "4,2,1")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "s_p <= s_g <= s_os" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def _sharded_beside_part_of_dp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    dp.DataParallel(model[0])                      # the second layer is outside it
    # beside a DataParallel over the whole model, a frozen weight is no reason to refuse
    whole = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    whole[0].weight.requires_grad_(False)
    dp.DataParallel(whole)
    zero.ShardedOptimizer(whole.parameters(), torch.optim.SGD, stage=1, lr=0.1)
    try:
        zero.ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.1)
    except UsageError as e:
        return str(e)
    return None


def test_sharded_optimizer_beside_a_data_parallel_over_part_of_its_parameters_is_refused():
    """The parameters outside the DataParallel would step on each rank's own gradient."""
    for message in dist.launch(_sharded_beside_part_of_dp, 2):
        assert message and "outside the DataParallel" in message
