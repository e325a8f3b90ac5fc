"""Exceptions raised for user errors: each message names the value, the reason and the fix; and the one check
every count in a config shares (:func:`check_positive_int`)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError", "ConfigError", "LayoutError", "NanotronExtError", "PipelineValidationError", "PlanningError", "RunFailure",
    "check_positive_int",
]


class NanotronExtError(ValueError):
    """Base class of every user-facing error in nanotron_ext."""


class ConfigError(NanotronExtError):
    """A config file or option is missing, malformed or out of range."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed as asked: half written, of another model, or not mappable onto the plan."""


class PlanningError(NanotronExtError):
    """No split of the model satisfies the requested constraints."""


class LayoutError(NanotronExtError):
    """An explicit layout string cannot be parsed or does not fit the model."""


class PipelineValidationError(NanotronExtError, RuntimeError):
    """Raised on every rank at once when some PP rank would have no gradient."""


class RunFailure(NanotronExtError, RuntimeError):
    """A run that started failed for a reason outside the config: a peer rank died or stopped answering."""


def check_positive_int(name: str, value: Any, *, source: str | None = None, fix: str | None = None) -> int:
    """``value`` if it is a positive integer (``True`` is not one, though Python says it is an int).

    Raises:
        ConfigError: ``{source}: {name}={value!r} must be a positive integer; {fix}``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source + ': ' if source else ''}{name}={value!r} must be a positive integer"
                          f"{'; ' + fix if fix else ''}")
    return value
