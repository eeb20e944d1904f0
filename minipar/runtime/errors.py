"""The error types for bad input (no torch import, so the planner can use them too).

Every command line turns them into one line on stderr and exit status 2, before any work starts.
"""


class UsageError(ValueError):
    """Bad input from the user: what is wrong, and what would fix it."""


class PlanError(UsageError):
    """Bad input to the planner (or a shard spec): one line, exit status 2.

    Messages say what is wrong and what would fix it.
    """


class Stopped(BaseException):
    """A launcher was told to stop (SIGTERM) and stopped every rank; exit status 128 + signal."""

    def __init__(self, signum: int):
        import signal
        super().__init__(f"stopped by {signal.Signals(signum).name}: every rank was stopped")
        self.signum = signum
