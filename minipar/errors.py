"""The one error type for bad input (no torch import, so the planner can use it too).

Every command line turns it into one line on stderr and exit status 2, before any work starts.
"""


class UsageError(ValueError):
    """Bad input from the user: what is wrong, and what would fix it."""
