"""The workshop deck in step with the code: every command on a slide passes the real parsers,
every figure it shows exists, no slide is taller than a 16:9 page (an estimate from the
deck's own font sizes, so a slide that overflows is caught without rendering it), and every
number from a run sits in a span that slides/make_figures.py rewrites."""
import math
import os
import re
import shlex
import struct

import pytest

from conftest import ROOT

DECK = os.path.join(ROOT, "slides", "minipar_workshop.md")


def slides() -> list[str]:
    text = open(DECK).read()
    body = text.split("\n---\n", 1)[1]          # after the front matter
    return [s for s in re.split(r"\n---\n", body) if s.strip()]


def _title(slide: str) -> str:
    m = re.search(r"^#+ (.*)$", slide, re.M)
    return m.group(1) if m else slide.strip().splitlines()[0]


# --------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------
def commands() -> list[tuple[str, list[str]]]:
    """(slide title, argv after `-m minipar.X`) for every minipar command on a slide."""
    found = []
    for slide in slides():
        text = re.sub(r"<!--.*?-->", "", slide, flags=re.S)
        text = text.replace("\\\n", " ")
        for line in text.splitlines():
            if re.match(r"#+ ", line):            # a title names a command, it does not run one
                continue
            for chunk in re.findall(r"`([^`]*-m minipar[^`]*)`", line) or [line]:
                for cmd in re.split(r"&&|;", chunk):
                    cmd = cmd.split(" # ")[0].split("  #")[0].strip()
                    m = re.search(r"-m (minipar(?:\.\w+)+)(.*)", cmd)
                    if not m or "..." in cmd or "|" in m.group(2):
                        continue
                    found.append((_title(slide), [m.group(1), *shlex.split(m.group(2))]))
    return found


def _parse(module: str, argv: list[str]) -> None:
    if module == "minipar.train":
        from minipar import train
        if "--nproc" in argv and "--resume" not in argv:
            train.parse_config(argv)          # the trainer's full validation
        else:           # torchrun / srun set the world; --resume needs the saved run
            train.parser().parse_args(argv)
    elif module == "minipar.sample":
        from minipar.train import sample
        sample.parser().parse_args(argv)
    elif module == "minipar.plan":
        from minipar.plan.__main__ import build_parser
        build_parser().parse_args(argv)
    elif module == "minipar.scaling":
        from minipar.train import scaling
        args, rest = scaling.parser().parse_known_args(argv)
        scaling.plan_points(args.mode, scaling.parse_nproc_list(args.nproc_list), rest)
    elif module == "minipar.exercises":
        from minipar import exercises
        assert argv[0] in ("list", "make", "check"), argv
        for ex_id in argv[1:]:
            if not ex_id.startswith("-"):
                exercises.get(ex_id)
    elif module == "minipar.bench":
        from minipar.bench import BENCHES
        assert argv and argv[0] in BENCHES, (argv, list(BENCHES))
    else:
        raise AssertionError(f"no parser known for {module}")


def test_the_deck_has_commands():
    assert len(commands()) >= 20


@pytest.mark.parametrize("title,argv", commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_every_command_on_a_slide_passes_the_real_parser(title, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)            # --save, --metrics and --plot paths are tried here
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if "--help" in argv:
        with pytest.raises(SystemExit) as e:
            _parse(argv[0], argv[1:])
        assert e.value.code == 0
    else:
        _parse(argv[0], argv[1:])


# --------------------------------------------------------------------------------------
# Figures and page size
# --------------------------------------------------------------------------------------
def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def test_every_figure_on_a_slide_exists():
    missing = [t for s in slides() for t in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", s)
               if not os.path.exists(os.path.join(ROOT, "slides", t))]
    assert not missing, missing


# The deck's style (front matter): text 22px (18px in class "small"), code at 0.8em (0.7em in
# "dense"), tables 0.85em, h1 1.5em; a 1280x720 page with Marp's default padding leaves about
# 1150 x 600 px for the content.
WIDTH, HEIGHT = 1150, 600


def slide_height(slide: str) -> float:
    cls = re.findall(r"<!-- _class: ([\w ]+) -->", slide)
    cls = cls[0].split() if cls else []
    text_px = 18 if "small" in cls else 22
    code_px = text_px * (0.7 if "dense" in cls else 0.8)
    body = re.sub(r"<!--.*?-->", "", slide, flags=re.S)
    height, in_code = 0.0, False
    for line in body.strip().splitlines():
        if line.startswith("```"):
            height += 0 if in_code else 16          # the code block's padding
            in_code = not in_code
            continue
        if in_code:
            height += code_px * 1.2 * max(1, math.ceil(len(line) * code_px * 0.6 / WIDTH))
            continue
        images = re.findall(r"!\[([^\]]*)\]\(([^)]+)\)", line)
        if images:
            heights = []
            for alt, target in images:
                w, h = _png_size(os.path.join(ROOT, "slides", target))
                m = re.search(r"w:(\d+)", alt)
                shown_w = int(m.group(1)) if m else min(w, WIDTH)
                m = re.search(r"h:(\d+)", alt)
                heights.append(int(m.group(1)) if m else shown_w * h / w)
            height += max(heights)
        elif line.startswith("# "):
            height += text_px * 1.5 * 1.6
        elif line.startswith("#"):
            height += text_px * 1.25 * 1.6
        elif line.startswith("|"):
            if not re.fullmatch(r"[|\s:-]+", line):
                height += text_px * 0.85 * 1.6
        elif not line.strip():
            height += text_px * 0.5
        else:
            height += text_px * 1.5 * max(1, math.ceil(len(line) * text_px * 0.5 / WIDTH))
    return height


@pytest.mark.parametrize("index", range(len(slides())))
def test_no_slide_overflows_its_page(index):
    slide = slides()[index]
    h = slide_height(slide)
    assert h <= HEIGHT, f"slide {index + 1} ({_title(slide)!r}) is about {h:.0f} px tall, the page {HEIGHT}"


def test_the_slides_readme_counts_the_slides():
    text = open(os.path.join(ROOT, "slides", "README.md")).read()
    assert f"({len(slides())} slides)" in text


# --------------------------------------------------------------------------------------
# Measured numbers: written by slides/make_figures.py (measured_runs.py), never by hand
# --------------------------------------------------------------------------------------
SPAN = re.compile(r"<!-- measured:(\w+) -->(.*?)<!-- /measured -->", re.S)
# what says "this number came from a run"
RUN_WORDS = re.compile(r"\bmeasured\b|ms/step|load average|tokens/s", re.I)
# digits that are names, not quantities: notebook 08, ex03, 1F1B, ZeRO-1, 3D, top-2
NAMES = re.compile(r"notebooks? \d+|\bex\d+[a-z]?\b|\b1F1B\b|ZeRO-\d|\b\dD\b|top-\d")


def _visible_items(slide: str) -> list[tuple[str, str]]:
    """(item, its table's header) for each bullet, paragraph or table row of a slide, as it
    reads with the measured spans, comments, code and math taken out."""
    text = SPAN.sub(" ", slide)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"\$[^$\n]*\$|`[^`\n]*`", "", text)
    items, header = [], ""
    for line in text.splitlines():
        starts = re.match(r"\s*$|#|- |\* |\d+\. |\||\*\*|!\[|>", line)
        if line.startswith("|"):
            if not items or not items[-1][0].startswith("|"):
                header = line                     # a new table: its first row is the header
            if not re.fullmatch(r"[|\s:-]+", line):
                items.append((line, header))
        elif starts or not items:
            if line.strip():
                items.append((line.strip(), ""))
            else:
                items.append(("", ""))
        else:
            items[-1] = (items[-1][0] + " " + line.strip(), items[-1][1])
    return [(i, h) for i, h in items if i]


def measured_numbers_outside_spans(deck: list[str] | None = None) -> list[str]:
    """Every item on a slide that quotes a number from a run outside a measured span: an item
    that says measured (ms/step, tokens/s, load average), a row of a table whose header does,
    or any item with a number on a slide titled "... measured ..." that is not a prediction."""
    found = []
    for slide in slides() if deck is None else deck:
        measured_slide = "measured" in _title(slide).lower()
        for item, header in _visible_items(slide):
            if item.startswith(("#", "![")) or not re.search(r"\d", NAMES.sub("", item)):
                continue
            says_run = RUN_WORDS.search(item) or RUN_WORDS.search(header)
            if says_run or (measured_slide and not re.search(r"predict", item, re.I)):
                found.append(f"{_title(slide)!r}: {item[:120]}")
    return found


def test_every_measured_number_on_a_slide_is_written_by_make_figures():
    assert not measured_numbers_outside_spans(), (
        "numbers from a run outside a <!-- measured:NAME --> span (slides/make_figures.py "
        "writes those):\n" + "\n".join(measured_numbers_outside_spans()))


def test_the_check_finds_a_measured_number_written_by_hand():
    by_hand = ["# Loss, measured\n\n- the MoE ends at 2.513 after 150 steps",
               "# Timing\n\n| run | ms/step |\n| --- | ---: |\n| dense | 33 |",
               "# Scaling\n\n- measured here: weak 37 % at 2 processes"]
    assert len(measured_numbers_outside_spans(by_hand)) == 3
    written = ["# Loss, measured\n\n- the MoE ends at <!-- measured:x -->2.513 after 150 "
               "steps<!-- /measured -->",
               "# Timing\n\n<!-- measured:y -->\n\n| run | ms/step |\n| --- | ---: |\n"
               "| dense | 33 |\n\n<!-- /measured -->",
               "# Scaling\n\n- measured here: <!-- measured:z -->weak 37 % at 2 processes"
               "<!-- /measured -->"]
    assert measured_numbers_outside_spans(written) == []


def test_the_measured_spans_are_the_ones_make_figures_writes():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "measured_runs", os.path.join(ROOT, "slides", "measured_runs.py"))
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    names = [m.group(1) for m in SPAN.finditer(open(DECK).read())]
    assert sorted(names) == sorted(runs.MEASURED)
    assert all(m.group(2).strip() for m in SPAN.finditer(open(DECK).read()))
    # both read the same markers
    assert runs.SPAN.pattern.replace("(", "").replace(")", "") == \
        SPAN.pattern.replace("(", "").replace(")", "")


def test_the_moe_slide_quotes_the_losses_notebook_08_prints():
    """The losses are deterministic (same seed, one thread): the deck's table, written by
    make_figures.py with lab.nb08.three_runs, and notebook 08's stored output agree."""
    import json
    nb = json.load(open(os.path.join(ROOT, "notebooks", "08_mixture_of_experts.ipynb")))
    printed = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                      for o in c.get("outputs", []))
    notebook = {name.strip(): loss for name, loss in
                re.findall(r"^(.+?)\s+final loss \(mean of last 10 steps\) ([\d.]+)", printed, re.M)}
    table = dict(SPAN.findall(open(DECK).read()))["moe_table"]
    deck = {row.split("|")[1].strip(): row.split("|")[3].strip()
            for row in table.strip().splitlines()[2:]}
    assert len(notebook) == 3, printed[-2000:]
    for name, loss in notebook.items():
        quoted = [v for k, v in deck.items() if k.startswith(name)]
        assert quoted == [loss], (name, loss, deck)
