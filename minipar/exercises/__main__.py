import sys

from .. import cli
from . import check, get, make, registry, student_path


def main(argv=None):
    p = cli.ArgumentParser(prog="python -m minipar.exercises",
                                description="List, make and check the workshop exercises.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the exercises and their files")
    m = sub.add_parser("make", help="(re)generate student files from the package source")
    m.add_argument("ids", nargs="*")
    m.add_argument("--out", default=None, help="folder (default: the repo's exercises/)")
    c = sub.add_parser("check", help="run an exercise's checks")
    c.add_argument("id")
    c.add_argument("--file", default=None, help="the student file (default: exercises/exNN_*.py)")
    c.add_argument("--solution", action="store_true", help="check the package's own solution")
    args = p.parse_args(argv)

    if args.cmd == "list":
        for ex_id, ex in registry().items():
            print(f"{ex_id}  {ex.TITLE:55s} {student_path(ex_id)}")
        return 0
    if args.cmd == "make":
        from pathlib import Path
        for ex_id in args.ids:
            get(ex_id)
        for path in make(args.ids or None, Path(args.out) if args.out else None):
            print(f"wrote {path}")
        return 0
    ex = get(args.id)
    print(f"checking {args.id}: {ex.TITLE} "
          f"({'package solution' if args.solution else args.file or student_path(args.id)})")
    failures = check(args.id, args.file, args.solution)
    if not failures:
        print(f"PASS {args.id}: every check passed")
        return 0
    print(f"FAIL {args.id}:")
    for f in failures:
        print("  - " + f.replace("\n", "\n    "))
    return 1


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
