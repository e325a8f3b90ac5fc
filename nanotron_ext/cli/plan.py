"""``nanotron-ext plan``: its flags, which table a command line asks for, and the per-stage table and verdict of one
split. Its other tables live by concept: plans side by side (:mod:`~nanotron_ext.cli.plan_compare`), the changes
that fit (:mod:`~nanotron_ext.cli.plan_fit`), a plan's simulated step (:mod:`~nanotron_ext.cli.plan_step`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from nanotron_ext.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    add_config_args,
    choice_lines,
    config_from_args,
    legend,
    verdict_line,
    warn_memory,
)
from nanotron_ext.cli.plan_compare import compare_engines, compare_strategies, frozen_tradeoff
from nanotron_ext.cli.plan_fit import FIT_ROWS, fit_table
from nanotron_ext.cli.plan_step import (
    best_valid_fields,
    best_valid_line,
    simulated,
    simulated_fields,
    step_time_line,
)
from nanotron_ext.cli.v_plan import print_v_plan
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import (
    AUTO_ENGINES,
    EngineChoice,
    Plan,
    VocabChoice,
    make_plan,
    resolve_engine,
    resolve_vocab_shards,
)
from nanotron_ext.plan.compare import best_valid_split
from nanotron_ext.report import format_seconds
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.simulate import SimResult

__all__ = ["add_subcommand", "cmd_plan"]


def add_subcommand(subparsers: Any) -> None:
    """Register ``plan`` on the ``nanotron-ext`` parser."""
    p = subparsers.add_parser(
        "plan",
        help="split a model into pipeline stages: each stage's blocks, memory and "
        "the simulated step, then whether it can train (a dry run)",
    )
    add_config_args(p, micro_batches=True, machine=True)
    p.add_argument("--compare", action="store_true", help="every strategy side by side")
    p.add_argument(
        "--compare-engines",
        dest="compare_engines",
        action="store_true",
        help=f"the default plan under each of {', '.join(AUTO_ENGINES)}, each planned for its own "
        "engine: split, simulated step, bubble, per-stage memory peak",
    )
    p.add_argument(
        "--fit",
        action="store_true",
        help="the cheapest changes (tp, pp, ZeRO-1, recompute_layer, engine) whose every stage fits the "
        "memory, each planned and simulated",
    )
    p.add_argument(
        "--all",
        dest="all_rows",
        action="store_true",
        help=f"with --fit: every candidate planned, not only the first {FIT_ROWS} rows",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint (or checkpoints folder with latest.txt): its recorded plan beside the one a "
        "resume under CONFIG trains, and what differs",
    )
    p.add_argument(
        "--replan",
        action="store_true",
        help="with --checkpoint: the resume plans anew (nanotron_ext.resume_plan: replan) instead of "
        "keeping the recorded split",
    )
    p.set_defaults(func=cmd_plan, whole_output=True)  # a report: written once (cli.output)


def cmd_plan(args: argparse.Namespace) -> int:
    """Handler of ``nanotron-ext plan``; returns the exit code."""
    if args.checkpoint is not None:
        from nanotron_ext.cli.resume import plan_against_checkpoint  # imports torch: only for --checkpoint

        cfg = config_from_args(args, args.config)
        return plan_against_checkpoint(
            cfg.with_overrides(resume_plan="replan") if args.replan else cfg, args.checkpoint, as_json=args.json
        )
    if args.replan:
        raise ConfigError("--replan goes with --checkpoint DIR (what a resume of that checkpoint would train)")
    if sum(map(bool, (args.compare, args.compare_engines, args.fit))) > 1:
        raise ConfigError("--compare, --compare-engines and --fit are three tables; pass one of them")
    if args.all_rows and not args.fit:
        raise ConfigError("--all goes with --fit (it prints every candidate --fit planned); add --fit or drop --all")
    if args.fit:
        return fit_table(config_from_args(args, args.config), as_json=args.json, every=args.all_rows)
    if args.compare_engines:
        return compare_engines(config_from_args(args, args.config), as_json=args.json)
    cfg, engine_choice = resolve_engine(config_from_args(args, args.config))
    cfg, choice = resolve_vocab_shards(cfg)
    blocks = inventory_from_config(cfg)
    if cfg.run.engine == V_ENGINE:
        if args.compare:
            raise ConfigError(
                "--compare sets the strategies' contiguous splits side by side; pp_engine zbv searches "
                "a V of its own: drop --compare, or compare engines with --compare-engines"
            )
        return print_v_plan(cfg, blocks, as_json=args.json, engine_choice=engine_choice)
    if args.compare:
        return compare_strategies(cfg, blocks, as_json=args.json)
    try:
        plan = make_plan(blocks, cfg)
    except PlanningError as exc:
        if args.json:
            print(json.dumps({"strategy": cfg.ext.cost_strategy, "ok": False, "error": str(exc)}, indent=2))
        else:
            print(f"{cfg.source}: strategy {cfg.ext.cost_strategy!r}, pp={cfg.run.pp}: no valid plan\n  {exc}")
        return EXIT_INVALID
    warn_memory(plan)
    result = simulated(plan, blocks, cfg)
    best = best_valid_split(blocks, cfg)
    if args.json:
        extra = {} if engine_choice is None else {"engine_choice": engine_choice.to_dict()}
        print(json.dumps({**plan.to_dict(), **simulated_fields(result), **best_valid_fields(best), **extra}, indent=2))
    else:
        print(_header(cfg, plan, choice, engine_choice))
        print(plan.table())
        limit = "" if plan.memory_limit is None else f"; each must fit {plan.memory_limit}"
        print(
            "\nmemory per stage (peak at the pipeline's or the optimizer step's worst moment; --json has the terms "
            f"alive then{limit}):"
        )
        print(plan.memory_table())
        print(_verdict(plan, result, step_time_line(cfg, blocks, plan, result), best))
        tradeoff = frozen_tradeoff(cfg, blocks)
        if tradeoff:
            print(tradeoff)
    return EXIT_OK if plan.ok else EXIT_INVALID


def _header(
    cfg: PlannerConfig, plan: Plan, choice: VocabChoice | None = None, engine_choice: EngineChoice | None = None
) -> str:
    m, r = cfg.model, cfg.run
    shards = choice_lines(engine_choice)
    if choice is not None:
        tried = ", ".join(f"K={k}: {format_seconds(t)}" for k, t in choice.step_times.items())
        shards += f"\n  vocab_shards: auto -> {choice.shards} (simulated step {tried})"
    elif cfg.vocab_shards > 1:
        shards += f"\n  vocab_shards: {cfg.vocab_shards}"
    return (
        f"{cfg.source}\n  model: {m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}"
        f" | pp={r.pp} dp={r.dp} tp={r.tp} engine={r.engine} micro-batches={r.n_micro_batches}"
        f" | strategy: {plan.strategy}{shards}\n  {legend()}\n"
    )


def _verdict(plan: Plan, result: SimResult | None, step_line: str, best: Plan | None) -> str:
    lines = ["", f"block -> stage: {list(plan.block_ranks)}", best_valid_line(plan, best), step_line]
    lines += [str(f) for f in plan.findings]
    lines.append(verdict_line(plan, result))
    return "\n".join(lines)
