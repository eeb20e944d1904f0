"""The planner's error type: minipar's UsageError, by another name (see ``minipar.runtime.errors``)."""

from ..runtime.errors import PlanError, UsageError  # noqa: F401


def raise_if(why: str | None) -> None:
    """PlanError(``why``) where a rule found what is wrong (``why`` not None or empty)."""
    if why:
        raise PlanError(why)
