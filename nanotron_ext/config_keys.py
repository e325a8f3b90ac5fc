"""Reading a config file strictly: every key we or Nanotron would ignore or reject is an error, before any work.

A leaf (it imports only :mod:`nanotron_ext.errors` and the standard library, plus PyYAML), called from
:mod:`nanotron_ext.config`:

* :func:`read_config_text` — the file itself: a folder, an unreadable file or bytes that are not UTF-8 get a
  message that says which;
* :func:`parse_yaml` — YAML with duplicate keys refused (PyYAML silently keeps the last one);
* :func:`check_keys` — unknown keys, with "did you mean": in our ``nanotron_ext:`` section (and its
  ``freeze:``), at the top level (a ``nanotron-ext:`` section is a misspelling, not a section Nanotron knows),
  and in every section of Nanotron 0.2's ``Config`` that its strict (dacite) loader checks;
* :func:`check_values` — the values the planner reads as numbers, under their YAML names, and the tensor-
  parallel degree against the head counts, so that neither an ``int("abc")`` traceback nor an internal field
  name reaches the user.

``NANOTRON_SCHEMA`` is the config layout of Nanotron 0.2 and of upstream main together (``nanotron.config.Config``
and its nested dataclasses; the model config is the union of the model families' keys), stored in
``nanotron_ext/data/nanotron_config_keys.json`` rather than imported, because importing ``nanotron`` pulls in
torch, which planning never needs; ``tests/test_bad_input.py`` checks it against the installed Nanotron.
A key given twice in one mapping is a :class:`DuplicateKeyWarning`, not an error: upstream's own
``examples/config_qwen_with_moe.yaml`` gives ``moe_config`` twice, and its loader keeps the last one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from nanotron_ext.errors import ConfigError

__all__ = [
    "EXT_KEYS",
    "FREEZE_KEYS",
    "NANOTRON_SCHEMA",
    "NANOTRON_SCHEMAS",
    "DuplicateKeyWarning",
    "check_keys",
    "check_values",
    "dataclass_keys",
    "get_dotted",
    "parse_yaml",
    "read_config_text",
]

#: Keys of our ``nanotron_ext:`` section (the fields of ``config.ExtConfig``; a test keeps them in step).
EXT_KEYS = frozenset({
    "cost_strategy", "base_strategy", "layout", "memory_cap_gib", "allow_frozen_stages", "projector", "freeze",
    "profile_cache", "objective", "p2p_gbps", "memory_overhead_gib", "memory_runtime", "vocab_shards",
})
#: Keys of ``nanotron_ext.freeze:``.
FREEZE_KEYS = frozenset({"modules", "unfreeze", "unfreeze_last_decoder_layers"})
#: Our key that may also sit under ``parallelism:``.
PARALLELISM_EXT_KEYS = frozenset({"cost_strategy"})

#: Each supported Nanotron's ``Config``: section → its keys (a mapping for a nested dataclass, None for a value),
#: read off its dataclasses by ``tools/nanotron_config_keys.py``; a test checks the installed one.
NANOTRON_SCHEMAS: dict[str, dict[str, Any]] = json.loads(
    resources.files("nanotron_ext").joinpath("data/nanotron_config_keys.json").read_text(encoding="utf-8")
)
#: LlaMoE's keys (upstream's ``examples/moe``, loaded there with its own config class).
EXAMPLE_MODEL_KEYS = frozenset({"is_llamoe_config", "moe_num_experts", "num_experts_per_tok", "moe_capacity_factor"})


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = _merge(out[key], value)
        elif not isinstance(out.get(key), dict):
            out[key] = value
    return out


#: The keys a config may hold: those of 0.2 or of upstream main (a config is read before any Nanotron is).
NANOTRON_SCHEMA: dict[str, Any] = _merge(*NANOTRON_SCHEMAS.values())
NANOTRON_SCHEMA["model"]["model_config"].update(dict.fromkeys(EXAMPLE_MODEL_KEYS))


def read_config_text(path: str | Path) -> str:
    """The config file's text.

    Raises:
        ConfigError: the path does not exist, is a folder, cannot be read, or is not UTF-8 text.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config path {str(path)!r} is a directory; pass the path of a Nanotron YAML file in it")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a Nanotron YAML")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"config file {str(path)!r} cannot be read ({exc.strerror or exc}); check its permissions"
        ) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
            f"save it as UTF-8 YAML"
        ) from None


class DuplicateKeyWarning(UserWarning):
    """A YAML mapping gives one key twice (the last one wins)."""


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that warns about a key given twice in one mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            continue  # SafeLoader reports unhashable keys itself
        if key in seen:
            warnings.warn(
                f"{loader.name}: key {key!r} appears twice in one mapping (line {seen[key] + 1} and line "
                f"{key_node.start_mark.line + 1}); YAML keeps the last one, and so does Nanotron. Delete one of them",
                DuplicateKeyWarning, stacklevel=2,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text, warning about duplicate keys (:class:`DuplicateKeyWarning`).

    Raises:
        ConfigError: malformed YAML.
    """
    loader = _StrictLoader(text)
    loader.name = source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: malformed YAML: {' '.join(str(exc).split())}; fix the YAML syntax") from None
    finally:
        loader.dispose()


def _suggest(key: Any, known: set[str] | frozenset[str], spell_out: bool = False) -> str:
    close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(known), n=1, cutoff=0.6)
    # Short lists and our own section are spelled out; Nanotron's sections run to dozens of keys.
    listed = f"known keys are {', '.join(sorted(known))}" if spell_out or len(known) <= 10 else ""
    if close:
        # The list goes on a line of its own: our section has grown past a dozen keys.
        return f"did you mean {close[0]!r}?" + (f"\n  {listed}" if listed else "")
    return listed or "remove it or check the spelling against Nanotron's config"


def _unknown(source: str, where: str, key: Any, known: set[str] | frozenset[str], why: str,
             spell_out: bool = False) -> ConfigError:
    return ConfigError(f"{source}: unknown key(s) {key!r} in {where}: {why}; {_suggest(key, known, spell_out)}")


def check_keys(raw: dict[str, Any], source: str, *, ext_section: str = "nanotron_ext") -> None:
    """Refuse unknown keys in our section and in every section Nanotron's strict loader checks.

    Raises:
        ConfigError: the first unknown key, with the closest known key ("did you mean").
    """
    top_known = set(NANOTRON_SCHEMA) | {ext_section}
    for key in raw:
        if key not in top_known:
            raise _unknown(source, "the top level", key, top_known,
                           "neither Nanotron nor nanotron_ext reads it (Nanotron's loader rejects it)")
    section = raw.get(ext_section)
    if isinstance(section, dict):
        for key in section:
            if key not in EXT_KEYS:
                raise _unknown(source, f"'{ext_section}:'", key, EXT_KEYS, "nanotron_ext has no such option",
                               spell_out=True)
        freeze = section.get("freeze")
        if isinstance(freeze, dict):
            for key in freeze:
                if key not in FREEZE_KEYS:
                    raise _unknown(source, f"'{ext_section}.freeze:'", key, FREEZE_KEYS, "freezing has no such option")
    for name, schema in NANOTRON_SCHEMA.items():
        _check_section(raw.get(name), schema, name, source)


def _check_section(node: Any, schema: dict[str, Any], where: str, source: str) -> None:
    if not isinstance(node, dict):
        return  # a missing or null section; a wrong type is reported where it is read
    known = set(schema) | (PARALLELISM_EXT_KEYS if where == "parallelism" else set())
    for key, value in node.items():
        if key not in known:
            raise _unknown(source, f"'{where}:'", key, known, "Nanotron's config loader rejects it")
        if isinstance(schema.get(key), dict):
            _check_section(value, schema[key], f"{where}.{key}", source)


_POSITIVE_INTS = (
    "parallelism.dp", "parallelism.pp", "parallelism.tp",
    "tokens.sequence_length", "tokens.micro_batch_size", "tokens.batch_accumulation_per_replica",
    "tokens.train_steps", "model.make_vocab_size_divisible_by",
    "model.model_config.hidden_size", "model.model_config.intermediate_size",
    "model.model_config.num_hidden_layers", "model.model_config.num_attention_heads",
    "model.model_config.num_key_value_heads", "model.model_config.vocab_size",
    "model.model_config.max_position_embeddings",
)
_POSITIVE_NUMBERS = ("model.model_config.rms_norm_eps",)
_EXT_STRINGS = ("cost_strategy", "base_strategy", "layout", "profile_cache")


def get_dotted(raw: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``raw["a"]["b"]`` for ``"a.b"``; ``default`` where a part is missing or null."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return default
        node = node[part]
    return node


def dataclass_keys(cls: type) -> dict[str, Any]:
    """Keys of a config dataclass such as Nanotron's ``Config``: a nested dataclass (also inside a union or a
    list) becomes a mapping of its keys, unions merged; anything else None. How the stored tables were made."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        subs = [b for a in (typing.get_args(hints[f.name]) or (hints[f.name],))
                for b in (typing.get_args(a) or (a,)) if dataclasses.is_dataclass(b)]
        if subs:
            merged: dict[str, Any] = {}
            for sub in subs:
                for key, value in dataclass_keys(sub).items():
                    merged[key] = value if merged.get(key) is None else merged[key]
            out[f.name] = merged
        else:
            out[f.name] = None
    return out


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
        value = get_dotted(raw, dotted)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{source}: {dotted}={value!r} must be a positive integer; write e.g. "
                              f"{dotted.rsplit('.', 1)[-1]}: 1")
    for dotted in _POSITIVE_NUMBERS:
        value = get_dotted(raw, dotted)
        if value is not None and not _positive_number(value):
            raise ConfigError(f"{source}: {dotted}={value!r} must be a positive number, e.g. 1.0e-5")
    section = raw.get(ext_section)
    if isinstance(section, dict):
        for key in _EXT_STRINGS:
            value = section.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{source}: {ext_section}.{key}={value!r} must be a non-empty string"
                                  + (" such as \"E,t*5|t*6,L\"" if key == "layout" else
                                     ", a folder path" if key == "profile_cache" else ""))
    tp = get_dotted(raw, "parallelism.tp")
    for heads_key in ("num_attention_heads", "num_key_value_heads"):
        heads = get_dotted(raw, f"model.model_config.{heads_key}")
        if isinstance(tp, int) and isinstance(heads, int) and tp > 1 and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(
                f"{source}: parallelism.tp={tp} does not divide model_config.{heads_key}={heads}: tensor "
                f"parallelism gives every rank the same number of heads (Nanotron asserts it). Use tp in "
                f"{{{', '.join(map(str, divisors))}}}"
            )
