"""Run the notebooks and store their outputs, so they read on GitHub without running.

    python -m minipar.lab refresh                      # every notebooks/*.ipynb, in order
    python -m minipar.lab refresh notebooks/05_3d_parallel_trainer.ipynb

Each notebook runs top to bottom in a fresh ``python3`` kernel, in the notebooks folder (as
JupyterLab runs it), and is written back with its outputs. A cell that raises (an assertion
on a measured trend, say) stops that notebook with the cell's error, and nothing is written
for it. The tests still run every notebook under nbval in lax mode, which executes every cell
(so the assertions count) but does not compare the stored outputs (timings, addresses).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..runtime import cli
from ..runtime.errors import UsageError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def parser():
    p = cli.ArgumentParser(prog="python -m minipar.lab",
                           description="Run the workshop notebooks and store their outputs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("refresh", help="execute notebooks in place, keeping their outputs")
    r.add_argument("notebooks", nargs="*", help="notebook files (default: every notebooks/*.ipynb)")
    r.add_argument("--timeout", type=cli.positive_float, default=1200.0,
                   help="seconds one cell may run")
    return p


def refresh(paths: list[Path], timeout: float = 1200.0) -> None:
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as e:
        raise UsageError(f"refresh needs nbformat and nbclient ({e}): "
                         f'pip install -e ".[notebooks]"') from None
    for path in paths:
        t = time.monotonic()
        print(f"running {path} ...", flush=True)
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        print(f"  stored its outputs ({time.monotonic() - t:.0f} s)", flush=True)


def main(argv=None):
    args = parser().parse_args(argv)
    paths = [Path(p) for p in args.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for p in paths:
        if p.suffix != ".ipynb" or not p.is_file():
            raise UsageError(f"{p}: not a notebook file (.ipynb)")
        cli.check_output_file(str(p), "notebook")
    refresh(paths, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
