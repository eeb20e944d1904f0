"""Workshop exercises, made from the package's own source so they never drift from it.

An exercise ``exNN`` is one small module here (``minipar/exercises/exNN.py``) declaring:

* ``TITLE``, ``INTRO``: what the student writes, in plain words;
* ``MODULE``, ``NAMES``: the package module holding the solution and the top-level functions or
  classes copied into the student file. Inside them, every region between
  ``# EXERCISE exNN begin`` and ``# EXERCISE exNN end`` is blanked: the first comment line after
  the begin marker (the hint) stays, the code becomes ``raise NotImplementedError``;
* ``check(student, report)``: real tests of the student's objects (multi-process ones
  through ``launch_student``). Each failing case goes to ``report.fail`` in the student's own
  terms (which rank, chunk, step, micro-batch or shard; expected against actual), with the
  common bug it points to named when its symptom is recognised; each thing verified goes to
  ``report.ok``, and an optional part not done yet to ``report.todo``;
* ``API``: the helpers the student may call, as dotted paths; the student file lists each one
  as it can call it there (the shortest name that evaluates in the file to that object, such as
  ``f``, ``comm.isend`` or ``torch.maximum``), with its signature and first docstring lines;
  ``EXTRA_IMPORTS`` (optional) lines that make one reachable; ``NOTES`` (optional, a function)
  more generated text for it;
* ``DIFFICULTY``, ``MINUTES``, ``NOTEBOOK``: for ``exercises/README.md``'s table;
* ``HARD_INTRO`` (optional; ``HARD_API`` beside it): the text of a harder track, written to
  ``exercises/harder/`` with the same checker: the index table or formula left out, and no
  hint comment or docstring in the blank.

A warm-up has the id of its exercise and a letter (``ex03a`` before ``ex03``).

The student file ``exercises/exNN_<slug>.py`` starts with ``from MODULE import *`` and then
redefines NAMES, so everything else comes from the package. Commands::

    python -m minipar.exercises list
    python -m minipar.exercises check ex01              # checks exercises/ex01_*.py
    python -m minipar.exercises check ex01 --solution   # checks the package's own code
    python -m minipar.exercises make [exNN ...]         # (re)generate the student files

PASS lists what was verified; FAIL lists every failing case and what was already right.

The checker is a grader: every check runs in a child process with a time limit, so a student
file that exits, loops forever or crashes the interpreter is a FAIL with the reason, never a
hang or a silent pass. ``make`` never overwrites a file the student has edited unless told
to (``--force``), and then keeps the old one next to it as ``.bak``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import json
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from ..runtime import dist

PACKAGE_DIR = Path(__file__).resolve().parent


def exercises_dir() -> Path:
    """The repository's ``exercises/`` folder (next to the package in a checkout)."""
    here = PACKAGE_DIR.parent.parent / "exercises"
    return here if here.is_dir() else Path.cwd() / "exercises"


ID = re.compile(r"ex\d\d[a-z]?")


def _order(ex_id: str):
    """ex03a (the warm-up) before ex03, ex03 before ex04."""
    return (int(ex_id[2:4]), ex_id[4:] == "", ex_id[4:])


def registry() -> dict[str, object]:
    """Every exercise module, by id, in order (a warm-up before its exercise)."""
    found = {}
    for info in pkgutil.iter_modules([str(PACKAGE_DIR)]):
        if ID.fullmatch(info.name):
            found[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return dict(sorted(found.items(), key=lambda kv: _order(kv[0])))


def get(ex_id: str):
    reg = registry()
    if ex_id not in reg:
        raise dist.UsageError(f"unknown exercise {ex_id!r}; available: {', '.join(reg) or 'none'}")
    return reg[ex_id]


def slug(ex) -> str:
    words = re.findall(r"[a-z0-9]+", ex.TITLE.lower())
    return "_".join(words[:4])


def student_path(ex_id: str, folder: Path | None = None) -> Path:
    ex = get(ex_id)
    return (folder or exercises_dir()) / f"{ex_id}_{slug(ex)}.py"


# --------------------------------------------------------------------------------------
# Making the student file
# --------------------------------------------------------------------------------------
def blank(source: str, ex_id: str, hints: bool = True) -> str:
    """Replace each ``# EXERCISE ex_id begin ... end`` region by its hint (unless ``hints`` is
    False: the harder track) and a raise. Markers of other exercises are dropped and their
    code kept.
    """
    out, inside = [], False
    begin = re.compile(r"^(\s*)# EXERCISE (ex\d\d[a-z]?) begin")
    end = re.compile(r"^\s*# EXERCISE (ex\d\d[a-z]?) end")
    hint_pending = False
    for line in source.splitlines():
        b, e = begin.match(line), end.match(line)
        if b:
            if b.group(2) == ex_id:
                inside, indent, hint_pending = True, b.group(1), True
                out.append(f"{indent}# TODO {ex_id}: write this part")
            continue
        if e:
            if e.group(1) == ex_id and inside:
                out.append(f'{indent}raise NotImplementedError("{ex_id}: this part is yours to write")')
                inside = False
            continue
        if inside:
            if hint_pending and line.strip().startswith("#"):
                if hints:
                    out.append(line)
            else:
                hint_pending = False
            continue
        out.append(line)
    if inside:
        raise ValueError(f"{ex_id}: begin marker without an end marker")
    return "\n".join(out) + "\n"


def _resolve_dotted(dotted: str):
    """The object a dotted path names (``torch.nn.functional.linear``, ``minipar.zero.Unit.x``)."""
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):        # the longest prefix that is a module
        try:
            obj = importlib.import_module(".".join(parts[:k]))
            break
        except ImportError:
            continue
    for attr in parts[k:]:
        obj = getattr(obj, attr)
    return obj


def _same(a, b) -> bool:
    try:
        return a is b or a == b
    except Exception:  # noqa: BLE001 - a comparison that raises is no match
        return False


def student_namespace(ex) -> dict:
    """The names a blank student file has before its own definitions: ``from MODULE import *``
    and the exercise's ``EXTRA_IMPORTS``."""
    ns: dict = {}
    exec(f"from {ex.MODULE} import *\n" + getattr(ex, "EXTRA_IMPORTS", ""), ns)  # noqa: S102
    return ns


def callable_name(dotted: str, ns: dict) -> str:
    """How the student file calls ``dotted``: the shortest expression that evaluates, in the
    file's namespace ``ns``, to that very object: a bare name (``f``), or a module the file
    has and the rest of the path (``torch.maximum``, ``comm.isend``, ``F.one_hot``).
    ValueError if the file cannot reach it (give the exercise an ``EXTRA_IMPORTS`` line)."""
    obj, parts = _resolve_dotted(dotted), dotted.split(".")
    candidates = [".".join(parts[k:]) for k in range(len(parts))]
    for alias, value in ns.items():                # a module imported under another name
        for k in range(1, len(parts)):
            if getattr(value, "__name__", None) == ".".join(parts[:k]):
                candidates.append(".".join([alias, *parts[k:]]))
    for expr in sorted(candidates, key=lambda c: (len(c), c)):
        try:
            if _same(eval(expr, dict(ns)), obj):    # noqa: S307 - our own dotted names
                return expr
        except (NameError, AttributeError):
            continue
    raise ValueError(f"{dotted} is not reachable in the student file as written; add an "
                     f"EXTRA_IMPORTS line for it")


def api_text(ex, names=None) -> str:
    """The helpers an exercise may call, each written as the student file calls it (one rule:
    ``callable_name``), with its signature and the first paragraph of its docstring, read
    from the package (so the list never drifts from the code)."""
    import textwrap
    lines, ns = [], student_namespace(ex)
    for dotted in getattr(ex, "API", ()) if names is None else names:
        obj, shown = _resolve_dotted(dotted), callable_name(dotted, ns)
        try:
            try:
                sig = str(inspect.signature(obj, eval_str=True))
            except Exception:  # noqa: BLE001 - an annotation that does not evaluate here
                sig = str(inspect.signature(obj))
            sig = re.sub(r"\bminipar\.\w+\.", "", sig.replace("torch.Tensor", "Tensor"))
            sig = sig.replace("torch.nn.parameter.Parameter", "nn.Parameter")
        except (TypeError, ValueError):
            sig = ""
        paragraphs = [p.replace("\n", " ") for p in inspect.cleandoc(obj.__doc__ or "").split("\n\n")]
        doc, name = paragraphs[0], dotted.rsplit(".", 1)[1]
        if not sig and doc.startswith(name + "("):  # a builtin: its doc opens with the signature
            sig, doc = doc[len(name):], (paragraphs[1:] or [""])[0]
        if not doc and inspect.isfunction(obj):     # a one-line helper: the comment on its def
            first = inspect.getsource(obj).splitlines()[0]
            doc = first.split("#", 1)[1].strip() if "#" in first else ""
        lines.append(f"    {shown}{sig}")
        if doc:
            lines += textwrap.wrap(doc, 92, initial_indent="        ", subsequent_indent="        ")
    return "\n".join(lines)


def _without_docstrings(source: str) -> str:
    """``source`` with the docstring of every def and class in it removed (the harder track:
    a docstring that states the algorithm would state the answer)."""
    import ast
    drop = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                ast.get_docstring(node, clean=False) is not None:
            doc = node.body[0]
            drop.update(range(doc.lineno, doc.end_lineno + 1))
    return "\n".join(ln for k, ln in enumerate(source.splitlines(), 1) if k not in drop) + "\n"


def student_source(ex_id: str, harder: bool = False) -> str:
    """The blank student file; ``harder``: the optional harder track of an exercise with a
    ``HARD_INTRO`` (the index table or formula left out, no hints, no docstrings, the same
    checker)."""
    ex = get(ex_id)
    module = importlib.import_module(ex.MODULE)
    parts = []
    for name in ex.NAMES:
        src = inspect.getsource(getattr(module, name))
        if f"# EXERCISE {ex_id} begin" not in src and not parts and name == ex.NAMES[-1]:
            raise ValueError(f"{ex_id}: no '# EXERCISE {ex_id} begin' marker in {ex.MODULE}.{name}")
        parts.append(_without_docstrings(blank(src, ex_id, hints=False)).rstrip("\n") + "\n"
                     if harder else blank(src, ex_id))
    intro = inspect.cleandoc(ex.HARD_INTRO if harder else ex.INTRO)
    api = api_text(ex, getattr(ex, "HARD_API", ex.API) if harder else ex.API)
    notes = inspect.cleandoc(ex.NOTES()) if hasattr(ex, "NOTES") else ""
    title = f"{ex.TITLE} (harder track)" if harder else ex.TITLE
    where = f" --file {harder_path(ex_id).relative_to(exercises_dir().parent)}" if harder else ""
    header = (f'"""Exercise {ex_id}: {title}\n\n{intro}\n\n'
              + (f"What you may call, each written as this file calls it (signatures from the "
                 f"package):\n\n{api}\n\n" if api else "")
              + (f"{notes}\n\n" if notes else "")
              + f"Fill in every block marked `# TODO {ex_id}`, then run:\n\n"
              f"    python -m minipar.exercises check {ex_id}{where}\n\n"
              f"Generated from {ex.MODULE} by `python -m minipar.exercises make {ex_id}`; the\n"
              f"solution is the package's own code, so peek only when stuck.\n"
              f'"""\n')
    assert "\n\n\n" not in header, f"{ex_id}: the header must not hold two blank lines in a row"
    imports = f"from {ex.MODULE} import *  # noqa: F401,F403  everything else, as the package has it\n"
    extra = getattr(ex, "EXTRA_IMPORTS", "")
    return header + imports + (extra.strip() + "\n" if extra else "") + "\n\n" + "\n\n".join(parts)


HARDER = "harder"       # the folder of the harder track, inside exercises/


def harder_path(ex_id: str, folder: Path | None = None) -> Path:
    return (folder or exercises_dir()) / HARDER / student_path(ex_id).name


def solution_regions(ex_id: str) -> list[tuple[str, str]]:
    """Each ``# EXERCISE ex_id begin ... end`` region of the package's solution, dedented, with
    where it sits (``Class.method``): what the instructor deck shows and the attendee's must not."""
    import textwrap
    ex = get(ex_id)
    module = importlib.import_module(ex.MODULE)
    out = []
    for name in ex.NAMES:
        where, inside, lines = name, False, []
        for line in inspect.getsource(getattr(module, name)).splitlines():
            m = re.match(r"\s*(?:def|class) (\w+)", line)
            if m and not inside:
                where = name if m.group(1) == name else f"{name}.{m.group(1)}"
            if re.match(rf"\s*# EXERCISE {ex_id} begin", line):
                inside, lines = True, []
            elif re.match(rf"\s*# EXERCISE {ex_id} end", line):
                inside = False
                out.append((where, textwrap.dedent("\n".join(lines))))
            elif inside:
                lines.append(line)
    return out


README_BEGIN = "<!-- exercises table: written by `python -m minipar.exercises make` -->"
README_END = "<!-- /exercises table -->"


def readme_table() -> str:
    """The table of exercises/README.md: id, file, what you write, difficulty, time, notebook."""
    rows = ["| id | file | what you write | difficulty | time | notebook section |",
            "| --- | --- | --- | --- | --- | --- |"]
    for ex_id, ex in registry().items():
        rows.append(f"| {ex_id} | `{student_path(ex_id).name}` | {ex.SUMMARY} | "
                    f"{ex.DIFFICULTY} | {ex.MINUTES} min | {ex.NOTEBOOK} |")
    return "\n".join([README_BEGIN, "", *rows, "", README_END])


def write_readme(folder: Path | None = None) -> Path | None:
    """Rewrite the table in ``folder``/README.md (if the file has the markers)."""
    path = (folder or exercises_dir()) / "README.md"
    text = _read(path)
    if text is None or README_BEGIN not in text or README_END not in text:
        return None
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    new = head + readme_table() + tail
    if new != text:
        path.write_text(new)
    return path


def make(ex_ids=None, folder: Path | None = None, force: bool = False) -> list[Path]:
    """Write the student files. A file that differs from its blank (the student's work) is
    not overwritten: UsageError, before anything is written, unless ``force``; then the old
    file is kept as ``<name>.bak``."""
    folder = folder or exercises_dir()
    if folder.exists() and not folder.is_dir():
        raise dist.UsageError(f"{folder}: not a folder; give --out a folder for the exercises")
    plan = []
    for ex_id in ex_ids or registry():
        path = student_path(ex_id, folder)
        plan.append((path, student_source(ex_id)))
        if hasattr(get(ex_id), "HARD_INTRO"):
            plan.append((harder_path(ex_id, folder), student_source(ex_id, harder=True)))
    edited = [path for path, text in plan if path.exists() and _read(path) != text]
    if edited and not force:
        names = ", ".join(str(p) for p in edited)
        raise dist.UsageError(f"{names}: differs from the blank exercise (your work?); not "
                              f"overwritten. Rename it, or pass --force to overwrite (the old "
                              f"file is kept as .bak)")
    written = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path, text in plan:
            path.parent.mkdir(exist_ok=True)
            if path in edited:
                path.replace(path.with_name(path.name + ".bak"))
            path.write_text(text)
            written.append(path)
        if ex_ids is None:
            write_readme(folder)
    except OSError as e:
        raise dist.UsageError(f"{folder}: cannot write the exercises there "
                              f"({e.strerror or e}); give --out a folder you can write") from None
    return written


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


# --------------------------------------------------------------------------------------
# Loading and checking
# --------------------------------------------------------------------------------------
def load(path: str | os.PathLike):
    """Import a student file by path, as a fresh module."""
    path = Path(path).resolve()
    name = f"minipar_student_{path.stem}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _ref(student) -> tuple[str, str]:
    """How a child process finds the student's code again: a file or a package module."""
    f = getattr(student, "__file__", None)
    if getattr(student, "__name__", "").startswith("minipar.") and not \
            getattr(student, "__name__", "").startswith("minipar_student"):
        return ("module", student.__name__)
    return ("path", str(f))


def _resolve(ref):
    kind, value = ref
    return importlib.import_module(value) if kind == "module" else load(value)


def _trampoline(fn, ref, *args):
    return fn(_resolve(ref), *args)


def launch_student(fn, nprocs: int, student, *args, timeout: float = 60.0) -> list:
    """Run ``fn(student_module, *args)`` on ``nprocs`` gloo ranks; results by rank."""
    results = dist.launch(_trampoline, nprocs, fn, _ref(student), *args, timeout=timeout)
    _progress()
    return results


# The grader's child touches this file after loading the student file and after every
# launch; the parent's time limit counts from the last touch, so a long but moving check is
# never cut while a file that loops forever is stopped after ``timeout`` seconds.
_PROGRESS_FILE = os.environ.get("MINIPAR_GRADE_PROGRESS")


def _progress() -> None:
    if _PROGRESS_FILE:
        Path(_PROGRESS_FILE).touch()


class Report:
    """What the checks found. ``fail``: a failing case, in the student's terms (expected
    against actual, and the bug its symptom points to); ``ok``: a thing verified; ``todo``: an
    optional part (an extension) not done yet or not right yet, which does not fail the
    exercise. ``MAX_PER_KIND`` similar failures are listed, then how many more there are."""

    MAX_PER_KIND = 6

    def __init__(self):
        self.failures: list[str] = []
        self.verified: list[str] = []
        self.todos: list[str] = []
        self.count = 0          # every failing case, also those not listed
        self._kinds: dict[str, int] = {}

    def fail(self, message: str, kind: str | None = None) -> None:
        """One failing case; ``kind`` groups similar ones (only the first few are listed)."""
        self.count += 1
        if kind is not None:
            self._kinds[kind] = self._kinds.get(kind, 0) + 1
            if self._kinds[kind] > self.MAX_PER_KIND:
                return
        self.failures.append(message)

    def fail_ranks(self, where: str, found: dict[int, tuple[str, str]], n: int) -> None:
        """``found``: {rank: (kind, text)}; ranks that found the same text share one line."""
        by_text: dict[tuple[str, str], list[int]] = {}
        for r, kind_text in sorted(found.items()):
            by_text.setdefault(kind_text, []).append(r)
        for (kind, text), ranks in by_text.items():
            who = (f"rank {ranks[0]}" if len(ranks) == 1 else "every rank" if len(ranks) == n
                   else f"ranks {', '.join(map(str, ranks))}")
            self.fail(f"{where}, {who}: {text}", kind=kind)

    def ok(self, message: str) -> None:
        self.verified.append(message)

    def todo(self, message: str) -> None:
        self.todos.append(message)

    def result(self) -> "Failures":
        more = [f"... and {n - self.MAX_PER_KIND} more like that ({kind})"
                for kind, n in self._kinds.items() if n > self.MAX_PER_KIND]
        return Failures(self.failures + more, self.verified, self.todos)


class Failures(list):
    """The failures (empty: PASS), with ``verified`` (what passed) and ``todos`` (optional
    parts still open) beside them."""

    def __init__(self, failures=(), verified=(), todos=()):
        super().__init__(failures)
        self.verified, self.todos = list(verified), list(todos)


def run_check(ex_id: str, student) -> Failures:
    """The exercise's checks on ``student``: the failures in plain words (empty: all
    passed), with what was verified."""
    ex = get(ex_id)
    report = Report()
    try:
        ex.check(student, report)
    except NotImplementedError as e:
        report.failures.insert(0, f"not written yet: {e}")
    except dist.RankFailed as e:
        text = str(e)
        if "NotImplementedError" in text:
            report.failures.insert(0, "not written yet: a rank hit a `# TODO` block (NotImplementedError)")
        else:
            last = [ln for ln in text.strip().splitlines() if ln.strip()][-1]
            report.failures += [f"a rank crashed: {last}", text]
    except TimeoutError as e:
        report.failures.append(f"timed out: {e} (a send without its matching receive hangs; "
                               f"check the order)")
    except Exception:  # noqa: BLE001 - any error in student code is a finding, not a crash
        tb = traceback.format_exc()
        last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1]
        report.failures += [f"your code raised {last}", tb]
    return report.result()


def _check_here(ex_id: str, path: str | None, solution: bool) -> Failures:
    """The checks, in this process (the grader's child runs this)."""
    ex = get(ex_id)
    if solution:
        student = importlib.import_module(ex.MODULE)
    else:
        try:
            student = load(path)
            _progress()
        except SystemExit as e:
            return Failures([f"your file does not load: it calls sys.exit({e.code!r}) when imported"])
        except BaseException:  # noqa: BLE001 - a syntax error is the most common student mistake
            tb = traceback.format_exc()
            last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1]
            return Failures([f"your file does not load: {last}", tb])
    try:
        return run_check(ex_id, student)
    except SystemExit as e:
        return Failures([f"your code called sys.exit({e.code!r}) during the checks"])
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - anything but a clean pass is a FAIL
        return Failures([f"your code raised {type(e).__name__}: {e}"])


def student_file(ex_id: str, path=None) -> Path:
    """The student file to check; a missing, empty or non-Python file is a UsageError."""
    path = Path(path) if path else student_path(ex_id)
    if not path.exists():
        raise dist.UsageError(f"{path}: no such file; run `python -m minipar.exercises make "
                              f"{ex_id}` to create it")
    if path.is_dir() or path.suffix != ".py":
        raise dist.UsageError(f"{path}: not a Python file; give the exercise's .py file")
    text = _read(path)
    if text is None:
        raise dist.UsageError(f"{path}: cannot be read as UTF-8 text; is it the exercise's .py file?")
    if not text.strip():
        raise dist.UsageError(f"{path}: the file is empty; run `python -m minipar.exercises make "
                              f"{ex_id} --force` to start again from the blank")
    return path


DEFAULT_CHECK_TIMEOUT = 60.0


def check(ex_id: str, path=None, solution: bool = False,
          timeout: float = DEFAULT_CHECK_TIMEOUT) -> Failures:
    """Grade: run the exercise's checks in a child process that must make progress (load
    the file, finish a launch) at least every ``timeout`` seconds.

    Returns the failures in plain words (empty: PASS), with ``.verified`` (what passed) and
    ``.todos`` (optional parts still open). A file that exits, loops, or takes the interpreter
    down is a failure with the reason; only a clean run of every check with no finding passes.
    """
    get(ex_id)
    if not (timeout > 0 and timeout < float("inf")):
        raise dist.UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    target = None if solution else str(student_file(ex_id, path).resolve())
    with tempfile.TemporaryDirectory(prefix="minipar-grade-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-c", "from minipar.exercises import _grade_child; _grade_child()",
               ex_id, target or "--solution", str(result)]
        env = dict(os.environ)
        root = str(PACKAGE_DIR.parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        progress = Path(tmp) / "progress"
        progress.touch()
        env["MINIPAR_GRADE_PROGRESS"] = str(progress)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            code = _wait_while_moving(proc, progress, timeout)
            if code is None:
                _kill_group(proc)
                return Failures([f"timed out after {timeout:.0f} s without progress: the checks "
                                 f"were stopped (an endless loop, or a send without its matching "
                                 f"receive?); on a slow machine give more time with --timeout"])
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)  # ranks the student's code may have left behind
        if result.exists():
            found = json.loads(result.read_text())
            failures = Failures(found["failures"], found["verified"], found["todos"])
            return failures if code == 0 or failures else Failures(
                [f"the checks ended with exit code {code}"])
        if code < 0:
            return Failures([f"the checks were killed by {signal.Signals(-code).name} (your code "
                             f"crashed the interpreter?)"])
        return Failures([f"the checks ended early with exit code {code} before reporting: your "
                         f"code exits the process (sys.exit / os._exit) instead of returning"])


def _wait_while_moving(proc, progress: Path, timeout: float) -> int | None:
    """The child's exit code, or None once ``progress`` is ``timeout`` seconds old."""
    import time
    while True:
        try:
            return proc.wait(timeout=min(1.0, timeout))
        except subprocess.TimeoutExpired:
            if time.time() - progress.stat().st_mtime > timeout:
                return None


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _grade_child() -> None:
    """The grader's child: run the checks, write the failures as JSON."""
    ex_id, target, out = sys.argv[1:4]
    try:
        import torch
        torch.set_num_threads(1)
        failures = _check_here(ex_id, None if target == "--solution" else target,
                               target == "--solution")
    except BaseException as e:  # noqa: BLE001 - the grader reports, it does not crash
        failures = Failures([f"the checker itself failed: {type(e).__name__}: {e}",
                             traceback.format_exc()])
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"failures": [str(x) for x in failures],
                   "verified": [str(x) for x in failures.verified],
                   "todos": [str(x) for x in failures.todos]}, f)
    os.replace(tmp, out)
    # A normal exit: the launches' queues unlink their semaphores. (A hang from here on is
    # cut by the parent's timeout, and the result is already written.)
    sys.exit(0)
