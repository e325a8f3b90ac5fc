"""``plan``'s tables of plans side by side: every strategy (``--compare``), every engine (``--compare-engines``), and,
for a frozen setup, ``constrained`` with and without a trainable block on every stage."""

from __future__ import annotations

import json
from collections.abc import Sequence

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    Notes,
    against,
    best_valid_cell,
    error_cell,
    speed_cell,
    stage_cell,
    titled_table,
    verdict_cell,
    warn_memory,
)
from nanotron_ext.cli.plan_step import best_valid_fields, best_valid_line_short, simulated, simulated_fields
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import AUTO_ENGINES, EngineOption, Plan, engine_option, make_plan, plan_every_strategy
from nanotron_ext.plan.compare import best_valid_split
from nanotron_ext.plan.v_plan import VPlan, v_plan_timeline
from nanotron_ext.report import compact_names, format_seconds, human_bytes, human_count
from nanotron_ext.simulate import SimResult

__all__ = ["compare_engines", "compare_strategies", "engine_rows", "frozen_tradeoff"]


def frozen_tradeoff(cfg: PlannerConfig, blocks: Sequence[BlockInfo]) -> str | None:
    """For frozen setups: ``constrained`` with a trainable block on every stage next to ``constrained`` with
    frozen stages allowed, by simulated step and slowest stage."""
    if all(b.trainable == b.params for b in blocks):
        return None
    notes, rows = Notes(), []
    trainable = [b.short for b in blocks if b.trainable]
    free: float | None = None
    free_plan: Plan | None = None
    for name, allow in (("frozen stages allowed", True), ("trainable on every stage", False)):
        variant = cfg.with_overrides(allow_frozen_stages=allow)
        if not allow and len(trainable) < cfg.run.pp:  # said here, not by the planner, whose fix is the other row
            rows.insert(
                0,
                [
                    name,
                    "-",
                    "-",
                    "-",
                    "-",
                    error_cell(
                        "impossible",
                        (
                            f"only {len(trainable)} block{'s train' if len(trainable) > 1 else ' trains'} "
                            f"({compact_names(trainable)}), fewer than pp={cfg.run.pp} "
                            f"stages; unfreeze more blocks or lower pp to {max(len(trainable), 1)}"
                        ),
                        notes,
                    ),
                ],
            )
            continue
        try:
            plan = make_plan(blocks, variant, "constrained")
        except NanotronExtError as exc:
            rows.insert(0, [name, "-", "-", "-", "-", error_cell("cannot plan", exc, notes)])
            continue
        result = simulated(plan, blocks, variant)
        step = None if result is None else result.step_time
        free, free_plan = (step, plan) if allow else (free, free_plan)
        rows.insert(
            0,
            [
                name,
                stage_cell(plan.stage_map()),
                "-" if step is None else format_seconds(step),
                human_count(plan.slowest_flops),
                sum(1 for s in plan.stages if s.trainable),
                speed_cell(free, step),
            ],
        )
    head = [
        "constrained plan",
        "stages",
        "sim. step",
        "slowest stage (train FLOPs/mb)",
        "stages with trainable",
        "vs frozen allowed",
    ]
    caveat = against("the plan with frozen stages allowed", free_plan)
    return (
        "\n"
        + titled_table("frozen setup: what a trainable block on every stage costs", head, rows, notes)
        + (f"\nvs frozen allowed: {caveat}" if caveat else "")
    )


def compare_strategies(cfg: PlannerConfig, blocks: Sequence[BlockInfo], *, as_json: bool) -> int:
    rows, out, selected_ok, notes = [], [], False, Notes()
    attempts = plan_every_strategy(blocks, cfg)
    results = {a.strategy: simulated(a.plan, blocks, cfg) for a in attempts if a.plan is not None}
    rule = results.get("nanotron")
    best = best_valid_split(blocks, cfg)
    for attempt in attempts:
        name, plan = attempt.strategy, attempt.plan
        if plan is None:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", error_cell("cannot plan", attempt.error, notes)])
            out.append({"strategy": name, "ok": False, "error": attempt.error})
            continue
        result = results.get(name)
        step = None if result is None else result.step_time
        rows.append(
            [
                name,
                stage_cell(plan.stage_map()),
                best_valid_cell(best, plan),
                "-" if step is None else format_seconds(step),
                speed_cell(None if rule is None else rule.step_time, step),
                f"{100 * plan.spread:.0f}%",
                "-" if result is None else f"{result.bubble_fraction:.1%}",
                human_count(min(s.trainable for s in plan.stages)),
                verdict_cell(plan.verdict, notes),
            ]
        )
        out.append({**plan.to_dict(), **simulated_fields(result), **best_valid_fields(best)})
        selected_ok |= name == cfg.ext.cost_strategy and plan.ok
        if name == cfg.ext.cost_strategy:
            warn_memory(plan)
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(
            titled_table(
                f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; "
                f"simulated step time on {machine_for(cfg, blocks).describe()}",
                [
                    "strategy",
                    "stages (block ranges)",
                    "vs best valid",
                    "sim. step",
                    "vs nanotron",
                    "spread",
                    "bubble",
                    "min trainable",
                    "verdict",
                ],
                rows,
                notes,
            )
        )
        rule_plan = next((a.plan for a in attempts if a.strategy == "nanotron"), None)
        print(
            "\n".join(
                f"{column}: {caveat}"
                for column, caveat in (
                    ("vs best valid", best_valid_line_short(best)),
                    ("vs nanotron", against("Nanotron's split", rule_plan)),
                )
                if caveat
            )
        )
    return EXIT_OK if selected_ok else EXIT_INVALID


def engine_rows(
    cfg: PlannerConfig, engines: Sequence[str] = AUTO_ENGINES
) -> list[tuple[EngineOption, SimResult | None]]:
    """The default plan of ``cfg`` under each engine (:func:`~nanotron_ext.plan.engine_option`), simulated."""
    rows = []
    for option in (engine_option(cfg, engine) for engine in engines):
        result = None
        if isinstance(option.plan, VPlan) and option.config is not None:
            result = v_plan_timeline(option.plan, inventory_from_config(option.config), option.config)
        elif option.plan is not None and option.config is not None:
            result = simulated(option.plan, inventory_from_config(option.config), option.config)
        rows.append((option, result))
    return rows


def compare_engines(cfg: PlannerConfig, *, as_json: bool) -> int:
    """``plan --compare-engines``: one row per engine; exit 0 when the configured engine's plan is valid (the
    first compared one when the config names another)."""
    rows = engine_rows(cfg)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        **o.to_dict(),
                        **(
                            {}
                            if o.plan is None
                            else {
                                "block_ranks": list(o.plan.block_ranks),
                                "stages": o.plan.stage_map(),
                                "bubble_fraction": None if r is None else r.bubble_fraction,
                            }
                        ),
                    }
                    for o, r in rows
                ],
                indent=2,
            )
        )
    else:
        base = next((o.step_time for o, _ in rows if o.engine == "1f1b"), None)
        cells, notes = [], Notes()
        for o, r in rows:
            if o.plan is None:
                cells.append([o.engine, "-", "-", "-", "-", "-", error_cell("cannot run", o.reason, notes)])
                continue
            cells.append(
                [
                    o.engine,
                    stage_cell(o.plan.stage_map()),
                    format_seconds(o.step_time or 0.0),
                    "-" if r is None else f"{r.bubble_fraction:.1%}",
                    speed_cell(base, o.step_time),
                    " / ".join(human_bytes(p) for p in o.peaks),
                    verdict_cell(o.plan.verdict, notes),
                ]
            )
        print(
            titled_table(
                f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.n_micro_batches} micro-batches, strategy "
                f"{cfg.ext.cost_strategy!r} planned under each engine; simulated step time on "
                f"{machine_for(cfg).describe()}",
                [
                    "engine",
                    "stages (block ranges)",
                    "sim. step",
                    "bubble",
                    "vs 1f1b",
                    "memory peak per stage",
                    "verdict",
                ],
                cells,
                notes,
            )
        )
        caveat = against("1F1B's split", next((o.plan for o, _ in rows if o.engine == "1f1b"), None))
        if base is not None and caveat:
            print(f"vs 1f1b: {caveat}")
    chosen = next((o for o, _ in rows if o.engine == cfg.run.engine), rows[0][0])
    return EXIT_OK if chosen.plan is not None and chosen.plan.ok else EXIT_INVALID
