"""MoE under context parallelism (``--cp``) against the single-process MoE run.

A cp rank holds chunks i and 2cp-1-i of every sequence, yet capacity slots (first come, first
served) and the balancing loss's f_e need the whole sequence's choices in true token order:
the layer all-gathers them over cp and puts each rank's rows back at its positions. With
capacity 1.0 the serial run drops assignments, so an order that is not the true one changes
the drops, the losses and the gradients (checked: gathering the rows in rank order instead
fails this file). Every layout (with and without --ep, with --tp 2 --sp and with --tp 2, under
ZeRO-1, with --pp 2 and with --recompute full) must give the serial losses, last gradients
and parameters (fp32, test_moe's tolerances), the serial aux loss, z-loss and drop rate, and
the bytes of the new all-gather must equal ``minipar.plan.moe.cp_layer_comm_bytes``; bf16
follows the bf16 serial run within test_precision's bound; a cp checkpoint resumes serially.

Cheap by construction: every layout in ONE launch of 4 ranks, against one serial run."""
import pytest

from conftest import NANO, assert_same_moe_training, assert_same_training, serial_state
from minipar.runtime import dist
from minipar import train
from minipar.model import config
from minipar.plan import moe as plan_moe
from minipar.train.loop import Hooks, with_state

STATE = Hooks(end=with_state)   # every rank returns its history, parameters and gradients

# MoE under cp: every test here shares 4-rank launches, so the module is in the full suite only
pytestmark = pytest.mark.slow

E, K = 4, 2
FLAGS = ["--moe-experts", str(E), "--moe-top-k", str(K), "--capacity-factor", "1.0",
         "--moe-z-coef", "1e-3", "--steps", "4"]
CASES = {  # name -> (flags, cp, dp): on 4 processes
    "cp2 dp2": (["--cp", "2"], 2, 2),
    "cp2 dp2 ep2": (["--cp", "2", "--ep", "2", "--save", "{tmp}/ck", "--save-every", "2"], 2, 2),
    "cp4": (["--cp", "4"], 4, 1),
    "cp2 tp2+sp": (["--cp", "2", "--tp", "2", "--sp"], 2, 1),
    "cp2 tp2": (["--cp", "2", "--tp", "2"], 2, 1),
    "cp2 dp2 ep2 zero1": (["--cp", "2", "--ep", "2", "--zero", "1"], 2, 2),
    "cp2 pp2": (["--cp", "2", "--pp", "2"], 2, 1),
    "cp2 dp2 ep2 recompute full": (["--cp", "2", "--ep", "2", "--recompute", "full"], 2, 2),
    "cp2 dp2 bf16": (["--cp", "2", "--dtype", "bf16"], 2, 2),
}
FP32 = [name for name, (flags, _, _) in CASES.items() if "--dtype" not in flags]


def _train_cases(cases: dict, tmp: str) -> dict:
    """On every rank: the trainer once per layout (one launch for them all)."""
    from minipar.train import parse_config, worker
    return {name: worker(parse_config(NANO + FLAGS + [f.format(tmp=tmp) for f in flags] +
                                      ["--nproc", "4"]), hooks=STATE)
            for name, (flags, _, _) in cases.items()}


_LAUNCH = []


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moecp"))


def _composed(name: str, tmp: str) -> dict:
    if not _LAUNCH:
        _LAUNCH.append(dist.launch(_train_cases, 4, CASES, tmp, timeout=240))   # < pytest's 300 s
    return train.merge_states([r[name] for r in _LAUNCH[0]])


@pytest.mark.slow
@pytest.mark.parametrize("name", FP32)
def test_moe_under_cp_equals_serial(name, tmp):
    ref = serial_state(FLAGS)
    assert_same_moe_training(_composed(name, tmp), ref)   # capacity order matters here


@pytest.mark.slow
def test_moe_under_cp_in_bf16_follows_the_bf16_serial_run(tmp):
    """tests/test_precision.py's bound: every step's loss within 2e-3 of the bf16 serial run."""
    ref = serial_state(FLAGS + ["--dtype", "bf16"])
    got = _composed("cp2 dp2 bf16", tmp)
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 2e-3, (got["losses"], ref["losses"])


@pytest.mark.parametrize("name", ["cp2 dp2", "cp2 dp2 ep2", "cp4", "cp2 dp2 ep2 recompute full"])
@pytest.mark.slow
def test_moe_cp_gather_bytes_equal_the_formula(name, tmp):
    """Without TP or ZeRO the only all-gather is the choices' over cp, once per MoE layer and
    micro-batch (forward only: the recomputed forward replays the first one's choices)."""
    flags, cp, dp = CASES[name]
    cfg = config("nano")
    layers = cfg.n_layer                      # --moe-every 1: every block is an MoE layer
    per_layer = plan_moe.cp_layer_comm_bytes(plan_moe.MoE(E, K), tokens=8 // dp * cfg.seq_len,
                                             cp=cp)
    got = _composed(name, tmp)["history"][-1]["comm_bytes"]
    assert got["all_gather"] == layers * per_layer["all_gather"]


@pytest.mark.slow
def test_moe_cp_state_bytes_and_counts_equal_the_planner(capsys, tmp):
    """cp=2 x dp=2, ep=2, ZeRO-1, fp32: the non-expert states sharded over dp x cp, the experts
    split by ep and replicated over cp, as ``plan.moe.state_bytes`` and ``python -m minipar.plan
    memory --cp 2`` say; the routing-count all-to-all of ``plan.moe.step_comm_bytes``."""
    import json
    from minipar.plan.__main__ import main as plan_main
    from minipar.plan.shapes import trainer_presets
    last = _composed("cp2 dp2 ep2 zero1", tmp)["history"][-1]
    got = last["model_state_bytes"]
    shape, moe = trainer_presets()["nano"], plan_moe.MoE(E, K)
    plan = plan_moe.state_bytes(shape, moe, dp=2, ep=2, zero=1, dtype="fp32", cp=2)
    assert (got["params"], got["grads"]) == (plan["params"], plan["grads"])
    assert plan_main(["memory", "--model", "nano", "--gpus", "4", "--cp", "2", "--zero", "1",
                      "--dtype", "fp32", "--moe-experts", str(E), "--ep", "2", "--json"]) == 0
    cli_plan = json.loads(capsys.readouterr().out)
    assert (cli_plan["params_bytes"], cli_plan["grads_bytes"]) == (got["params"], got["grads"])
    counts = plan_moe.step_comm_bytes(shape, moe, tokens=8 // 2 * shape.seq_len // 2, ep=2)
    assert last["comm_bytes"]["all_to_all_counts"] == counts["all_to_all_counts"]


def test_moe_cp_checkpoint_resumes_on_one_process(tmp):
    """Saved at step 2 as cp=2 x dp=2 (ep 2): steps 3 and 4 on one process are the serial run's."""
    from minipar.train import run_state
    ref = serial_state(FLAGS)
    _composed("cp2 dp2 ep2", tmp)
    got = run_state(NANO + FLAGS + ["--resume", f"{tmp}/ck/step-000002"], nproc=1)
    assert_same_training(got, dict(ref, losses=ref["losses"][2:]), loss_tol=1e-5, tol=1e-4)
