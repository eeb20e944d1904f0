"""Teaching that holds up: no solution reaches an attendee before the attempt, the instructor's
deck stays generated, the deck names the whole course, every stored widget has a static
figure beside it, and every notebook 01-09 ends with questions whose answers unfold."""
import importlib.util
import json
import os
import re

import pytest

from conftest import ROOT
from minipar import exercises

SLIDES = os.path.join(ROOT, "slides")
NOTEBOOKS = os.path.join(ROOT, "notebooks")
DECK = os.path.join(SLIDES, "minipar_workshop.md")
INSTRUCTOR = os.path.join(SLIDES, "minipar_workshop_instructor.md")


# --------------------------------------------------------------------------------------
# No solution line in the attendee's slides or in the notebooks
# --------------------------------------------------------------------------------------
def _norm(line: str) -> str:
    """A line as compared: no indentation, no trailing comment, single spaces."""
    line = re.sub(r"\s+# .*$", "", line.strip())
    return re.sub(r"\s+", " ", line).strip()


def _nontrivial(line: str) -> bool:
    """Worth comparing: not blank, not a comment, not a short generic line (`return x`)."""
    return len(line) >= 12 and not line.startswith("#")


def solution_pairs() -> dict[tuple[str, str], str]:
    """Every two consecutive non-trivial lines of every exercise's solution region."""
    pairs = {}
    for ex_id in exercises.registry():
        for where, code in exercises.solution_regions(ex_id):
            lines = [n for n in map(_norm, code.splitlines()) if _nontrivial(n)]
            for a, b in zip(lines, lines[1:]):
                pairs[(a, b)] = f"{ex_id} ({where})"
    return pairs


def leaks(text: str, pairs=None) -> list[str]:
    """The solution pairs that ``text`` shows, each as two consecutive non-trivial lines
    (statements joined by ``;`` count as lines)."""
    pairs = solution_pairs() if pairs is None else pairs
    lines = [n for raw in text.splitlines() for part in raw.split(";")
             if _nontrivial(n := _norm(part))]
    found = []
    for a, b in zip(lines, lines[1:]):
        if (a, b) in pairs:
            found.append(f"{pairs[(a, b)]}: {a!r} / {b!r}")
    return found


def attendee_texts() -> dict[str, str]:
    """Every text file under slides/ an attendee sees (the instructor's copy excepted), and
    each notebook's cells (sources and stored text outputs)."""
    texts = {}
    for dirpath, _, files in os.walk(SLIDES):
        for name in files:
            path = os.path.join(dirpath, name)
            if path != INSTRUCTOR and name.endswith((".md", ".py", ".txt")):
                texts[os.path.relpath(path, ROOT)] = open(path).read()
    for name in sorted(os.listdir(NOTEBOOKS)):
        if name.endswith(".ipynb"):
            nb = json.load(open(os.path.join(NOTEBOOKS, name)))
            for i, cell in enumerate(nb["cells"]):
                parts = ["".join(cell["source"])] + ["".join(o.get("text", "")) for o in cell.get("outputs", [])]
                texts[f"notebooks/{name} cell {i}"] = "\n".join(parts)
    return texts


def test_no_solution_line_reaches_an_attendee():
    pairs = solution_pairs()
    assert len(pairs) > 40, "too few solution lines to compare: is solution_regions broken?"
    found = {where: hits for where, text in attendee_texts().items() if (hits := leaks(text, pairs))}
    assert not found, f"exercise solutions shown to attendees: {found}"


def test_the_attendee_deck_names_no_instructor_file_and_states_no_merge():
    """The attendee's copy does not point at the instructor's file, and the context-parallel
    slide leaves ex09's merge (lse = log(e^lse_a + e^lse_b), the reweighting) to the exercise."""
    deck = open(DECK).read()
    assert "minipar_workshop_instructor" not in deck
    assert not re.search(r"\\log\(e\^\{\\ell_a\}", deck) and "e^{\\ell_a-\\ell}" not in deck


def test_one_true_statement_about_gloo_and_send_order():
    """A send waited for before its receive hangs on gloo too: no text says gloo buffers sends
    so that any order passes."""
    from minipar.exercises import ex01
    texts = {"README.md": open(os.path.join(ROOT, "README.md")).read(), "ex01": ex01.INTRO,
             "slides": open(DECK).read(),
             **{k: v for k, v in attendee_texts().items() if k.startswith("notebooks/00")}}
    false = re.compile(r"gloo buffers sends|any order passes|gloo it hardly matters|"
                       r"almost any order of sends", re.IGNORECASE)
    assert not {k for k, v in texts.items() if false.search(v)}
    texts["notebook 00"] = texts.pop("notebooks/00_collectives.ipynb cell 12")
    for name in ("README.md", "ex01", "slides", "notebook 00"):
        assert "posts both ops before it waits on either" in re.sub(r"\s+", " ", texts[name]), name


def test_the_leak_check_finds_a_pasted_solution():
    """The check above can fail: a slide with two lines of ex01's ring, or one statement per
    line joined by semicolons, is caught; the same lines apart are not."""
    where, code = exercises.solution_regions("ex01")[0]
    lines = [ln for ln in code.splitlines() if _nontrivial(_norm(ln))]
    i = next(k for k in range(len(lines) - 1) if "chunks[" in lines[k])
    slide = f"# A slide\n\n```python\n{lines[i]}\n\n    {lines[i + 1]}   # why\n```\n"
    assert leaks(slide)
    assert leaks(f"`{_norm(lines[i])}; {_norm(lines[i + 1])}`".strip("`"))
    assert not leaks(f"{lines[i]}\nsomething else entirely here\n{lines[i + 1]}\n")


# --------------------------------------------------------------------------------------
# The instructor's deck: generated, never forked
# --------------------------------------------------------------------------------------
def _make_instructor():
    spec = importlib.util.spec_from_file_location("make_instructor", os.path.join(SLIDES, "make_instructor.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_instructor_deck_is_generated_from_the_attendee_deck():
    make = _make_instructor()
    want = make.instructor_deck(open(DECK).read())
    assert open(INSTRUCTOR).read() == want, "run `python slides/make_instructor.py`"


def test_the_instructor_deck_answers_every_exercise():
    text = open(INSTRUCTOR).read()
    for ex_id in exercises.registry():
        assert re.search(rf"^# Solution {ex_id}\b", text, re.M), ex_id
        for _, code in exercises.solution_regions(ex_id):
            assert code.strip() in text, ex_id
    assert "Do not hand it out" in text


# --------------------------------------------------------------------------------------
# The deck names the whole course
# --------------------------------------------------------------------------------------
def _plan_table(deck: str) -> str:
    slide = next(s for s in deck.split("\n---\n") if "# The plan for today" in s)
    return "\n".join(ln for ln in slide.splitlines() if ln.startswith("|"))


def notebooks_named(table: str) -> set[str]:
    """The notebook numbers in a plan table's fourth column ("05, 06", "00-09")."""
    named = set()
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for a, b in re.findall(r"\b(\d\d)(?:-(\d\d))?\b", cells[3]):
            named |= {f"{k:02d}" for k in range(int(a), int(b or a) + 1)}
    return named


def course() -> tuple[set[str], set[str]]:
    notebooks = {n[:2] for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb")}
    return notebooks, set(exercises.registry())


def test_the_plan_names_every_notebook_and_exercise():
    deck = open(DECK).read()
    table = _plan_table(deck)
    named_nb = notebooks_named(table)
    notebooks, ids = course()
    assert notebooks - named_nb == set(), f"the plan leaves out notebooks {notebooks - named_nb}"
    named_ex = set(re.findall(r"\bex\d\d[a-z]?\b", table))
    assert ids - named_ex == set(), f"the plan leaves out exercises {ids - named_ex}"
    assert "context parallelism" in table


def test_the_exercises_slide_lists_every_exercise():
    slide = next(s for s in open(DECK).read().split("\n---\n") if "# Exercises, and where to go next" in s)
    table = "\n".join(ln for ln in slide.splitlines() if ln.startswith("|"))
    missing = set(exercises.registry()) - set(re.findall(r"\bex\d\d[a-z]?\b", table))
    assert not missing, f"the exercises slide leaves out {missing}"


def test_the_course_check_fails_on_a_deck_that_lags():
    """A plan table without notebook 09 and ex09 (the deck before this check) is caught."""
    lagging = ("| part | idea | code | notebook | exercise |\n| --- | --- | --- | --- | --- |\n"
               "| 1 | a | `a.py` | 00 | ex01 |\n| 2 | b | `b.py` | 01-08 | ex02 |")
    named_nb = notebooks_named(lagging)
    notebooks, ids = course()
    assert "09" in notebooks - named_nb and "ex09" in ids - set(re.findall(r"\bex\d\d[a-z]?\b", lagging))


# --------------------------------------------------------------------------------------
# Notebooks: a static figure beside every widget, questions at the end
# --------------------------------------------------------------------------------------
def _notebooks():
    return sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def widget_cells_without_a_figure(nb: dict) -> list[int]:
    """Code cells whose stored outputs hold a widget but no image beside it: in the same cell,
    or in the code cell just before (a static drawing, then the widget that redraws it)."""
    bad, before = [], set()
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            before = set()
            continue
        kinds = {k for o in cell.get("outputs", []) for k in o.get("data", {})}
        if "application/vnd.jupyter.widget-view+json" in kinds and "image/png" not in kinds | before:
            bad.append(i)
        before = kinds
    return bad


@pytest.mark.parametrize("name", _notebooks())
def test_every_stored_widget_has_a_static_figure_beside_it(name):
    nb = json.load(open(os.path.join(NOTEBOOKS, name)))
    assert widget_cells_without_a_figure(nb) == [], (
        f"{name}: a reader without a kernel sees no figure there (store one: lab.explorer does)")


def test_the_widget_check_fails_on_a_widget_stored_alone():
    widget = {"data": {"application/vnd.jupyter.widget-view+json": {}, "text/plain": "interactive(...)"},
              "output_type": "display_data"}
    figure = {"data": {"image/png": "...", "text/plain": "<Figure>"}, "output_type": "display_data"}
    cell = lambda *outputs: {"cell_type": "code", "source": "", "outputs": list(outputs)}   # noqa: E731
    text = {"cell_type": "markdown", "source": "a figure"}
    assert widget_cells_without_a_figure({"cells": [cell(widget)]}) == [0]
    assert widget_cells_without_a_figure({"cells": [cell(figure), text, cell(widget)]}) == [2]
    assert widget_cells_without_a_figure({"cells": [cell(figure, widget)]}) == []
    assert widget_cells_without_a_figure({"cells": [cell(figure), cell(widget)]}) == []


@pytest.mark.parametrize("name", [n for n in _notebooks() if "01" <= n[:2] <= "09"])
def test_each_notebook_ends_with_questions_whose_answers_unfold(name):
    nb = json.load(open(os.path.join(NOTEBOOKS, name)))
    text = "".join(nb["cells"][-1]["source"]) if nb["cells"][-1]["cell_type"] == "markdown" else ""
    assert "## Explain why" in text, f"{name}: the last cell is not the questions"
    answers = re.findall(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", text, re.S)
    assert 2 <= len(answers) <= 4, f"{name}: {len(answers)} unfoldable answers"
    assert all(len(a.strip()) > 80 for _, a in answers), name


def test_the_tp_slide_quotes_what_the_planner_predicts():
    """The deck's 'Keep TP inside a node' table is notebook 02's prediction, to the 0.1 ms."""
    from minipar.lab import nb02
    slide = next(s for s in open(DECK).read().split("\n---\n") if "# Keep TP inside a node" in s)
    quoted = re.findall(r"^\| (\d) \| ([\d.]+) ms \| ([\d.]+) ms \| ([\d.]+) ms \|$", slide, re.M)
    want = [(str(r["t"]), f"{r['compute']:.1f}", f"{r['inside']:.1f}", f"{r['across']:.1f}")
            for r in nb02.tp_cost_table("gpt-22b", "frontier-mi250x", 1)]
    assert quoted == want
