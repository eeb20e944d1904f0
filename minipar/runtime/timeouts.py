"""The collective timeout: every process group minipar makes waits at most this long.

``MINIPAR_TIMEOUT`` seconds: a rank that died or hangs ends the others' wait with an error
instead of torch's default of 30 minutes for sub-groups. Its default depends on the backend:
60 s on gloo (CPU runs, the tests), 600 s on NCCL/RCCL, where the same timeout also bounds the
rendezvous and the watchdog, and the first rank to arrive may wait minutes for the others to
import torch from a shared file system and create their communicators. ``--compile`` raises the
default (``timeout_default``), since one rank may still be compiling its first step while the
others already wait in a collective. ``new_group`` is the one place sub-groups are made
(``minipar.mesh``); ``minipar.runtime.dist`` re-exports all of it.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os

import torch.distributed as dist

from .errors import UsageError


DEFAULT_TIMEOUT_S = {"gloo": 60.0, "nccl": 600.0}


def _backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _timeout_s(backend: str | None = None) -> float:
    """The collective timeout in seconds: MINIPAR_TIMEOUT if set, else 600 on NCCL and 60
    otherwise. ``backend`` defaults to the default process group's (none yet: gloo's)."""
    default = DEFAULT_TIMEOUT_S["nccl" if (backend or _backend()) == "nccl" else "gloo"]
    text = os.environ.get("MINIPAR_TIMEOUT", f"{default:g}")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"MINIPAR_TIMEOUT={text!r}: give the collective timeout as a positive "
                         f"number of seconds (default 60, 600 on NCCL)")
    return value


def collective_timeout(backend: str | None = None) -> datetime.timedelta:
    return datetime.timedelta(seconds=_timeout_s(backend))


# ``--compile``: the first step compiles every Block (inductor: minutes for a large model,
# and not in step on every rank), while the others already wait in a collective.
COMPILE_TIMEOUT_S = 600


@contextlib.contextmanager
def timeout_default(seconds: float | None):
    """Inside: MINIPAR_TIMEOUT defaults to ``seconds`` (None: to the backend's default); a
    value the user set wins. Set in the environment, so ranks started inside inherit it."""
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
