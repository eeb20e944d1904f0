"""Bringing minipar up on a new GPU cluster, checked on the CPU: communication seconds as the
device spends them (``comm.clock``), no per-step work the user did not ask for (the global
gradient norm, host syncs for metrics), ``--compile``'s longer collective timeout,
``bench gpu --check``, and every torchrun rank checking one ``--metrics`` path at once."""
import re

import pytest
import torch

from conftest import NANO
from minipar import comm, train
from minipar.runtime import dist
from minipar.train import optim


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


@pytest.mark.slow
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
    assert "[ok] two fresh --deterministic runs: nano, fp32, 10 steps" in out
    assert "all checks passed" in out


# --------------------------------------------------------------------------------------
# No per-step work the user did not ask for
# --------------------------------------------------------------------------------------
BASE = NANO[:NANO.index("--steps")] + NANO[NANO.index("--steps") + 2:]


def _counting_norms(monkeypatch):
    calls = []
    real = optim.global_grad_norm
    monkeypatch.setattr(optim, "global_grad_norm",
                        lambda *a: calls.append(1) or real(*a))
    return calls


def test_norm_only_when_clipping_or_logging(monkeypatch):
    """Without --clip-grad the global norm is computed on logging steps only (here 3 and 6
    of 6); with it, on every step. The losses do not depend on when it is computed, and
    every step's loss still reaches the history (the --metrics lines)."""
    calls = _counting_norms(monkeypatch)
    every = train.run(BASE + ["--steps", "6"])
    assert len(calls) == 6
    calls.clear()
    sparse = train.run(BASE + ["--steps", "6", "--log-every", "3"])
    assert len(calls) == 2
    assert [h["loss"] for h in sparse] == [h["loss"] for h in every]
    assert [h["step"] for h in sparse] == list(range(1, 7))
    for h in sparse:
        if h["step"] % 3:
            assert set(h) == {"step", "loss", "lr", "comm_bytes", "step_time_s",
                              "tokens_per_s", "model_state_bytes"}, h
        else:
            assert h["grad_norm"] == every[h["step"] - 1]["grad_norm"]
            assert h["comm_clock"] == "host" and "step_time_s" in h
    calls.clear()
    clipped = train.run(BASE + ["--steps", "6", "--log-every", "3", "--clip-grad", "0.5"])
    assert len(calls) == 6
    assert [h["grad_norm"] for h in clipped if h["step"] % 3 == 0] != [None, None]


def test_host_reads_do_not_grow_with_non_logging_steps(monkeypatch):
    """A non-logging step reads nothing off the device: 2 steps logging once and 5 steps
    logging once make the same number of reads (float/item/tolist) in minipar's code. Not
    counted: ``minipar.data`` (batch indices from a CPU generator, never a device tensor) and
    torch's own (CPU Adam reads its step counter; the fused GPU kernel does not)."""
    import sys
    reads = []

    def counted(real):
        def read(self, *a, **k):
            where = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "/minipar/" in where and not where.endswith("minipar/data.py"):
                reads.append(where)
            return real(self, *a, **k)
        return read

    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    counts = []
    for steps in (2, 5):
        reads.clear()
        train.run(BASE + ["--steps", str(steps), "--log-every", str(steps)])
        counts.append(len(reads))
    assert counts[0] == counts[1], counts


def test_every_step_reaches_the_metrics_file_across_ranks(tmp_path):
    """A 2-stage pipeline (the loss lives on the last stage only), --log-every 4 over 6
    steps: six lines, the serial run's losses; the logging steps' lines (4 and the last)
    carry the full record."""
    import json
    path = tmp_path / "m.jsonl"
    train.run(BASE + ["--steps", "6", "--log-every", "4", "--nproc", "2", "--pp", "2",
                      "--metrics", str(path)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    serial = train.run(BASE + ["--steps", "6"])
    assert [r["step"] for r in lines] == list(range(1, 7))
    for r, s in zip(lines, serial):
        assert abs(r["loss"] - s["loss"]) <= 1e-5
        # every line keeps the documented keys; only logging steps measure the rest
        assert {"step_time_s", "tokens_per_s", "model_state_bytes", "comm_bytes"} <= set(r)
        assert ("grad_norm" in r) == (r["step"] in (4, 6))


def test_compile_gets_a_longer_default_collective_timeout(monkeypatch):
    """--compile: the first step compiles while other ranks wait, so the default
    MINIPAR_TIMEOUT is dist.COMPILE_TIMEOUT_S there; a value the user set wins."""
    seen = []
    monkeypatch.setattr(dist, "launch", lambda *a, **k: seen.append(dist._timeout_s()) or [[]])
    monkeypatch.delenv("MINIPAR_TIMEOUT", raising=False)
    train.run(BASE + ["--nproc", "2", "--compile"])
    train.run(BASE + ["--nproc", "2"])
    monkeypatch.setenv("MINIPAR_TIMEOUT", "45")
    train.run(BASE + ["--nproc", "2", "--compile"])
    assert seen == [dist.COMPILE_TIMEOUT_S, 60, 45]
    assert dist._timeout_s() == 45


# --------------------------------------------------------------------------------------
# Start-up under torchrun: every rank parses the flags, every rank checks --metrics
# --------------------------------------------------------------------------------------
PARSE_ROUNDS = """
import os, sys
import torch.distributed as tdist
from minipar import train
tdist.init_process_group("gloo")
failed = 0
for i in range(int(sys.argv[2])):
    tdist.barrier()            # all four ranks check the same new path at once
    try:
        train.parse_config(["--model", "nano", "--metrics", os.path.join(sys.argv[1], f"m{i}.jsonl")])
    except BaseException as e:
        failed += 1
        print(f"rank {tdist.get_rank()} round {i}: {type(e).__name__}: {e}", flush=True)
tdist.barrier()
print(f"rank {tdist.get_rank()} failed {failed}", flush=True)
tdist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_ranks_check_one_metrics_file_at_once(tmp_path):
    """torchrun, 4 ranks, the trainer's own flag check on one --metrics path per round, the
    ranks released together 25 times: 0 failures, and no probe file left behind. (The old
    create-then-delete probe failed 12 of these 100 checks on the 2-core VM.)"""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    script = tmp_path / "parse_rounds.py"
    script.write_text(PARSE_ROUNDS)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--master-port", str(dist.free_port()), str(script), str(out), "25"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    # four processes share one stdout: their lines may interleave, so find each rank's verdict
    verdicts = sorted(re.findall(r"rank (\d+) failed (\d+)", r.stdout))
    assert verdicts == [(str(k), "0") for k in range(4)], r.stdout
    assert os.listdir(out) == []
