"""``--cp N`` in the trainer: every layout it composes with equals the serial run (fp32, within
1e-5; bf16 and fp16 within test_precision's 2e-3 of the 16-bit serial run), the ring's bytes
equal the planner's estimate of the layout to the byte (``Estimate.cp_bytes``), a checkpoint
saved with cp resumes in another layout, and one rank's activation memory falls as 1/cp
(measured with ``saved_tensors_hooks``, against the formula).

Cheap by construction: all the cases of one world size run in ONE launch (each rank loops over
them), against one serial run."""
import pytest
import torch

from conftest import NANO, assert_same_training, serial_state
from minipar.runtime import dist
from minipar import train
from minipar.runtime.errors import UsageError
from minipar import plan
from minipar.train.loop import Hooks, with_state

STATE = Hooks(end=with_state)   # every rank returns its history, parameters and gradients

STEPS = ["--steps", "6"]


def _cases(cases, tmp):
    """On every rank: train each case (flags, with {tmp} filled in); every rank's state."""
    out = []
    for flags in cases:
        argv = NANO + STEPS + [f.format(tmp=tmp) for f in flags]
        out.append(train.worker(train.parse_config(argv), hooks=STATE))
    return out


def _merged(results, i):
    params, grads = {}, {}
    for r in results:
        params.update(r[i]["params"])
        grads.update(r[i]["grads"])
    return dict(losses=[h["loss"] for h in results[0][i]["history"]],
                history=results[0][i]["history"], params=params, grads=grads)


def _ring_bytes(flags, cp, dp, tp, m=1, recompute="none", e=4):
    """What the planner's estimate of this layout says one rank sends round the ring per step
    (``Estimate.cp_bytes``, ``plan.cp.cp_comm_bytes``)."""
    layout = plan.Layout(tp=tp, cp=cp, dp=dp, micro_batch=8 // (dp * m), microbatches=m,
                         recompute=recompute, sp="--sp" in flags)
    return plan.estimate(plan.model_preset("nano"), "laptop-cpu", layout,
                         dtype="fp32" if e == 4 else "mixed").cp_bytes


FOUR = [  # (flags, cp, dp, tp, ring bytes checked)
    (["--cp", "4"], 4, 1, 1, True),
    (["--cp", "2"], 2, 2, 1, True),
    (["--cp", "2", "--tp", "2", "--sp", "--save", "{tmp}/ck", "--save-every", "3"], 2, 1, 2, True),
    (["--cp", "2", "--pp", "2"], 2, 1, 1, False),
    (["--cp", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "4"], 2, 1, 1,
     False),
    (["--cp", "2", "--zero", "1"], 2, 2, 1, True),
    (["--cp", "2", "--zero", "2"], 2, 2, 1, True),
    (["--cp", "2", "--zero", "3"], 2, 2, 1, True),
    (["--cp", "2", "--shard", "1,2,4"], 2, 2, 1, True),
    (["--cp", "4", "--recompute", "full"], 4, 1, 1, True),
    (["--cp", "4", "--resume", "{tmp}/ck/step-000003"], 4, 1, 1, True),
    (["--cp", "4", "--dtype", "bf16"], 4, 1, 1, True),
    (["--cp", "2", "--dtype", "bf16", "--zero", "1"], 2, 2, 1, True),
    (["--cp", "2", "--dtype", "fp16", "--tp", "2", "--sp"], 2, 1, 2, True),
]


@pytest.mark.slow
def test_cp_equals_serial_on_4_ranks(tmp_path):
    # 21 s at load 4 (2 cores): 240 s ends a slow launch with its message, inside pytest's 300 s
    results = dist.launch(_cases, 4, [c[0] for c in FOUR], str(tmp_path), timeout=240)
    ref = serial_state(STEPS)
    ref16 = {d: train.run_state(NANO + STEPS + ["--dtype", d], nproc=1) for d in ("bf16", "fp16")}
    for i, (flags, cp, dp, tp, check_bytes) in enumerate(FOUR):
        got = _merged(results, i)
        if "--resume" in flags:       # steps 4..6 again, from the cp=2 x tp=2 checkpoint
            ref_tail = dict(ref, losses=ref["losses"][3:])
            assert_same_training(got, ref_tail, loss_tol=1e-5)
        elif "--dtype" in flags:      # tests/test_precision.py's tolerance, 16-bit serial run
            ref_16 = ref16[flags[flags.index("--dtype") + 1]]
            for a, b in zip(got["losses"], ref_16["losses"]):
                assert abs(a - b) <= 2e-3, (flags, got["losses"], ref_16["losses"])
        else:
            assert_same_training(got, ref, loss_tol=1e-5)
        if check_bytes:
            recompute = "full" if "full" in flags else "none"
            e = 2 if "--dtype" in flags else 4
            sent = got["history"][-1]["comm_bytes"]["send"]
            assert sent == _ring_bytes(flags, cp, dp, tp, recompute=recompute, e=e), flags
    # and the cp checkpoint resumes on one process
    one = train.run_state(NANO + STEPS + ["--resume", f"{tmp_path}/ck/step-000003"], nproc=1)
    assert_same_training(one, dict(ref, losses=ref["losses"][3:]), loss_tol=1e-5)


EIGHT = [(["--cp", "4", "--tp", "2", "--sp"], 4, 1, 2),
         (["--cp", "4", "--pp", "2"], 4, 1, 1),
         (["--cp", "4", "--zero", "1"], 4, 2, 1)]


@pytest.mark.slow
def test_cp4_composes_on_8_ranks(tmp_path):
    results = dist.launch(_cases, 8, [c[0] for c in EIGHT], str(tmp_path), timeout=240)
    ref = serial_state(STEPS)
    for i, (flags, cp, dp, tp) in enumerate(EIGHT):
        assert_same_training(_merged(results, i), ref, loss_tol=1e-5)


@pytest.mark.parametrize("flags,message", [
    (["--cp", "3", "--nproc", "3"], "not divisible by 6"),
    (["--cp", "2", "--nproc", "2", "--seq-len", "18"], "not divisible by 4"),
    (["--cp", "2", "--tp", "4", "--sp", "--nproc", "8", "--seq-len", "12"], "over --tp 4"),
    (["--cp", "2", "--nproc", "3"], "multiple of 2"),
    (["--cp", "2", "--tp", "4", "--nproc", "8", "--moe-experts", "4", "--seq-len", "20"],
     "share 10 of the sequence is not divisible by 4"),
    (["--cp", "0"], "--cp"),
])
def test_cp_refuses_what_cannot_compose(flags, message):
    with pytest.raises(UsageError, match=message):
        train.parse_config(["--model", "nano"] + flags)


def _activation_bytes():
    """On 4 ranks: one layer's saved bytes for one sequence at cp = 2 (two rings) and 4."""
    import torch.distributed as tdist
    from minipar.lab import nb09
    me = tdist.get_rank()
    pairs = [tdist.new_group(r) for r in ([0, 1], [2, 3])]
    return {2: nb09.activation_bytes([64, 256], group=pairs[me // 2]),
            4: nb09.activation_bytes([64, 256], group=tdist.group.WORLD)}


def test_activation_memory_falls_as_one_over_cp():
    from minipar.lab import nb09
    serial = {r["seq_len"]: r for r in nb09.activation_bytes([64, 256])}
    for per_rank in dist.launch(_activation_bytes, 4, timeout=240):
        for n, rows in per_rank.items():
            for r in rows:
                one = serial[r["seq_len"]]
                assert r["measured"] * n == one["measured"]          # exactly 1/cp
                assert abs(r["measured"] / r["planned"] - 1) < 0.10   # the formula, within 10%
                assert r["planned"] * n == pytest.approx(one["planned"])
