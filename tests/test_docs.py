"""The repository's own reference matches the code, and cites nothing outside the repository."""
import os
import re
import subprocess

from conftest import ROOT

REFERENCE = os.path.join(ROOT, "docs", "reference.md")


def _flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s != "--help"}


def test_every_trainer_flag_is_documented():
    from minipar import train
    text = open(REFERENCE).read()
    missing = sorted(f for f in _flags(train.parser()) if f"`{f}" not in text)
    assert not missing, f"flags missing from docs/reference.md: {missing}"


def test_every_planner_subcommand_is_documented():
    from minipar.plan.__main__ import build_parser
    text = open(REFERENCE).read()
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    missing = sorted(name for name in sub.choices if f"`{name}" not in text)
    assert not missing, f"planner sub-commands missing from docs/reference.md: {missing}"


def test_no_file_cites_a_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    cited = re.compile(r"\b(CONTRACTS|STYLE|DEVELOPERS)\.md\b")
    offenders = [f for f in files if f.endswith((".py", ".md", ".ipynb", ".toml", ".txt", ".sh"))
                 and cited.search(open(os.path.join(ROOT, f), errors="replace").read())]
    assert not offenders, f"these files cite a document that is not in the repository: {offenders}"


def test_markdown_links_to_repository_files_exist():
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    broken = []
    for f in files:
        text = open(os.path.join(ROOT, f)).read()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(f), target))
            if not os.path.exists(path):
                broken.append(f"{f} -> {target}")
    assert not broken, f"links to missing files: {broken}"
