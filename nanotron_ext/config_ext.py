"""Our own keys of a Nanotron YAML (the ``nanotron_ext:`` section, and ``cost_strategy`` next to ``pp``): their
types, defaults and checks, and the one check of a value against its choices (:func:`check_choice`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from nanotron_ext.config_keys import not_a_mapping, unknown_key
from nanotron_ext.errors import ConfigError, suggest

__all__ = [
    "BlockTimes",
    "DEFAULT_MEMORY_OVERHEAD_GIB",
    "DEFAULT_STRATEGY",
    "EXT_KEYS",
    "EXT_SECTION",
    "ExtConfig",
    "MemoryRuntime",
    "OBJECTIVES",
    "REPLAN_KEYS",
    "ReplanConfig",
    "ReplanEngine",
    "ResumePlan",
    "VOCAB_SHARDS_AUTO",
    "check_choice",
    "replan_after_steps",
]

#: Where the memory estimate's plan runs: Nanotron's trainer on CUDA, or this package's CPU runtime.
MemoryRuntime = Literal["gpu", "cpu"]
#: Where block times come from (``nanotron_ext.times``; ``--times``).
BlockTimes = Literal["machine", "flops", "profiled"]
#: What a resume trains (``nanotron_ext.resume_plan``; ``--replan``): the checkpoint's recorded split, or a new plan.
ResumePlan = Literal["keep", "replan"]
#: Which engines a re-plan after K steps may move to (``nanotron_ext.replan.engine``): the run's own, or any
#: contiguous one ``pp_engine: auto`` would consider.
ReplanEngine = Literal["keep", "auto"]
#: ``memory_overhead_gib`` when not given, per runtime: on a GPU the CUDA context (~0.5 GiB), NCCL's
#: communicator buffers and the caching allocator's fragmentation are not tensors; on CPU the measured
#: quantity is torch's live tensor bytes, so nothing is added.
DEFAULT_MEMORY_OVERHEAD_GIB: dict[str, float] = {"gpu": 1.0, "cpu": 0.0}
EXT_SECTION = "nanotron_ext"
DEFAULT_STRATEGY = "constrained"

#: ``nanotron_ext.vocab_shards: auto``: the planner picks the number of vocabulary shards.
VOCAB_SHARDS_AUTO = "auto"

#: What the optimal strategies minimise (``nanotron_ext.objective``).
OBJECTIVES: tuple[str, ...] = ("step_time", "slowest_stage")


def replan_after_steps(value: object, name: str) -> int:
    """The one rule of K, the step after which a run re-plans, for the YAML's key and the flag alike (``name``: what
    the user wrote, ``nanotron_ext.replan.after_steps`` or ``--replan-after``): a whole number of at least 2.

    Raises:
        ConfigError: anything else, naming ``name`` and the value, with an example.
    """
    flag = name.startswith("-")  # a flag's value is its text; the YAML's is typed
    k = int(value) if flag and isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        typed = f"{name} {value}" if flag else f"{name}={value!r}"
        example = "--replan-after 20" if flag else "replan: {after_steps: 20}"
        raise ConfigError(
            f"{typed} must be a whole number of at least 2 (step 1 pays one-off costs and is not timed; the steps "
            f"after it price the run), e.g. {example}"
        )
    return k


@dataclass(frozen=True)
class ReplanConfig:
    """``nanotron_ext.replan``: after ``after_steps`` steps a run prices itself from its own steps, tries the plans
    worth trying against its own in turns and keeps the one it measured faster (``docs/replan.md``).

    Attributes:
        after_steps: the step after which the run re-plans; None: never (the default).
        min_gain: the least gain, a fraction of the step, worth a move: a plan is tried where the profile, at its
            error, could reach it, and kept where the trial measured it.
        engine: ``keep`` the run's engine, or let the re-plan pick among the contiguous engines (``auto``);
            None: ``auto`` where the config's ``pp_engine`` is ``auto``, else ``keep``.
        trials: the most plans tried against the run's own (the fastest first, then those within the profile's
            error of it).
        turn_steps: timed steps per turn of the trial (each after one untimed step; twice as many in the middle).
    """

    after_steps: int | None = None
    min_gain: float = 0.03
    engine: ReplanEngine | None = None
    trials: int = 2
    turn_steps: int = 2

    def __post_init__(self) -> None:
        if self.after_steps is not None:
            replan_after_steps(self.after_steps, f"{EXT_SECTION}.replan.after_steps")
        g = self.min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and 0 <= g < 1):
            raise ConfigError(
                f"{EXT_SECTION}.replan.min_gain={g!r} must be a fraction of the step in [0, 1), "
                f"e.g. 0.03 to move only for a gain of 3 % or more"
            )
        if self.engine is not None:
            check_choice(f"{EXT_SECTION}.replan.engine", self.engine, ReplanEngine)
        for key, example in (("trials", "trials: 2"), ("turn_steps", "turn_steps: 2")):
            n = getattr(self, key)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(
                    f"{EXT_SECTION}.replan.{key}={n!r} must be a whole number of at least 1 (a plan is kept only "
                    f"where a trial measured it), e.g. {example}"
                )

    @classmethod
    def from_yaml(cls, value: Any) -> ReplanConfig:
        """The ``replan:`` mapping of a YAML (or an instance, unchanged).

        Raises:
            ConfigError: not a mapping; a key it does not know (with the closest one); a bad value.
        """
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise not_a_mapping(
                f"{EXT_SECTION}.replan", value, "replan: {after_steps: 20, min_gain: 0.03}", see="docs/replan.md"
            )
        for key in value:
            if key not in REPLAN_KEYS:
                raise unknown_key(
                    None, f"'{EXT_SECTION}.replan:'", key, REPLAN_KEYS, "replan has no such option", spell_out=True
                )
        return cls(**value)


#: Keys of ``nanotron_ext.replan``.
REPLAN_KEYS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ReplanConfig))


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
        replan: re-plan after K steps of a run (:class:`ReplanConfig`; a mapping in the YAML).
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
    replan: ReplanConfig = dataclasses.field(default_factory=ReplanConfig)

    @property
    def overhead_gib(self) -> float:
        """The overhead allowance in effect (the default of ``memory_runtime`` when not set)."""
        if self.memory_overhead_gib is not None:
            return float(self.memory_overhead_gib)
        return DEFAULT_MEMORY_OVERHEAD_GIB[self.memory_runtime]

    def __post_init__(self) -> None:
        object.__setattr__(self, "replan", ReplanConfig.from_yaml(self.replan))  # frozen: the YAML's mapping, typed
        k = self.vocab_shards
        if k != VOCAB_SHARDS_AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"nanotron_ext.vocab_shards={k!r} is neither a positive integer nor 'auto'; "
                f"{suggest(k, [VOCAB_SHARDS_AUTO]) if isinstance(k, str) else ''}write 1 to keep "
                f"one lm_head block, K > 1 to split the vocabulary into K blocks (e.g. vocab_shards: 2), or auto to "
                f"let the planner pick"
            )
        if self.memory_runtime not in get_args(MemoryRuntime):
            raise ConfigError(
                f"nanotron_ext.memory_runtime={self.memory_runtime!r} is unknown; "
                f"{suggest(self.memory_runtime, get_args(MemoryRuntime))}use gpu (Nanotron's trainer) or cpu "
                f"(nanotron-ext train)"
            )
        default = f"the default ({DEFAULT_MEMORY_OVERHEAD_GIB['gpu']:g} GiB on gpu)"
        _check_amount("memory_overhead_gib", self.memory_overhead_gib, "GiB", 1.5, default, zero_ok=True)
        check_choice(f"{EXT_SECTION}.objective", self.objective, OBJECTIVES)
        _check_amount("p2p_gbps", self.p2p_gbps, "GB/s", 50, "the machine profile's links")
        _check_amount("tflops", self.tflops, "TFLOP/s", 400, "the machine profile's block times")
        check_choice(f"{EXT_SECTION}.times", self.times, BlockTimes)
        check_choice(f"{EXT_SECTION}.resume_plan", self.resume_plan, ResumePlan)
        if self.times == "profiled" and self.tflops is not None:
            raise ConfigError(
                "nanotron_ext.times=profiled measures block times; tflops would replace them with a "
                "FLOP rate. Drop one of the two"
            )
        if self.machine is not None and (not isinstance(self.machine, str) or not self.machine):
            raise ConfigError(
                f"{EXT_SECTION}.machine={self.machine!r} must be the path of a machine profile "
                f"(JSON from `nanotron-ext calibrate`), or null"
            )
        if not isinstance(self.cost_strategy, str) or not self.cost_strategy:
            raise ConfigError(f"cost_strategy={self.cost_strategy!r} must be a non-empty strategy name")
        if self.base_strategy == "constrained":
            raise ConfigError("nanotron_ext.base_strategy='constrained' would recurse; use flops, memory or uniform")
        _check_amount("memory_cap_gib", self.memory_cap_gib, "GiB", 70, "the machine's device memory")
        for name in ("allow_frozen_stages", "projector"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"nanotron_ext.{name}={getattr(self, name)!r} must be true or false")
        if self.freeze is not None and not isinstance(self.freeze, dict):
            # The user's own word as the pattern: `freeze: decoder` most likely means freeze the decoder.
            word = self.freeze if isinstance(self.freeze, str) else "decoder"
            raise not_a_mapping(
                f"{EXT_SECTION}.freeze",
                self.freeze,
                f"freeze: {{modules: [{word}], unfreeze: [lm_head]}}",
                see="docs/freezing.md",
            )


def _check_amount(key: str, value: Any, unit: str, example: float, otherwise: str, *, zero_ok: bool = False) -> None:
    """The one check of an amount one of our keys takes (GiB, GB/s, TFLOP/s): null, or a finite number above 0 (at or
    above 0 with ``zero_ok``), never true or false; the error gives an example and what null means."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (value == 0 and not zero_ok):
        kind = f"a number of {unit} >= 0" if zero_ok else f"a positive number of {unit}"
        raise ConfigError(
            f"{EXT_SECTION}.{key}={value!r} must be {kind}, e.g. {key}: {example:g}, or null for {otherwise}"
        )


#: Keys of our ``nanotron_ext:`` section: the fields of :class:`ExtConfig`, so a new option is a new field only.
EXT_KEYS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ExtConfig))


def check_choice(name: str, value: Any, choices: Any) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (a ``Literal`` or a tuple), with "did you mean".

    Raises:
        ConfigError: ``{name}={value!r} is not one of ...``, with the closest choice first.
    """
    allowed = get_args(choices) or tuple(choices)
    if value not in allowed:
        raise ConfigError(
            f"{name}={value!r} is not one of {', '.join(allowed)}; {suggest(value, allowed)}write one of them"
        )
