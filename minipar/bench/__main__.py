import importlib
import sys

from . import BENCHES


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m minipar.bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        sys.exit(2)
    try:
        module = importlib.import_module(f"minipar.bench.{argv[0]}")
    except ModuleNotFoundError:
        print(f"error: the {argv[0]} benchmark is not available in this version", file=sys.stderr)
        sys.exit(2)
    module.main(argv[1:])


if __name__ == "__main__":
    main()
