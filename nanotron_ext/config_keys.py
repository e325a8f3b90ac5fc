"""Reading a config file: a misspelt key or a bad value is an error before any work; a key no Nanotron we
know reads is a warning, because forks and examples read keys of their own.

A leaf (it imports only :mod:`nanotron_ext.errors`, :mod:`nanotron_ext.config_values` and the standard library, plus
PyYAML), called from :mod:`nanotron_ext.config`:

* :func:`read_config_text` — the file itself: a folder, an unreadable file or bytes that are not UTF-8 get a
  message that says which;
* :func:`parse_yaml` — YAML with duplicate keys warned about (PyYAML silently keeps the last one);
* :func:`check_ext_section` — our ``nanotron_ext:`` section (and its ``freeze:``): an unknown key is an error,
  with "did you mean" and the known keys (Nanotron never sees this section, so no one else would catch it);
* :func:`check_keys` — Nanotron's sections: a key that is a near miss of a known key (``ppp``, ``cost_stratgy``,
  ``costStrategy``, a ``nanotron-ext:`` section) is an error with "did you mean"; any other key that neither
  Nanotron 0.2 nor upstream main reads is an :class:`UnreadKeyWarning` (SmolLM3's configs carry
  ``parallelism.moe_layer_recompute`` from the Nanotron branch that trained it, upstream's DoReMi example a
  ``doremi:`` section its own config class reads): the plan goes on, and the Nanotron that loads the file has
  the final word;
* :func:`check_values` — the values (:mod:`nanotron_ext.config_values`, re-exported here with
  :func:`get_dotted` and :func:`not_a_mapping`).

``NANOTRON_SCHEMA`` is the config layout of Nanotron 0.2 and of upstream main together (``nanotron.config.Config``
and its nested dataclasses; the model config is the union of the model families' keys), stored in
``nanotron_ext/data/nanotron_config_keys.json`` rather than imported, because importing ``nanotron`` pulls in
torch, which planning never needs; ``tests/test_bad_input.py`` checks it against the installed Nanotron. Where
Nanotron is imported anyway (the launcher, ``train``), :func:`installed_nanotron_keys` adds the installed one's
keys, so that a fork's own keys are neither refused nor warned about.
A key given twice in one mapping is a :class:`DuplicateKeyWarning`, not an error: upstream's own
``examples/config_qwen_with_moe.yaml`` gives ``moe_config`` twice, and its loader keeps the last one.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from nanotron_ext.config_values import REQUIRED, check_values, get_dotted, not_a_mapping
from nanotron_ext.errors import ConfigError, did_you_mean, near_miss

__all__ = [
    "FREEZE_KEYS",
    "NANOTRON_SCHEMA",
    "NANOTRON_SCHEMAS",
    "REQUIRED",
    "DuplicateKeyWarning",
    "UnreadKeyWarning",
    "check_ext_section",
    "check_keys",
    "check_values",
    "dataclass_keys",
    "get_dotted",
    "installed_nanotron_keys",
    "not_a_mapping",
    "parse_yaml",
    "read_config_text",
    "unknown_key",
]

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
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
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
                DuplicateKeyWarning,
                stacklevel=2,
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


class UnreadKeyWarning(UserWarning):
    """Keys that no Nanotron we know reads (a fork's or an example's own): the plan goes on without them."""


def unknown_key(
    source: str | None,
    where: str,
    key: Any,
    known: set[str] | frozenset[str],
    why: str,
    suggestion: str | None = None,
    spell_out: bool = False,
) -> ConfigError:
    """The one message of an unknown key: what it is, where (in ``source``, where known), why it is refused, "did
    you mean" for a near miss, and (for short lists and our own section) the known keys on a line of their own."""
    close = suggestion or did_you_mean(key, known)
    # Short lists and our own section are spelled out; Nanotron's sections run to dozens of keys.
    listed = f"known keys are {', '.join(sorted(known))}" if spell_out or len(known) <= 10 else ""
    if close:
        hint = f"did you mean {close!r}?" + (f"\n  {listed}" if listed else "")
    else:
        hint = listed or "remove it or check the spelling against Nanotron's config"
    return ConfigError(f"{source + ': ' if source else ''}unknown key(s) {key!r} in {where}: {why}; {hint}")


def check_ext_section(section: Any, source: str, *, ext_keys: frozenset[str], ext_section: str) -> None:
    """Refuse an unknown key in our section or in its ``freeze:`` (the one check of our section's keys).

    Raises:
        ConfigError: the first unknown key, with "did you mean" and the known keys.
    """
    if not isinstance(section, dict):
        return
    for key in section:
        if key not in ext_keys:
            raise unknown_key(
                source, f"'{ext_section}:'", key, ext_keys, "nanotron_ext has no such option", spell_out=True
            )
    freeze = section.get("freeze")
    if isinstance(freeze, dict):
        for key in freeze:
            if key not in FREEZE_KEYS:
                raise unknown_key(source, f"'{ext_section}.freeze:'", key, FREEZE_KEYS, "freezing has no such option")


def check_keys(
    raw: dict[str, Any], source: str, *, ext_section: str = "nanotron_ext", installed: dict[str, Any] | None = None
) -> None:
    """Check the keys outside our section against every Nanotron we know (and ``installed``, the keys of the
    Nanotron that will load the file, where it is imported anyway).

    A near miss of a known key is an error; any other key no Nanotron we know reads is one
    :class:`UnreadKeyWarning` naming them all and the loaders that reject them.

    Raises:
        ConfigError: the first near miss, with "did you mean".
    """
    schema = _merge(NANOTRON_SCHEMA, installed) if installed else NANOTRON_SCHEMA
    unread = _unread_keys(raw, schema, "", source, top={ext_section})
    if not unread:
        return
    shown = ", ".join(repr(k) for k in unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
    rejecting = [name for name, table in NANOTRON_SCHEMAS.items() if any(not _has(table, k) for k in unread)]
    warnings.warn(
        f"{source}: {shown} {'is' if len(unread) == 1 else 'are'} read by no Nanotron nanotron_ext knows: the "
        f"loader{'s' if len(rejecting) > 1 else ''} of Nanotron {' and '.join(rejecting)} "
        f"reject{'' if len(rejecting) > 1 else 's'} {'it' if len(unread) == 1 else 'them'} (a fork or the "
        f"example's own config class may read {'it' if len(unread) == 1 else 'them'}); the plan goes on without "
        f"{'it' if len(unread) == 1 else 'them'}",
        UnreadKeyWarning,
        stacklevel=3,
    )


def _unread_keys(
    node: Any, schema: dict[str, Any], where: str, source: str, top: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """Dotted names of the keys under ``node`` that ``schema`` lacks (not looking inside them).

    Raises:
        ConfigError: a key that is a near miss of a known one.
    """
    if not isinstance(node, dict):
        return []  # a missing or null section; a wrong type is reported where it is read
    known = set(schema) | set(top) | (PARALLELISM_EXT_KEYS if where == "parallelism" else set())
    unread: list[str] = []
    for key, value in node.items():
        if key in known:
            if isinstance(schema.get(key), dict):
                unread += _unread_keys(value, schema[key], f"{where}.{key}" if where else str(key), source)
            continue
        close = near_miss(key, known)
        if close is not None:
            where_ = f"'{where}:'" if where else "the top level"
            raise unknown_key(
                source,
                where_,
                key,
                known,
                "Nanotron's config loader rejects it (0.2's and main's alike)",
                suggestion=close,
            )
        unread.append(f"{where}.{key}" if where else str(key))
    return unread


def _has(schema: dict[str, Any], dotted: str) -> bool:
    node: Any = schema
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def installed_nanotron_keys() -> dict[str, Any] | None:
    """The keys of the installed Nanotron's ``Config`` (None when none can be imported). Imports Nanotron, hence
    torch: for the launcher and ``train``, which import them anyway."""
    try:
        from nanotron.config import Config
    except ImportError:
        return None
    return dataclass_keys(Config)


def dataclass_keys(cls: type) -> dict[str, Any]:
    """Keys of a config dataclass such as Nanotron's ``Config``: a nested dataclass (also inside a union or a
    list) becomes a mapping of its keys, unions merged; anything else None. How the stored tables were made."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        subs = [
            b
            for a in (typing.get_args(hints[f.name]) or (hints[f.name],))
            for b in (typing.get_args(a) or (a,))
            if dataclasses.is_dataclass(b)
        ]
        if subs:
            merged: dict[str, Any] = {}
            for sub in subs:
                for key, value in dataclass_keys(sub).items():
                    merged[key] = value if merged.get(key) is None else merged[key]
            out[f.name] = merged
        else:
            out[f.name] = None
    return out
