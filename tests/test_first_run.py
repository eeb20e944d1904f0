"""The defects a first GPU job would hit, each shown on this CPU machine (fake Slurm, ROCm and
GPU environments, as tests/test_dist.py and tests/test_scripts.py do) and fixed.

* sampling counts tokens, not the decoded text's bytes;
* a Slurm task is bound to one GPU only when exactly one is visible (DGX: "Duplicate GPU");
* the collective timeout is 600 s on NCCL (rendezvous, watchdog), 60 s on gloo;
* the cluster scripts: the timeout exported, the ROCm module checked against the wheel, the
  RCCL plugin needed between nodes only, a 2-rank all-reduce smoke step first;
* on a GPU host the CPU suite sees no GPU; ``bench gpu --check`` runs its pytest with its own
  options and names each failure;
* ``--trace`` on NCCL says its times are host launch times;
* per-step costs: CUDA events on logging steps only, the pieces' geometry cached, contiguous
  pinned batches;
* the end of a run: the summary of a ``--log-every K`` run with MFU (any GPU) ends with exit 0.
"""
import datetime
import os
import re
import sys

import pytest
import torch

from conftest import NANO, ROOT, cli, hide_gpus, runs_only_gpu_tests
from minipar import comm, train
from minipar.runtime import dist, timeouts, trace
from minipar.train import optim, pieces, sample
from minipar.bench import gpu as bench_gpu
from minipar.data import ByteTokenizer
from test_scripts import _srun_steps, run_script

SHORT = NANO[:NANO.index("--steps")] + ["--steps", "4"]


# --------------------------------------------------------------------------------------
# Sampling: 32 tokens, whatever the decoder keeps
# --------------------------------------------------------------------------------------
def test_sampling_counts_tokens_not_decoded_bytes(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    train.run(SHORT + ["--save", root])
    made = []
    real = sample.generate
    monkeypatch.setattr(sample, "generate", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    texts = [sample.run(["--resume", root, "--prompt", "def ", "--tokens", "32", "--seed", str(s)])
             for s in range(4)]
    for out, text in zip(made, texts):
        assert out.numel() == len(b"def ") + 32                  # what the GPU test now checks
        assert text == ByteTokenizer().decode(out.tolist()) and text.startswith("def ")
    # the old check (>= 32 bytes of text) fails on this working sampler: a tiny model emits
    # bytes that make no UTF-8 character, and the decoder leaves them out
    assert any(len(t.encode()) < 32 for t in texts), [len(t.encode()) for t in texts]


# --------------------------------------------------------------------------------------
# Which GPU a Slurm task takes
# --------------------------------------------------------------------------------------
DGX_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
            "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16", "SLURM_GPUS_PER_TASK": "1",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_a_task_that_sees_several_gpus_takes_its_local_ranks(monkeypatch):
    """--gpus-per-task 1 --gpu-bind closest on a DGX: each task sees its socket's 4 GPUs.
    Device 0 for all four tasks of a socket was NCCL's "Duplicate GPU"."""
    monkeypatch.setattr(dist, "gpu_count", lambda: 4)
    backend, device, _ = dist.resolve("nccl", 8, DGX_TASK)
    assert (backend, str(device)) == ("nccl", "cuda:3")
    with pytest.raises(dist.UsageError) as e:
        dist.resolve("auto", 8, dict(DGX_TASK, SLURM_LOCALID="5"))
    line = str(e.value)
    assert "\n" not in line and "local rank 5 sees 4 GPUs" in line and "single:1" in line
    # exactly one visible and Slurm bound it: the task's device 0 (Frontier, single:1)
    monkeypatch.setattr(dist, "gpu_count", lambda: 1)
    assert str(dist.resolve("nccl", 8, dict(DGX_TASK, CUDA_VISIBLE_DEVICES="5"))[1]) == "cuda:0"


# --------------------------------------------------------------------------------------
# The collective timeout
# --------------------------------------------------------------------------------------
def test_nccl_waits_600_s_by_default_and_gloo_60(monkeypatch):
    monkeypatch.delenv("MINIPAR_TIMEOUT", raising=False)
    assert timeouts._timeout_s("nccl") == 600 and timeouts._timeout_s("gloo") == 60
    monkeypatch.setenv("MINIPAR_TIMEOUT", "42")
    assert timeouts._timeout_s("nccl") == timeouts._timeout_s("gloo") == 42


def test_init_hands_nccl_its_timeout(monkeypatch):
    monkeypatch.delenv("MINIPAR_TIMEOUT", raising=False)
    for var, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29999").items():
        monkeypatch.setenv(var, value)
    seen = {}
    monkeypatch.setattr(dist, "resolve", lambda *a, **k: ("nccl", torch.device("cuda", 0), None))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *a, **k: seen.update(k))
    dist.init("auto")
    assert seen["timeout"] == datetime.timedelta(seconds=600)
    assert seen["device_id"] == torch.device("cuda", 0)


# --------------------------------------------------------------------------------------
# The cluster scripts
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["frontier.sbatch", "dgx.sbatch"])
def test_scripts_export_the_nccl_timeout_and_smoke_test_first(script, tmp_path):
    done, calls = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr
    (argv, env), = _srun_steps(calls, "minipar.train")
    assert env["MINIPAR_TIMEOUT"] == "600"
    steps = [argv for name, argv, _ in calls if name == "srun" and "python" in argv]
    assert "minipar.runtime.smoke" in steps[0], steps[0]                 # before the training step
    smoke = " ".join(steps[0])
    assert "-n 2" in smoke and "--ntasks-per-node 1" in smoke     # one rank on each of 2 nodes


@pytest.mark.parametrize("script", ["frontier.sbatch", "dgx.sbatch"])
def test_a_failing_smoke_step_stops_the_job_with_one_line(script, tmp_path):
    done, calls = run_script(script, tmp_path, FAKE_SRUN_FAIL="minipar.runtime.smoke",
                             FAKE_SRUN_SAYS="smoke failed: rank 1: joining the process group: "
                                            "DistStoreError: timed out")
    assert done.returncode == 1
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "smoke step failed" in lines[0], done.stderr
    assert "rank 1: joining the process group" in lines[0]
    assert not _srun_steps(calls, "minipar.train")


def test_frontier_checks_the_rocm_module_against_the_wheel(tmp_path):
    done, calls = run_script("frontier.sbatch", tmp_path, FAKE_PY_OUT="6.1.40091-a8dbc0c19")
    assert done.returncode == 1
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert "ROCm 6.2" in lines[0] and "built for ROCm 6.1" in lines[0] and "ROCM_MODULE" in lines[0]
    assert not [c for c in calls if c[0] == "srun"]
    (tmp_path / "b").mkdir()
    ok, _ = run_script("frontier.sbatch", tmp_path / "b", ROCM_MODULE="rocm/6.1.3",
                       FAKE_PY_OUT="6.1.40091-a8dbc0c19")
    assert ok.returncode == 0, ok.stderr


def test_frontier_needs_the_rccl_plugin_only_between_nodes(tmp_path):
    done, calls = run_script("frontier.sbatch", tmp_path, plugin=False, SLURM_NNODES="1")
    assert done.returncode == 0, done.stderr
    (argv, env), = _srun_steps(calls, "minipar.train")
    assert "NCCL_NET" not in env and "one node" in done.stdout
    smoke = " ".join(_srun_steps(calls, "minipar.runtime.smoke")[0][0])
    assert "-N 1 -n 2 --ntasks-per-node 2" in smoke


def test_the_smoke_command_all_reduces_on_two_ranks():
    r = cli("minipar.runtime.smoke", "--nproc", "2", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("smoke ok: 2 ranks, gloo on cpu")
    r = cli("minipar.runtime.smoke", "--nproc", "2", "--backend", "nccl")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# --------------------------------------------------------------------------------------
# GPU tests are the only tests that see a GPU
# --------------------------------------------------------------------------------------
def test_the_suite_hides_gpus_except_from_test_gpu():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" == os.environ.get("HIP_VISIBLE_DEVICES")
    assert runs_only_gpu_tests(["tests/test_gpu.py"], ROOT)
    assert runs_only_gpu_tests([os.path.join(ROOT, "tests", "test_gpu.py") + "::test_x"], "/")
    assert not runs_only_gpu_tests(["tests/test_gpu.py", "tests/test_mfu.py"], ROOT)
    assert not runs_only_gpu_tests(["tests", "notebooks"], ROOT)
    assert not runs_only_gpu_tests([], ROOT)
    environ = {}
    hide_gpus(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


class _TorchThatCountedAGpu:
    """torch as minipar's device rule (``minipar.runtime.dist``) sees it on a GPU host where
    torch counted one GPU before the suite hid it; everything else is the real torch."""
    cuda = type("cuda", (), dict(is_available=staticmethod(lambda: True),
                                 device_count=staticmethod(lambda: 1)))

    def __getattr__(self, name):
        return getattr(torch, name)


def test_on_a_gpu_host_the_cpu_suite_trains_on_the_cpu(monkeypatch):
    """A GPU host, faked for minipar's device rule alone: it is told of a GPU. The hidden
    devices win: gloo on the CPU, no MFU and no GPU memory in the metrics (test_mfu's
    expectations). torch's own code is not told: faking ``torch.cuda.is_available`` for the
    whole run, as this test did, can send a CUDA build's own code into a CUDA call with no GPU
    visible (some torch releases' optimizer graph-capture check asks ``is_available()``, then
    the stream), which is the likely reason it failed on an H200 and nowhere else."""
    monkeypatch.setattr(dist, "torch", _TorchThatCountedAGpu())
    assert dist.gpu_count() == 0
    assert dist.resolve("auto", 1)[:2] == ("gloo", torch.device("cpu"))
    history = train.run(SHORT)
    assert history[-1]["mfu"] is None and "peak_memory_bytes" not in history[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")            # not hidden: the GPU is used
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    assert dist.resolve("auto", 1)[:2] == ("nccl", torch.device("cuda", 0))


@pytest.mark.slow     # a smoke run of a bench: the full suite runs it
def test_bench_gpu_check_runs_pytest_with_its_own_options():
    """Without the [test] extras (no xdist, no nbval) the repository's addopts would be an
    error; the check's pytest drops them."""
    cmd = bench_gpu.gpu_test_command()
    assert cmd[cmd.index("-o") + 1] == "addopts="
    ok, text = bench_gpu.run_gpu_tests(timeout=240, extra=("-p", "no:xdist", "-p", "no:nbval"))
    assert ok and "skipped" in text, text


@pytest.mark.slow     # a smoke run of a bench: the full suite runs it
def test_bench_gpu_check_compares_two_fresh_deterministic_runs(monkeypatch):
    """--check's repeat: two fresh trainer processes, their losses compared bit for bit (on the
    CPU here; on a GPU, tests/test_gpu.py): a difference is named by its first step. (Equal
    runs reported bit-identical: test_bringup's smoke of ``bench gpu --check``, which runs it.)"""
    from types import SimpleNamespace
    args = SimpleNamespace(model="nano", batch_size=8, dtype="fp32", device="cpu", compile=False)
    runs = iter(["1", "2"])                       # the second run with another seed
    real = bench_gpu.subprocess.run
    monkeypatch.setattr(bench_gpu.subprocess, "run",
                        lambda cmd, **kw: real(cmd + ["--seed", next(runs)], **kw))
    ok, text = bench_gpu.repeat_runs(args, steps=3, timeout=240)
    assert not ok and "losses differ from step 1" in text, text


@pytest.mark.slow     # a smoke run of a bench: the full suite runs it
def test_bench_gpu_deterministic_prints_its_cost():
    r = cli("minipar.bench", "gpu", "--device", "cpu", "--model", "nano", "--batch-size", "8",
            "--steps", "3", "--warmup", "1", "--dtype", "fp32", "--deterministic", timeout=240)
    assert r.returncode == 0, r.stderr
    assert re.search(r"minipar --deterministic: [\d.]+ ms a step, [\d.]+x the default's",
                     r.stdout), r.stdout


def test_bench_gpu_check_names_each_failure(tmp_path, monkeypatch):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_gpu.py").write_text("def test_fine():\n    pass\n\n\n"
                                       "def test_broken():\n    assert 1 == 2, 'one is not two'\n")
    monkeypatch.setattr(bench_gpu, "GPU_TESTS", str(tests / "test_gpu.py"))
    ok, text = bench_gpu.run_gpu_tests(timeout=240)
    assert not ok
    assert "1 failed, 1 passed" in text and "FAILED tests/test_gpu.py::test_broken" in text, text


# --------------------------------------------------------------------------------------
# --trace on NCCL
# --------------------------------------------------------------------------------------
def test_a_trace_on_nccl_says_it_holds_host_launch_times(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    tracer = trace.start(0)
    trace.stop()
    assert tracer.clock == trace.LAUNCH_CLOCK
    path = str(tmp_path / "t.json")
    trace.gather_and_write(path, tracer)
    import json
    data = json.load(open(path))
    assert "launch" in data["otherData"]["clock"] and "not GPU time" in data["otherData"]["clock"]
    names = [e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"]
    assert "comm (host launch times, not GPU time)" in names
    assert trace.Tracer(0).clock == trace.HOST_CLOCK               # gloo: host time is right


# --------------------------------------------------------------------------------------
# Per-step costs
# --------------------------------------------------------------------------------------
class _FakeEvent:
    made = 0

    def __init__(self, enable_timing=False):
        _FakeEvent.made += 1

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


def _events_per_run(log_every):
    """On a gloo rank made to time like NCCL: CUDA events made by a 6-step run."""
    comm.clock = lambda: "cuda-events"
    torch.cuda.Event = _FakeEvent
    # TP: every rank owns gradient pieces, so the norm needs no device of its own
    cfg = train.parse_config(NANO[:NANO.index("--steps")] + ["--steps", "6", "--log-every",
                                                             str(log_every), "--tp", "2",
                                                             "--nproc", "2"])
    _FakeEvent.made = 0
    history = train.worker(cfg)
    return _FakeEvent.made, history


def test_cuda_events_only_on_logging_steps():
    every, = {r[0] for r in dist.launch(_events_per_run, 2, 1, timeout=120)}
    results = dist.launch(_events_per_run, 2, 3, timeout=120)
    third = results[0][0]
    assert every > 0 and every == 3 * third                      # 6 logging steps against 2
    assert results[0][1][-1]["comm_seconds"]["all_reduce"] > 0   # the logging step is timed


def test_the_pieces_geometry_is_worked_out_once(monkeypatch):
    cfg = train.parse_config(SHORT + ["--weight-decay", "0.1"])
    mesh = train.build_mesh(cfg)
    runner = train.build_runner(cfg, mesh, train.build_model(cfg, mesh, torch.device("cpu")))
    engine = train.build_engine(cfg, mesh, runner.module)
    for p in runner.module.parameters():
        p.grad = torch.randn_like(p)
    worked = []
    real = pieces._boxes
    monkeypatch.setattr(pieces, "_boxes", lambda *a: worked.append(a[2]) or real(*a))
    plans = {}
    fresh = pieces.pieces(mesh, runner, engine)
    n = len(worked)
    for _ in range(3):
        cached = pieces.pieces(mesh, runner, engine, plans)
    assert len(worked) == 2 * n                                   # fresh, then the first cached
    assert len(fresh) == len(cached) > 0
    for a, b in zip(fresh, cached):
        assert (a.name, a.shape, a.offsets, a.sizes, a.owner) == (b.name, b.shape, b.offsets,
                                                                   b.sizes, b.owner)
        assert set(a.views) == set(b.views)
        assert all(torch.equal(a.views[k], b.views[k]) and
                   a.views[k].data_ptr() == b.views[k].data_ptr() for k in a.views)
    # the hook keeps them: the norm of every step reuses the first step's geometry
    hook = optim.StepHook(mesh, runner, engine)
    for _ in range(2):
        norm = optim.global_grad_norm(mesh, runner, engine, hook._plans)
    assert norm == pytest.approx(torch.cat([p.grad.flatten() for p in
                                            runner.module.parameters()]).double().norm().item())


def test_batches_are_pinned_contiguous(monkeypatch):
    """Batches hands out strided views; one contiguous pinned copy goes to the GPU."""
    from minipar import data
    x, _ = data.Batches(ByteTokenizer().encode(data.load_text(None)), 16, 8).local_batch(1)
    assert not x.is_contiguous()
    real_empty = torch.empty
    asked = []
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k:
                        asked.append(pin_memory) or real_empty(*a, **k))    # no pinning on a CPU
    staged = train.loop.pinned(x)
    assert asked == [True] and staged.is_contiguous() and torch.equal(staged, x)


# --------------------------------------------------------------------------------------
# The end of a run
# --------------------------------------------------------------------------------------
def test_a_run_logging_every_k_steps_with_mfu_ends_with_its_summary():
    """Any GPU knows its peak, so MFU is on the logging steps' records only; the summary's
    mean over every record was a KeyError after the last step: exit 1 after a good run
    (both cluster scripts use --log-every 5). --peak-tflops gives the CPU a peak."""
    history = train.run(NANO[:NANO.index("--steps")] + ["--steps", "9", "--log-every", "3",
                                                         "--peak-tflops", "1"])
    assert [h["step"] for h in history if "mfu" in h] == [3, 6, 9]
    text = train.report.summary(history)
    assert "MFU" in text
    # a GPU's peaks on the logging records: 2, 5 and 3 GiB. The peak is their max, 5.00 GiB;
    # the first (2.00), the last (3.00), the mean (3.33) and the sum (10.00) all read otherwise
    gib = {3: 2, 6: 5, 9: 3}
    gpu = [dict(h, peak_memory_bytes=gib[h["step"]] * 2**30) if "mfu" in h else h for h in history]
    peak, = [ln for ln in train.report.summary(gpu).splitlines() if "peak GPU memory" in ln]
    assert peak.endswith("): 5.00 GiB"), peak


@pytest.mark.slow     # a trainer process under torchrun's environment
def test_torchrun_rank_ends_with_exit_0_after_logging_every_k_steps(tmp_path):
    # the rank joins a store this process hosts, as torchrun's ranks join its agent's (and as
    # dist.launch does): a port the OS gave while bound, never one picked to be bound later.
    # The store must outlive the rank: it is referenced after subprocess.run returns
    import torch.distributed as tdist
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True", PYTHONPATH=ROOT)
    import subprocess
    r = subprocess.run([sys.executable, "-m", "minipar.train", *NANO[:NANO.index("--steps")],
                        "--steps", "4", "--log-every", "3", "--peak-tflops", "1", "--save",
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=180,
                       env=env, cwd=ROOT)
    del store                                    # the rank has ended: the store may go
    assert r.returncode == 0, r.stderr[-2000:]
    assert "summary: 4 steps" in r.stdout
