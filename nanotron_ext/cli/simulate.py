"""``nanotron-ext simulate``: one training step of a plan under Nanotron's engine, as a table and a timeline.

Every time comes from the config's machine (``--machine FILE`` from ``calibrate``, or the analytic H100 model),
with ``--times``, ``--tflops`` and ``--p2p-gbps`` as overrides; the plans are made under the same machine
(:mod:`nanotron_ext.machine`).

::

    nanotron-ext simulate CONFIG [--cost-strategy S] [--pp N] [--engine afab|1f1b|zb1p] [--compare] [--machine FILE]
                                 [--times machine|flops|profiled] [--tflops X] [--p2p-gbps Y] [--out timeline.png]
                                 [--loads-out stage_loads.png] [--json]

Exit codes as ``plan``: 0 when the chosen plan is valid, 1 when it has errors (it is still simulated and
drawn), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    Notes,
    add_config_args,
    against,
    check_outputs,
    config_from_args,
    error_cell,
    legend,
    model_name,
    speed_cell,
    stage_cell,
    titled_table,
    verdict_cell,
    verdict_line,
    warn_memory,
)
from nanotron_ext.cli.step_report import stage_table, step_lines
from nanotron_ext.cli.v_plan import simulate_v_plan
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.outputs import PICTURE_SUFFIXES
from nanotron_ext.plan import Plan, make_plan, plan_every_strategy, resolve_engine, resolve_vocab_shards
from nanotron_ext.report import format_seconds, time_unit
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.simulate import (
    SimResult,
    ideal_bubble_fraction,
    plan_stage_times,
    simulate_plan,
    stage_labels,
)

__all__ = ["add_subcommand", "cmd_simulate"]

_DESCRIPTION = (
    "Simulate one training step of the plan under Nanotron's engine (the config's pp_engine and "
    "batch_accumulation_per_replica), on one machine: --machine FILE (from `nanotron-ext calibrate`) or the "
    "analytic H100 model, named in the header. Its blocks' forward, backward and update times, each cut's p2p "
    "(latency + bytes / bandwidth of what crosses that cut) and gradient syncs price the step; the plans are "
    "made under the same machine. Exit 0: valid plan; 1: the plan has errors (still simulated and drawn); "
    "2: usage error."
)


def add_subcommand(subparsers: Any) -> None:
    """Register ``simulate`` on the ``nanotron-ext`` parser's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate the pipeline schedule of a plan on a machine model and draw its timeline",
        description=_DESCRIPTION,
    )
    add_config_args(p, micro_batches=True, machine=True)
    p.add_argument(
        "--compare",
        action="store_true",
        help="simulate every strategy; table of step time and bubble, plus a stage-load PNG",
    )
    p.add_argument(
        "--out",
        default="timeline.png",
        metavar="PNG",
        help="timeline picture of the chosen strategy (default timeline.png)",
    )
    p.add_argument(
        "--loads-out",
        dest="loads_out",
        default="stage_loads.png",
        metavar="PNG",
        help="with --compare: per-stage load of every strategy (default stage_loads.png)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_simulate, whole_output=True)  # a report: written once (cli.output)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Handler of ``nanotron-ext simulate``; returns the exit code."""
    check_outputs(
        (args.out, "--out"), (args.loads_out if args.compare else None, "--loads-out"), suffixes=PICTURE_SUFFIXES
    )
    cfg = config_from_args(args, args.config)  # the machine and its overrides: plans and steps priced alike
    cfg, engine_choice = resolve_engine(cfg)
    cfg, _ = resolve_vocab_shards(cfg)
    blocks = inventory_from_config(cfg)
    if cfg.run.engine == V_ENGINE:
        if args.compare:
            raise ConfigError(
                "--compare simulates the strategies' contiguous splits; pp_engine zbv searches a V of "
                "its own: drop --compare"
            )
        return simulate_v_plan(cfg, blocks, out=args.out, as_json=args.json, engine_choice=engine_choice)
    machine = machine_for(cfg, blocks)
    ideal = ideal_bubble_fraction(cfg.run.pp, cfg.run.n_micro_batches)
    out: dict[str, Any] = {
        "config": cfg.source,
        "strategy": cfg.ext.cost_strategy,
        "engine": cfg.run.engine,
        "pp": cfg.run.pp,
        "n_micro_batches": cfg.run.n_micro_batches,
        "machine": machine.describe(),
        "ideal_bubble_fraction": ideal,
    }
    text: list[str] = [
        f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches",
        *([] if engine_choice is None else engine_choice.lines()),
        f"machine: {machine.describe()}",
        legend(),
        "",
    ]
    if engine_choice is not None:
        out["engine_choice"] = engine_choice.to_dict()
    code = _simulate_chosen(args, cfg, blocks, out, text)
    if args.compare:
        _simulate_every_strategy(args, cfg, blocks, machine.name, out, text)
    print(json.dumps(out, indent=2, default=str) if args.json else "\n".join(text))
    return code


def _simulate_chosen(
    args: argparse.Namespace,
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo],
    out: dict[str, Any],
    text: list[str],
) -> int:
    """Simulate and draw the config's own strategy; adds to ``out`` and ``text``, returns the exit code."""
    from nanotron_ext.simulate.timeline import plot_timeline

    chosen = cfg.ext.cost_strategy
    try:
        plan = make_plan(blocks, cfg, chosen)
    except PlanningError as exc:
        out.update(ok=False, error=str(exc))
        text.append(f"strategy {chosen!r}: no valid plan\n  {exc}")
        return EXIT_INVALID
    warn_memory(plan)
    result = simulate_plan(plan, blocks, cfg)
    png = plot_timeline(
        result,
        args.out,
        stage_labels=stage_labels(plan),
        title=f"{model_name(cfg)}: {plan.strategy}, {cfg.run.engine.upper()}, "
        f"pp={plan.pp}, {cfg.run.n_micro_batches} micro-batches",
        verdict=None if plan.ok else f"INVALID, cannot train: {_codes(plan)}",
        grad_cuts=plan_stage_times(plan, blocks, cfg).grad_cuts,
    )
    out.update(ok=plan.ok, plan=plan.to_dict(), simulation=result.to_dict(), timeline=str(png))
    ideal = out["ideal_bubble_fraction"]
    text += [
        f"strategy: {plan.strategy}",
        stage_table(plan, result),
        "",
        step_lines(result),
        "",
        f"pipeline bubble {result.pipeline_bubble_fraction:.1%} vs ideal (p-1)/(m+p-1) = {ideal:.1%} "
        f"({100 * (result.pipeline_bubble_fraction - ideal):+.1f} points); "
        + (f"with the update, bubble {result.bubble_fraction:.1%}; " if result.step_time > result.pipeline_time else "")
        + f"step {format_seconds(result.step_time)}",
    ]
    text += [str(f) for f in plan.findings]
    text.append(verdict_line(plan, result))
    text.append(f"timeline: {png}")
    return EXIT_OK if plan.ok else EXIT_INVALID


def _simulate_every_strategy(
    args: argparse.Namespace,
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo],
    model_text: str,
    out: dict[str, Any],
    text: list[str],
) -> None:
    """``--compare``: every strategy's step and bubble in a table, and the stage-load picture."""
    from nanotron_ext.simulate.loads_chart import plot_stage_loads

    notes = Notes()
    rows, loads, entries, plans = _compare(cfg, blocks, notes)
    out["compare"] = entries
    step = {e["strategy"]: e.get("step_time") for e in entries}
    chosen, rule = step.get(cfg.ext.cost_strategy), step.get("nanotron")
    text += [
        "",
        titled_table(
            f"every strategy ({cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches, "
            f"the pipeline bubble's equal-stage ideal {out['ideal_bubble_fraction']:.1%}):",
            ["strategy", "stages (block ranges)", "slowest stage F+B", "step", "vs best", "bubble", "verdict"],
            rows,
            notes,
        ),
    ]
    if chosen and rule and cfg.ext.cost_strategy != "nanotron":
        out["gain_over_nanotron"] = rule / chosen
        caveat = against("Nanotron's split", plans.get("nanotron"))
        text.append(
            f"{cfg.ext.cost_strategy} vs Nanotron's rule: step {format_seconds(chosen)} vs {format_seconds(rule)}, "
            f"{speed_cell(rule, chosen)} as fast{'; ' + caveat if caveat else ''}"
        )
    if loads:
        n = len(next(iter(loads.values())))
        unit, scale = time_unit(max(max(v) for v in loads.values()))
        png = plot_stage_loads(
            [f"stage {k}" for k in range(n)],
            {name: [t / scale for t in v] for name, v in loads.items()},
            args.loads_out,
            title=f"{model_name(cfg)}, pp={cfg.run.pp}: forward + backward time per micro-batch\non {model_text}",
            ylabel=f"{unit} per micro-batch (F + B)",
            invalid={name: _codes(plan) for name, plan in plans.items() if name in loads and not plan.ok},
            unit=unit,
        )
        out["stage_loads"] = str(png)
        text.append(f"stage loads: {png}")


def _compare(
    cfg: PlannerConfig, blocks: Sequence[BlockInfo], notes: Notes
) -> tuple[list[list[object]], dict[str, list[float]], list[dict[str, Any]], dict[str, Plan]]:
    """Every strategy's row, stage loads and JSON entry, and the plans by strategy."""
    runs: list[tuple[str, Plan | None, SimResult | None, str]] = []
    for attempt in plan_every_strategy(blocks, cfg):
        plan = attempt.plan
        result = None if plan is None else simulate_plan(plan, blocks, cfg)
        runs.append((attempt.strategy, plan, result, attempt.error))
    # vs best: the fastest plan that can train; a faster one that cannot (over the memory) is no yardstick.
    steps = [r.step_time for _, p, r, _ in runs if r is not None and p is not None and p.ok]
    best = min(steps) if steps else None
    rows: list[list[object]] = []
    loads: dict[str, list[float]] = {}
    entries: list[dict[str, Any]] = []
    for name, plan, result, error in runs:
        if plan is None or result is None:
            rows.append([name, "-", "-", "-", "-", "-", error_cell("cannot plan", error, notes)])
            entries.append({"strategy": name, "ok": False, "error": error})
            continue
        per_stage = [s.forward + s.backward for s in result.stages]
        rows.append(
            [
                name,
                stage_cell(plan.stage_map()),
                format_seconds(max(per_stage)),
                format_seconds(result.step_time),
                speed_cell(best, result.step_time),
                f"{result.bubble_fraction:.1%}",
                verdict_cell(plan.verdict, notes),
            ]
        )
        loads[name] = per_stage
        entries.append(
            {
                "strategy": name,
                "ok": plan.ok,
                "block_ranks": list(plan.block_ranks),
                "step_time": result.step_time,
                "bubble_fraction": result.bubble_fraction,
                "stage_seconds": per_stage,
            }
        )
    return rows, loads, entries, {name: plan for name, plan, _, _ in runs if plan is not None}


def _codes(plan: Plan) -> str:
    """``no-params@1``: the findings' codes of a plan's verdict, what a picture says of a plan that cannot train."""
    return plan.verdict.partition(" (")[2].rstrip(")")
