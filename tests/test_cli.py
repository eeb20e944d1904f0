"""The command lines' shared plumbing (minipar.runtime.cli): defaults in --help, bad input is one
line and exit status 2, the number parsers."""
import argparse
import os
import queue

import pytest

from conftest import cli
from minipar.runtime import cli as mcli
from minipar.runtime.errors import UsageError
from minipar.plan.__main__ import build_parser
from minipar.train import parser


def _entries(help_text):
    """{flag: its help, joined over lines} from argparse's options section."""
    out, flag = {}, None
    for line in help_text.split("options:")[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            out[flag] = line
        elif flag:
            out[flag] += " " + line.strip()
    return {f: " ".join(h.split()) for f, h in out.items()}


def test_help_shows_every_default():
    text = parser().format_help()
    entries = _entries(text)
    for flag, default in [("--tp", "1"), ("--steps", "20"), ("--seed", "0"), ("--lr", "0.001"),
                          ("--schedule", "1f1b"), ("--bucket-mb", "4.0")]:
        assert f"(default: {default})" in entries[flag], entries[flag]
    assert "(default: None)" not in text and "(default: False)" not in text
    memory = build_parser()._subparsers._group_actions[0].choices["memory"].format_help()
    assert "(default: mixed)" in memory and "(default: 1)" in memory


def test_bad_flag_raises_one_line():
    with pytest.raises(UsageError, match=r"^python -m minipar.train: argument --tp: invalid"):
        parser().parse_args(["--tp", "x"])


def test_number_parsers():
    assert mcli.positive_int("3") == 3 and mcli.count("6.7B") == 6_700_000_000
    assert mcli.count("350M") == 350_000_000 and mcli.fraction("0.25") == 0.25
    for parse, text in [(mcli.positive_int, "0"), (mcli.positive_int, "1.5"),
                        (mcli.count, "lots"), (mcli.fraction, "1.5")]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_main_guard_exit_status(capsys):
    def bad(argv):
        raise UsageError("no such layout; use --tp 2")
    with pytest.raises(SystemExit) as exit_:
        mcli.main_guard(bad)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: no such layout; use --tp 2\n"
    assert mcli.main_guard(lambda argv: 7) == 7


@pytest.mark.parametrize("command", [["minipar.bench", "dp", "--nproc", "0"],
                                     ["minipar.exercises", "check"]])
@pytest.mark.slow
def test_commands_refuse_bad_input_with_one_line(command):
    r = cli(*command)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


def _probe_rounds(folder, rounds, barrier, failures):
    for i in range(rounds):
        barrier.wait()            # every process checks the same new path at the same moment
        try:
            mcli.check_output_file(os.path.join(folder, f"m{i}.jsonl"), "--metrics")
        except BaseException as e:  # noqa: BLE001 - any failure is what this test counts
            failures.put(f"round {i}: {type(e).__name__}: {e}")


def test_output_probe_is_safe_when_every_rank_checks_at_once(tmp_path):
    """torchrun/srun: every rank parses the flags, so every rank probes the same --metrics
    path at once; none may fail, and the probe leaves nothing behind."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    ranks, rounds = 8, 150
    barrier, failures = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_probe_rounds, args=(str(tmp_path), rounds, barrier, failures))
             for _ in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * ranks
    seen = []
    while True:
        try:
            seen.append(failures.get(timeout=0.5))
        except queue.Empty:
            break
    assert seen == [], f"{len(seen)} of {ranks * rounds} checks failed, e.g. {seen[:3]}"
    assert os.listdir(tmp_path) == []
