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
    return {p.name.split("_")[0]: p for p in exercises.make(None, folder)
            if p.parent.name != exercises.HARDER}


@pytest.mark.parametrize("ex_id", IDS)
def test_checks_pass_the_solution_and_say_what_they_verified(ex_id):
    """The checks themselves, in this process (the grader's child is tested below). A PASS
    lists what was verified; the package's solution leaves no optional part open."""
    result = exercises._check_here(ex_id, None, solution=True)
    assert result == [] and result.todos == [], (list(result), result.todos)
    assert result.verified and all(len(line) > 40 for line in result.verified), result.verified


@pytest.mark.parametrize("ex_id", IDS)
def test_checks_fail_the_blank_exercise(ex_id, blanks):
    failures = exercises._check_here(ex_id, str(blanks[ex_id]), solution=False)
    assert failures and "not written yet" in failures[0]


@pytest.mark.slow
def test_grader_passes_a_solution_and_fails_a_blank(blanks):
    """The whole grader (child process, time limit) on one exercise both ways."""
    # timeout: seconds without progress; two checks that each stall 120 s end inside 300 s
    passed = exercises.check("ex01", solution=True, timeout=120)
    assert passed == [] and passed.verified
    failures = exercises.check("ex01", path=blanks["ex01"], timeout=120)
    assert failures and "not written yet" in failures[0]


def _mutant(tmp_path, ex_id, old, new):
    """The solution with one deliberate mistake, written as a student file."""
    src = exercises.student_source(ex_id)
    import importlib
    import inspect
    ex = exercises.get(ex_id)
    module = importlib.import_module(ex.MODULE)
    solution = "\n\n".join(inspect.getsource(getattr(module, n)) for n in ex.NAMES)
    assert solution.count(old) == 1, "mutation target not found exactly once"
    header = src[:src.index("\n\n\n") + 3]
    path = tmp_path / f"{ex_id}_mutant.py"
    path.write_text(header + solution.replace(old, new, 1))
    return path


# The common bugs a checker names by their symptom (issue: "detect the common bugs by their
# symptom and name them"): each is a mutant below, and each fails with its own words.
NAMED = {
    "wrong ring index, reduce-scatter": "Wrong ring index in the reduce-scatter phase",
    "wrong ring index, all-gather": "Wrong ring index in the all-gather phase",
    "rebound buffer": "rebound buffer instead of an in-place write",
    "not accumulated": "not accumulated over micro-batches",
    "missing division": "missing division by the group size",
    "missing max": "missing max in log-sum-exp",
    "off-by-one warm-up": "off-by-one warm-up",
}

TARGET_BUG = "targets are global ids: subtract start, and only the owner contributes"

MUTANTS = [
    # ex01: each phase's ring index (the chunk sent, the chunk written), copy vs add, a rebound
    # name, every rank sending first (posted both: gloo passes, NCCL would hang), a blocking
    # send first (hangs on gloo too), a collective
    ("ex01", "exchange(chunks[(r - k) % n])", "exchange(chunks[(r + k) % n])",
     NAMED["wrong ring index, reduce-scatter"]),
    ("ex01", "chunks[(r - k - 1) % n] += incoming", "chunks[(r - k) % n] += incoming",
     NAMED["wrong ring index, reduce-scatter"]),
    ("ex01", "exchange(chunks[(r + 1 - k) % n])", "exchange(chunks[(r - k) % n])",
     NAMED["wrong ring index, all-gather"]),
    ("ex01", "chunks[(r - k) % n].copy_(incoming)", "chunks[(r - k - 1) % n].copy_(incoming)",
     NAMED["wrong ring index, all-gather"]),
    ("ex01", "chunks[(r - k - 1) % n] += incoming", "chunks[(r - k - 1) % n].copy_(incoming)",
     "add it (`+=`)"),
    ("ex01", "chunks[(r - k - 1) % n] += incoming",
     "c = chunks[(r - k - 1) % n]; c = c + incoming", NAMED["rebound buffer"]),
    ("ex01", "chunks[(r - k) % n].copy_(incoming)", "chunks[(r - k) % n].add_(incoming)",
     "copy it (`copy_`)"),
    ("ex01", "if r % 2 == 0:", "if True:", "would hang on NCCL"),
    ("ex01", "if r % 2 == 0:\n            handle = comm.isend(outgoing, right)\n",
     "if True:\n            handle = comm.isend(outgoing, right)\n            handle.wait()\n",
     "every rank waited in a send (the wait of an isend) before posting its receive: this hangs "
     "on gloo and on NCCL"),
    ("ex01", "    for k in range(n - 1):\n        exchange(chunks[(r - k) % n])",
     "    comm.all_reduce(t, comm.WORLD); return t\n    for k in range(n - 1):\n        exchange(chunks[(r - k) % n])",
     "isend/recv only"),
    # ex02
    ("ex02", "b.buffer.div_(n)", "pass", NAMED["missing division"]),
    ("ex02", "b.buffer.div_(n)", "b.buffer.div_(2)", "not by the group size 3"),
    ("ex02", 'comm.all_reduce(b.buffer, group, op="sum")\n        b.buffer.div_(n)',
     'comm.all_reduce(b.buffer, group, op="avg")', "gloo has no AVG"),
    ("ex02", "size + p.numel() * p.element_size() > bucket_bytes", "False", "more than bucket_bytes"),
    ("ex02", "for p in reversed(params):", "for p in params:", "last to first"),
    # ex03a, ex03 (and its extension)
    ("ex03a", "        comm.all_reduce(grad, ctx.group)\n", "\n", "f backward must sum"),
    ("ex03a", "        x = x.clone(memory_format=torch.contiguous_format)\n", "",
     "changed its input x in place"),
    ("ex03a", "        comm.all_reduce(x, group)\n        return x", "        return x",
     "g forward must sum its input"),
    ("ex03", "y = F.linear(x, self.weight)\n", "y = F.linear(x, self.weight, bias)\n",
     "holds the bias 3 times"),
    ("ex03", "if self.sequence_parallel else f(x, self.group)", "if self.sequence_parallel else x",
     "enter through f"),
    ("ex03", "if self.sequence_parallel else g(y, self.group)", "if self.sequence_parallel else y",
     "sum the partial products over the group with g"),
    ("ex03", "y = gather_from_tp(y, self.group)[..., :self.out_features]",
     "y = gather_from_tp(y, self.group)", "keep its first out_features"),
    # ex04
    ("ex04", 'comm.all_reduce(top, group, op="max")', "top.zero_()", NAMED["missing max"]),
    ("ex04", 'logits = logits.masked_fill(columns >= vocab_size, float("-inf"))\n', "\n",
     "mask them to -inf"),
    ("ex04", "grad[rows, local_target] -= mine.to(grad.dtype)", "pass", "without the -1 at the target"),
    ("ex04", 'comm.all_reduce(top, group, op="max")', "pass", "All-reduce the max with op='max'"),
    ("ex04", "local_target = targets - start", "local_target = targets", TARGET_BUG),
    ("ex04", "mine = (local_target >= 0) & (local_target < n_local)",
     "mine = torch.ones_like(local_target, dtype=torch.bool)", TARGET_BUG),
    ("ex04", "local_target = targets - start\n        mine = (local_target >= 0) & (local_target < n_local)",
     "local_target = targets\n        mine = torch.ones_like(local_target, dtype=torch.bool)",
     TARGET_BUG),
    ("ex04", 'target_logit = torch.where(mine, rearrange(target_logit, "n 1 -> n"), 0.0)',
     'target_logit = rearrange(target_logit, "n 1 -> n")', TARGET_BUG),
    # ex05
    ("ex05", "warmup = min(p - r - 1, m)", "warmup = min(p - r, m)", NAMED["off-by-one warm-up"]),
    ("ex05", "warmup = min(p - r - 1, m)", "warmup = max(p - r - 2, 0)", NAMED["off-by-one warm-up"]),
    # a steady phase of backward-then-forward pairs is the same list as a warm-up one forward
    # too short (stage 0 of p=4: F0 F1 F2 B0 F3 ...), and the checker names it so
    ("ex05", "[forward(warmup + k), backward(k)]", "[backward(k), forward(warmup + k)]",
     NAMED["off-by-one warm-up"]),
    ("ex05", "    order += [backward(k) for k in range(m - warmup, m)]\n", "\n", "the cool-down"),
    # ex06a, ex06, ex07
    ("ex06a", "    shard_grad.div_(d)", "    pass", NAMED["missing division"]),
    ("ex06a", "    comm.reduce_scatter(shard_grad, flat_grad, group)\n    shard_grad.div_(d)",
     "    out = torch.empty_like(shard_grad)\n    comm.reduce_scatter(out, flat_grad, group)\n"
     "    shard_grad = out / d", NAMED["rebound buffer"]),
    ("ex06a", "    comm.all_gather(flat, flat.chunk(d)[comm.rank(group)].clone(), group)", "    pass",
     "all-gather the updated slices"),
    ("ex06a", "    optimizer.step()                    # updates slice r of flat, in place\n"
     "    comm.all_gather(flat, flat.chunk(d)[comm.rank(group)].clone(), group)",
     "    comm.all_gather(flat, flat.chunk(d)[comm.rank(group)].clone(), group)\n"
     "    optimizer.step()", "the all-gather ran before optimizer.step()"),
    ("ex06", "u.os_grad.copy_(summed).div_(mesh.d)", "u.os_grad.copy_(summed)", NAMED["missing division"]),
    ("ex06", "u.os_grad.copy_(summed).div_(mesh.d)", "u.os_grad = summed / mesh.d",
     NAMED["rebound buffer"]),
    ("ex06", "all_gather_in_place(u.g_slice, mesh.os_group)", "pass", "each updated only its own slice"),
    ("ex06", "u.os_grad.copy_(summed).div_(mesh.d)", "u.os_grad.add_(summed).div_(mesh.d)",
     "write it with `copy_`, do not accumulate"),
    ("ex06", "u.os_grad.copy_(summed).div_(mesh.d)", "u.os_grad.add_(summed / mesh.d)",
     "write it with `copy_`, do not accumulate"),
    ("ex06", "comm.all_reduce(summed, mesh.rep_group)", "pass", "all-reduce it over mesh.rep_group"),
    ("ex07", "u.grad_shard.add_(shard)", "u.grad_shard = u.grad_shard + shard", NAMED["rebound buffer"]),
    ("ex07", "u.grad_shard.add_(shard)", "u.grad_shard.copy_(shard)", NAMED["not accumulated"]),
    ("ex07", "u.grad_shard.add_(shard)", "u.grad_shard.add_(shard / mesh.d)", "ZeRO-2 only sums"),
    ("ex07", "        p.grad = None\n", "        pass\n", "set p.grad = None"),
    # ex08
    ("ex08", "weights = top_probs if k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)",
     "weights = top_probs", "renormalise them to sum to 1"),
    ("ex08", "weights = top_probs if k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)",
     "weights = top_probs / top_probs.sum(dim=-1, keepdim=True)", "keep the raw probability"),
    ("ex08", 'P = rearrange(probs, "(b s) e -> b s e", b=f.shape[0]).sum(dim=1) / seq_len',
     "P = probs.mean(dim=0)", "per sequence"),
    ("ex08", "probs = F.softmax(logits.float(), dim=-1)", "probs = F.softmax(logits.float(), dim=0)",
     "softmax over the tokens"),
    ("ex08", "return n_experts * (f * P).sum(dim=-1).mean()", "return (f * P).sum(dim=-1).mean()",
     "multiply by E"),
    ("ex08", 'P = rearrange(probs, "(b s) e -> b s e", b=f.shape[0]).sum(dim=1) / seq_len',
     'P = rearrange(probs, "(b s) e -> b s e", b=f.shape[0]).mean(dim=1)',
     "not by the 2 tokens this rank holds"),
    # ex09
    ("ex09", "lse = torch.logaddexp(lse_a, lse_b)", "lse = torch.maximum(lse_a, lse_b)",
     "that is max(lse_a, lse_b)"),
    ("ex09", "lse = torch.logaddexp(lse_a, lse_b)",
     "lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))", NAMED["missing max"]),
    ("ex09", "torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b",
     "torch.exp(lse_b - lse)[..., None] * out_a + torch.exp(lse_a - lse)[..., None] * out_b",
     "its own block"),
    ("ex09", "torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b",
     "(out_a + out_b) / 2", "not softmax attention"),
    ("ex09", "torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b",
     "torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b",
     "unnormalised weights"),
]


def _quick_first(mutants):
    """The first wrong answer of each exercise runs in the quick tier; the rest carry the slow
    mark (the full suite tries every one)."""
    seen = set()
    out = []
    for m in mutants:
        marks = () if m[0] not in seen else (pytest.mark.slow,)
        seen.add(m[0])
        out.append(pytest.param(*m, marks=marks, id=f"{m[0]}-{m[3][:40]}"))
    return out


@pytest.mark.parametrize("ex_id,old,new,expected", _quick_first(MUTANTS))
def test_checks_catch_wrong_answers_and_name_the_bug(tmp_path, ex_id, old, new, expected):
    failures = exercises._check_here(ex_id, str(_mutant(tmp_path, ex_id, old, new)), solution=False)
    assert failures, "the checker accepted a wrong answer"
    assert any(expected in f for f in failures), failures
    # each named bug is named only when it is the bug
    for name, words in NAMED.items():
        if words != expected and words not in new:
            assert not any(words in f for f in failures), (name, failures)
    # never another exercise's hint: no message names another exercise, and ex07 (whose
    # checks share ex06's training) never says ex06's "check the average (divide by d)"
    others = [e for e in IDS if e != ex_id and not ex_id.startswith(e)]
    assert not any(e in f for f in failures for e in others), failures
    if ex_id == "ex07":
        assert not any("divide by d" in f or "check the average" in f for f in failures), failures


def test_every_named_bug_has_a_mutant():
    named = {m[3] for m in MUTANTS}
    assert set(NAMED.values()) <= named, set(NAMED.values()) - named


def test_the_sequence_parallel_extension_of_ex03_is_optional(tmp_path):
    """An extension not written yet is listed, and the core still passes."""
    old = "x = all_gather_seq(x, self.group) if self.sequence_parallel else f(x, self.group)"
    new = ("if self.sequence_parallel:\n            raise NotImplementedError('extension')\n"
           "        x = f(x, self.group)")
    result = exercises._check_here("ex03", str(_mutant(tmp_path, "ex03", old, new)), solution=False)
    assert result == [] and result.verified, list(result)
    assert result.todos == ["extension, sequence parallelism: not written yet"], result.todos


def test_each_student_file_lists_the_api_it_may_call():
    for ex_id in IDS:
        ex = exercises.get(ex_id)
        text = exercises.student_source(ex_id)
        assert "What you may call" in text, ex_id
        for dotted in ex.API:
            assert dotted.rsplit(".", 1)[1] + "(" in text, (ex_id, dotted)


def test_ex03_bridges_the_notation_and_ex06_says_copy_do_not_rebind():
    assert "weight by ROWS" in exercises.student_source("ex03")
    assert "(out, in)" in exercises.student_source("ex03")
    six = exercises.student_source("ex06")
    assert "Copy into `u.os_grad`, don't rebind it" in six
    assert "os_group: [[0, 1], [2, 3]]" in six and "rep_group: [[0, 2], [1, 3]]" in six


def test_warm_ups_come_before_their_exercise():
    assert IDS.index("ex03a") == IDS.index("ex03") - 1
    assert IDS.index("ex06a") == IDS.index("ex06") - 1


def test_the_exercises_readme_table_is_generated():
    """Difficulty, time and the notebook section of every exercise, from its module."""
    text = (exercises.exercises_dir() / "README.md").read_text()
    assert exercises.readme_table() in text, "run `python -m minipar.exercises make`"
    for ex_id, ex in exercises.registry().items():
        assert ex.DIFFICULTY in ("easy", "medium", "hard"), ex_id
        assert 10 <= ex.MINUTES <= 90, ex_id


def test_each_exercise_names_a_notebook_section_that_exists():
    import json
    import re
    from conftest import ROOT
    import os
    for ex_id, ex in exercises.registry().items():
        m = re.match(r"(\d\d), sections? (\d+)", ex.NOTEBOOK)
        assert m, (ex_id, ex.NOTEBOOK)
        path = next(p for p in os.listdir(os.path.join(ROOT, "notebooks")) if p.startswith(m.group(1)))
        nb = json.load(open(os.path.join(ROOT, "notebooks", path)))
        heads = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
        assert any(re.search(rf"^## {m.group(2)}\. ", h, re.M) for h in heads), (ex_id, ex.NOTEBOOK)


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


@pytest.mark.slow     # the make CLI; the quick tier checks the committed files
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
    r = cli("minipar.exercises", "check", "ex01", "--file", str(path), timeout=240)
    assert r.returncode == 1 and "FAIL ex01" in r.stdout and "sys.exit(0)" in r.stdout, r


@pytest.mark.slow
def test_check_cli_lists_what_passed():
    r = cli("minipar.exercises", "check", "ex09", "--solution", timeout=240)
    assert r.returncode == 0 and "PASS ex09" in r.stdout and "  + " in r.stdout, r


@pytest.mark.slow     # the make CLI; the quick tier checks the committed files
def test_make_never_destroys_a_students_work(tmp_path):
    written = exercises.make(["ex01"], tmp_path)                # with its harder track
    path = written[0]
    assert written[1:] == [exercises.harder_path("ex01", tmp_path)]
    assert exercises.make(["ex01"], tmp_path) == written        # unchanged blanks: rewritten
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


def _listed_api(text):
    """The names the 'What you may call' block of a student file lists, as it writes them."""
    import re
    block = text.split("What you may call", 1)[1].split("\n\n", 2)[1]
    return [re.match(r"    ([\w.]+)", line).group(1) for line in block.splitlines()
            if re.match(r"    \w", line)]


@pytest.mark.parametrize("ex_id", IDS)
def test_each_listed_helper_is_callable_as_shown_in_its_blank_file(ex_id, blanks):
    """What the file says is available is available under the name it shows: each listed name
    evaluates, in the blank file's own namespace, to the package's object."""
    student = exercises.load(blanks[ex_id])
    shown = _listed_api(blanks[ex_id].read_text())
    ex = exercises.get(ex_id)
    assert len(shown) == len(ex.API), (shown, ex.API)
    for expr, dotted in zip(shown, ex.API):
        try:
            found = eval(expr, dict(vars(student)))
        except (NameError, AttributeError) as e:
            raise AssertionError(f"{blanks[ex_id].name} lists {expr!r}, which raises {e!r} there")
        assert exercises._same(found, exercises._resolve_dotted(dotted)), (ex_id, expr, dotted)


HARDER = [ex_id for ex_id in IDS if hasattr(exercises.get(ex_id), "HARD_INTRO")]
# what the harder track leaves out: the index table, the table of f and g, the formula
GIVEN_AWAY = {"ex01": ["(r - k - 1)", "(r + 1 - k)", "even ranks send first"],
              "ex03a": ["backward: all-reduce", "identity forward", "forward: identity"],
              "ex09": ["logaddexp", "exp(lse_x - lse)", "lse_a - lse", "maximum"]}


def test_the_harder_track_is_generated_and_leaves_the_derivation_out():
    assert set(HARDER) == {"ex01", "ex03a", "ex09"}
    for ex_id in HARDER:
        path = exercises.harder_path(ex_id)
        text = exercises.student_source(ex_id, harder=True)
        committed = _committed(path)
        assert committed is None or committed == text, f"{path.name}: run `python -m minipar.exercises make`"
        assert f"check {ex_id} --file exercises/harder/" in text
        assert not [w for w in GIVEN_AWAY[ex_id] if w in text], ex_id
        assert all(w in exercises.student_source(ex_id) for w in GIVEN_AWAY[ex_id][:1]), ex_id


@pytest.mark.parametrize("ex_id", ["ex03a", "ex09"])
def test_the_harder_track_has_the_same_checker(tmp_path, ex_id):
    """Its blank fails as 'not written yet'; the solution in its file passes."""
    import importlib
    import inspect
    blank = tmp_path / "blank.py"
    blank.write_text(exercises.student_source(ex_id, harder=True))
    failures = exercises._check_here(ex_id, str(blank), solution=False)
    assert failures and "not written yet" in failures[0]
    ex = exercises.get(ex_id)
    module = importlib.import_module(ex.MODULE)
    src = exercises.student_source(ex_id, harder=True)
    solved = tmp_path / "solved.py"
    solved.write_text(src[:src.index("\n\n\n") + 3] +
                      "\n\n".join(inspect.getsource(getattr(module, n)) for n in ex.NAMES))
    result = exercises._check_here(ex_id, str(solved), solution=False)
    assert result == [] and result.verified, list(result)
