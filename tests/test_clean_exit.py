"""A user's own script ends cleanly: runs of ``tests/spawn_wrappers.py`` (2-rank gloo worlds
under ``torch.multiprocessing.spawn`` using DataParallel, ShardedOptimizer and fully_shard,
each rank returning normally and ending with ``destroy_process_group()``), none aborted, none
failed, none hung. The suite runs 8 (2 spawns of 4 pairs: 16 interpreters, each a fresh
Python that imports torch and ends through interpreter finalization, where the abort lived);
the issue's 100 (200 interpreters, about 6.5 min on an idle 2-core VM) is
``MINIPAR_CLEAN_EXIT_RUNS=100 python -m pytest tests/test_clean_exit.py``."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

RUNS, PAIRS = int(os.environ.get("MINIPAR_CLEAN_EXIT_RUNS", "8")), 4


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_spawned_script_using_the_wrappers_ends_cleanly_every_time():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "spawn_wrappers.py"),
                          str(RUNS), str(PAIRS)], capture_output=True, text=True, env=env,
                         timeout=1800, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"runs {RUNS} aborted 0 failed 0" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_delayed_gloo_worker_thread_cannot_abort_a_launched_rank():
    """tests/exit_abort.py: a sub-group kept past destroy_process_group, its worker thread
    delayed while it frees an op's tensor. A script ending by interpreter finalization aborts
    (SIGABRT, every run of 5 on the 2-core VM: the window docs/reference.md states); ranks of
    minipar's launcher end through dist.finish and os._exit and never do: 10 launches of two
    fresh ranks each, from one launcher process (the abort is a rank's own end)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "exit_abort.py"),
                          "launch", "10"], capture_output=True, text=True, env=env,
                         timeout=850, cwd=ROOT)
    assert "runs 10 aborted 0 failed 0" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
