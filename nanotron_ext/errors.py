"""Exceptions raised for user errors: each message names the value, the reason and the fix."""

from __future__ import annotations

__all__ = [
    "ConfigError", "LayoutError", "NanotronExtError", "PipelineValidationError", "PlanningError", "RunFailure",
]


class NanotronExtError(ValueError):
    """Base class of every user-facing error in nanotron_ext."""


class ConfigError(NanotronExtError):
    """A config file or option is missing, malformed or out of range."""


class PlanningError(NanotronExtError):
    """No split of the model satisfies the requested constraints."""


class LayoutError(NanotronExtError):
    """An explicit layout string cannot be parsed or does not fit the model."""


class PipelineValidationError(NanotronExtError, RuntimeError):
    """Raised on every rank at once when some PP rank would have no gradient."""


class RunFailure(NanotronExtError, RuntimeError):
    """A run that started failed for a reason outside the config: a peer rank died or stopped answering."""
