"""The same command twice gives the same losses, bit for bit (same seed, same layout)."""
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
