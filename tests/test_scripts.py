"""The cluster scripts in scripts/: run under bash with stand-ins for srun, torchrun and
python (no cluster here), every trainer and sweep command they issue must pass the real
parsers and the trainer's validation for the world size it would get."""
import os
import shlex
import subprocess

import pytest

from minipar import plan, scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["frontier.sbatch", "dgx.sbatch", "torchrun_multinode.sh"]
SEP = "\x1e"

LOGGER = f"""#!/bin/bash
{{ printf '%s\\n' "$(basename "$0")" "$@"; printf '{SEP}\\n'; }} >> "$FAKE_LOG"
"""


def issued_commands(script, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "torchrun", "python"):
        (bin_dir / name).write_text(LOGGER)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node001\necho node002\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "HOME": str(tmp_path),
           "USER": "tester", "SLURM_JOB_ID": "1234", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[001-002]"}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [c.strip("\n").split("\n") for c in log.read_text().split(SEP + "\n") if c.strip()]
    return calls


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
