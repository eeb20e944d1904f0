"""What only a GPU can show: run whenever torch sees one (CUDA or ROCm), skipped otherwise.

``python -m minipar.bench gpu --check`` runs this file first when a GPU is lent. Each test is
small (the nano model, a few steps) and names what it proves:

* an NCCL (RCCL) process group through the trainer, one rank, with the device's clock for
  communication (``comm_clock: cuda-events``) and the serial run's losses;
* bf16 training saved and resumed on the GPU, bit for bit, Adam's step counter on the device
  (where the fused kernel reads it);
* ``--compile`` (inductor on the GPU) training like eager;
* sampling on the GPU from a checkpoint;
* ``python -m minipar.bench gpu`` as a smoke test;
* bf16 training measuring the GPU's peak memory (and MFU where the GPU's peak is listed).
* ``--deterministic``: two fresh bf16 runs, the same losses bit for bit.

Only this file sees a GPU: on a GPU host the rest of the suite runs with every GPU hidden
(tests/conftest.py), so run it by itself.
"""
import os

import pytest
import torch

from conftest import NANO, cli
from minipar.train import checkpoint, sample
from minipar.runtime import dist
from minipar import train
from minipar.data import ByteTokenizer
from minipar.runtime.errors import UsageError

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=("the suite hides GPUs from every test but these (tests/conftest.py): run "
            "`python -m pytest tests/test_gpu.py` or `python -m minipar.bench gpu --check`"
            if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else
            "needs a GPU (torch.cuda.is_available() is False)"))

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


def test_sampling_on_the_gpu(tmp_path, monkeypatch):
    """32 tokens (bytes) sampled on the GPU. The text can hold fewer bytes: the decoder leaves
    out bytes that make no complete UTF-8 character (a tiny model emits many), so the tokens
    are counted, not the text's bytes."""
    root = str(tmp_path / "run")
    train.run(SHORT + ["--save", root])
    made = []
    real = sample.generate
    monkeypatch.setattr(sample, "generate", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    args = ["--resume", root, "--prompt", "def ", "--tokens", "32", "--device", "cuda"]
    text = sample.run(args)
    out, = made
    assert out.device.type == "cuda" and out.numel() == len(b"def ") + 32
    assert text.startswith("def ") and text == ByteTokenizer().decode(out.tolist())
    assert sample.run(args) == text           # the same seed, the same text


def test_bench_gpu_smoke():
    res = cli("minipar.bench", "gpu", "--model", "nano", "--steps", "6", "--warmup", "2",
              timeout=600)
    assert res.returncode == 0, res.stderr
    assert "minipar / plain step time" in res.stdout and "peak GPU memory" in res.stdout


def test_bf16_on_cuda_measures_peak_memory():
    """(Was in test_precision.py: the suite's other files see no GPU.)"""
    got = train.run_state(SHORT + ["--dtype", "bf16", "--backend", "nccl"], nproc=1)
    record = got["history"][-1]
    assert record["peak_memory_bytes"] >= record["model_state_bytes"]["total"]
    assert record["peak_reserved_bytes"] >= record["peak_memory_bytes"]   # held >= live
    from minipar.train.mfu import peak_tflops
    listed = peak_tflops(torch.cuda.get_device_name(), "bf16") is not None
    assert (record["mfu"] is not None) == listed


def test_two_fresh_deterministic_runs_are_bit_identical():
    """--deterministic: two fresh processes training the small model in bf16 for 10 steps give
    the same loss at every step, bit for bit (without it, gpt2 in bf16 differed from step 2)."""
    from types import SimpleNamespace
    from minipar.bench import gpu as bench_gpu
    args = SimpleNamespace(model="small", batch_size=8, dtype="bf16", device="cuda",
                           compile=False)
    ok, text = bench_gpu.repeat_runs(args, steps=10, timeout=600)
    assert ok, text
