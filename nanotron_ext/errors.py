"""Exceptions raised for user errors: each message names the value, the reason and the fix; the one check
every count in a config shares (:func:`check_positive_int`); and the one "did you mean" rule for every name a
user types (YAML keys, strategies, engines, choices: :func:`did_you_mean`)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CheckpointError",
    "ConfigError",
    "LayoutError",
    "NanotronExtError",
    "PipelineValidationError",
    "PlanningError",
    "RunFailure",
    "check_positive_int",
    "did_you_mean",
    "near_miss",
    "suggest",
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
        raise ConfigError(
            f"{source + ': ' if source else ''}{name}={value!r} must be a positive integer{'; ' + fix if fix else ''}"
        )
    return value


def near_miss(key: Any, known: Iterable[str]) -> str | None:
    """The known name ``key`` is a slip of: the same once case, ``-`` and ``_`` are ignored (``costStrategy``,
    ``nanotron-ext``), or one edit away (two for names longer than 5 characters; a swap of neighbours is one
    edit: ``rms_norm_esp``). None when it is no near miss (``doremi``, ``moe_layer_recompute``).
    """
    word = str(key).lower().replace("-", "_")
    best: tuple[int, str] | None = None
    for name in sorted(known):
        if word.replace("_", "") == name.lower().replace("_", ""):
            return name
        distance = _edit_distance(word, name.lower())
        if distance <= (1 if len(name) <= 5 else 2) and (best is None or distance < best[0]):
            best = (distance, name)
    return None if best is None else best[1]


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance where swapping two neighbours counts as one edit (optimal string alignment)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def did_you_mean(word: Any, known: Iterable[str]) -> str | None:
    """The known name ``word`` most likely means: a :func:`near_miss`, else the closest by ``difflib`` (ratio
    0.6 or more); None when nothing is close."""
    names = sorted(str(k) for k in known)
    return near_miss(word, names) or next(
        iter(difflib.get_close_matches(str(word).replace("-", "_"), names, n=1, cutoff=0.6)), None
    )


def suggest(word: Any, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for a name close to ``word`` (see :func:`did_you_mean`), else ``""``: the prefix
    of a message's fix."""
    close = did_you_mean(word, known)
    return f"did you mean {close!r}? " if close else ""
