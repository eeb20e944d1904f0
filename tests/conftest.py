"""Shared test helpers: tiny models, gloo processes with timeouts, serial references."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

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
    importing it again (0.8 to 0.9 s per rank, measured on the 2-core VM at load 19)."""
    from minipar import dist
    ctx = dist._context()
    if hasattr(ctx, "set_forkserver_preload"):
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "einops",
                                    "minipar.train", "minipar.checkpoint", "minipar.sample",
                                    "minipar.exercises"])


_warm_forkserver()

# nodeid -> the line printed when it starts: the run says what takes minutes, not only dots.
_ANNOUNCE: dict[str, str] = {}
STILL_RUNNING_S = 20.0   # a test still running after this long is named, and every minute after


def pytest_collection_modifyitems(config, items):
    """Every notebook is slow (nbval runs it top to bottom): the quick tier skips them.
    Each notebook is announced by one line when it starts."""
    cells: dict[str, list] = {}
    for item in items:
        path = str(item.fspath)
        if path.endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
            cells.setdefault(path, []).append(item)
    for path, nb_items in cells.items():
        _ANNOUNCE[nb_items[0].nodeid] = (f"notebook {os.path.relpath(path, ROOT)}: "
                                         f"running its {len(nb_items)} cells")


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


_WATCH: list = []


def _reporter():
    reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    return reporter if reporter is not None and reporter.verbosity <= 0 else None


def pytest_runtest_logstart(nodeid, location):
    reporter = _reporter()
    if reporter is None:
        return
    line = _ANNOUNCE.get(nodeid)
    if line:
        reporter.ensure_newline()
        reporter.write_line(line)
    _WATCH.append(_Watch(reporter, nodeid))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    if _WATCH and (report.when == "call" or report.outcome != "passed"):
        _WATCH.pop().stop()


def pytest_runtest_logfinish(nodeid, location):
    while _WATCH:
        _WATCH.pop().stop()


_CONFIG: list = []


def pytest_configure(config):
    _CONFIG.append(config)


@pytest.fixture
def nano_serial():
    return serial_state()


def quick_tier(names, quick):
    """Parameters for ``parametrize``: the names in ``quick`` run in the quick tier, the others
    (4-rank twins, more specs of the same engine) carry the slow mark and run in the full suite."""
    unknown = set(quick) - set(names)
    assert not unknown, f"quick_tier: {sorted(unknown)} not among {list(names)}"
    return [n if n in quick else pytest.param(n, marks=pytest.mark.slow) for n in names]
