"""The one exception the planner raises for bad input: minipar's UsageError, by another name."""

from ..errors import UsageError


class PlanError(UsageError):
    """Bad input: the CLI prints the message as one line and exits with status 2.

    Messages say what is wrong and what would fix it.
    """
