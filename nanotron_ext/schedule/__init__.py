"""Nanotron's two pipeline engines and the zero-bubble one by name, and the one rule on micro-batches.

``1f1b`` is ``OneForwardOneBackwardPipelineEngine``, ``afab`` ``AllForwardAllBackwardPipelineEngine``
(``nanotron/parallel/pipeline_parallel/engine.py``). The 1F1B engine asserts ``nb_microbatches >= pp - 1``;
at exactly ``pp - 1`` it runs, but the pipeline never fills.

``zb1p`` is ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's program with each
backward split into its input-gradient part (``B``) and a deferred weight-gradient part (``W``); it keeps
1F1B's warm-up, so it shares 1F1B's rule on micro-batches (see ``docs/zero-bubble.md``). ``zb2p`` is ZB-H2
of the same paper: zb1p with twice 1F1B's warm-up forwards (stage ``s`` runs ``2(pp - s - 1)``, at most ``m``),
so that the first ``B`` reaches stage 0 before it idles, at the cost of up to twice 1F1B's micro-batches in
flight.

The event simulator of both engines' programs lives in :mod:`nanotron_ext.schedule.simulator` (pure Python,
planner layer: the schedule-aware partitioner evaluates splits with it; ``nanotron_ext.simulate`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "ENGINES",
    "AUTO_UNRESOLVED",
    "ENGINE_AUTO",
    "V_ENGINE",
    "V_NOT_CONTIGUOUS",
    "ONE_F_ONE_B_FAMILY",
    "ZERO_BUBBLE",
    "Engine",
    "EngineSetting",
    "MicroBatchShortfall",
    "fills_pipeline",
    "ideal_bubble_fraction",
    "micro_batch_shortfall",
    "min_micro_batches",
    "too_few_micro_batches",
]

Engine = Literal["1f1b", "afab", "zb1p", "zb2p"]
ENGINES: tuple[str, ...] = get_args(Engine)
#: ``parallelism.pp_engine: auto``: the planner chooses the engine with the split (``nanotron_ext.plan.engine_choice``).
ENGINE_AUTO = "auto"
#: ``parallelism.pp_engine: zbv``: the V (two chunks per rank, ``nanotron_ext.schedule.zbv``), planned by
#: ``nanotron_ext.plan.v_plan.make_v_plan`` rather than as ``pp`` contiguous stages; the CPU runtime runs it.
V_ENGINE = "zbv"
EngineSetting = Literal["1f1b", "afab", "zb1p", "zb2p", "zbv", "auto"]
#: What code that plans ``pp`` contiguous stages says when it is given ``zbv``.
V_NOT_CONTIGUOUS = (
    "parallelism.pp_engine: zbv places two chunks on each rank (a V), not one stage: plan it with "
    "nanotron_ext.plan.plan_for(blocks, cfg) (plan, simulate and train do)"
)
#: What code that needs one engine says when it is given ``auto``.
AUTO_UNRESOLVED = (
    "parallelism.pp_engine: auto is chosen by the planner together with the split; resolve it first "
    "with nanotron_ext.plan.resolve_engine(cfg) (plan, simulate, train and the launcher do)"
)
#: Engines that run 1F1B's warm-up / steady / cool-down program (and so share its micro-batch rule).
ONE_F_ONE_B_FAMILY: tuple[str, ...] = ("1f1b", "zb1p", "zb2p")
#: Engines that split each backward into B (input gradient) and a deferred W (weight gradient).
ZERO_BUBBLE: tuple[str, ...] = ("zb1p", "zb2p")
_NAMES = {
    "1f1b": "1F1B",
    "zb1p": "zb1p (ZB-H1, 1F1B's program with deferred weight gradients)",
    "zb2p": "zb2p (ZB-H2, zb1p with twice 1F1B's warm-up forwards)",
    "zbv": "zbv (ZB-V, two chunks per rank down and back up the ranks)",
}


def ideal_bubble_fraction(pp: int, m: int) -> float:
    """Bubble fraction ``(pp - 1) / (m + pp - 1)`` of ``pp`` equal stages and ``m`` micro-batches.

    Raises:
        ValueError: if ``pp`` or ``m`` is below 1.
    """
    if pp < 1 or m < 1:
        raise ValueError(f"ideal_bubble_fraction needs pp >= 1 and m >= 1, got pp={pp}, m={m}")
    return (pp - 1) / (m + pp - 1)


def min_micro_batches(engine: str, pp: int) -> int:
    """The fewest micro-batches per step Nanotron's ``engine`` accepts on ``pp`` stages."""
    return max(1, pp - 1) if engine in ONE_F_ONE_B_FAMILY else 1


def fills_pipeline(engine: str, pp: int, n_micro_batches: int) -> bool:
    """Whether 1F1B (or zb1p) reaches its steady phase on every stage (AFAB always does what it can)."""
    return engine not in ONE_F_ONE_B_FAMILY or n_micro_batches >= pp


@dataclass(frozen=True)
class MicroBatchShortfall:
    """1F1B (or zb1p) with fewer micro-batches than stages: ``fatal`` when Nanotron's engine refuses it (fewer than
    ``pp - 1``), otherwise it runs with a pipeline that never fills."""

    fatal: bool
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.reason}; {self.fix}"


def micro_batch_shortfall(engine: str, pp: int, n_micro_batches: int) -> MicroBatchShortfall | None:
    """What is wrong with ``n_micro_batches`` on ``pp`` stages under ``engine``, with the fix; None if nothing.

    Example:
        >>> print(micro_batch_shortfall("1f1b", 4, 2))
        1F1B needs at least pp - 1 = 3 micro-batches, got 2: Nanotron's engine asserts nb_microbatches >= pp - 1 \
and stops; set tokens.batch_accumulation_per_replica >= 4 (>= pp fills the pipeline), or pp_engine: afab
        >>> print(micro_batch_shortfall("zb1p", 4, 2))
        zb1p (ZB-H1, 1F1B's program with deferred weight gradients) needs at least pp - 1 = 3 micro-batches, got 2: \
it runs 1F1B's pp - stage - 1 warm-up forwards and asserts nb_microbatches >= pp - 1 as Nanotron's 1F1B engine does; \
set tokens.batch_accumulation_per_replica >= 4 (>= pp fills the pipeline), or pp_engine: afab
    """
    if fills_pipeline(engine, pp, n_micro_batches):
        return None
    fix = f"set tokens.batch_accumulation_per_replica >= {pp} (>= pp fills the pipeline), or pp_engine: afab"
    need = min_micro_batches(engine, pp)
    name = _NAMES[engine]
    if n_micro_batches < need:
        why = {
            "1f1b": "Nanotron's engine asserts nb_microbatches >= pp - 1 and stops",
            "zb1p": "it runs 1F1B's pp - stage - 1 warm-up forwards and asserts nb_microbatches >= pp - 1 as "
            "Nanotron's 1F1B engine does",
        }.get(
            engine,
            "it keeps the rule of the 1F1B family it extends (Nanotron's 1F1B engine asserts "
            "nb_microbatches >= pp - 1)",
        )
        return MicroBatchShortfall(
            True, f"{name} needs at least pp - 1 = {need} micro-batches, got {n_micro_batches}: {why}", fix
        )
    bubble = ideal_bubble_fraction(pp, n_micro_batches)
    return MicroBatchShortfall(
        False,
        f"{name} with {n_micro_batches} micro-batches on {pp} stages: the pipeline "
        f"never fills (pipeline bubble at least {bubble:.0%})",
        fix,
    )


def too_few_micro_batches(engine: str, pp: int, n_micro_batches: int) -> str | None:
    """Why Nanotron's engine would refuse ``n_micro_batches`` on ``pp`` stages, with the fix; None if it runs."""
    shortfall = micro_batch_shortfall(engine, pp, n_micro_batches)
    return str(shortfall) if shortfall is not None and shortfall.fatal else None
