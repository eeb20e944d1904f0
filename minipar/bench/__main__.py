import importlib
import sys

from ..runtime import cli
from ..runtime.errors import UsageError
from . import BENCHES

USAGE = f"usage: python -m minipar.bench {{{','.join(BENCHES)}}} [options]  (each takes --help)"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in BENCHES:
        raise UsageError(f"choose a benchmark: {', '.join(BENCHES)} ({USAGE})")
    module = importlib.import_module(f"minipar.bench.{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
