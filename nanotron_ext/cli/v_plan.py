"""``nanotron-ext plan`` and ``simulate`` under ``pp_engine: zbv``: the V plan, two chunks per rank, its simulated step
and each rank's peak (:func:`~nanotron_ext.plan.v_plan.make_v_plan`), as a table or as JSON; ``simulate`` adds the
step's timeline, one row per rank."""

from __future__ import annotations

import json
from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo, short_name
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, choice_lines, model_name
from nanotron_ext.cli.step_report import step_lines
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import PlanningError
from nanotron_ext.machine import machine_for
from nanotron_ext.plan.engine_choice import EngineChoice
from nanotron_ext.plan.v_plan import VPlan, make_v_plan, strategy_note, v_plan_timeline
from nanotron_ext.report import compact_names, format_seconds

__all__ = ["print_v_plan", "simulate_v_plan"]


def _choice_fields(choice: EngineChoice | None) -> dict[str, object]:
    return {} if choice is None else {"engine_choice": choice.to_dict()}


def _v_plan_or_say_why(
    cfg: PlannerConfig, blocks: Sequence[BlockInfo], as_json: bool, engine_choice: EngineChoice | None
) -> VPlan | None:
    """The V plan (the one ``auto`` made when it chose the V: a search is seconds), or None once why there is none
    is printed."""
    chosen = None if engine_choice is None else engine_choice.chosen.plan
    if isinstance(chosen, VPlan):
        return chosen
    try:
        return make_v_plan(blocks, cfg)
    except PlanningError as exc:
        if as_json:
            print(json.dumps({"engine": cfg.run.engine, "ok": False, "error": str(exc)}, indent=2))
        else:
            print(f"{cfg.source}: pp_engine zbv, pp={cfg.run.pp}: no V plan\n  {exc}")
        return None


def print_v_plan(
    cfg: PlannerConfig, blocks: Sequence[BlockInfo], *, as_json: bool, engine_choice: EngineChoice | None = None
) -> int:
    """Print the V plan of ``cfg``; returns 0, or 1 when no V can train (the reason printed)."""
    plan = _v_plan_or_say_why(cfg, blocks, as_json, engine_choice)
    if plan is None:
        return EXIT_INVALID
    note = strategy_note(cfg)
    if as_json:
        step = v_plan_timeline(plan, blocks, cfg)  # the bubble of the step, as every other --json carries it
        print(
            json.dumps(
                {
                    **plan.to_dict(),
                    "ok": True,
                    "simulated_step_time": plan.step_time,
                    "bubble_fraction": step.bubble_fraction,
                    "pipeline_bubble_fraction": plan.bubble,
                    "notes": [note] if note else [],
                    **_choice_fields(engine_choice),
                },
                indent=2,
            )
        )
        return EXIT_OK
    m, r = cfg.model, cfg.run
    print(
        f"{cfg.source}\n  model: {m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size} | "
        f"pp={r.pp} dp={r.dp} tp={r.tp} engine=zbv micro-batches={r.n_micro_batches} | two chunks per rank: "
        f"rank r holds chunk r on the way down and chunk {2 * r.pp - 1} - r on the way up"
        + choice_lines(engine_choice)
        + "\n"
    )
    print(plan.table())
    print(f"\nblock -> rank: {plan.block_ranks}\nblock -> virtual stage: {plan.stages}")
    crossings = ", ".join(f"{i}->{i + 1} {format_seconds(t)}" for i, t in enumerate(plan.p2p) if i != r.pp - 1)
    print(
        f"priced on {machine_for(cfg, blocks).describe()}\np2p per crossing: {crossings or '-'} (chunks "
        f"{r.pp - 1}->{r.pp}, the V's bottom, stay on rank {r.pp - 1})"
    )
    if note:
        print(f"note: {note}")
    return EXIT_OK


def simulate_v_plan(
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo],
    *,
    out: str,
    as_json: bool,
    engine_choice: EngineChoice | None = None,
) -> int:
    """``simulate`` of a V: the plan, its step per rank, and its timeline drawn to ``out``; returns 0, or 1 when
    no V can train."""
    from nanotron_ext.simulate.timeline import plot_timeline
    from nanotron_ext.simulate.timeline_marks import v_chunks

    plan = _v_plan_or_say_why(cfg, blocks, as_json, engine_choice)
    if plan is None:
        return EXIT_INVALID
    result = v_plan_timeline(plan, blocks, cfg)
    pp, m = plan.pp, plan.n_micro_batches
    labels = [
        f"rank {r}: chunk {r} ({compact_names([short_name(b) for b in plan.chunk(r)])}), chunk {2 * pp - 1 - r} "
        f"({compact_names([short_name(b) for b in plan.chunk(2 * pp - 1 - r)])})"
        for r in range(pp)
    ]
    png = plot_timeline(
        result,
        out,
        stage_labels=labels,
        title=f"{model_name(cfg)}: zbv (two chunks per rank), pp={pp}, {m} micro-batches",
        chunks=v_chunks(result, plan.order),
    )
    if as_json:
        print(
            json.dumps(
                {
                    **plan.to_dict(),
                    "ok": True,
                    "simulation": result.to_dict(),
                    "timeline": str(png),
                    "machine": machine_for(cfg, blocks).describe(),
                    **_choice_fields(engine_choice),
                },
                indent=2,
                default=str,
            )
        )
        return EXIT_OK
    print(
        f"{cfg.source}: pp={pp}, zbv, {m} micro-batches{choice_lines(engine_choice)}\n"
        f"machine: {machine_for(cfg, blocks).describe()}\n"
    )
    print(plan.table())
    print(f"\n{step_lines(result)}\n\ntimeline: {png}")
    return EXIT_OK
