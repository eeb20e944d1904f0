"""What every command line of minipar shares (torch-free, so the planner can use it too).

* ``ArgumentParser``: argparse whose ``--help`` shows each option's default, and whose bad
  flag raises ``UsageError`` (one line, see below) instead of printing the usage block.
* ``main_guard(main)``: runs an entry point; ``UsageError`` (bad input, found before any
  work starts) becomes ``error: ...`` on stderr and exit status 2; a failed or timed-out
  rank (``minipar.runtime.dist.RankFailed``, ``TimeoutError``) its message and exit status 1;
  Ctrl-C one line and 130, a launcher stopped by SIGTERM one line and 143; a reader who
  leaves early (``| head``) is not an error.
* Number parsers for ``type=``: ``positive_int`` (1, 2, ...), ``nonnegative_int`` (0, 1, ...),
  ``positive_float`` (finite, > 0: no NaN, no infinity), ``count`` ("175B", "6.7e9",
  "350M"), ``fraction`` (0 to 1).
* ``check_output_file(path, flag)``: an output path that can be written, checked before any
  work starts (not a folder, its folder exists, a file can be created there).
* ``text_table(rows, headers)`` and ``emit(args, data, text)``: what the planner's and the
  benches' sub-commands print, a right-aligned table or with ``--json`` one JSON document.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile

from .errors import Stopped, UsageError


def _shows_default(action) -> bool:
    """An option whose default is worth printing (not None, not an off switch)."""
    return bool(action.option_strings) and not any(
        action.default is nothing for nothing in (None, False, argparse.SUPPRESS))


class _Formatter(argparse.HelpFormatter):
    """Add ``(default: X)`` to every option that has a default and does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not _shows_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in ``--help``; a bad flag raises ``UsageError`` (one line, exit
    status 2 through ``main_guard``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None and _shows_default(action):   # argparse skips an empty help
            action.help = "(default: %(default)s)"
        return action

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def main_guard(main, argv=None):
    """Run ``main(argv)`` as a command line; return its result, or exit with status 2 (bad
    input) or 1 (a rank failed or timed out) after one message on stderr."""
    try:
        return main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:                  # the reader left early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:                # Ctrl-C: one line, not a traceback
        launched = "minipar.runtime.dist" in sys.modules
        print("interrupted" + (": every rank was stopped" if launched else ""), file=sys.stderr)
        sys.exit(130)
    except Stopped as e:                     # SIGTERM to a launcher: it stopped every rank
        print(str(e), file=sys.stderr)
        sys.exit(128 + e.signum)
    except Exception as e:
        # a rank can only have failed if the launcher (minipar.runtime.dist, torch) is loaded
        rank_failed = getattr(sys.modules.get("minipar.runtime.dist"), "RankFailed", None)
        if isinstance(e, TimeoutError) or (rank_failed is not None and isinstance(e, rank_failed)):
            print(str(e), file=sys.stderr)
            sys.exit(1)
        raise


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a count of ranks, steps, sequences...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


MAX_COUNT = 10**15     # a thousand times the largest model trained: beyond it, a typo


def count(text: str) -> int:
    """argparse type: '175e9', '175B', '6.7b', '1T', '350M' -> an integer from 1 to
    ``MAX_COUNT`` (0, a negative, NaN, infinity or an overflowing figure is refused)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMbBgGtT]?)\s*", str(text))
    try:
        value = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (try 175e9 or 175B)") from None
    if not 0.5 <= value <= MAX_COUNT:           # False for NaN and infinity too
        raise argparse.ArgumentTypeError(f"must be a count from 1 to {MAX_COUNT:.0e}, got "
                                         f"{text!r}")
    return int(round(value))


def fraction(text: str) -> float:
    """argparse type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (warm-up steps, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a rate, a size, a time; not NaN, not infinity)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def check_output_file(path: str, flag: str) -> None:
    """Raise UsageError unless ``path`` can be written: not a folder, in an existing folder
    where a file can be created (tried, not guessed from permission bits).

    Safe when many ranks check the same path at once (torchrun, srun: every rank parses the
    flags): an existing file is opened for appending (no change, nothing removed), and a
    missing one is never created here; instead each process creates and removes its *own*
    probe file beside it (a unique name), so no rank can remove what another one made.
    """
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: its folder does not exist; create it first")
    try:
        if os.path.exists(path):
            with open(path, "a"):
                pass
        else:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".minipar-probe-")
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be written ({e.strerror or e}); "
                         f"choose another path") from None


def check_output_folder(path: str, flag: str) -> None:
    """Raise UsageError unless a folder can be made at ``path`` (or already is one) and files
    written in it: a probe file in its nearest existing folder, tried, not guessed from mode
    bits (root ignores them; a read-only mount does not)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file; give a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".minipar-probe-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be written in {probe} ({e.strerror or e}); "
                         f"choose another folder") from None


def text_table(rows: list[list], headers: list[str]) -> str:
    """Rows under right-aligned headers, a dashed line between."""
    cells = [[str(h) for h in headers]] + [[str(x) for x in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(args, data, text: str) -> None:
    """With ``--json`` the data as one JSON document on stdout, else the readable text."""
    print(json.dumps(data, indent=2) if args.json else text)
