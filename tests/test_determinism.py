"""The same command twice gives the same losses, bit for bit (same seed, same layout)."""
import os

import pytest

from minipar import train

COMMON = ["--model", "nano", "--steps", "5", "--batch-size", "8", "--quiet"]


@pytest.mark.parametrize("layout", [
    ["--nproc", "2", "--tp", "2", "--sp"],
    ["--nproc", "2", "--pp", "2", "--microbatches", "4"],
], ids=["tp2-sp", "pp2"])
def test_same_command_twice_gives_identical_losses(layout):
    first = [h["loss"] for h in train.run(COMMON + layout)]
    second = [h["loss"] for h in train.run(COMMON + layout)]
    assert len(first) == 5
    assert first == second


def test_deterministic_changes_nothing_on_the_cpu():
    """--deterministic on the CPU: the same losses bit for bit, and torch's global switches
    as they were (CPU runs already repeat; the GPU test is in tests/test_gpu.py)."""
    import torch
    before = torch.are_deterministic_algorithms_enabled()
    plain = [h["loss"] for h in train.run(COMMON + ["--nproc", "2", "--tp", "2"])]
    seen = []
    hooks = train.Hooks(before_step=lambda step: seen.append(
        torch.are_deterministic_algorithms_enabled()))
    det = [h["loss"] for h in train.run(COMMON + ["--deterministic"], hooks)]
    assert det == [h["loss"] for h in train.run(COMMON)]
    assert [h["loss"] for h in train.run(COMMON + ["--nproc", "2", "--tp", "2",
                                                   "--deterministic"])] == plain
    assert seen == [before] * 5 and torch.are_deterministic_algorithms_enabled() == before


def test_deterministic_mode_on_a_gpu_sets_and_restores_torchs_switches(monkeypatch):
    """What --deterministic sets on a GPU device (checked on the CPU: the switches are
    process-wide), and that leaving restores them."""
    import torch
    from minipar.train.loop import CUBLAS_WORKSPACE, deterministic
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic(True, torch.device("cuda", 0)):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.backends.cuda.math_sdp_enabled()
        assert not (torch.backends.cuda.flash_sdp_enabled()
                    or torch.backends.cuda.mem_efficient_sdp_enabled())
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cudnn.deterministic
