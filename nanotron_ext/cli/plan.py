"""``nanotron-ext plan``: the per-stage table and verdict of a split, or every strategy side by side."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    add_config_args,
    config_from_args,
    ratio_cell,
    stage_cell,
    verdict_cell,
    warn_memory,
)
from nanotron_ext.cli.resume import plan_against_checkpoint
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import Plan, VocabChoice, make_plan, plan_every_strategy, resolve_vocab_shards
from nanotron_ext.report import first_line, human_bytes, human_count, table
from nanotron_ext.simulate import format_seconds, simulate_plan

__all__ = ["COMPARED_ENGINES", "EngineRow", "add_subcommand", "cmd_plan", "compare_engines", "engine_rows",
           "frozen_tradeoff"]

#: The engines ``plan --compare-engines`` puts side by side.
COMPARED_ENGINES = ("1f1b", "zb1p")


def add_subcommand(subparsers: Any) -> None:
    """Register ``plan`` on the ``nanotron-ext`` parser."""
    p = subparsers.add_parser("plan", help="print the per-stage plan and verdict (dry run)")
    add_config_args(p, micro_batches=True, machine=True)
    p.add_argument("--compare", action="store_true", help="every strategy side by side")
    p.add_argument("--compare-engines", dest="compare_engines", action="store_true",
                   help=f"the default plan under each of {' and '.join(COMPARED_ENGINES)}, each planned for its own "
                        "engine: split, simulated step, bubble, per-stage memory peak")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a checkpoint (or checkpoints folder with latest.txt): its recorded plan beside the one a "
                        "resume under CONFIG trains, and what differs")
    p.add_argument("--replan", action="store_true",
                   help="with --checkpoint: the resume plans anew (nanotron_ext.resume_plan: replan) instead of "
                        "keeping the recorded split")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Handler of ``nanotron-ext plan``; returns the exit code."""
    if args.checkpoint is not None:
        cfg = config_from_args(args, args.config)
        return plan_against_checkpoint(cfg.with_overrides(resume_plan="replan") if args.replan else cfg,
                                       args.checkpoint, as_json=args.json)
    if args.replan:
        raise ConfigError("--replan goes with --checkpoint DIR (what a resume of that checkpoint would train)")
    if args.compare_engines:
        if args.compare:
            raise ConfigError("--compare and --compare-engines are two tables; pass one of them")
        return compare_engines(config_from_args(args, args.config), as_json=args.json)
    cfg, choice = resolve_vocab_shards(config_from_args(args, args.config))
    blocks = inventory_from_config(cfg)
    if args.compare:
        return _compare(cfg, blocks, as_json=args.json)
    try:
        plan = make_plan(blocks, cfg)
    except PlanningError as exc:
        if args.json:
            print(json.dumps({"strategy": cfg.ext.cost_strategy, "ok": False, "error": str(exc)}, indent=2))
        else:
            print(f"{cfg.source}: strategy {cfg.ext.cost_strategy!r}, pp={cfg.run.pp}: no valid plan\n  {exc}")
        return EXIT_INVALID
    warn_memory(plan)
    if args.json:
        print(plan.to_json())
    else:
        print(_header(cfg, plan, choice))
        print(plan.table())
        print("\nmemory per stage (peak at the pipeline's or the optimizer step's worst moment; --json has the terms "
              "alive then):")
        print(plan.memory_table())
        print(_verdict(plan, step_time_line(cfg, blocks, plan)))
        tradeoff = frozen_tradeoff(cfg, blocks)
        if tradeoff:
            print(tradeoff)
    return EXIT_OK if plan.ok else EXIT_INVALID


def _header(cfg: PlannerConfig, plan: Plan, choice: VocabChoice | None = None) -> str:
    m, r = cfg.model, cfg.run
    shards = ""
    if choice is not None:
        tried = ", ".join(f"K={k}: {format_seconds(t)}" for k, t in choice.step_times.items())
        shards = f"\n  vocab_shards: auto -> {choice.shards} (simulated step {tried})"
    elif cfg.vocab_shards > 1:
        shards = f"\n  vocab_shards: {cfg.vocab_shards}"
    return (f"{cfg.source}\n  model: {m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}"
            f" | pp={r.pp} dp={r.dp} tp={r.tp} engine={r.engine} micro-batches={r.n_micro_batches}"
            f" | strategy: {plan.strategy}{shards}\n")


def _verdict(plan: Plan, step_line: str = "") -> str:
    lines = ["", f"block -> stage: {list(plan.block_ranks)}",
             f"slowest stage vs optimum: {ratio_cell(plan.vs_optimum)}   1F1B bubble estimate: {plan.bubble_estimate:.1%}"]
    lines += [step_line] if step_line else []
    lines += [str(f) for f in plan.findings]
    lines.append("VALID: every stage has parameters to train" if plan.ok else "INVALID: this plan cannot train")
    return "\n".join(lines)


def simulated_step(plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> float | None:
    """The plan's simulated step time on the config's machine under its schedule, or None when the schedule
    cannot run it (1F1B with too few micro-batches)."""
    try:
        return simulate_plan(plan, blocks, cfg).step_time
    except NanotronExtError:
        return None


def step_time_line(cfg: PlannerConfig, blocks: Sequence[BlockInfo], plan: Plan) -> str:
    """``simulated step: 1.23 ms (...); Nanotron's rule: 1.30 ms, this split is 1.057x faster``."""
    step = simulated_step(plan, blocks, cfg)
    if step is None:
        return "simulated step: - (the engine cannot run this many micro-batches)"
    line = (f"simulated step: {format_seconds(step)} ({cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; "
            f"{machine_for(cfg, blocks).describe()})")
    if plan.strategy != "nanotron":
        try:
            rule = simulated_step(make_plan(blocks, cfg, "nanotron"), blocks, cfg)
        except NanotronExtError:
            rule = None
        if rule:
            line += f"; Nanotron's rule: {format_seconds(rule)}, this split is {rule / step:.3f}x as fast"
    return line


def frozen_tradeoff(cfg: PlannerConfig, blocks: Sequence[BlockInfo]) -> str | None:
    """For frozen setups: the constrained plan's slowest stage next to the optimum with frozen stages allowed."""
    if all(b.trainable == b.params for b in blocks):
        return None
    lines = ["", "frozen setup: what a trainable block on every stage costs"]
    try:
        constrained = make_plan(blocks, cfg, "constrained")
        free = make_plan(blocks, cfg.with_overrides(allow_frozen_stages=True), "flops")
    except NanotronExtError as exc:
        return "\n".join(lines + [f"  constrained: cannot plan ({first_line(exc, 200)})"])
    ratio = constrained.slowest_flops / free.slowest_flops if free.slowest_flops else float("nan")
    lines.append(table(
        ["plan", "stages", "slowest stage (train FLOPs/mb)", "stages with trainable", "vs frozen-allowed"],
        [["constrained", constrained.stage_map(), human_count(constrained.slowest_flops),
          sum(1 for s in constrained.stages if s.trainable), f"{ratio:.3f}x"],
         ["optimum, frozen stages allowed", free.stage_map(), human_count(free.slowest_flops),
          sum(1 for s in free.stages if s.trainable), "1.000x"]],
    ))
    return "\n".join(lines)


def _compare(cfg: PlannerConfig, blocks: Sequence[BlockInfo], *, as_json: bool) -> int:
    rows, out, selected_ok = [], [], False
    attempts = plan_every_strategy(blocks, cfg)
    steps = {a.strategy: simulated_step(a.plan, blocks, cfg) for a in attempts if a.plan is not None}
    rule = steps.get("nanotron")
    for attempt in attempts:
        name, plan = attempt.strategy, attempt.plan
        if plan is None:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", f"cannot plan: {first_line(attempt.error)}"])
            out.append({"strategy": name, "ok": False, "error": attempt.error})
            continue
        step = steps.get(name)
        rows.append([name, stage_cell(plan.stage_map()), ratio_cell(plan.vs_optimum),
                     "-" if step is None else format_seconds(step),
                     f"{rule / step:.3f}x" if rule and step else "-", f"{100 * plan.spread:.0f}%",
                     f"{100 * plan.bubble_estimate:.1f}%", human_count(min(s.trainable for s in plan.stages)),
                     verdict_cell(plan.verdict)])
        out.append({**plan.to_dict(), "simulated_step_time": step})
        selected_ok |= name == cfg.ext.cost_strategy and plan.ok
        if name == cfg.ext.cost_strategy:
            warn_memory(plan)
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; sim. step: "
              f"simulated step time on {machine_for(cfg, blocks).describe()}; vs nanotron: Nanotron's rule's "
              f"step ÷ this one's\n")
        print(table(["strategy", "stages (block ranges)", "slowest/opt", "sim. step", "vs nanotron", "spread", "bubble est.",
                     "min trainable", "verdict"], rows))
    return EXIT_OK if selected_ok else EXIT_INVALID


@dataclass(frozen=True)
class EngineRow:
    """The config's default plan under one engine, planned for that engine: None fields where it cannot run."""

    engine: str
    plan: Plan | None
    step_time: float | None = None
    bubble: float | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        base = {"engine": self.engine, "ok": self.plan is not None and self.plan.ok}
        if self.plan is None:
            return {**base, "error": self.error}
        return {**base, "block_ranks": list(self.plan.block_ranks), "stages": self.plan.stage_map(),
                "simulated_step_time": self.step_time, "bubble_fraction": self.bubble,
                "memory_peak_bytes": [s.memory_bytes for s in self.plan.stages]}


def engine_rows(cfg: PlannerConfig, engines: Sequence[str] = COMPARED_ENGINES) -> list[EngineRow]:
    """The default plan of ``cfg`` under each engine (``vocab_shards: auto`` resolved per engine), simulated."""
    rows = []
    for engine in engines:
        cfg_e, _ = resolve_vocab_shards(cfg.with_overrides(engine=engine))
        blocks = inventory_from_config(cfg_e)
        try:
            plan = make_plan(blocks, cfg_e)
            result = simulate_plan(plan, blocks, cfg_e)
        except NanotronExtError as exc:
            rows.append(EngineRow(engine, None, error=first_line(exc, 300)))
            continue
        rows.append(EngineRow(engine, plan, result.step_time, result.bubble_fraction))
    return rows


def compare_engines(cfg: PlannerConfig, *, as_json: bool) -> int:
    """``plan --compare-engines``: one row per engine; exit 0 when the configured engine's plan is valid (the
    first compared one when the config names another)."""
    rows = engine_rows(cfg)
    if as_json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        base = next((r.step_time for r in rows if r.engine == "1f1b"), None)
        cells = []
        for r in rows:
            if r.plan is None:
                cells.append([r.engine, "-", "-", "-", "-", "-", f"cannot run: {r.error}"])
                continue
            cells.append([r.engine, stage_cell(r.plan.stage_map()), format_seconds(r.step_time or 0.0),
                          f"{(r.bubble or 0.0):.1%}", f"{base / r.step_time:.3f}x" if base and r.step_time else "-",
                          " / ".join(human_bytes(s.memory_bytes) for s in r.plan.stages), verdict_cell(r.plan.verdict)])
        print(f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.n_micro_batches} micro-batches, strategy "
              f"{cfg.ext.cost_strategy!r} planned under each engine; sim. step on "
              f"{machine_for(cfg).describe()}; vs 1f1b: 1F1B's step ÷ this one's\n")
        print(table(["engine", "stages (block ranges)", "sim. step", "bubble", "vs 1f1b", "memory peak per stage",
                     "verdict"], cells))
    chosen = next((r for r in rows if r.engine == cfg.run.engine), rows[0])
    return EXIT_OK if chosen.plan is not None and chosen.plan.ok else EXIT_INVALID
