"""The cluster scripts in scripts/: run under bash with stand-ins for srun, torchrun, python
and module (no cluster here), every trainer and sweep command they issue must pass the real
parsers and the trainer's validation for the world size it would get, and each srun step
must get the environment and binding the site's guidance asks for (Frontier: OLCF's
"PyTorch on Frontier" page; the RCCL network plugin is required, not optional)."""
import os
import shlex
import subprocess

import pytest

from minipar import plan
from minipar.train import scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["frontier.sbatch", "dgx.sbatch", "torchrun_multinode.sh"]
SEP = "\x1e"

ENV = "__ENV__"
LOGGER = f"""#!/bin/bash
{{ printf '%s\\n' "$(basename "$0")" "$@" {ENV}; env; printf '{SEP}\\n'; }} >> "$FAKE_LOG"
"""
# python answers what torch.version.hip is (FAKE_PY_OUT); srun fails a step whose command
# holds FAKE_SRUN_FAIL, printing FAKE_SRUN_SAYS as the step's output
PYTHON = LOGGER + 'if [ -n "${FAKE_PY_OUT:-}" ]; then echo "$FAKE_PY_OUT"; fi\n'
SRUN = LOGGER + ('if [ -n "${FAKE_SRUN_FAIL:-}" ] && [[ " $* " == *"$FAKE_SRUN_FAIL"* ]]; then '
                 'printf "%s\\n" "$FAKE_SRUN_SAYS"; exit 1; fi\n')


def run_script(script, tmp_path, plugin=True, **extra_env):
    """Run ``script`` with the stand-ins; returns (process, [(name, argv, env) per call])."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "torchrun", "python", "module"):
        (bin_dir / name).write_text({"python": PYTHON, "srun": SRUN}.get(name, LOGGER))
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node001\necho node002\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "HOME": str(tmp_path),
           "USER": "tester", "SLURM_JOB_ID": "1234", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_EXPORT_ENV": "NONE",
           "FAKE_PY_OUT": "6.2.41134-65d174c3e" if script == "frontier.sbatch" else "",
           **extra_env}
    if plugin:   # an aws-ofi-rccl install prefix, as the user builds it
        (tmp_path / "plugin" / "lib").mkdir(parents=True)
        (tmp_path / "plugin" / "lib" / "librccl-net.so").write_text("")
        env["AWS_OFI_RCCL_DIR"] = str(tmp_path / "plugin")
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    calls = []
    for c in (log.read_text().split(SEP + "\n") if log.exists() else []):
        if c.strip():
            lines = c.strip("\n").split("\n")
            cut = lines.index(ENV)
            calls.append((lines[0], lines[1:cut],
                          dict(kv.split("=", 1) for kv in lines[cut + 1:] if "=" in kv)))
    return done, calls


def issued_commands(script, tmp_path):
    done, calls = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr
    return [[name, *argv] for name, argv, _ in calls]


def after_module(argv, module):
    i = argv.index("-m")
    assert argv[i + 1] == module
    return argv[i + 2:]


def flag(argv, name):
    return int(argv[argv.index(name) + 1])


def check_trainer(argv, world):
    # no GPU here: the layout is checked on gloo, which is what --backend changes
    cfg = scaling.trainer_config(argv + ["--nproc", str(world), "--backend", "gloo"])
    assert cfg.tp * cfg.pp * cfg.dp == world


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_commands_parse(script, tmp_path, monkeypatch):
    calls = issued_commands(script, tmp_path)
    monkeypatch.chdir(tmp_path)   # where the script made its output folder
    trained = swept = 0
    for name, *argv in calls:
        if "minipar.train" in argv:
            trainer = after_module(argv, "minipar.train")
            if name == "srun":
                world = flag(argv, "-n")
            else:
                assert name == "torchrun"
                world = flag(argv, "--nnodes") * flag(argv, "--nproc-per-node")
            check_trainer(trainer, world)
            trained += 1
        elif "minipar.scaling" in argv:
            assert name == "python"
            args, trainer = scaling.parser().parse_known_args(after_module(argv, "minipar.scaling"))
            points = scaling.plan_points(args.mode, scaling.parse_nproc_list(args.nproc_list),
                                         trainer)
            assert [p.processes for p in points][-1] >= 8
            plan.load_hardware(args.hardware)
            shlex.split(args.srun_args)
            swept += 1
    assert trained >= 1 and swept >= 1, calls


def _srun_steps(calls, module):
    return [(argv, env) for name, argv, env in calls if name == "srun" and module in argv]


def _opts(argv):
    """srun's options before the program, as one string (``-c 7 --gpus-per-task 1 ...``)."""
    return " ".join(argv[:argv.index("python")])


def test_frontier_environment_follows_olcf(tmp_path):
    """The training step gets OLCF's PyTorch-on-Frontier setup: modules, the RCCL plugin on
    LD_LIBRARY_PATH and forced (no socket fallback), hsn0, node-local MIOpen caches,
    SLURM_EXPORT_ENV unset (sbatch --export=NONE), 7 bound cores and the closest GCD per
    task, MASTER_ADDR on the first node; the sweeps pass the same binding to their steps."""
    done, calls = run_script("frontier.sbatch", tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = [argv[1] for name, argv, _ in calls if name == "module" and argv[0] == "load"]
    assert loaded[0] == "PrgEnv-gnu" and any(m.startswith("rocm/") for m in loaded)
    assert "craype-accel-amd-gfx90a" in loaded
    (argv, env), = _srun_steps(calls, "minipar.train")
    opts = _opts(argv)
    for want in ("-c 7", "--cpu-bind cores", "--gpus-per-task 1", "--gpu-bind closest"):
        assert want in opts, opts
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path / "plugin" / "lib")
    assert env["NCCL_NET"] == "AWS Libfabric" and env["NCCL_SOCKET_IFNAME"] == "hsn0"
    assert env["FI_CXI_ATS"] == "0" and env["OMP_NUM_THREADS"] == "7"
    assert env["MIOPEN_USER_DB_PATH"].startswith("/tmp/")
    assert env["MIOPEN_CUSTOM_CACHE_DIR"] == env["MIOPEN_USER_DB_PATH"]
    assert "SLURM_EXPORT_ENV" not in env
    assert env["MASTER_ADDR"] == "node001"
    # the cache folder is made on every node before the first training step
    first_train = next(i for i, (n, a, _) in enumerate(calls) if n == "srun" and "minipar.train" in a)
    assert any(n == "srun" and "--ntasks-per-node" in a and env["MIOPEN_USER_DB_PATH"] in a[-1]
               for n, a, _ in calls[:first_train])
    sweeps = [argv for name, argv, _ in calls if name == "python" and "minipar.scaling" in argv]
    assert len(sweeps) == 2
    for argv in sweeps:
        assert "-c 7" in argv[argv.index("--srun-args") + 1]


def test_frontier_refuses_without_the_rccl_plugin(tmp_path):
    """No aws-ofi-rccl plugin: one line on stderr and no srun step (RCCL would otherwise
    run between nodes over TCP sockets, silently and far slower)."""
    done, calls = run_script("frontier.sbatch", tmp_path, plugin=False)
    assert done.returncode == 1
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "aws-ofi-rccl" in lines[0], done.stderr
    assert not [c for c in calls if c[0] == "srun"]


def test_dgx_binds_cores_and_gpus(tmp_path):
    done, calls = run_script("dgx.sbatch", tmp_path, plugin=False, MINIPAR_MODULES="cuda")
    assert done.returncode == 0, done.stderr
    assert [argv for name, argv, _ in calls if name == "module"] == [["load", "cuda"]]
    (argv, env), = _srun_steps(calls, "minipar.train")
    opts = _opts(argv)
    for want in ("-c 8", "--cpu-bind cores", "--gpus-per-task 1", "--gpu-bind single:1"):
        assert want in opts, opts
    assert env["MASTER_ADDR"] == "node001" and env["OMP_NUM_THREADS"] == "8"
