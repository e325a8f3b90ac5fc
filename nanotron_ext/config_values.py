"""A config's values, under the names the YAML gives them: the counts the planner turns into numbers, our string
options, the tensor-parallel degree against the head counts, and the one message of a value that must be a mapping,
so that neither an ``int("abc")`` traceback nor an internal field name reaches the user.

A leaf like :mod:`nanotron_ext.config_keys` (the errors module and the standard library); called from
:mod:`nanotron_ext.config`, re-exported by ``config_keys``.
"""

from __future__ import annotations

import math
from typing import Any

from nanotron_ext.errors import ConfigError, check_positive_int

__all__ = ["REQUIRED", "check_values", "get_dotted", "not_a_mapping"]

_POSITIVE_INTS = (
    "parallelism.dp",
    "parallelism.pp",
    "parallelism.tp",
    "tokens.sequence_length",
    "tokens.micro_batch_size",
    "tokens.batch_accumulation_per_replica",
    "tokens.train_steps",
    "model.make_vocab_size_divisible_by",
    "model.model_config.hidden_size",
    "model.model_config.intermediate_size",
    "model.model_config.num_hidden_layers",
    "model.model_config.num_attention_heads",
    "model.model_config.num_key_value_heads",
    "model.model_config.vocab_size",
    "model.model_config.max_position_embeddings",
)
_POSITIVE_NUMBERS = ("model.model_config.rms_norm_eps",)
_EXT_STRINGS = ("cost_strategy", "base_strategy", "layout", "profile_cache")

#: YAML's names of the types a value parses to (the words a user reads in the file, not Python's).
_YAML_TYPES: dict[type, str] = {
    str: "text",
    bool: "true/false",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "a mapping",
    type(None): "null (empty)",
}


def not_a_mapping(
    where: str, value: Any, example: str, *, source: str | None = None, see: str | None = None
) -> ConfigError:
    """The one message of a value that must be a mapping and is not: what it is, and an example of the right form.

    Example:
        >>> str(not_a_mapping("nanotron_ext.freeze", "decoder", "freeze: {modules: [decoder]}"))
        "nanotron_ext.freeze is text ('decoder'), but it must be a mapping; write it like \
`freeze: {modules: [decoder]}`"
    """
    kind = _YAML_TYPES.get(type(value), type(value).__name__)
    return ConfigError(
        f"{source + ': ' if source else ''}{where} is {kind} ({value!r}), but it must be a mapping; "
        f"write it like `{example}`" + (f" (see {see})" if see else "")
    )


#: ``get_dotted``'s default: the key must be there.
REQUIRED: Any = object()


def get_dotted(raw: dict[str, Any], dotted: str, default: Any = REQUIRED, *, source: str = "<dict>") -> Any:
    """``raw["a"]["b"]`` for ``"a.b"``; ``default`` where a part is missing or null.

    Raises:
        ConfigError: a part is missing or null and no ``default`` was given; the message names the key and the file.
    """
    node: Any = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if node is not None and not isinstance(node, dict):  # `parallelism: 2`: say so, not "dp is missing"
            where = ".".join(parts[:i])
            raise not_a_mapping(where, node, f"{parts[i - 1]}: {{{part}: ...}}", source=source)
        if node is None or node.get(part) is None:
            if default is not REQUIRED:
                return default
            raise ConfigError(
                f"{source}: required key '{dotted}' is missing; add it to the YAML "
                f"(see examples/configs/tiny_llama_large_vocab.yaml)"
            )
        node = node[part]
    return node


def _positive_number(value: Any) -> bool:
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as text; Nanotron's float() accepts it
        try:
            value = float(value)
        except ValueError:
            return False
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_values(raw: dict[str, Any], source: str, *, ext_section: str = "nanotron_ext") -> None:
    """Type-check the values the planner turns into numbers, under the names the YAML gives them.

    Raises:
        ConfigError: a count that is not a positive integer, ``rms_norm_eps`` that is not a positive number,
        one of our string options given as something else, or a tensor-parallel degree that does not divide
        the attention head counts.
    """
    for dotted in _POSITIVE_INTS:
        value = get_dotted(raw, dotted, None, source=source)
        if value is not None:
            check_positive_int(dotted, value, source=source, fix=f"write e.g. {dotted.rsplit('.', 1)[-1]}: 1")
    for dotted in _POSITIVE_NUMBERS:
        value = get_dotted(raw, dotted, None, source=source)
        if value is not None and not _positive_number(value):
            raise ConfigError(f"{source}: {dotted}={value!r} must be a positive number, e.g. 1.0e-5")
    section = raw.get(ext_section)
    if isinstance(section, dict):
        for key in _EXT_STRINGS:
            value = section.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(
                    f"{source}: {ext_section}.{key}={value!r} must be a non-empty string"
                    + (
                        ' such as "E,t*5|t*6,L"'
                        if key == "layout"
                        else ", a folder path"
                        if key == "profile_cache"
                        else ""
                    )
                )
    tp = get_dotted(raw, "parallelism.tp", None, source=source)
    for heads_key in ("num_attention_heads", "num_key_value_heads"):
        heads = get_dotted(raw, f"model.model_config.{heads_key}", None, source=source)
        if isinstance(tp, int) and isinstance(heads, int) and tp > 1 and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(
                f"{source}: parallelism.tp={tp} does not divide model_config.{heads_key}={heads}: tensor "
                f"parallelism gives every rank the same number of heads (Nanotron asserts it). Use tp in "
                f"{{{', '.join(map(str, divisors))}}}"
            )
