"""Bringing minipar up on a new GPU cluster, checked on the CPU: communication seconds as the
device spends them (``comm.clock``), and no per-step work the user did not ask for (the
global gradient norm, host syncs for metrics)."""
import pytest
import torch

from minipar import comm


class _FakeEvent:
    """A stand-in for ``torch.cuda.Event``: a made-up device clock, 5 ms per record."""
    now = 0.0
    synced = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        _FakeEvent.now += 5.0
        self.t = _FakeEvent.now

    def synchronize(self):
        _FakeEvent.synced += 1

    def elapsed_time(self, end):
        return end.t - self.t                   # milliseconds, as CUDA's


def test_comm_seconds_host_clock_without_nccl():
    assert comm.clock() == "host"
    comm.reset()
    comm._run("all_reduce", "g", 8, 8, lambda a: None, False)
    assert comm.stats.calls[("all_reduce", "g")] == 1
    assert comm.stats.pending == [] and comm.stats.seconds_by_op()["all_reduce"] >= 0.0
    comm.reset()


def test_comm_seconds_from_cuda_events_on_nccl(monkeypatch):
    """On NCCL each op is bracketed by two events on the current stream, read only when the
    seconds are asked for (after the step's synchronize): sync ops and the wait of async ones."""
    monkeypatch.setattr(comm, "clock", lambda: "cuda-events")
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    comm.reset()
    comm._run("all_reduce", "g", 8, 8, lambda a: None, False)            # start, end: 5 ms
    handle = comm._run("all_gather", "g", 8, 8, lambda a: None, True)
    assert comm.stats.calls[("all_gather", "g")] == 0                    # not waited yet
    handle.wait()
    assert len(comm.stats.pending) == 2 and _FakeEvent.synced == 0      # nothing read yet
    with comm.untracked():
        comm._run("all_reduce", "g", 8, 8, lambda a: None, False)        # bookkeeping: no events
    assert len(comm.stats.pending) == 2
    by_op = comm.stats.seconds_by_op()
    assert by_op == pytest.approx({"all_reduce": 0.005, "all_gather": 0.005})
    assert comm.stats.pending == [] and _FakeEvent.synced == 2
    comm.reset()


def test_bench_gpu_check_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from conftest import cli
    res = cli("minipar.bench", "gpu", "--check")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--check needs a GPU" in lines[0], res.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_gpu_check_cpu_smoke():
    """``--check --device cpu`` runs every part of the check's machinery (no GPU figures):
    the comparison and an fp32 checkpoint round trip, bit for bit, and a pasteable summary."""
    from conftest import cli
    res = cli("minipar.bench", "gpu", "--check", "--device", "cpu", "--model", "nano",
              "--steps", "3", "--warmup", "1", "--batch-size", "4", "--dtype", "fp32",
              timeout=540)
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    assert out.startswith("minipar GPU check:") and "machine:" in out
    assert "[ok] trainer vs plain loop: model nano" in out
    assert "[ok] fp32 checkpoint round trip: losses and parameters of steps 3..4 bit-identical" in out
    assert "all checks passed" in out
