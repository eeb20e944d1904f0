"""The collective timeout: every process group minipar makes waits at most this long.

``MINIPAR_TIMEOUT`` seconds (default 60): a rank that died or hangs ends the others' wait with an
error instead of torch's default of 30 minutes for sub-groups. ``--compile`` raises the default
(``timeout_default``), since one rank may still be compiling its first step while the others
already wait in a collective. ``new_group`` is the one place sub-groups are made
(``minipar.mesh``); ``minipar.dist`` re-exports all of it.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os

import torch.distributed as dist

from .errors import UsageError


def _timeout_s() -> float:
    """The collective timeout, MINIPAR_TIMEOUT seconds (60 by default), for every group."""
    text = os.environ.get("MINIPAR_TIMEOUT", "60")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"MINIPAR_TIMEOUT={text!r}: give the collective timeout as a positive "
                         f"number of seconds (default 60)")
    return value


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=_timeout_s())


# ``--compile``: the first step compiles every Block (inductor: minutes for a large model,
# and not in step on every rank), while the others already wait in a collective.
COMPILE_TIMEOUT_S = 600


@contextlib.contextmanager
def timeout_default(seconds: float | None):
    """Inside: MINIPAR_TIMEOUT defaults to ``seconds`` (None: to 60 as always); a value the
    user set wins. Set in the environment, so ranks started inside inherit it."""
    if seconds is None or "MINIPAR_TIMEOUT" in os.environ:
        yield
        return
    os.environ["MINIPAR_TIMEOUT"] = str(seconds)
    try:
        yield
    finally:
        os.environ.pop("MINIPAR_TIMEOUT", None)


def new_group(ranks: list[int]):
    """``torch.distributed.new_group`` with the collective timeout (the library's default is
    30 minutes, whatever the default group has). Every sub-group goes through here."""
    return dist.new_group(ranks, timeout=collective_timeout())
