"""The layout that shows the lessons, held as facts (read from the source; nothing imported).

A reader lists ``minipar/`` and finds each paradigm by its name, reads it top to bottom in one
sitting, and finds the composition in one place (``minipar/parallelize.py``); the machinery
lives in sub-packages. ``tests/test_imports.py`` holds the import graph (no cycles)."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from test_imports import MODULES, PKG, graph, imports

ROOT = PKG.parent

# the lessons: one paradigm each (pp's schedules and the point-to-point order are lessons of
# their own: notebook 03 and ex05, notebook 00 and ex01)
LESSONS = ("dp", "tp", "pp", "schedules", "cp", "zero", "moe", "p2p_order")
SHARED = ("comm", "mesh", "model", "data", "precision", "rules")   # what the lessons stand on
COMPOSITION = ("parallelize",)
# a path users write or a command they run, each a few lines that re-export a sub-package's
SHIMS = ("fsdp", "checkpoint", "sample", "scaling")
# what a lesson may import besides the shared pieces: its own parts
OWN = {"pp": {"minipar.schedules"}, "schedules": {"minipar.p2p_order"},
       "dp": {"minipar.wrappers"},
       "zero": {"minipar.wrappers", "minipar.wrappers.zero_optimizer"}}


def top_level() -> list[str]:
    return sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def docstring_lines(path: Path) -> int:
    tree = ast.parse(path.read_text())
    first = tree.body[0] if tree.body else None
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return first.end_lineno if is_doc else 0


def test_listing_minipar_shows_the_lessons_and_what_they_stand_on():
    names = top_level()
    assert len(names) <= 20, names
    assert set(names) == set(LESSONS + SHARED + COMPOSITION + SHIMS), (
        f"unplaced: {sorted(set(names) - set(LESSONS + SHARED + COMPOSITION + SHIMS))}, "
        f"missing: {sorted(set(LESSONS + SHARED + COMPOSITION + SHIMS) - set(names))}")
    subpackages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert subpackages == ["bench", "exercises", "lab", "plan", "runtime", "train", "wrappers"]
    for name in SHIMS:
        assert len((PKG / f"{name}.py").read_text().splitlines()) <= 10, name


def test_each_lesson_reads_in_one_sitting():
    for name in LESSONS + COMPOSITION:
        path = PKG / f"{name}.py"
        lines = len(path.read_text().splitlines())
        assert lines <= 450, f"{name}.py has {lines} lines (at most 450)"
        assert docstring_lines(path) <= 60, f"{name}.py opens with {docstring_lines(path)} lines"


def test_a_lesson_imports_no_other_features_module():
    g = graph()
    shared = {f"minipar.{n}" for n in SHARED} | {"minipar", "minipar.runtime",
                                                   "minipar.runtime.errors"}
    for name in LESSONS:
        extra = g[f"minipar.{name}"] - shared - OWN.get(name, set())
        assert not extra, f"minipar/{name}.py imports {sorted(extra)}"
    # the shared pieces stand below every lesson (the GPT builds its MoE layers: the one edge)
    lessons = {f"minipar.{n}" for n in LESSONS}
    for name in SHARED:
        allowed = {"minipar.moe"} if name == "model" else set()
        assert not (g[f"minipar.{name}"] & lessons) - allowed, name


def test_moe_and_the_other_paradigms_do_not_know_each_other():
    g = graph()
    assert not g["minipar.moe"] & {"minipar.tp", "minipar.cp", "minipar.pp", "minipar.schedules"}
    for name in ("dp", "tp", "pp", "cp", "zero"):
        assert "minipar.moe" not in g[f"minipar.{name}"], name


GLOBAL_HOOKS = ("register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
                "register_module_forward_pre_hook", "register_module_forward_hook",
                "register_module_full_backward_hook", "register_module_backward_hook",
                "register_module_full_backward_pre_hook")
REGISTRIES = ("WeakKeyDictionary", "WeakIdKeyDictionary", "WeakValueDictionary", "WeakSet")


def test_no_registries_keyed_by_tensors_and_no_process_wide_hooks():
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = (node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    else node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    else None)
            assert name not in GLOBAL_HOOKS, f"{path.name}: a process-wide hook ({name})"
        for node in tree.body:                  # module level: a weak map keyed by tensors
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                called = [n for n in ast.walk(node.value) if isinstance(n, ast.Call)]
                for call in called:
                    f = call.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                    assert name not in REGISTRIES, f"{path.name}: a module-level {name}"


def test_precision_is_a_value_not_sniffed():
    for path in PKG.rglob("*.py"):
        assert not re.search(r"isinstance\([^)]*MixedPrecision", path.read_text()), path.name


def test_the_step_loop_reads_like_nanogpts():
    tree = ast.parse((PKG / "train" / "loop.py").read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "worker")
    loop = next(n for n in ast.walk(worker) if isinstance(n, ast.For))
    body = loop.body[-1].end_lineno - loop.body[0].lineno + 1
    assert body <= 40, f"the step loop's body is {body} lines"
    assert worker.end_lineno - worker.lineno + 1 <= 60


def test_no_fault_injection_in_the_package():
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        assert "MINIPAR_CRASH_AT" not in text and "MINIPAR_OVERFLOW_AT" not in text, path
        assert "injected crash" not in text, path


def test_no_grid_names_left():
    """One mesh API: the old ``Grid`` and its attribute aliases are gone."""
    old = re.compile(r"\b(dist\.Grid|GroupGrid|DataAxis)\b|\b(mesh|grid|m|g)\.(tp|dp|pp|cp)_(group|rank|ranks)\b")
    for path in list(PKG.rglob("*.py")) + list((ROOT / "tests").glob("*.py")):
        if path.name == "test_layout.py":
            continue
        hits = [m.group(0) for m in old.finditer(path.read_text())]
        assert not hits, f"{path.relative_to(ROOT)}: {hits[:3]}"


def test_the_readme_is_for_users_and_requirements_match_the_extras():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "## Test time" not in readme and "### Test time" not in readme
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | {
        r for extra in ("test", "notebooks") for r in project["optional-dependencies"][extra]}
    listed = {ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    assert listed == wanted, f"requirements.txt {sorted(listed ^ wanted)}"


def test_every_module_named_in_this_file_exists():
    for name in LESSONS + SHARED + COMPOSITION + SHIMS:
        assert f"minipar.{name}" in MODULES, name
    assert imports(PKG / "zero.py") >= {"minipar.wrappers.zero_optimizer"}
