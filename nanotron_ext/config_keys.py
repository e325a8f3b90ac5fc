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

``NANOTRON_SCHEMA`` is Nanotron 0.2's config layout (``nanotron.config.Config`` and its nested dataclasses; the
model config is the union of the model families' keys). It is written out rather than imported, because
importing ``nanotron`` pulls in torch, which planning never needs; ``tests/test_bad_input.py`` checks it
against the installed Nanotron.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import yaml

from nanotron_ext.errors import ConfigError

__all__ = ["EXT_KEYS", "FREEZE_KEYS", "NANOTRON_SCHEMA", "check_keys", "check_values", "parse_yaml", "read_config_text"]

#: Keys of our ``nanotron_ext:`` section (the fields of ``config.ExtConfig``; a test keeps them in step).
EXT_KEYS = frozenset({
    "cost_strategy", "base_strategy", "layout", "memory_cap_gib", "allow_frozen_stages", "projector", "freeze",
    "profile_cache",
})
#: Keys of ``nanotron_ext.freeze:``.
FREEZE_KEYS = frozenset({"modules", "unfreeze", "unfreeze_last_decoder_layers"})
#: Our key that may also sit under ``parallelism:``.
PARALLELISM_EXT_KEYS = frozenset({"cost_strategy"})

_PARALLELISM = {k: None for k in (
    "dp", "expert_parallel_size", "pp", "pp_engine", "recompute_granularity", "tp", "tp_linear_async_communication",
    "tp_mode")}

#: Nanotron 0.2's ``Config``: section → its keys (a dict for a nested dataclass, None for a plain value).
NANOTRON_SCHEMA: dict[str, Any] = {
    "checkpoints": dict.fromkeys((
        "checkpoint_interval", "checkpoints_path", "checkpoints_path_is_shared_file_system",
        "resume_checkpoint_path", "save_initial_state")),
    "data": {
        "dataset": dict.fromkeys((
            "dataset_overwrite_cache", "dataset_processing_num_proc_per_process", "hf_dataset_config_name",
            "hf_dataset_or_datasets", "hf_dataset_splits", "text_column_name")),
        "num_loading_workers": None, "seed": None,
    },
    "general": dict.fromkeys((
        "benchmark_csv_path", "consumed_train_samples", "ignore_sanity_checks", "project", "run", "seed", "step")),
    "lighteval": {
        "batch_size": None, "checkpoints_path": None,
        "generation": dict.fromkeys(("eos", "n_samples", "sampler", "seed", "temperature", "top_k", "top_p",
                                     "use_cache")),
        "logging": dict.fromkeys((
            "hub_repo_details", "hub_repo_results", "hub_repo_tensorboard", "local_output_path",
            "push_details_to_hub", "push_results_to_hub", "push_results_to_tensorboard",
            "tensorboard_metric_prefix")),
        "parallelism": dict(_PARALLELISM),
        "slurm_script_dir": None, "slurm_template": None,
        "tasks": dict.fromkeys((
            "custom_tasks", "dataset_loading_processes", "max_samples", "multichoice_continuations_start_space",
            "no_multichoice_continuations_start_space", "num_fewshot_seeds", "tasks")),
        "wandb": dict.fromkeys(("wandb_entity", "wandb_project", "wandb_run_name")),
    },
    "logging": dict.fromkeys(("iteration_step_info_interval", "log_level", "log_level_replica")),
    "model": {
        "ddp_bucket_cap_mb": None, "dtype": None,
        "init_method": dict.fromkeys(("path", "std")),
        "make_vocab_size_divisible_by": None,
        "model_config": dict.fromkeys((
            "activation_function", "attention_softmax_in_fp32", "attn_pdrop", "bos_token_id", "embd_pdrop",
            "eos_token_id", "global_attn_layers", "grouped_query", "hidden_act", "hidden_size", "initializer_range",
            "intermediate_size", "is_llama_config", "is_starcoder2_config", "layer_norm_epsilon",
            "max_position_embeddings", "multi_query", "num_attention_heads", "num_hidden_layers",
            "num_key_value_heads", "num_kv_heads", "pad_token_id", "pretraining_tp", "resid_pdrop", "rms_norm_eps",
            "rope_scaling", "rope_theta", "scale_attention_softmax_in_fp32", "scale_attn_weights",
            "sliding_window_size", "tie_word_embeddings", "use_cache", "use_position_embeddings",
            "use_rotary_embeddings", "vocab_size")),
    },
    "optimizer": {
        "accumulate_grad_in_fp32": None, "adam_beta1": None, "adam_beta2": None, "adam_eps": None, "clip_grad": None,
        "learning_rate_scheduler": dict.fromkeys((
            "learning_rate", "lr_decay_starting_step", "lr_decay_steps", "lr_decay_style", "lr_warmup_steps",
            "lr_warmup_style", "min_decay_lr")),
        "torch_adam_is_fused": None, "weight_decay": None, "zero_stage": None,
    },
    "parallelism": dict(_PARALLELISM),
    "profiler": dict.fromkeys(("profiler_export_path",)),
    "tokenizer": dict.fromkeys(("tokenizer_max_length", "tokenizer_name_or_path", "tokenizer_revision")),
    "tokens": dict.fromkeys((
        "batch_accumulation_per_replica", "limit_test_batches", "limit_val_batches", "micro_batch_size",
        "sequence_length", "train_steps", "val_check_interval")),
}


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


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping."""


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
            raise ConfigError(
                f"{loader.name}: key {key!r} appears twice in one mapping (line {seen[key] + 1} and line "
                f"{key_node.start_mark.line + 1}); YAML would silently keep the last one. Delete one of them"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text, refusing duplicate keys.

    Raises:
        ConfigError: malformed YAML or a key given twice.
    """
    loader = _StrictLoader(text)
    loader.name = source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: malformed YAML: {' '.join(str(exc).split())}; fix the YAML syntax") from None
    finally:
        loader.dispose()


def _suggest(key: Any, known: set[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(known), n=1, cutoff=0.6)
    listed = f"known keys are {', '.join(sorted(known))}" if len(known) <= 12 else ""
    if close:
        return f"did you mean {close[0]!r}?" + (f" ({listed})" if listed else "")
    return listed or "remove it or check the spelling against Nanotron's config"


def _unknown(source: str, where: str, key: Any, known: set[str] | frozenset[str], why: str) -> ConfigError:
    return ConfigError(f"{source}: unknown key(s) {key!r} in {where}: {why}; {_suggest(key, known)}")


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
                raise _unknown(source, f"'{ext_section}:'", key, EXT_KEYS, "nanotron_ext has no such option")
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


def _get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return None
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
        value = _get(raw, dotted)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{source}: {dotted}={value!r} must be a positive integer; write e.g. "
                              f"{dotted.rsplit('.', 1)[-1]}: 1")
    for dotted in _POSITIVE_NUMBERS:
        value = _get(raw, dotted)
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
    tp = _get(raw, "parallelism.tp")
    for heads_key in ("num_attention_heads", "num_key_value_heads"):
        heads = _get(raw, f"model.model_config.{heads_key}")
        if isinstance(tp, int) and isinstance(heads, int) and tp > 1 and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ConfigError(
                f"{source}: parallelism.tp={tp} does not divide model_config.{heads_key}={heads}: tensor "
                f"parallelism gives every rank the same number of heads (Nanotron asserts it). Use tp in "
                f"{{{', '.join(map(str, divisors))}}}"
            )
