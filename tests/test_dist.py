"""The launcher, the environment readers and the process mesh."""
import time

import pytest
import torch
import torch.distributed as tdist

from minipar import comm
from minipar.mesh import Mesh
from minipar.runtime import dist


def _grid_coords(dp, pp, tp):
    g = Mesh(dp=dp, pp=pp, tp=tp)
    return dict(rank=g.rank, coords=(g.coord("dp"), g.coord("pp"), g.coord("tp")), tp=g.ranks("tp"),
                pp=g.ranks("pp"), dp=g.ranks("dp"), sizes=(comm.size(g.group("dp")), comm.size(g.group("pp")),
                                                    comm.size(g.group("tp"))))


@pytest.mark.slow     # 8 ranks; test_mesh's 8-rank check of the same view is quick
def test_grid_layout_matches_arange_view():
    out = dist.launch(_grid_coords, 8, dp=2, pp=2, tp=2)
    ranks = torch.arange(8).view(2, 2, 2)
    for r in out:
        d, p, t = r["coords"]
        assert ranks[d, p, t] == r["rank"]
        assert r["tp"] == ranks[d, p, :].tolist()        # TP neighbours are adjacent ranks
        assert r["pp"] == ranks[d, :, t].tolist()
        assert r["dp"] == ranks[:, p, t].tolist()
        assert r["sizes"] == (2, 2, 2)


def _group_sum(dp, pp, tp):
    g = Mesh(dp=dp, pp=pp, tp=tp)
    x = torch.tensor([float(g.rank)])
    comm.all_reduce(x, g.group("tp"))
    return x.item(), sum(g.ranks("tp"))


def test_groups_reduce_over_their_own_ranks():
    for got, expected in dist.launch(_group_sum, 4, dp=1, pp=2, tp=2):
        assert got == expected


def _raise_on_rank_1():
    if tdist.get_rank() == 1:
        raise ValueError("boom from rank one")
    x = torch.ones(4)
    tdist.all_reduce(x)  # rank 0 blocks here, waiting for the dead rank
    return x


def test_failing_rank_stops_all_fast_with_its_traceback():
    t = time.monotonic()
    with pytest.raises(dist.RankFailed) as e:
        dist.launch(_raise_on_rank_1, 2, timeout=60)
    assert "boom from rank one" in str(e.value) and "rank 1" in str(e.value)
    assert time.monotonic() - t < 30


def _sleep_forever():
    time.sleep(1000)


def test_timeout_kills_every_rank():
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        dist.launch(_sleep_forever, 2, timeout=3)
    assert time.monotonic() - t < 20


def _hard_exit():
    import os
    if tdist.get_rank() == 0:
        os._exit(7)
    time.sleep(1000)


def test_killed_rank_is_reported():
    with pytest.raises(dist.RankFailed, match="exit code 7"):
        dist.launch(_hard_exit, 2, timeout=60)


def test_env_torchrun_and_slurm():
    e = dist.env_from_os({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                          "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (3, 8, 1, "n0", 1234)
    s = dist.env_from_os({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                          "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16",
                          "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)",
                          "SLURM_NODELIST": "frontier[00012-00013]", "SLURM_JOBID": "77"})
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (9, 16, 1, 8)
    assert s.master_addr == "frontier00012"
    assert dist.env_from_os({}) is None


def test_sbatch_script_outside_srun_is_a_plain_process(monkeypatch):
    """Inside an sbatch batch script but outside srun, SLURM_PROCID and SLURM_NTASKS are
    set: that is no rank of a 16-task world (it would wait for 15 ranks that never come)."""
    assert dist.env_from_os(SBATCH_SCRIPT) is None
    assert dist.in_slurm_step(SRUN_TASK) and not dist.in_slurm_step(SBATCH_SCRIPT)
    # the batch script's --gpus-per-task binds nothing to it: --nproc 4 there takes GPUs 0..3
    _gpus(monkeypatch, 8)
    assert dist.resolve("auto", 4, dict(SBATCH_SCRIPT, LOCAL_RANK="2"))[1] == torch.device("cuda", 2)
    # srun's own step: the step's task count is the world
    s = dist.env_from_os(dict(SRUN_TASK, SLURM_NTASKS="16", SLURM_STEP_NUM_TASKS="8",
                              SLURM_NODELIST="n[1-2]"))
    assert (s.rank, s.world_size) == (3, 8)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_inside_sbatch_script_ends(tmp_path):
    """``python -m minipar.train --nproc 1`` and ``--nproc 2`` in a batch script (a fake
    one: the job's Slurm variables, no srun step) run and end instead of waiting for ranks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(SBATCH_SCRIPT, PYTHONPATH=ROOT, MINIPAR_TIMEOUT="30")
    for nproc in ("1", "2"):
        r = subprocess.run([sys.executable, "-m", "minipar.train", "--nproc", nproc, "--model",
                            "nano", "--steps", "2", "--quiet"], capture_output=True, text=True,
                           timeout=240, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "summary: 2 steps" in r.stdout


# --------------------------------------------------------------------------------------
# Device and backend: one rule (dist.resolve), checked with fake environments
# --------------------------------------------------------------------------------------
def _gpus(monkeypatch, n):
    monkeypatch.setattr(dist, "gpu_count", lambda: n)


SRUN_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0",
             "SLURM_STEP_NUM_TASKS": "8"}
SRUN_BOUND = dict(SRUN_TASK, SLURM_GPUS_PER_TASK="1")
SRUN_GPU_BIND = dict(SRUN_TASK, SLURM_STEP_GPUS="0,1,2,3,4,5,6,7", ROCR_VISIBLE_DEVICES="3")
SRUN_UNBOUND = dict(SRUN_TASK)
# an sbatch batch script outside srun: the job's PROCID/NTASKS, none of the step's variables
SBATCH_SCRIPT = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "16",
                 "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8",
                 "SLURM_GPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "frontier[00012-00013]"}


@pytest.mark.parametrize("n_gpu,backend,local,environ,expected", [
    # no GPU: gloo on CPU, nothing to explain
    (0, "auto", 1, {}, ("gloo", "cpu", None)),
    (0, "auto", 4, {}, ("gloo", "cpu", None)),
    (0, "gloo", 2, {}, ("gloo", "cpu", None)),
    # a single process uses the GPU, as --nproc 1 and torchrun --nproc-per-node 1 both do
    (1, "auto", 1, {}, ("nccl", "cuda:0", None)),
    (1, "nccl", 1, {}, ("nccl", "cuda:0", None)),
    # one GPU per local rank
    (4, "auto", 4, {"LOCAL_RANK": "2"}, ("nccl", "cuda:2", None)),
    (8, "auto", 4, {"LOCAL_RANK": "3"}, ("nccl", "cuda:3", None)),
    (8, "auto", 8, {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"},
     ("nccl", "cuda:3", None)),
    # too few GPUs: gloo on CPU with one line saying why (never silently)
    (1, "auto", 2, {}, ("gloo", "cpu", "2 processes, 1 GPU: using gloo on CPU")),
    (4, "auto", 8, {"LOCAL_RANK": "5"}, ("gloo", "cpu", "8 processes, 4 GPUs: using gloo on CPU")),
    # Slurm bound one GPU to each task (Frontier: --gpus-per-task 1 / --gpu-bind): device 0
    (1, "auto", 8, SRUN_BOUND, ("nccl", "cuda:0", None)),
    (1, "nccl", 8, SRUN_BOUND, ("nccl", "cuda:0", None)),
    (1, "auto", 8, SRUN_GPU_BIND, ("nccl", "cuda:0", None)),
    # one GPU visible under srun without a per-task binding is not a binding
    (1, "auto", 8, SRUN_UNBOUND, ("gloo", "cpu", "8 processes, 1 GPU: using gloo on CPU")),
    (1, "auto", 8, dict(SRUN_UNBOUND, CUDA_VISIBLE_DEVICES="0"),
     ("gloo", "cpu", "8 processes, 1 GPU: using gloo on CPU")),
    # an explicit gloo is honoured as asked
    (4, "gloo", 4, {}, ("gloo", "cpu", None)),
])
def test_resolve_device_and_backend(monkeypatch, n_gpu, backend, local, environ, expected):
    _gpus(monkeypatch, n_gpu)
    b, device, note = dist.resolve(backend, local, environ)
    assert (b, str(device), note) == expected


@pytest.mark.parametrize("n_gpu,local,environ,message", [
    (0, 1, {}, "needs a GPU but torch sees none"),
    (1, 2, {}, "needs one GPU per local process: 2 processes, 1 GPU"),
    (4, 8, SRUN_UNBOUND, "8 processes, 4 GPUs"),
])
def test_nccl_that_cannot_be_honoured_is_a_usage_error(monkeypatch, n_gpu, local, environ, message):
    _gpus(monkeypatch, n_gpu)
    with pytest.raises(dist.UsageError, match=message):
        dist.resolve("nccl", local, environ)


def test_unknown_backend_is_a_usage_error():
    with pytest.raises(dist.UsageError, match="choose auto, gloo or nccl"):
        dist.resolve("mpi", 1, {})


# --------------------------------------------------------------------------------------
# Every group has the collective timeout
# --------------------------------------------------------------------------------------
def _group_timeouts():
    g = Mesh(dp=2, pp=1, tp=1)
    extra = g.new_groups([[0, 1]], "extra")
    cpu = torch.device("cpu")
    return [grp._get_backend(cpu).options._timeout.total_seconds()
            for grp in (tdist.group.WORLD, g.group("dp"), extra)]


def test_every_group_gets_the_collective_timeout(monkeypatch):
    monkeypatch.setenv("MINIPAR_TIMEOUT", "17")
    for timeouts in dist.launch(_group_timeouts, 2, timeout=60):
        assert timeouts == [17.0, 17.0, 17.0]


def test_no_module_creates_a_group_without_the_helper():
    """torch's new_group defaults to a 30-minute timeout whatever the default group has:
    every group must come from timeouts.new_group (re-exported as dist.new_group; directly
    or via Grid.new_groups)."""
    import pathlib
    import re
    pkg = pathlib.Path(dist.__file__).parent
    offenders = [str(f.relative_to(pkg)) for f in pkg.rglob("*.py") if f.name != "timeouts.py"
                 and re.search(r"(torch\.distributed|\bdist|\btdist)\.new_(sub)?group\(",
                               f.read_text())]
    assert offenders == []


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_bad_minipar_timeout_is_a_usage_error(monkeypatch, value):
    monkeypatch.setenv("MINIPAR_TIMEOUT", value)
    with pytest.raises(dist.UsageError, match="MINIPAR_TIMEOUT"):
        dist.launch(_grid_coords, 2, 1, 1, 2)


# --------------------------------------------------------------------------------------
# Faults: a rank killed, the launcher signalled or killed; nothing left behind
# --------------------------------------------------------------------------------------
import os
import re
import signal
import subprocess
import sys

from conftest import ROOT


def _proc_table():
    """{pid: (ppid, session id)} of every process, from /proc (Linux)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead, only not yet reaped
            table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def _session(sid):
    return sorted(pid for pid, (_, s) in _proc_table().items() if s == sid)


def _descendants(pid):
    table, out, todo = _proc_table(), [], [pid]
    while todo:
        p = todo.pop()
        kids = sorted(c for c, (pp, _) in table.items() if pp == p)
        out += kids
        todo += kids
    return out


def _ranks_of(launcher):
    """The ranks: the forkserver's children, started (so numbered) in rank order."""
    table = _proc_table()
    forkserver = [p for p, (pp, _) in table.items() if pp == launcher
                  and "forkserver" in open(f"/proc/{p}/cmdline").read()]
    return sorted(c for c, (pp, _) in table.items() if pp == forkserver[0])


def _semaphores_of(pids):
    """The named semaphores (/dev/shm/sem.*) these processes have open."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split("/dev/shm/", 1)[1].strip() for line in f if "/dev/shm/sem." in line}
        except OSError:
            continue
    return found


def _assert_no_semaphore_left(sems, timeout=10):
    deadline = time.monotonic() + timeout
    left = {s for s in sems if os.path.exists(f"/dev/shm/{s}")}
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = {s for s in sems if os.path.exists(f"/dev/shm/{s}")}
    assert left == set(), f"semaphores left in /dev/shm: {sorted(left)}"


# Started as a terminal starts a command: SIGINT at its default. A suite run as a background
# job (`python -m pytest &` from a script) has SIGINT ignored, which a child would inherit
# (POSIX: a non-interactive shell's background jobs ignore SIGINT; the launcher keeps it so).
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _start(argv, **kw):
    """A command in its own session (so the test can find, and finally kill, all it started),
    with SIGINT at its default whatever this process has (the exec keeps the pid)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, **kw.pop("env", {}))
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_line(proc, pattern, timeout=120):
    """Read stdout until a line matches; returns the lines read."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if re.search(pattern, line):
                return lines
        if proc.poll() is not None:
            break
    raise AssertionError(f"no line matching {pattern!r}: {''.join(lines)}{proc.stderr.read()}")


def _assert_all_gone(proc, timeout=30):
    """Every process the command started has ended; no semaphore of ours is left in /dev/shm."""
    deadline = time.monotonic() + timeout
    left = _session(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = _session(proc.pid)
    try:
        assert left == [], f"processes left behind: {left}"
    finally:
        if left:
            os.killpg(proc.pid, signal.SIGKILL)


TRAIN_FOREVER = ["-m", "minipar.train", "--model", "nano", "--steps", "100000", "--batch-size", "8"]


def _kill_a_rank_mid_run(layout, victim_index):
    """Start the trainer, SIGKILL one rank mid-run; the run must end fast, naming that rank."""
    proc = _start(TRAIN_FOREVER + layout)
    try:
        _wait_for_line(proc, r"step\s+2/")
        sems = _semaphores_of(_session(proc.pid))
        ranks = _ranks_of(proc.pid)
        t = time.monotonic()
        os.kill(ranks[victim_index], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    report = err.strip().splitlines()
    assert any(re.fullmatch(r"rank \d+ died: killed by SIGKILL \(exit -9\), no traceback", ln)
               for ln in report[:1]), err
    assert elapsed < 60
    _assert_all_gone(proc)
    _assert_no_semaphore_left(sems)
    return report


@pytest.mark.slow
def test_killing_a_rank_of_a_3d_layout_ends_the_run_naming_it():
    report = _kill_a_rank_mid_run(["--nproc", "8", "--dp", "2", "--pp", "2", "--tp", "2",
                                   "--microbatches", "4"], 5)
    assert "then what the other ranks saw:" in "\n".join(report)


@pytest.mark.slow
def test_killing_a_rank_of_a_zero3_run_ends_the_run_naming_it():
    _kill_a_rank_mid_run(["--nproc", "4", "--zero", "3"], 2)


@pytest.mark.parametrize("how,status,line", [
    ("SIGTERM", 128 + 15, "stopped by SIGTERM: every rank was stopped"),
    pytest.param("SIGINT", 130, "interrupted: every rank was stopped", marks=pytest.mark.slow),
    pytest.param("Ctrl-C", 130, "interrupted: every rank was stopped", marks=pytest.mark.slow),
    pytest.param("Ctrl-C, suite in the background", 130, "interrupted: every rank was stopped",
                 marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_signalled_launcher_stops_every_rank_with_one_line(how, status, line):
    # in the background (`python -m pytest &` from a script) this process ignores SIGINT
    background = how.endswith("in the background")
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if background else None
    try:
        proc = _start(TRAIN_FOREVER + ["--nproc", "2"])
    finally:
        if background:
            signal.signal(signal.SIGINT, old)
    try:
        _wait_for_line(proc, r"step\s+2/")
        sems = _semaphores_of(_session(proc.pid))
        ranks = [p for p in _descendants(proc.pid) if p in _ranks_of(proc.pid)]
        t = time.monotonic()
        if how.startswith("Ctrl-C"):  # the terminal signals the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, getattr(signal, how))
        while set(ranks) & set(_proc_table()) and time.monotonic() - t < 30:
            time.sleep(0.05)
        ranks_stopped = time.monotonic() - t
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, err
    assert err.strip() == line
    # at once, not after a grace period (it was ~10 s); the machine may be loaded
    assert ranks_stopped < 3, f"ranks took {ranks_stopped:.1f}s to stop"
    _assert_all_gone(proc, timeout=10)
    _assert_no_semaphore_left(sems)


@pytest.mark.slow
def test_sigkilled_launcher_takes_every_rank_with_it():
    proc = _start(TRAIN_FOREVER + ["--nproc", "2"])
    try:
        _wait_for_line(proc, r"step\s+2/")
        sems = _semaphores_of(_session(proc.pid))
        assert sems, "the launcher's queue should hold named semaphores"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        _assert_all_gone(proc, timeout=15)
    finally:
        if _session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_no_semaphore_left(sems)


# --------------------------------------------------------------------------------------
# torchrun: the same trainer, ending cleanly every time
# --------------------------------------------------------------------------------------
def _torchrun(*train_args, nproc=2, timeout=180):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(nproc), "--master-port", str(dist.free_port()), "-m",
                           "minipar.train", *train_args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def _clean_end(r):
    assert r.returncode == 0, r.stderr[-2000:]
    for bad in ("terminate called", "destroy_process_group() was not called", "Traceback"):
        assert bad not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    """The trainer under torchrun reads its environment, gives the serial losses, ends cleanly."""
    import json
    from minipar import train
    path = tmp_path / "m.jsonl"
    r = _torchrun("--steps", "3", "--model", "nano", "--metrics", str(path))
    _clean_end(r)
    got = [json.loads(line)["loss"] for line in path.read_text().splitlines()]
    ref = [h["loss"] for h in train.run(["--steps", "3", "--model", "nano", "--quiet"])]
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_torchrun_ends_cleanly_every_time():
    """The gloo abort at interpreter shutdown ("terminate called without an active exception")
    came about 1 run in 4 on a loaded machine before ranks ended through dist.finish: 6 runs
    in a row (a relapse to 1 in 4 passes all 6 with probability 0.18; the other torchrun tests
    check the same clean end), zero aborts, no warning about an undestroyed process group."""
    for run in range(6):
        r = _torchrun("--steps", "2", "--model", "nano", "--quiet")
        assert "summary:" in r.stdout, f"run {run + 1}: {r.stderr[-2000:]}"
        _clean_end(r)


@pytest.mark.slow
def test_torchrun_rank_killed_ends_every_rank():
    """A rank SIGKILLed under torchrun: torchrun names it, the other rank ends, fast."""
    proc = _start(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(dist.free_port()), *TRAIN_FOREVER])
    try:
        _wait_for_line(proc, r"step\s+2/")
        table = _proc_table()
        agent_kids = sorted(p for p in _descendants(proc.pid)
                            if "minipar.train" in open(f"/proc/{p}/cmdline").read()
                            and table.get(p, (0,))[0] != 1)
        t = time.monotonic()
        os.kill(agent_kids[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "-9" in err and "SIGKILL" in err, err[-2000:]
    assert "terminate called" not in err
    assert elapsed < 60
    _assert_all_gone(proc)


@pytest.mark.slow
def test_full_metrics_destination_mid_run_ends_every_rank_with_the_cause():
    """/dev/full opens fine and fails every write (ENOSPC): a disk filling up mid-run."""
    t = time.monotonic()
    r = subprocess.run([sys.executable, *TRAIN_FOREVER[:2], "--model", "nano", "--steps", "5",
                        "--nproc", "2", "--metrics", "/dev/full", "--quiet"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("rank 0 failed:") and "No space left on device" in r.stderr, r.stderr
    assert time.monotonic() - t < 60
