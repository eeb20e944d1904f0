"""Every exercise: its student file is generated from the package, its checker passes the
package's solution, fails the blank file, and catches typical wrong answers."""
import time

import pytest

from conftest import cli
from minipar import exercises

IDS = list(exercises.registry())


def _committed(path):
    """The file as committed (git HEAD), not the student's working copy; None outside git."""
    import subprocess
    rel = path.relative_to(exercises.PACKAGE_DIR.parent.parent).as_posix()
    try:
        r = subprocess.run(["git", "show", f"HEAD:{rel}"], capture_output=True, text=True,
                           cwd=exercises.PACKAGE_DIR.parent.parent, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


@pytest.mark.parametrize("ex_id", IDS)
def test_committed_student_file_is_generated_from_the_package(ex_id):
    """The repository's exercises/ files are the blanks `make` writes. Read from git, so a
    student's solved exercise in the working copy fails nothing."""
    path = exercises.student_path(ex_id)
    text = _committed(path)
    if text is None:
        pytest.skip(f"{path.name} is not committed in a git checkout here")
    assert text == exercises.student_source(ex_id), (
        f"{path.name} drifted from the package source: run `python -m minipar.exercises make {ex_id}`")


@pytest.fixture(scope="module")
def blanks(tmp_path_factory):
    """Freshly generated blank student files (never the student's own copies)."""
    folder = tmp_path_factory.mktemp("blanks")
    return {p.name.split("_")[0]: p for p in exercises.make(None, folder)}


@pytest.mark.parametrize("ex_id", IDS)
def test_checks_pass_the_solution(ex_id):
    """The checks themselves, in this process (the grader's child is tested below)."""
    assert exercises._check_here(ex_id, None, solution=True) == []


@pytest.mark.parametrize("ex_id", IDS)
def test_checks_fail_the_blank_exercise(ex_id, blanks):
    failures = exercises._check_here(ex_id, str(blanks[ex_id]), solution=False)
    assert failures and "not written yet" in failures[0]


@pytest.mark.slow
def test_grader_passes_a_solution_and_fails_a_blank(blanks):
    """The whole grader (child process, time limit) on one exercise both ways."""
    assert exercises.check("ex01", solution=True, timeout=300) == []
    failures = exercises.check("ex01", path=blanks["ex01"], timeout=300)
    assert failures and "not written yet" in failures[0]


def _mutant(tmp_path, ex_id, old, new):
    """The solution with one deliberate mistake, written as a student file."""
    src = exercises.student_source(ex_id)
    import importlib
    import inspect
    ex = exercises.get(ex_id)
    module = importlib.import_module(ex.MODULE)
    solution = "\n\n".join(inspect.getsource(getattr(module, n)) for n in ex.NAMES)
    assert old in solution, "mutation target not found"
    header = src[:src.index("\n\n\n") + 3]
    path = tmp_path / f"{ex_id}_mutant.py"
    path.write_text(header + solution.replace(old, new, 1))
    return path


@pytest.mark.parametrize("ex_id,old,new,expected", [
    ("ex01", "chunks[(r - k - 1) % n] += incoming", "chunks[(r - k - 1) % n].copy_(incoming)",
     "sum"),
    ("ex01", "    for k in range(n - 1):\n        exchange(chunks[(r + 1 - k) % n])",
     "    comm.all_reduce(t, comm.WORLD); return t\n    for k in range(n - 1):\n        exchange(chunks[(r + 1 - k) % n])",
     "isend/recv only"),
    # every rank sends first: gloo buffers the sends and passes it; NCCL would hang
    ("ex01", "if r % 2 == 0:", "if True:", "would hang on NCCL"),
    ("ex02", "b.buffer.div_(n)", "pass", "average"),
    ("ex02", "size + p.numel() * p.element_size() > bucket_bytes", "False", "several"),
    ("ex05", "warmup = min(p - r - 1, m)", "warmup = min(p - r, m)", "holds"),
    ("ex05", "[forward(warmup + k), backward(k)]", "[backward(k), forward(warmup + k)]",
     "cannot run"),
    ("ex06", "u.os_grad.copy_(summed).div_(mesh.d)", "u.os_grad.copy_(summed)", ""),
    ("ex06", "all_gather_in_place(u.g_slice, mesh.os_group)", "pass", ""),
    ("ex07", "u.grad_shard.add_(shard)", "u.grad_shard.copy_(shard)", ""),
    ("ex07", "        p.grad = None\n", "        pass\n", ""),
    ("ex08", "weights = top_probs if k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)",
     "weights = top_probs", "renormalised"),
    ("ex08", "weights = top_probs if k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)",
     "weights = top_probs / top_probs.sum(dim=-1, keepdim=True)", "raw probability at k = 1"),
    ("ex08", 'P = rearrange(probs, "(b s) e -> b s e", b=f.shape[0]).sum(dim=1) / seq_len',
     "P = probs.mean(dim=0)", "per sequence"),
    ("ex09", "lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)",
     "merged lse"),
    ("ex09", "lse = torch.logaddexp(lse_a, lse_b)",
     "lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))", "overflow"),
    ("ex09", "torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b",
     "torch.exp(lse_b - lse)[..., None] * out_a + torch.exp(lse_a - lse)[..., None] * out_b",
     "its own block"),
    ("ex09", "torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b",
     "(out_a + out_b) / 2", "not softmax attention"),
])
def test_checks_catch_wrong_answers(tmp_path, ex_id, old, new, expected):
    failures = exercises._check_here(ex_id, str(_mutant(tmp_path, ex_id, old, new)), solution=False)
    assert failures, "the checker accepted a wrong answer"
    assert any(expected in f for f in failures), failures


# --------------------------------------------------------------------------------------
# The checker is a grader: anything but a clean pass is a FAIL with the reason
# --------------------------------------------------------------------------------------
HEADER = "from minipar.comm import *  # noqa\n"


@pytest.mark.parametrize("body,reason", [
    ("import sys\nsys.exit(0)\n", "calls sys.exit(0) when imported"),
    ("import os\nos._exit(0)\n", "ended early with exit code 0"),
    ("raise ValueError('oops')\n", "does not load: ValueError: oops"),
    ("def ring_all_reduce(t, group:\n", "does not load: SyntaxError"),
    ("def ring_all_reduce(t, group):\n    import sys; sys.exit(0)\n", "SystemExit"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "killed by SIGSEGV"),
])
@pytest.mark.slow
def test_grader_fails_a_file_that_exits_raises_or_crashes(tmp_path, body, reason):
    path = tmp_path / "ex01_student.py"
    path.write_text(HEADER + body)
    failures = exercises.check("ex01", path=path, timeout=240)
    assert failures and reason in failures[0], failures


@pytest.mark.slow
def test_grader_stops_an_endless_loop(tmp_path):
    path = tmp_path / "ex01_student.py"
    path.write_text(HEADER + "while True:\n    pass\n")
    t = time.monotonic()
    failures = exercises.check("ex01", path=path, timeout=3)     # the loop burns a core
    assert failures and failures[0].startswith("timed out after 3 s without progress"), failures
    assert time.monotonic() - t < 20


@pytest.mark.slow
def test_grader_waits_for_a_slow_check_that_makes_progress(tmp_path, monkeypatch):
    """The time limit counts from the last progress (file loaded, launch finished), so a
    check longer than the limit passes as long as it moves."""
    path = tmp_path / "ex01_student.py"
    path.write_text("import sys, time\nfrom minipar.exercises import _progress\n"
                    "for _ in range(4):\n    time.sleep(3); _progress()\nsys.exit(0)\n")
    failures = exercises.check("ex01", path=path, timeout=10)   # 12 s in all, 3 s apart
    assert failures and "calls sys.exit(0) when imported" in failures[0], failures


def test_make_into_a_folder_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = cli("minipar.exercises", "make", "ex01", "--out", str(blocker / "sub"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r
    assert "cannot write the exercises there" in r.stderr


@pytest.mark.slow
def test_check_cli_never_exits_0_without_a_verdict(tmp_path):
    """The original bug: a file calling sys.exit(0) at import made `check` exit 0 silently."""
    path = tmp_path / "ex01_student.py"
    path.write_text(HEADER + "import sys\nsys.exit(0)\n")
    r = cli("minipar.exercises", "check", "ex01", "--file", str(path), timeout=300)
    assert r.returncode == 1 and "FAIL ex01" in r.stdout and "sys.exit(0)" in r.stdout, r


def test_make_never_destroys_a_students_work(tmp_path):
    (path,) = exercises.make(["ex01"], tmp_path)
    assert exercises.make(["ex01"], tmp_path) == [path]        # unchanged blank: rewritten
    path.write_text(path.read_text() + "\n# my work\n")
    with pytest.raises(exercises.dist.UsageError, match="not overwritten.*--force"):
        exercises.make(["ex01"], tmp_path)
    assert path.read_text().endswith("# my work\n")
    r = cli("minipar.exercises", "make", "ex01", "--out", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert path.read_text().endswith("# my work\n")
    exercises.make(["ex01"], tmp_path, force=True)
    assert path.read_text() == exercises.student_source("ex01")
    assert path.with_name(path.name + ".bak").read_text().endswith("# my work\n")
