"""Shared test helpers: tiny models, gloo processes with timeouts, serial references."""
import os
import subprocess
import sys
import threading
import time

# One thread per process, here and in every process a test starts (ranks, commands, notebook
# kernels): with 2 to 8 processes on 2 cores, more threads only wait on each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
os.environ.setdefault("MINIPAR_TIMEOUT", "60")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model every equivalence test trains: the `nano` preset, 20 steps, fp32.
NANO = ["--model", "nano", "--batch-size", "8", "--steps", "20", "--quiet", "--lr", "3e-3"]

_SERIAL_CACHE = {}


def serial_state(extra=()):
    """The single-process run that every layout is compared with (cached per argument list)."""
    from minipar.train import run_state
    key = tuple(NANO) + tuple(extra)
    if key not in _SERIAL_CACHE:
        _SERIAL_CACHE[key] = run_state(list(key), nproc=1)
    return _SERIAL_CACHE[key]


def assert_same_training(got, ref, loss_tol=1e-5, tol=1e-4, check_grads=True):
    """Same losses at every step, same final parameters and last-step gradients."""
    assert len(got["losses"]) == len(ref["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= loss_tol, f"step {step}: loss {a} != serial {b}"
    assert set(got["params"]) == set(ref["params"]), (
        f"parameter names differ: {sorted(set(got['params']) ^ set(ref['params']))}")
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    if check_grads:
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=tol, rtol=tol, msg=lambda m: f"grad {name}: {m}")


def assert_same_moe_training(got, ref):
    """MoE against its serial twin: losses and last gradients within 1e-5, parameters within
    1e-4 (Adam's 1/sqrt(v) turns a tiny gradient's reordering noise into up to lr of
    movement), and the aux and z losses and the drop rate at every step. The serial run must
    drop some assignments, so that the order capacity slots are taken in is tested too."""
    assert_same_training(got, ref, loss_tol=1e-5, tol=1e-4)
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, atol=1e-5, rtol=1e-5, msg=n)
    for a, b in zip(got["history"], ref["history"]):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
        assert a["z_loss"] == pytest.approx(b["z_loss"], abs=1e-5)
        assert a["drop_rate"] == pytest.approx(b["drop_rate"], abs=1e-9)
    assert any(h["drop_rate"] > 0 for h in ref["history"])


def cli(*args, timeout=120):
    """Run `python -m ...` as a user would; returns CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _warm_forkserver():
    """Every ``dist.launch`` forks its ranks from one forkserver per test process. With the
    package imported there as well as torch, a rank starts with minipar loaded instead of
    importing it again (0.8 to 0.9 s per rank, measured on the 2-core VM at load 19).
    DCP, which ``minipar.checkpoint`` imports only when a checkpoint is read or written, and
    DTensor with it, are preloaded too: many tests' ranks save, load or build torch's twins."""
    from minipar.runtime import dist
    ctx = dist._context()
    if hasattr(ctx, "set_forkserver_preload"):
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "einops",
                                    "minipar.train", "minipar.checkpoint", "minipar.sample",
                                    "minipar.exercises", "torch.distributed.checkpoint"])


_warm_forkserver()

STILL_RUNNING_S = 20.0   # a test still running after this long is named, and every minute after

# The files that take longest, heaviest first (seconds of a whole run, per file: the full suite
# on the 2-core VM at load 4 to 9, with test_clean_exit's and test_porting's costs as after
# their speed-ups; every file of 10 s or more). pytest-xdist hands whole files to its two
# workers in this order, so the run does not end with one worker busy on a long file while
# the other waits; it was also simulated to balance the quick tier as it then was (283 s a
# worker each, before part of it moved to the slow mark). Order only: every file runs, and a
# file missing here runs after these.
HEAVY_FIRST = [
    "tests/test_dist.py", "tests/test_compose.py", "tests/test_exercises.py", "tests/test_plan.py",
    "tests/test_scaling.py", "tests/test_train.py", "notebooks/06_scaling_experiments.ipynb",
    "tests/test_first_run.py", "notebooks/05_3d_parallel_trainer.ipynb",
    "tests/test_clean_exit.py", "tests/test_pp.py", "tests/test_moe.py", "tests/test_zero.py",
    "tests/test_cp_train.py", "tests/test_bringup.py", "tests/test_dp.py",
    "notebooks/08_mixture_of_experts.ipynb", "tests/test_plan_fit.py", "tests/test_checkpoint.py",
    "notebooks/01_data_parallel.ipynb", "tests/test_wrappers.py", "tests/test_tp.py",
    "notebooks/03_pipeline_parallel.ipynb", "tests/test_moe_cp.py", "tests/test_mfu.py",
    "notebooks/09_long_context.ipynb", "notebooks/04_zero_and_amsp.ipynb",
    "tests/test_dropin_hard.py", "tests/test_plan_cp.py", "notebooks/02_tensor_parallel.ipynb",
    "tests/test_porting.py", "tests/test_p2p_order.py", "tests/test_precision.py",
    "notebooks/00_collectives.ipynb", "tests/test_plan_scale.py", "tests/test_optim.py",
    "tests/test_kernel.py", "notebooks/07_planning_at_scale.ipynb", "tests/test_recompute.py",
]


def pytest_collection_modifyitems(config, items):
    """Every notebook is slow (nbval runs it top to bottom): the quick tier skips them. The
    heaviest files go first (``HEAVY_FIRST``); the order inside a file is kept."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.fspath), ROOT), len(rank)))


def _announcement(nodeid: str) -> str | None:
    """The line printed when a notebook starts (nbval names its first code cell "Cell 0")."""
    path, _, cell = nodeid.partition("::")
    if not (path.endswith(".ipynb") and cell == "Cell 0"):
        return None
    import json
    with open(os.path.join(ROOT, path)) as f:
        cells = sum(c["cell_type"] == "code" for c in json.load(f)["cells"])
    return f"notebook {path}: running its {cells} cells"


class _Watch:
    """Names the test that has run STILL_RUNNING_S seconds without a result, from a timer
    thread; the lock keeps its line out of the reporter's own writing."""

    def __init__(self, reporter, nodeid):
        self.reporter, self.nodeid, self.t0 = reporter, nodeid, time.monotonic()
        self.lock, self.done = threading.Lock(), False
        self._arm(STILL_RUNNING_S)

    def _arm(self, seconds):
        self.timer = threading.Timer(seconds, self._say)
        self.timer.daemon = True
        self.timer.start()

    def _say(self):
        with self.lock:
            if self.done:
                return
            capture = _CONFIG[0].pluginmanager.get_plugin("capturemanager")
            with capture.global_and_fixture_disabled():   # the test's output is being captured
                self.reporter.ensure_newline()
                self.reporter.write_line(f"still running after "
                                         f"{time.monotonic() - self.t0:.0f} s: {self.nodeid}")
            self._arm(60.0)

    def stop(self):
        with self.lock:
            self.done = True
            self.timer.cancel()


# nodeid -> its watch; under pytest-xdist two tests run at once and both are reported here
_WATCH: dict = {}


def _reporter():
    reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    return reporter if reporter is not None and reporter.verbosity <= 0 else None


def pytest_runtest_logstart(nodeid, location):
    reporter = _reporter()
    if reporter is None:
        return
    line = _announcement(nodeid)
    if line:
        reporter.ensure_newline()
        reporter.write_line(line)
    _WATCH[nodeid] = _Watch(reporter, nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        watch = _WATCH.pop(report.nodeid, None)
        if watch is not None:
            watch.stop()


def pytest_runtest_logfinish(nodeid, location):
    watch = _WATCH.pop(nodeid, None)
    if watch is not None:
        watch.stop()


_CONFIG: list = []

# GPU tests are the only tests that see a GPU: on a GPU host the CPU suite must not move onto
# cuda:0 and NCCL (the trainer's backend "auto" would), so unless pytest was asked for
# tests/test_gpu.py alone (as `python -m minipar.bench gpu --check` does), every GPU is hidden
# from this process and from every process it starts, before anything touches CUDA.
GPU_TESTS = os.path.join(ROOT, "tests", "test_gpu.py")
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def runs_only_gpu_tests(args, cwd) -> bool:
    """Whether pytest's path arguments all name tests/test_gpu.py (or tests in it)."""
    paths = [a.split("::")[0] for a in args if not a.startswith("-")]
    return bool(paths) and all(
        os.path.realpath(os.path.join(cwd, p)) == os.path.realpath(GPU_TESTS) for p in paths)


def hide_gpus(environ=os.environ) -> None:
    environ.update(HIDE_GPUS)


def pytest_configure(config):
    _CONFIG.append(config)
    if not runs_only_gpu_tests(config.args, str(config.invocation_params.dir)):
        hide_gpus()


@pytest.fixture
def nano_serial():
    return serial_state()


def quick_tier(names, quick):
    """Parameters for ``parametrize``: the names in ``quick`` run in the quick tier, the others
    (4-rank twins, more specs of the same engine) carry the slow mark and run in the full suite."""
    unknown = set(quick) - set(names)
    assert not unknown, f"quick_tier: {sorted(unknown)} not among {list(names)}"
    return [n if n in quick else pytest.param(n, marks=pytest.mark.slow) for n in names]
