"""The planner's error type: minipar's UsageError, by another name (see ``minipar.errors``)."""

from ..errors import PlanError, UsageError  # noqa: F401
