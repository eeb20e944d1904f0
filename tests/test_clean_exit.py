"""A user's own script ends cleanly: 100 runs of ``tests/spawn_wrappers.py`` (2-rank gloo worlds
under ``torch.multiprocessing.spawn`` using DataParallel, ShardedOptimizer and fully_shard,
each rank returning normally and ending with ``destroy_process_group()``), none aborted, none
failed, none hung. Slow: 200 interpreters start and import torch (5 pairs per spawn, 20
spawns): measured 785 CPU-seconds (40.6 min wall on a 2-core VM, torch 2.13 CPU, gloo, loaded
by parallel work; about 6.5 min on the idle machine). MINIPAR_CLEAN_EXIT_RUNS lowers the count."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

RUNS, PAIRS = int(os.environ.get("MINIPAR_CLEAN_EXIT_RUNS", "100")), 5


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
