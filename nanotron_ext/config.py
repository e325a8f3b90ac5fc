"""Read a Nanotron YAML: the model and run shape the planner needs, plus our own keys.

Our keys live in the same file so a user keeps one config:

* ``parallelism.cost_strategy`` — next to ``pp``, the one key most users set;
* a top-level ``nanotron_ext:`` section for everything else (strategy options, freezing, memory cap).

Both are removed from the dict handed to Nanotron's strict (dacite) loader, which would reject them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from nanotron_ext import config_keys, config_values
from nanotron_ext.config_ext import (
    DEFAULT_MEMORY_OVERHEAD_GIB,
    DEFAULT_STRATEGY,
    EXT_KEYS,
    EXT_SECTION,
    OBJECTIVES,
    VOCAB_SHARDS_AUTO,
    BlockTimes,
    ExtConfig,
    MemoryRuntime,
    ResumePlan,
)
from nanotron_ext.config_shapes import DTYPE_BYTES, DType, ModelShape, RunShape
from nanotron_ext.errors import ConfigError, check_positive_int
from nanotron_ext.families import model_family, moe_shape

# Our keys' types live in config_ext and the shapes in config_shapes; they are re-exported here, where the rest of the
# package reads a config.
__all__ = [
    "BlockTimes",
    "MemoryRuntime",
    "OBJECTIVES",
    "ResumePlan",
    "DEFAULT_STRATEGY",
    "DTYPE_BYTES",
    "DEFAULT_MEMORY_OVERHEAD_GIB",
    "DType",
    "EXT_KEYS",
    "EXT_SECTION",
    "ExtConfig",
    "ModelShape",
    "PlannerConfig",
    "RunShape",
    "VOCAB_SHARDS_AUTO",
    "bundled_config",
    "config_from_dict",
    "load_config",
    "split_ext_keys",
    "vocab_shard_candidates",
]


@dataclass(frozen=True)
class PlannerConfig:
    """Everything the planner reads from one YAML file.

    Attributes:
        model: the model shape.
        run: parallelism and batch shape.
        ext: our keys.
        nanotron: the YAML as a dict with our keys removed, ready for Nanotron's loader.
        source: where it came from, for messages.
    """

    model: ModelShape
    run: RunShape
    ext: ExtConfig = field(default_factory=ExtConfig)
    nanotron: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    source: str = "<dict>"

    def __post_init__(self) -> None:
        k = self.ext.vocab_shards
        if isinstance(k, int) and k > 1:
            if k > self.model.vocab_size:
                raise ConfigError(
                    f"{self.source}: nanotron_ext.vocab_shards={k} is more than the vocabulary size "
                    f"{self.model.vocab_size}: a shard would hold no row; use at most {self.model.vocab_size}"
                )
            if self.model.tie_word_embeddings:
                raise ConfigError(
                    f"{self.source}: nanotron_ext.vocab_shards={k} with tie_word_embeddings: true is not supported "
                    f"(a shard would need a slice of the tied embedding, which Nanotron ties only as a whole "
                    f"parameter); set model_config.tie_word_embeddings: false to untie, or vocab_shards: 1"
                )

    @property
    def vocab_shards(self) -> int:
        """The number of vocabulary-shard blocks (1: Nanotron's lm_head, cast and loss).

        Raises:
            ConfigError: still ``auto``; resolve it with :func:`nanotron_ext.plan.resolve_vocab_shards`.
        """
        k = self.ext.vocab_shards
        if k == VOCAB_SHARDS_AUTO:
            raise ConfigError(
                f"{self.source}: nanotron_ext.vocab_shards is 'auto' and was not resolved; call "
                f"nanotron_ext.plan.resolve_vocab_shards(cfg) first, or set a number"
            )
        return int(k)

    def with_overrides(
        self,
        *,
        cost_strategy: str | None = None,
        pp: int | None = None,
        n_micro_batches: int | None = None,
        engine: str | None = None,
        **ext: Any,
    ) -> PlannerConfig:
        """A copy with command-line overrides applied (they win over the YAML); ``n_micro_batches`` replaces
        ``tokens.batch_accumulation_per_replica``, ``engine`` ``parallelism.pp_engine``.

        Raises:
            ConfigError: an unknown engine (naming the choices).
        """
        run = self.run if pp is None else dataclasses.replace(self.run, pp=pp)
        if n_micro_batches is not None:
            run = dataclasses.replace(run, n_micro_batches=n_micro_batches)
        if engine is not None:
            run = dataclasses.replace(run, engine=engine)  # RunShape checks the name
        changes = {k: v for k, v in ext.items() if v is not None}
        if cost_strategy is not None:
            changes["cost_strategy"] = cost_strategy
        new_ext = dataclasses.replace(self.ext, **changes) if changes else self.ext
        nanotron = copy.deepcopy(self.nanotron)
        if pp is not None and "parallelism" in nanotron:
            nanotron["parallelism"]["pp"] = pp
        if n_micro_batches is not None and "tokens" in nanotron:
            nanotron["tokens"]["batch_accumulation_per_replica"] = n_micro_batches
        if engine is not None and "parallelism" in nanotron:
            nanotron["parallelism"]["pp_engine"] = engine
        return dataclasses.replace(self, run=run, ext=new_ext, nanotron=nanotron)


def vocab_shard_candidates(cfg: PlannerConfig) -> list[int]:
    """K values ``vocab_shards: auto`` tries (and ``calibrate`` measures): 1, 2, 3, 4, 6, 8, 12, 16 up to ``2·pp``
    (more shards than that only add hops) and the vocabulary size; only 1 for a model with tied embeddings (see
    ``PlannerConfig``)."""
    if cfg.model.tie_word_embeddings:
        return [1]
    limit = min(2 * cfg.run.pp, cfg.model.vocab_size)
    return [k for k in (1, 2, 3, 4, 6, 8, 12, 16) if k == 1 or k <= limit]


def bundled_config(name: str = "tiny_llama_large_vocab.yaml") -> Path:
    """Path of a config shipped with the package (the default of ``plan``, ``simulate`` and ``train``)."""
    return Path(str(resources.files("nanotron_ext") / "configs" / name))


def load_config(
    path: str | Path,
    *,
    cost_strategy: str | None = None,
    pp: int | None = None,
    nanotron_keys: dict[str, Any] | None = None,
) -> PlannerConfig:
    """Load a Nanotron YAML with our keys.

    Args:
        path: the YAML file.
        cost_strategy: overrides the YAML's ``cost_strategy`` (the ``--cost-strategy`` flag).
        pp: overrides ``parallelism.pp``.
        nanotron_keys: the keys of the Nanotron that will load the file
            (:func:`nanotron_ext.config_keys.installed_nanotron_keys`), known on top of 0.2's and main's: where
            that Nanotron reads a key, it is not ours to refuse or warn about.

    Returns:
        The parsed config; ``.nanotron`` holds the dict Nanotron's own loader accepts.

    Raises:
        ConfigError: the file is missing or malformed, a required key is missing, one of our keys is unknown or
            a key is a near miss of a known one (keys no Nanotron reads are a
            :class:`~nanotron_ext.config_keys.UnreadKeyWarning`).
    """
    path = Path(path)
    raw = config_keys.parse_yaml(config_keys.read_config_text(path), str(path))
    cfg = config_from_dict(raw, source=str(path), nanotron_keys=nanotron_keys)
    if cost_strategy is not None or pp is not None:
        cfg = cfg.with_overrides(cost_strategy=cost_strategy, pp=pp)
    return cfg


def config_from_dict(raw: Any, *, source: str = "<dict>", nanotron_keys: dict[str, Any] | None = None) -> PlannerConfig:
    """Parse an already-loaded YAML dict; see :func:`load_config`."""
    if raw is None:
        raise ConfigError(
            f"{source} is empty (no YAML in it); start from a Nanotron YAML such as "
            f"examples/configs/tiny_llama_large_vocab.yaml"
        )
    if not isinstance(raw, dict):
        raise config_values.not_a_mapping(
            "the top level", raw, "model: {...}, parallelism: {...}, tokens: {...}", source=source
        )
    model_config = (raw.get("model") or {}).get("model_config") if isinstance(raw.get("model"), dict) else None
    if isinstance(model_config, dict):
        model_family(model_config, source=source)  # a family we cannot price says so before its keys are checked
    config_keys.check_keys(raw, source, ext_section=EXT_SECTION, installed=nanotron_keys)
    config_values.check_values(raw, source, ext_section=EXT_SECTION)
    nanotron, ext = split_ext_keys(raw, source=source)  # our section's keys are checked there, once

    def get(dotted: str, default: Any = config_values.REQUIRED) -> Any:
        return config_values.get_dotted(nanotron, dotted, default, source=source)

    model = _model_shape(get, source)
    run = RunShape(
        dp=get("parallelism.dp"),
        pp=get("parallelism.pp"),
        tp=get("parallelism.tp"),
        sequence_length=get("tokens.sequence_length"),
        micro_batch_size=get("tokens.micro_batch_size"),
        n_micro_batches=get("tokens.batch_accumulation_per_replica"),
        engine=str(get("parallelism.pp_engine", default="afab")).lower(),
        dtype=str(get("model.dtype", default="bfloat16")),
        zero_stage=get("optimizer.zero_stage", default=0),
        accumulate_grad_in_fp32=bool(get("optimizer.accumulate_grad_in_fp32", default=False)),
        tp_mode=str(get("parallelism.tp_mode", default="ALL_REDUCE")).upper().removeprefix("TENSORPARALLELLINEARMODE."),
        tp_async=bool(get("parallelism.tp_linear_async_communication", default=False)),
        torch_adam_is_fused=bool(_adam_fused(nanotron)),
        recompute_layer=get("parallelism.recompute_layer", default=False),
        tp_recompute_allgather=get("parallelism.tp_recompute_allgather", default=True),
    )
    return PlannerConfig(model=model, run=run, ext=ext, nanotron=nanotron, source=source)


def _adam_fused(nanotron: dict[str, Any]) -> bool:
    # Nanotron 0.2 keeps torch_adam_is_fused next to the other optimizer keys; upstream main under
    # optimizer.optimizer_factory.
    opt = nanotron.get("optimizer") or {}
    if not isinstance(opt, dict):
        return False
    factory = opt.get("optimizer_factory") or {}
    return bool(opt.get("torch_adam_is_fused") or (isinstance(factory, dict) and factory.get("torch_adam_is_fused")))


def split_ext_keys(raw: dict[str, Any], *, source: str = "<dict>") -> tuple[dict[str, Any], ExtConfig]:
    """Remove our keys from a Nanotron YAML dict.

    Returns:
        (the dict for Nanotron's strict loader, our parsed keys).

    Raises:
        ConfigError: an unknown key in our section, or ``cost_strategy`` given twice with different values.
    """
    nanotron = copy.deepcopy(raw)
    section = nanotron.pop(EXT_SECTION, None) or {}
    if not isinstance(section, dict):
        raise config_values.not_a_mapping(
            EXT_SECTION, section, f"{EXT_SECTION}: {{allow_frozen_stages: true}}", source=source
        )
    config_keys.check_ext_section(section, source, ext_keys=EXT_KEYS, ext_section=EXT_SECTION)
    parallelism = nanotron.get("parallelism")
    if isinstance(parallelism, dict) and "cost_strategy" in parallelism:
        value = parallelism.pop("cost_strategy")
        if "cost_strategy" in section and section["cost_strategy"] != value:
            raise ConfigError(
                f"{source}: cost_strategy is {value!r} under 'parallelism:' but {section['cost_strategy']!r} "
                f"under '{EXT_SECTION}:'; keep one of them"
            )
        section = {**section, "cost_strategy": value}
    return nanotron, ExtConfig(**section)


def _model_shape(get: Callable[..., Any], source: str) -> ModelShape:
    """The model's shape and family from ``model.model_config`` (family keys as Nanotron's config classes name them);
    ``get(dotted, default)`` reads the YAML."""
    model_cfg = get("model.model_config")
    if not isinstance(model_cfg, dict):
        raise config_values.not_a_mapping(
            "model.model_config",
            model_cfg,
            "model_config: {hidden_size: 576, num_hidden_layers: 30, ...}",
            source=source,
        )
    family = model_family(model_cfg, source=source)
    hidden = get("model.model_config.hidden_size")
    layers = get("model.model_config.num_hidden_layers")
    if family == "starcoder2":
        # Starcoder2Config: MQA (one kv head) unless grouped_query names num_kv_heads; embeddings always tied.
        kv_heads = model_cfg.get("num_kv_heads") if model_cfg.get("grouped_query") else 1
        intermediate = model_cfg.get("intermediate_size") or (4 * hidden if isinstance(hidden, int) else hidden)
        tied, eps = True, model_cfg.get("layer_norm_epsilon", 1e-5)
    else:
        kv_heads = model_cfg.get("num_key_value_heads")
        intermediate = get("model.model_config.intermediate_size")
        tied, eps = bool(model_cfg.get("tie_word_embeddings", False)), model_cfg.get("rms_norm_eps", 1e-6)
    return ModelShape(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=get("model.model_config.num_attention_heads"),
        vocab_size=_padded_vocab(
            get("model.model_config.vocab_size"),
            get("model.make_vocab_size_divisible_by", default=1),
            get("parallelism.tp"),
        ),
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        max_position_embeddings=model_cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=float(eps),
        family=family,
        attention_bias=family == "qwen2" and bool(model_cfg.get("attention_bias", False)),
        fused_rms_norm=family != "qwen2" or model_cfg.get("_fused_rms_norm", True) is not False,
        moe=moe_shape(family, model_cfg, layers, source=source) if isinstance(layers, int) and layers > 0 else None,
    )


def _padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    # Nanotron's trainer pads the vocabulary before building the model; plan what it will build.
    check_positive_int("model_config.vocab_size", vocab)
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-vocab // multiple) * multiple
