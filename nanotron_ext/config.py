"""Read a Nanotron YAML: the model and run shape the planner needs, plus our own keys.

Our keys live in the same file so a user keeps one config:

* ``parallelism.cost_strategy`` — next to ``pp``, the one key most users set;
* a top-level ``nanotron_ext:`` section for everything else (strategy options, freezing, memory cap).

Both are removed from the dict handed to Nanotron's strict (dacite) loader, which would reject them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from nanotron_ext import config_keys
from nanotron_ext.errors import ConfigError, check_positive_int
from nanotron_ext.families import Family, MoEShape, model_family, moe_shape
from nanotron_ext.schedule import Engine

__all__ = [
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

DType = Literal["float32", "bfloat16", "float16"]
TPMode = Literal["ALL_REDUCE", "REDUCE_SCATTER"]
#: Where the memory estimate's plan runs: Nanotron's trainer on CUDA, or this package's CPU runtime.
MemoryRuntime = Literal["gpu", "cpu"]
#: Where block times come from (``nanotron_ext.times``; ``--times``).
BlockTimes = Literal["machine", "flops", "profiled"]
#: What a resume trains (``nanotron_ext.resume_plan``; ``--replan``): the checkpoint's recorded split, or a new plan.
ResumePlan = Literal["keep", "replan"]
#: ``memory_overhead_gib`` when not given, per runtime: on a GPU the CUDA context (~0.5 GiB), NCCL's
#: communicator buffers and the caching allocator's fragmentation are not tensors; on CPU the measured
#: quantity is torch's live tensor bytes, so nothing is added.
DEFAULT_MEMORY_OVERHEAD_GIB: dict[str, float] = {"gpu": 1.0, "cpu": 0.0}
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
EXT_SECTION = "nanotron_ext"
DEFAULT_STRATEGY = "constrained"


@dataclass(frozen=True)
class ModelShape:
    """The shape fields the planner prices (Nanotron's ``LlamaConfig`` names), and the model family.

    Attributes:
        family: ``llama``, ``qwen2``, ``starcoder2`` or ``llamoe`` (:mod:`nanotron_ext.families`).
        attention_bias: Qwen2's qkv projection has a bias.
        moe: the mixture-of-experts layers, None for a dense model.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    family: Family = "llama"
    attention_bias: bool = False
    moe: MoEShape | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            check_positive_int(f"model_config.{name}", getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        check_positive_int("model_config.num_key_value_heads", self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model_config.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model_config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs an integer group size"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def moe_layer(self, layer: int | None) -> bool:
        """Whether decoder layer ``layer`` is a mixture of experts."""
        return self.moe is not None and layer is not None and layer in self.moe.layers


@dataclass(frozen=True)
class RunShape:
    """Parallelism and batch shape of one training step."""

    dp: int
    pp: int
    tp: int
    sequence_length: int
    micro_batch_size: int
    n_micro_batches: int  # Nanotron's tokens.batch_accumulation_per_replica
    engine: Engine = "afab"  # Nanotron's default pp_engine
    dtype: DType = "bfloat16"
    zero_stage: int = 0
    accumulate_grad_in_fp32: bool = False
    tp_mode: TPMode = "ALL_REDUCE"  # Nanotron's parallelism.tp_mode (REDUCE_SCATTER: sequence parallel)
    tp_async: bool = False  # parallelism.tp_linear_async_communication
    torch_adam_is_fused: bool = False  # optimizer.torch_adam_is_fused

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "sequence_length", "micro_batch_size", "n_micro_batches"):
            check_positive_int(name, getattr(self, name))
        _check_choice("parallelism.pp_engine", self.engine, Engine)
        _check_choice("model.dtype", self.dtype, DType)
        _check_choice("parallelism.tp_mode", self.tp_mode, TPMode)
        if self.zero_stage not in (0, 1):
            raise ConfigError(f"optimizer.zero_stage={self.zero_stage!r}: Nanotron supports 0 or 1")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.sequence_length * self.micro_batch_size


#: ``nanotron_ext.vocab_shards: auto``: the planner picks the number of vocabulary shards.
VOCAB_SHARDS_AUTO = "auto"

#: What the optimal strategies minimise (``nanotron_ext.objective``).
OBJECTIVES: tuple[str, ...] = ("step_time", "slowest_stage")


@dataclass(frozen=True)
class ExtConfig:
    """Our keys: how to split the model across pipeline stages.

    Attributes:
        cost_strategy: registered strategy name or ``package.module:attr``.
        base_strategy: what ``constrained`` balances (``flops``, ``memory``, ``uniform``...).
        layout: per-stage layout string for the ``layout`` strategy, e.g. ``"E,t*5|t*6,L"``.
        memory_cap_gib: optional per-stage memory ceiling the partitioner must respect.
        allow_frozen_stages: let a stage hold only frozen blocks (no optimizer, no DDP there).
        projector: add a trainable projector block after the embedding (CPU model only).
        freeze: which modules to freeze (see ``nanotron_ext.inventory.freeze``); ``None`` trains everything.
        profile_cache: directory of the ``profiled`` strategy's timing cache.
        objective: what ``constrained`` (with ``base_strategy: flops``) and ``profiled`` minimise:
            ``step_time`` (default), the simulated step under the config's schedule
            (:mod:`nanotron_ext.partition.schedule_aware`), or ``slowest_stage``, the slowest stage's cost.
        machine: a machine profile (JSON from ``nanotron-ext calibrate``) that prices every block, transfer and
            sync; None: the analytic H100 model (see the machine package).
        times: where block times come from: ``machine`` (the profile's), ``flops`` (one FLOP rate for every
            block) or ``profiled`` (measured on this machine now, cached).
        tflops: override: price every block at this FLOP rate (TFLOP/s), dropping measured block times.
        p2p_gbps: override: every p2p link at this bandwidth (GB/s), keeping the profile's latency.
        memory_runtime: ``gpu`` (Nanotron's trainer: foreach AdamW unless fused) or ``cpu`` (the CPU runtime:
            single-tensor AdamW); decides the optimizer step's temporaries and the default overhead.
        memory_overhead_gib: per-stage allowance for memory that is not tensors (context, communication
            buffers, fragmentation); None: :data:`DEFAULT_MEMORY_OVERHEAD_GIB` of the runtime (1 GiB on gpu).
        vocab_shards: split lm_head + cast + loss into this many vocabulary-shard blocks (an online
            log-sum-exp chain the partitioner can spread over stages); 1 keeps Nanotron's lm_head, ``auto``
            lets the planner pick (:func:`nanotron_ext.plan.resolve_vocab_shards`).
        resume_plan: on a resume, ``keep`` trains the split the checkpoint was trained with wherever the config
            allows it (same pp and vocabulary shards), even if pricing would choose another today; ``replan``
            plans anew and moves the saved state onto the new plan (:mod:`nanotron_ext.checkpoint`).
    """

    cost_strategy: str = DEFAULT_STRATEGY
    base_strategy: str = "flops"
    layout: str | None = None
    memory_cap_gib: float | None = None
    allow_frozen_stages: bool = False
    projector: bool = False
    freeze: dict[str, Any] | None = None
    profile_cache: str | None = None
    objective: str = "step_time"
    machine: str | None = None
    times: BlockTimes = "machine"
    tflops: float | None = None
    p2p_gbps: float | None = None
    memory_runtime: str = "gpu"
    memory_overhead_gib: float | None = None
    vocab_shards: int | str = 1
    resume_plan: ResumePlan = "keep"

    @property
    def overhead_gib(self) -> float:
        """The overhead allowance in effect (the default of ``memory_runtime`` when not set)."""
        if self.memory_overhead_gib is not None:
            return float(self.memory_overhead_gib)
        return DEFAULT_MEMORY_OVERHEAD_GIB[self.memory_runtime]

    def __post_init__(self) -> None:
        k = self.vocab_shards
        if k != VOCAB_SHARDS_AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"nanotron_ext.vocab_shards={k!r} is neither a positive integer nor 'auto'; write 1 to keep "
                f"one lm_head block, K > 1 to split the vocabulary into K blocks, or auto to let the planner pick"
            )
        if self.memory_runtime not in get_args(MemoryRuntime):
            raise ConfigError(
                f"nanotron_ext.memory_runtime={self.memory_runtime!r} is unknown; use gpu (Nanotron's trainer) or "
                f"cpu (nanotron-ext train)"
            )
        if self.memory_overhead_gib is not None and not (
            isinstance(self.memory_overhead_gib, (int, float)) and not isinstance(self.memory_overhead_gib, bool)
            and math.isfinite(self.memory_overhead_gib) and self.memory_overhead_gib >= 0
        ):
            raise ConfigError(
                f"nanotron_ext.memory_overhead_gib={self.memory_overhead_gib!r} must be a number of GiB >= 0, or null "
                f"for the default ({DEFAULT_MEMORY_OVERHEAD_GIB['gpu']:g} GiB on gpu)"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"nanotron_ext.objective={self.objective!r} is unknown; use one of {', '.join(OBJECTIVES)}"
            )
        if self.p2p_gbps is not None and not (
            isinstance(self.p2p_gbps, (int, float)) and math.isfinite(self.p2p_gbps) and self.p2p_gbps > 0
        ):
            raise ConfigError(f"nanotron_ext.p2p_gbps={self.p2p_gbps!r} must be a positive number of GB/s, or null")
        if self.tflops is not None and not (
            isinstance(self.tflops, (int, float)) and not isinstance(self.tflops, bool)
            and math.isfinite(self.tflops) and self.tflops > 0
        ):
            raise ConfigError(f"nanotron_ext.tflops={self.tflops!r} must be a positive number of TFLOP/s, or null")
        _check_choice(f"{EXT_SECTION}.times", self.times, BlockTimes)
        _check_choice(f"{EXT_SECTION}.resume_plan", self.resume_plan, ResumePlan)
        if self.times == "profiled" and self.tflops is not None:
            raise ConfigError("nanotron_ext.times=profiled measures block times; tflops would replace them with a "
                              "FLOP rate. Drop one of the two")
        if self.machine is not None and (not isinstance(self.machine, str) or not self.machine):
            raise ConfigError(f"{EXT_SECTION}.machine={self.machine!r} must be the path of a machine profile "
                              f"(JSON from `nanotron-ext calibrate`), or null")
        if not isinstance(self.cost_strategy, str) or not self.cost_strategy:
            raise ConfigError(f"cost_strategy={self.cost_strategy!r} must be a non-empty strategy name")
        if self.base_strategy == "constrained":
            raise ConfigError("nanotron_ext.base_strategy='constrained' would recurse; use flops, memory or uniform")
        if self.memory_cap_gib is not None and not (
            isinstance(self.memory_cap_gib, (int, float)) and math.isfinite(self.memory_cap_gib) and self.memory_cap_gib > 0
        ):
            raise ConfigError(f"nanotron_ext.memory_cap_gib={self.memory_cap_gib!r} must be a positive number of GiB")
        for name in ("allow_frozen_stages", "projector"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"nanotron_ext.{name}={getattr(self, name)!r} must be true or false")
        if self.freeze is not None and not isinstance(self.freeze, dict):
            raise ConfigError(f"nanotron_ext.freeze must be a mapping, got {type(self.freeze).__name__}")


#: Keys of our ``nanotron_ext:`` section: the fields of :class:`ExtConfig`, so a new option is a new field only.
EXT_KEYS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ExtConfig))


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
        self, *, cost_strategy: str | None = None, pp: int | None = None, n_micro_batches: int | None = None,
        engine: str | None = None, **ext: Any,
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


def load_config(path: str | Path, *, cost_strategy: str | None = None, pp: int | None = None,
                nanotron_keys: dict[str, Any] | None = None) -> PlannerConfig:
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
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    model_config = (raw.get("model") or {}).get("model_config") if isinstance(raw.get("model"), dict) else None
    if isinstance(model_config, dict):
        model_family(model_config, source=source)  # a family we cannot price says so before its keys are checked
    config_keys.check_keys(raw, source, ext_section=EXT_SECTION, installed=nanotron_keys)
    config_keys.check_values(raw, source, ext_section=EXT_SECTION)
    nanotron, ext = split_ext_keys(raw, source=source)  # our section's keys are checked there, once

    def get(dotted: str, default: Any = config_keys.REQUIRED) -> Any:
        return config_keys.get_dotted(nanotron, dotted, default, source=source)

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
        raise ConfigError(f"{source}: '{EXT_SECTION}:' must be a mapping of our options")
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
        raise ConfigError(f"{source}: 'model.model_config' must be a mapping, got {type(model_cfg).__name__}")
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
        moe=moe_shape(family, model_cfg, layers, source=source) if isinstance(layers, int) and layers > 0 else None,
    )


def _padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    # Nanotron's trainer pads the vocabulary before building the model; plan what it will build.
    check_positive_int("model_config.vocab_size", vocab)
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-vocab // multiple) * multiple


def _check_choice(name: str, value: Any, choices: Any) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")
