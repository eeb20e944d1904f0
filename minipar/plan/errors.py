"""The planner's error type: minipar's UsageError, by another name (see ``minipar.runtime.errors``)."""

from ..runtime.errors import PlanError, UsageError  # noqa: F401
