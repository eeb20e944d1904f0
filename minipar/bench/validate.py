"""``python -m minipar.bench validate``: the planner's predicted step times against
``minipar.train``'s measured ones on this machine (``minipar.bench.calibrate``)."""
import sys


def main(argv=None) -> int:
    from minipar.plan.__main__ import main as plan_main
    return plan_main(["validate", *(sys.argv[1:] if argv is None else argv)])
