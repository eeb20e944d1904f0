"""What only a GPU can show: run whenever torch sees one (CUDA or ROCm), skipped otherwise.

``python -m minipar.bench gpu --check`` runs this file first when a GPU is lent. Each test is
small (the nano model, a few steps) and names what it proves:

* an NCCL (RCCL) process group through the trainer, one rank, with the device's clock for
  communication (``comm_clock: cuda-events``) and the serial run's losses;
* bf16 training saved and resumed on the GPU, bit for bit, Adam's step counter on the device
  (where the fused kernel reads it);
* ``--compile`` (inductor on the GPU) training like eager;
* sampling on the GPU from a checkpoint;
* ``python -m minipar.bench gpu`` as a smoke test.
"""
import pytest
import torch

from conftest import NANO, cli
from minipar.train import checkpoint, sample
from minipar.runtime import dist
from minipar import train
from minipar.runtime.errors import UsageError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (torch.cuda.is_available() is False)")

SHORT = NANO[:NANO.index("--steps")] + NANO[NANO.index("--steps") + 2:] + ["--steps", "4"]


def test_nccl_process_group_of_one_rank_through_the_trainer():
    cfg = train.parse_config(SHORT + ["--nproc", "1", "--backend", "nccl"])
    history, = dist.launch(train.worker, 1, cfg, backend="nccl", timeout=600)
    serial = train.run(SHORT)                 # no process group: the same device rule
    assert [h["comm_clock"] for h in history] == ["cuda-events"] * 4
    for a, b in zip(history, serial):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_bf16_save_and_resume_on_the_gpu(tmp_path, monkeypatch):
    made = []
    real = train.make_optimizer
    monkeypatch.setattr(train.loop, "make_optimizer",
                        lambda params, lr: made.append(real(params, lr)) or made[-1])
    flags = SHORT + ["--dtype", "bf16"]
    root = str(tmp_path / "run")
    try:
        train.parse_config(flags + ["--save", root])
    except UsageError as e:               # say so, and test it the day the trainer allows it
        pytest.skip(f"this trainer refuses bf16 checkpoints: {e}")
    full = train.run_state(flags + ["--save", root, "--save-every", "2"], nproc=1)
    again = train.run_state(flags + ["--resume", checkpoint.step_dir(root, 2)], nproc=1)
    assert again["losses"] == full["losses"][2:]
    for name, p in full["params"].items():
        assert torch.equal(again["params"][name], p), name
    opt = made[-1]
    assert opt.param_groups[0]["fused"]       # every parameter is on the GPU
    for p, state in opt.state.items():
        assert state["step"].device == p.device and p.device.type == "cuda"


def test_compile_trains_like_eager_on_the_gpu():
    eager = train.run(SHORT)
    compiled = train.run(SHORT + ["--compile"])
    for a, b in zip(eager, compiled):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


def test_sampling_on_the_gpu(tmp_path):
    root = str(tmp_path / "run")
    train.run(SHORT + ["--save", root])
    args = ["--resume", root, "--prompt", "def ", "--tokens", "32", "--device", "cuda"]
    text = sample.run(args)
    assert text.startswith("def ") and len(text.encode()) >= 32
    assert sample.run(args) == text           # the same seed, the same text


def test_bench_gpu_smoke():
    res = cli("minipar.bench", "gpu", "--model", "nano", "--steps", "6", "--warmup", "2",
              timeout=600)
    assert res.returncode == 0, res.stderr
    assert "minipar / plain step time" in res.stdout and "peak GPU memory" in res.stdout
