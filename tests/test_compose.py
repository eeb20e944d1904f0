"""Every feature composes with every layout: the composition matrix.

Cells are layouts (DP, ZeRO-1/2/3, an AMSP spec, TP+SP, PP with each schedule, TP x PP, 3D)
crossed with precisions (fp32, bf16, fp16), dense and MoE, recompute none/full, and
save-in-one-layout-resume-in-another. Every cell is held against its serial twin, the
single-process run of the same flags, computed once per flag set.

Cheap by construction: all cells of one world size run in ONE ``dist.launch``, in sequence,
through ``train.worker`` (each builds its own mesh and engines); the serial twins run in this
process. ``nano`` model, 4 steps.

Tolerances. fp32: the layouts only reorder sums, so losses within 1e-5 and parameters and
gradients within 1e-4 (``conftest.assert_same_training``, the suite's standard). bf16 and
fp16: the bounds of ``tests/test_precision.py`` (derived there): loss within 2e-3 of the
16-bit serial run at every step, final parameters within 5% of the distance training moved
them (10% under TP, which also rounds each rank's partial matmul sums), last-step gradients
within 4 eps(bf16) of their norm. fp16 keeps 10 mantissa bits against bf16's 7, so the bf16
bounds hold it with room (its gradients are scaled by the same loss scale in every layout,
so they compare as they are).
"""
import dataclasses
import math
import os

import pytest
import torch

from conftest import assert_same_training
from minipar.runtime import dist
from minipar.model import build
from minipar.train.loop import Hooks, with_state

STATE = Hooks(end=with_state)   # every rank returns its history, parameters and gradients

STEPS = 4
BASE = ["--model", "nano", "--batch-size", "8", "--steps", str(STEPS), "--quiet", "--lr", "3e-3"]
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]

# name -> (flags beyond BASE, world). The quick tier runs QUICK; the rest is marked slow.
CELLS_4 = {
    "dp4": ([], 4),
    "zero1": (["--zero", "1"], 4),
    "zero2": (["--zero", "2"], 4),
    "zero3": (["--zero", "3"], 4),
    "shard1,2,4": (["--shard", "1,2,4"], 4),
    "tp2+sp": (["--tp", "2", "--sp"], 4),
    "pp2-gpipe": (["--pp", "2", "--schedule", "gpipe"], 4),
    "pp2-1f1b": (["--pp", "2", "--schedule", "1f1b"], 4),
    "pp2-interleaved": (["--pp", "2", "--schedule", "interleaved", "--microbatches", "4"], 4),
    "tp2xpp2": (["--tp", "2", "--sp", "--pp", "2"], 4),
    "zero1+tp2": (["--zero", "1", "--tp", "2"], 4),
    "dp4-recompute": (["--recompute", "full"], 4),
    "tp2+sp-recompute": (["--tp", "2", "--sp", "--recompute", "full"], 4),
    "pp2-recompute": (["--pp", "2", "--recompute", "full"], 4),
    "moe-ep2": (MOE + ["--ep", "2"], 4),
    "moe-ep4-zero1": (MOE + ["--ep", "4", "--zero", "1"], 4),
    "moe-ep2-zero3": (MOE + ["--ep", "2", "--zero", "3"], 4),
    # clipping below the norm: under fp16 the experts' gradients must enter the norm unscaled
    "moe-ep2-zero1-clip": (MOE + ["--ep", "2", "--zero", "1", "--clip-grad", "0.05"], 4),
    "moe-ep2+tp2": (MOE + ["--ep", "2", "--tp", "2"], 4),
    "moe-ep2+pp2": (MOE + ["--ep", "2", "--pp", "2"], 4),
    "moe-ep2-recompute": (MOE + ["--ep", "2", "--recompute", "full"], 4),
}
CELLS_8 = {
    "3d": (["--tp", "2", "--sp", "--pp", "2"], 8),          # dp 2 x pp 2 x tp 2
    "3d-zero1": (["--tp", "2", "--pp", "2", "--zero", "1"], 8),
}
QUICK = [("dp4", "fp32"), ("tp2xpp2", "fp32"), ("tp2+sp", "fp16"), ("pp2-1f1b", "bf16")]
# The whole matrix, kept to one launch of 4 ranks: every layout in fp32, and each 16-bit
# precision across engines (DP, ZeRO stages, AMSP), TP, every schedule, TP x PP, recompute and
# MoE, plain and under ZeRO-1 and ZeRO-3 (the experts stay whole beside the shards, their fp32
# masters in the same optimizer).
MATRIX = ([(c, "fp32") for c in CELLS_4]
          + [(c, "bf16") for c in ("dp4", "zero2", "zero3", "tp2+sp", "pp2-interleaved",
                                   "dp4-recompute", "moe-ep2", "moe-ep4-zero1", "moe-ep2-zero3")]
          + [(c, "fp16") for c in ("dp4", "zero1", "zero3", "shard1,2,4", "pp2-gpipe",
                                   "tp2xpp2", "tp2+sp-recompute", "zero1+tp2", "moe-ep2",
                                   "moe-ep2+pp2", "moe-ep2-recompute", "moe-ep4-zero1",
                                   "moe-ep2-zero3", "moe-ep2-zero1-clip")])


def _flags(cell: str, precision: str, table: dict) -> list[str]:
    flags, _ = table[cell]
    # fp16 starts at a loss scale of 2^12: at 2^16 one rank's gradient of its share of the
    # batch can overflow where the serial mean does not, and that run skips a step the serial
    # one takes (correct, and tested in tests/test_precision.py); here both take every step
    scale = ["--loss-scale-init", "4096"] if precision == "fp16" else []
    return BASE + flags + ["--dtype", precision] + scale


def _serial_flags(flags: list[str]) -> list[str]:
    """The serial twin: the same model, data, precision and recompute, one process."""
    out, skip = [], {"--tp": 1, "--pp": 1, "--zero": 1, "--shard": 1, "--ep": 1, "--schedule": 1,
                     "--microbatches": 1, "--sp": 0, "--dp-mode": 1, "--compile": 0,
                     "--cp": 1}
    i = 0
    while i < len(flags):
        if flags[i] in skip:
            i += 1 + skip[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def run_cells(argvs: list[list[str]], world: int, timeout: float | None = None) -> list[dict]:
    """Run each argv as one training run on ``world`` ranks, all in ONE launch, within
    ``timeout`` seconds (240 unless given: inside pytest's 300 s; the 42 cells of the slow
    tier took 28 s at load 5 on the 2-core VM)."""
    from minipar import train
    results = dist.launch(_cells_worker, world, argvs, world, timeout=timeout or 240)
    return [train.merge_states([r[i] for r in results]) for i in range(len(argvs))]


def _cells_worker(argvs, world):
    from minipar import train
    out = []
    for argv in argvs:
        cfg = dataclasses.replace(train.parse_config(argv + ["--nproc", str(world)]), quiet=True)
        out.append(train.worker(cfg, hooks=STATE))
    return out


_SERIAL = {}


def serial(flags: list[str]) -> dict:
    from minipar import train
    key = tuple(_serial_flags(flags))
    if key not in _SERIAL:
        _SERIAL[key] = train.run_state(list(key), nproc=1)
    return _SERIAL[key]


def _distance(a, b):
    return math.sqrt(sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in b))


def _norm(a):
    return math.sqrt(sum((v.float() ** 2).sum().item() for v in a.values() if v is not None))


def assert_like_serial(got: dict, ref: dict, precision: str, tp: bool, where: str,
                       grads: bool = True) -> None:
    if precision == "fp32":
        try:
            assert_same_training(got, ref)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        return
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= 2e-3, f"{where} step {step}: loss {a} vs 16-bit serial {b}"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(p.dtype == dtype for p in got["params"].values()), where
    cfg_flags = ["--moe-experts", "4"] if any(".experts." in k for k in ref["params"]) else []
    theta0 = {k: v.detach().to(dtype) for k, v in _initial(tuple(cfg_flags)).items()}
    moved = 0.10 if tp else 0.05
    assert _distance(got["params"], ref["params"]) <= moved * _distance(ref["params"], theta0), where
    if not grads:
        return
    grads = {k: v for k, v in ref["grads"].items() if v is not None}
    assert _distance({k: got["grads"][k] for k in grads}, grads) <= 4 * 2**-8 * _norm(grads), where


def _initial(flags):
    from minipar.model import config
    cfg = config("nano", moe_experts=4, moe_top_k=2) if flags else config("nano")
    return dict(build(cfg, seed=0).named_parameters())


def check_cells(cells: list[tuple[str, str]], table: dict, world: int) -> None:
    argvs = [_flags(c, p, table) for c, p in cells]
    for (cell, precision), argv, got in zip(cells, argvs, run_cells(argvs, world)):
        ref = serial(argv)
        assert len(got["losses"]) == STEPS
        if precision == "fp16":     # the premise of comparing step by step: no step skipped
            assert got["history"][-1]["skipped_steps"] == ref["history"][-1]["skipped_steps"] == 0
        clipped = "--clip-grad" in argv
        if clipped and precision != "fp32":
            # 16-bit engines report different gradients under clipping (ZeRO its fp32 average
            # after the clip, DP the 16-bit .grad before it): the norm each step measured
            # (what the clip used) is held to the serial one's instead
            for a, b in zip(got["history"], ref["history"]):
                assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-2 * b["grad_norm"], cell
        assert_like_serial(got, ref, precision, "--tp" in argv, f"{cell} {precision}",
                           grads=not (clipped and precision != "fp32"))


def test_quick_subset_equals_serial_twins():
    check_cells(QUICK, CELLS_4, 4)


@pytest.mark.slow
def test_every_4_rank_cell_equals_its_serial_twin():
    cells = [cell for cell in MATRIX if cell not in QUICK]
    check_cells(cells, CELLS_4, 4)


@pytest.mark.slow
def test_3d_cells_equal_their_serial_twins():
    check_cells([(c, p) for c in CELLS_8 for p in ("fp32", "bf16")], CELLS_8, 8)


COMPILED = {
    "tp2+sp-compile": (["--tp", "2", "--sp", "--compile", "--steps", "3"], 4),
    "pp2-compile": (["--pp", "2", "--compile", "--steps", "3"], 4),
    "zero3-compile": (["--zero", "3", "--compile", "--steps", "3"], 4),
    # dynamo breaks the graph where minipar.comm times a call (time.perf_counter), the ring's
    # isend/irecv among them: they run eagerly between compiled pieces (a warning, no crash)
    "cp2-compile": (["--cp", "2", "--compile", "--steps", "3"], 4),
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compile_with_tp_pp_zero3_cp_equals_the_eager_serial_run():
    """--compile (inductor on the CPU: slow to compile, so one launch for the four layouts)
    against the uncompiled single-process run of the same 3 steps."""
    argvs = [_flags(c, "fp32", COMPILED) for c in COMPILED]
    for cell, argv, got in zip(COMPILED, argvs, run_cells(argvs, 4, timeout=1100)):
        ref = serial(argv)
        assert len(got["losses"]) == 3, cell
        assert_same_training(got, ref)


# --------------------------------------------------------------------------------------
# Save in one layout, resume in another (and across precisions)
# --------------------------------------------------------------------------------------
# Weight decay strong enough to see: at 10 (decoupled, lr 3e-3) it moves the bf16 serial run's
# parameters by 27% of the distance training moves them (measured), far above the 5% the 16-bit
# comparison allows, so decay skipped (or applied to the 16-bit copies) fails it.
WD = ["--weight-decay", "10"]
FP16_SCALER = ["--dtype", "fp16", "--loss-scale-window", "1", "--loss-scale-init", "1024"]


def _save_resume_worker(tmp, world):
    """Save at step 2 in one layout, resume to step 4 in others, all in this one launch."""
    from minipar import train
    runs = [
        ("save-zero1-fp32", BASE + ["--zero", "1", "--steps", "2", "--save", f"{tmp}/a"]),
        ("resume-tp2xpp2-fp32", BASE + ["--tp", "2", "--pp", "2", "--resume", f"{tmp}/a"]),
        ("save-dp4-bf16", BASE + ["--dtype", "bf16", "--steps", "2", "--save", f"{tmp}/b",
                                  "--weight-decay", "0.1"]),
        ("resume-tp2-bf16", BASE + ["--dtype", "bf16", "--tp", "2", "--resume", f"{tmp}/b",
                                    "--weight-decay", "0.1"]),
        ("resume-pp2-as-fp32", BASE + ["--pp", "2", "--resume", f"{tmp}/b",
                                       "--weight-decay", "0.1"]),
        ("save-pp2-fp16", BASE + ["--dtype", "fp16", "--pp", "2", "--steps", "2", "--save",
                                  f"{tmp}/c", "--loss-scale-window", "1",
                                  "--loss-scale-init", "1024"]),
        ("resume-dp4-fp16", BASE + ["--dtype", "fp16", "--resume", f"{tmp}/c",
                                    "--loss-scale-window", "1",
                                    "--loss-scale-init", "1024"]),
    ]
    # 16-bit under ZeRO/AMSP with weight decay: saved as ZeRO-1, ZeRO-3 and 1,2,4 (each
    # checkpoint holds the fp32 masters of the OS shards), resumed in another layout and as fp32
    bf16 = ["--dtype", "bf16"] + WD
    runs += [
        ("save-zero1-bf16", BASE + bf16 + ["--zero", "1", "--steps", "2", "--save", f"{tmp}/d"]),
        ("resume-zero3-bf16", BASE + bf16 + ["--zero", "3", "--resume", f"{tmp}/d"]),
        ("save-zero3-bf16", BASE + bf16 + ["--zero", "3", "--steps", "2", "--save", f"{tmp}/e"]),
        ("resume-shard1,2,4-bf16", BASE + bf16 + ["--shard", "1,2,4", "--resume", f"{tmp}/e"]),
        ("resume-zero1-as-fp32", BASE + WD + ["--zero", "1", "--resume", f"{tmp}/e"]),
        ("save-shard1,2,4-bf16", BASE + bf16 + ["--shard", "1,2,4", "--steps", "2",
                                                "--save", f"{tmp}/f"]),
        ("resume-dp4-bf16", BASE + bf16 + ["--resume", f"{tmp}/f"]),
        ("save-zero3-fp16", BASE + FP16_SCALER + ["--zero", "3", "--steps", "2",
                                                  "--save", f"{tmp}/g"]),
        ("resume-shard1,2,4-fp16", BASE + FP16_SCALER + ["--shard", "1,2,4",
                                                         "--resume", f"{tmp}/g"]),
    ]
    out = {}
    for name, argv in runs:
        cfg = dataclasses.replace(train.parse_config(argv + ["--nproc", str(world)]), quiet=True)
        out[name] = train.worker(cfg, hooks=STATE)
    return out


@pytest.mark.slow
def test_save_in_one_layout_resume_in_another(tmp_path):
    from minipar import train
    results = dist.launch(_save_resume_worker, 4, str(tmp_path), 4, timeout=240)
    got = {k: train.merge_states([r[k] for r in results]) for k in results[0]}
    # fp32: ZeRO-1 then TP x PP equals the uninterrupted serial run
    ref = serial(BASE)
    resumed = got["resume-tp2xpp2-fp32"]
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    for a, b in zip(resumed["losses"], ref["losses"][2:]):
        assert abs(a - b) <= 1e-5
    for name, p in ref["params"].items():
        torch.testing.assert_close(resumed["params"][name], p, atol=1e-4, rtol=1e-4)
    # bf16 with weight decay: DP then TP equals the uninterrupted bf16 serial run
    ref16 = serial(BASE + ["--dtype", "bf16", "--weight-decay", "0.1"])
    for a, b in zip(got["resume-tp2-bf16"]["losses"], ref16["losses"][2:]):
        assert abs(a - b) <= 2e-3
    # a bf16 checkpoint resumed as fp32 (under PP) equals one process resuming it as fp32:
    # the fp32 masters continue, in fp32
    as32 = got["resume-pp2-as-fp32"]
    assert all(p.dtype == torch.float32 for p in as32["params"].values())
    twin32 = train.run_state(BASE + ["--resume", f"{tmp_path}/b", "--weight-decay", "0.1"], 1)
    assert_same_training(as32, twin32)
    # fp16: the loss scaler's state travels with the checkpoint (window 1: it grows each clean
    # step), and the resumed DP run follows one process resuming the same checkpoint
    saved = got["save-pp2-fp16"]["history"]
    resumed16 = got["resume-dp4-fp16"]
    twin16 = train.run_state(BASE + ["--dtype", "fp16", "--resume", f"{tmp_path}/c",
                                     "--loss-scale-window", "1",
                                  "--loss-scale-init", "1024"], 1)
    skipped_at_2 = saved[1]["skipped_steps"] > saved[0]["skipped_steps"]
    next_scale = saved[1]["loss_scale"] * (0.5 if skipped_at_2 else 2.0)
    assert resumed16["history"][0]["loss_scale"] == next_scale     # not the initial 2**16
    assert [h["loss_scale"] for h in resumed16["history"]] == \
        [h["loss_scale"] for h in twin16["history"]]
    assert_like_serial(resumed16, twin16, "fp16", False, "resume-dp4-fp16")
    # 16-bit ZeRO/AMSP with weight decay, saved in one layout and resumed in another: each half
    # follows the uninterrupted bf16 serial run (the decay acts on the fp32 masters)
    ref_wd = serial(BASE + ["--dtype", "bf16"] + WD)
    for name in ("save-zero1-bf16", "save-zero3-bf16", "save-shard1,2,4-bf16"):
        for step, (a, b) in enumerate(zip(got[name]["losses"], ref_wd["losses"][:2]), 1):
            assert abs(a - b) <= 2e-3, f"{name} step {step}: loss {a} vs 16-bit serial {b}"
    rest = {**ref_wd, "losses": ref_wd["losses"][2:]}
    for name in ("resume-zero3-bf16", "resume-shard1,2,4-bf16", "resume-dp4-bf16"):
        assert [h["step"] for h in got[name]["history"]] == [3, 4], name
        assert_like_serial(got[name], rest, "bf16", False, name)
    # a ZeRO-3 bf16 checkpoint resumed as fp32 under ZeRO-1 equals one process resuming it
    as32 = got["resume-zero1-as-fp32"]
    assert all(p.dtype == torch.float32 for p in as32["params"].values())
    assert_same_training(as32, train.run_state(BASE + WD + ["--resume", f"{tmp_path}/e"], 1))
    # fp16 under ZeRO-3, resumed as 1,2,4: the scaler's state and the fp32 masters travel
    resumed = got["resume-shard1,2,4-fp16"]
    twin = train.run_state(BASE + FP16_SCALER + ["--resume", f"{tmp_path}/g"], 1)
    assert [h["loss_scale"] for h in resumed["history"]] == \
        [h["loss_scale"] for h in twin["history"]]
    saved = got["save-zero3-fp16"]["history"]
    grew = saved[1]["skipped_steps"] == saved[0]["skipped_steps"]
    assert resumed["history"][0]["loss_scale"] == saved[1]["loss_scale"] * (2.0 if grew else 0.5)
    assert_like_serial(resumed, twin, "fp16", False, "resume-shard1,2,4-fp16")
