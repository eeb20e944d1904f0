"""MFU/HFU in the trainer's metrics, the peak table, --compile, and ``python -m minipar.bench gpu``.

On this CPU-only machine MFU is null unless --peak-tflops is given, and the GPU benchmark
refuses to run (exit 2) unless asked for a CPU smoke test. The suite hides a GPU host's GPUs
from these tests (tests/conftest.py); the benchmark on a GPU is tests/test_gpu.py's.
"""
import pytest
import torch

from minipar.train import mfu
from minipar import plan
from minipar.model import build, config
from minipar.train import run
from minipar.parallelize import LocalRunner
from minipar.train.report import summary

from conftest import cli

NANO = ["--model", "nano", "--batch-size", "4", "--steps", "2", "--quiet", "--lr", "3e-3"]


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("AMD Instinct MI250X", "bf16", 191.5),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("Some Laptop GPU", "bf16", None),
    (None, "bf16", None),
])
def test_peak_table(name, dtype, peak):
    assert mfu.peak_tflops(name, dtype) == peak


def test_mfu_and_hfu_are_the_planners_flops_over_the_peak():
    cfg = config("nano")
    shape = mfu.shape_of(cfg)
    assert shape.params == sum(p.numel() for p in build("nano").parameters())
    for mode in ("none", "selective", "full"):
        history = run(NANO + ["--peak-tflops", "2", "--recompute", mode])
        model = plan.training_flops(shape, 4, "none")
        hardware = plan.training_flops(shape, 4, mode)
        for h in history:
            assert h["mfu"] == pytest.approx(model / (h["step_time_s"] * 2e12))
            assert h["hfu"] == pytest.approx(hardware / (h["step_time_s"] * 2e12))
            assert "peak_memory_bytes" not in h            # no GPU: no allocator to ask
        assert (history[-1]["hfu"] > history[-1]["mfu"]) == (mode != "none")
    assert "MFU" in summary(history)


def test_mfu_is_null_on_a_cpu_without_a_peak():
    history = run(NANO)
    assert history[-1]["mfu"] is None and history[-1]["hfu"] is None
    assert "MFU" not in summary(history)


@pytest.mark.slow
def test_bad_peak_is_a_usage_error():
    res = cli("minipar.train", "--peak-tflops", "-3")
    assert res.returncode == 2 and "--peak-tflops" in res.stderr


def test_the_loss_stays_on_the_device():
    """No host sync per micro-batch: the runner hands back a tensor, read once per step."""
    runner = LocalRunner(build("nano"), microbatches=2)
    x = torch.randint(0, 256, (4, 16))
    loss = runner.forward_backward(x, x)
    assert torch.is_tensor(loss) and loss.dim() == 0 and not loss.requires_grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.slow
def test_bench_gpu_refuses_without_a_gpu():
    res = cli("minipar.bench", "gpu")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0], res.stderr


@pytest.mark.slow
def test_bench_gpu_cpu_smoke():
    res = cli("minipar.bench", "gpu", "--device", "cpu", "--model", "nano", "--steps", "3",
              "--warmup", "1", "--batch-size", "4", "--peak-tflops", "1", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "minipar / plain step time" in res.stdout
    assert "plain" in res.stdout and "MFU" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compile_trains_like_eager():
    """torch.compile of each Block (inductor: minutes on a busy 2-core CPU, hence slow)."""
    eager = run(NANO + ["--recompute", "full"])
    compiled = run(NANO + ["--recompute", "full", "--compile"])
    for a, b in zip(eager, compiled):
        assert abs(a["loss"] - b["loss"]) <= 1e-5


def test_bench_gpu_reads_the_peak_off_the_logging_steps_records():
    """With --log-every K only the logging steps' records carry the interval's peak memory:
    bench gpu --log-every 10 on an H100 raised a KeyError after printing its ratio."""
    from minipar.bench.gpu import peak_memory
    history = [{"step": 1}, {"step": 2, "peak_memory_bytes": 5}, {"step": 3},
               {"step": 4, "peak_memory_bytes": 7}]
    assert peak_memory(history) == 7
