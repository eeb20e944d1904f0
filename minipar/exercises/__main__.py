import sys

from ..runtime import cli
from ..runtime.errors import UsageError
from . import DEFAULT_CHECK_TIMEOUT, check, get, make, registry, student_file, student_path


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.exercises",
                                description="List, make and check the workshop exercises.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the exercises and their files")
    m = sub.add_parser("make", help="(re)generate student files from the package source")
    m.add_argument("ids", nargs="*")
    m.add_argument("--out", default=None, help="folder (default: the repo's exercises/)")
    m.add_argument("--force", action="store_true",
                   help="overwrite files you edited (the old one is kept as .bak)")
    c = sub.add_parser("check", help="run an exercise's checks")
    c.add_argument("id")
    c.add_argument("--file", default=None, help="the student file (default: exercises/exNN_*.py)")
    c.add_argument("--solution", action="store_true", help="check the package's own solution")
    c.add_argument("--timeout", type=cli.positive_float, default=DEFAULT_CHECK_TIMEOUT,
                   help="seconds without progress (file loaded, a launch finished) before the checks "
                        "count as hung")
    args = p.parse_args(argv)

    if args.cmd == "list":
        for ex_id, ex in registry().items():
            print(f"{ex_id:6s} {ex.TITLE:55s} {ex.DIFFICULTY:8s} {ex.MINUTES:>3} min  "
                  f"{student_path(ex_id)}")
        return 0
    if args.cmd == "make":
        from pathlib import Path
        for ex_id in args.ids:
            get(ex_id)
        for path in make(args.ids or None, Path(args.out) if args.out else None, force=args.force):
            print(f"wrote {path}")
        return 0
    ex = get(args.id)
    if args.solution and args.file:
        raise UsageError("give --file or --solution, not both")
    if not args.solution:
        student_file(args.id, args.file)  # a missing, empty or unreadable file: one line, exit 2
    print(f"checking {args.id}: {ex.TITLE} "
          f"({'package solution' if args.solution else args.file or student_path(args.id)})",
          flush=True)
    failures = check(args.id, args.file, args.solution, timeout=args.timeout)
    if not failures:
        print(f"PASS {args.id}: every check passed. Verified:")
        for line in failures.verified:
            print("  + " + line)
    else:
        print(f"FAIL {args.id}:")
        for f in failures:
            print("  - " + f.replace("\n", "\n    "))
        if failures.verified:
            print("already right:")
            for line in failures.verified:
                print("  + " + line)
    if failures.todos:
        print("optional, still open:")
        for line in failures.todos:
            print("  ~ " + line.replace("\n", "\n    "))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
