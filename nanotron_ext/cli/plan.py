"""``nanotron-ext plan``: the per-stage table and verdict of a split, or every strategy side by side."""

from __future__ import annotations

import argparse
import dataclasses
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
    best_valid_cell,
    choice_lines,
    config_from_args,
    error_cell,
    legend,
    speed_cell,
    stage_cell,
    titled_table,
    verdict_cell,
    verdict_line,
    warn_memory,
)
from nanotron_ext.cli.v_plan import print_v_plan
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import (
    AUTO_ENGINES,
    EngineChoice,
    EngineOption,
    Plan,
    VocabChoice,
    engine_option,
    make_plan,
    plan_every_strategy,
    plan_with_ranks,
    resolve_engine,
    resolve_vocab_shards,
)
from nanotron_ext.plan.compare import best_valid_split
from nanotron_ext.plan.v_plan import VPlan, v_plan_timeline
from nanotron_ext.report import compact_names, human_bytes, human_count
from nanotron_ext.schedule import V_ENGINE
from nanotron_ext.simulate import SimResult, format_seconds, simulate_plan
from nanotron_ext.simulate.fit_search import FitRow

__all__ = [
    "add_subcommand",
    "best_valid_fields",
    "best_valid_line",
    "cmd_plan",
    "compare_engines",
    "engine_rows",
    "fit_table",
    "frozen_tradeoff",
    "left_out",
    "simulated",
    "simulated_fields",
    "step_time_line",
]

#: The engines ``plan --compare-engines`` puts side by side.


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


def best_valid_line(plan: Plan, best: Plan | None) -> str:
    """``slowest stage vs best valid split: 0.917x (...)``: ``plan``'s slowest stage against the smallest slowest
    stage of a split that can train and fits (:func:`~nanotron_ext.plan.compare.best_valid_split`)."""
    if best is None:
        return "slowest stage vs best valid split: - (no split can train and fit under this config)"
    return (
        f"slowest stage vs best valid split: {best_valid_cell(best, plan)} (train FLOPs/mb: the slowest stage "
        f"of the best split that can train and fits ({best.stage_map()}) ÷ this one's)"
    )


def best_valid_fields(best: Plan | None) -> dict[str, float | None]:
    """What ``--json`` carries of the best valid split: its slowest stage (None when no split is valid)."""
    return {"best_valid_flops": None if best is None else best.slowest_flops}


def simulated(plan: Plan, blocks: Sequence[BlockInfo], cfg: PlannerConfig) -> SimResult | None:
    """One simulated step of ``plan`` on the config's machine under its schedule (what ``simulate`` prints), or
    None when the schedule cannot run it (1F1B with too few micro-batches)."""
    try:
        return simulate_plan(plan, blocks, cfg)
    except NanotronExtError:
        return None


def simulated_fields(result: SimResult | None) -> dict[str, float | None]:
    """The simulated step and bubble as every ``--json`` carries them (None where the schedule cannot run)."""
    return {
        "simulated_step_time": None if result is None else result.step_time,
        "bubble_fraction": None if result is None else result.bubble_fraction,
    }


def step_time_line(cfg: PlannerConfig, blocks: Sequence[BlockInfo], plan: Plan, result: SimResult | None) -> str:
    """``simulated step: 1.23 ms, bubble 40.0% (...)``, then ``Nanotron's rule: 1.30 ms, this split is 1.057x as
    fast``, saying in that line when Nanotron's split cannot train or does not fit."""
    if result is None:
        return "simulated step: - (the engine cannot run this many micro-batches)"
    line = (
        f"simulated step: {format_seconds(result.step_time)}, bubble {result.bubble_fraction:.1%} "
        f"({cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; {machine_for(cfg, blocks).describe()})"
    )
    if plan.strategy != "nanotron":
        try:
            rule_plan = make_plan(blocks, cfg, "nanotron", suggest_fixes=False)
        except NanotronExtError:
            rule_plan = None
        rule = None if rule_plan is None else simulated(rule_plan, blocks, cfg)
        if rule is not None:
            caveat = against("Nanotron's split", rule_plan)
            line += (
                f"\nNanotron's rule: {format_seconds(rule.step_time)}, this split is "
                f"{speed_cell(rule.step_time, result.step_time)} as fast{'; ' + caveat if caveat else ''}"
            )
    return line + gave_up_line(cfg, blocks, plan, result)


def gave_up_line(cfg: PlannerConfig, blocks: Sequence[BlockInfo], plan: Plan, result: SimResult) -> str:
    """What fitting the memory cost: the faster split it ruled out, its step and its largest stage."""
    if plan.over_memory_ranks is None or plan.memory_limit is None:
        return ""
    faster = plan_with_ranks(blocks, cfg, plan.over_memory_ranks, plan.strategy, suggest_fixes=False)
    sim = simulated(faster, blocks, cfg)
    worst = max(faster.stages, key=lambda s: s.memory_bytes)
    step = "-" if sim is None else format_seconds(sim.step_time)
    slower = "" if sim is None else f", {speed_cell(sim.step_time, result.step_time)} as fast as it"
    return (
        f"\nto fit {plan.memory_limit}: the fastest split ({faster.stage_map()}, {step}) needs "
        f"{worst.memory_bytes / GIB:.3g} GiB on stage {worst.stage}; this one fits{slower}"
    )


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


def _compare(cfg: PlannerConfig, blocks: Sequence[BlockInfo], *, as_json: bool) -> int:
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


def best_valid_line_short(best: Plan | None) -> str:
    """What the ``vs best valid`` column of a table compares with."""
    if best is None:
        return "no split can train and fit under this config"
    return f"the best split that can train and fits is {best.stage_map()}"


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


#: Rows ``plan --fit`` prints: the config as it is, then the cheapest that fit, then the nearest that do not.
FIT_ROWS = 8


def left_out(rows: Sequence[FitRow], shown: Sequence[FitRow]) -> str:
    """What ``plan --fit`` did not print: how many candidates, how many of them fit, and how to see them."""
    hidden = [r for r in rows if r not in shown]
    fitting = sum(r.fits for r in hidden)
    return (
        f"{len(hidden)} more candidate{'s' if len(hidden) != 1 else ''} left out ({fitting} of them "
        f"fit{'' if fitting != 1 else 's'}): --all prints every one, --json lists them all"
    )


def fit_table(cfg: PlannerConfig, *, as_json: bool, every: bool = False) -> int:
    """``plan --fit``: the candidates of :func:`~nanotron_ext.simulate.fit_search.fit_search`, the first
    :data:`FIT_ROWS` of them (``every``: all, as ``--json`` gives); exit 0 when one fits."""
    import sys

    from tqdm import tqdm

    from nanotron_ext.simulate.fit_search import fit_search

    with tqdm(desc="fit", unit="candidate", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        limit, rows = fit_search(cfg, progress=advance)
    if as_json:
        print(
            json.dumps(
                {
                    "limit": None if limit is None else dataclasses.asdict(limit),
                    "rows": [{**dataclasses.asdict(r), "gpus": r.gpus} for r in rows],
                },
                indent=2,
            )
        )
        return EXIT_OK if any(r.fits for r in rows) else EXIT_INVALID
    shown = [r for r in rows if r.change == "as configured"] + [r for r in rows if r.change != "as configured"]
    shown = shown if every else shown[:FIT_ROWS]
    table_rows = [
        [
            r.change,
            r.tp * r.pp,
            human_bytes(r.peak),
            "-" if limit is None else f"{r.peak / limit.bytes:.0%}",
            "-" if r.step_time is None else format_seconds(r.step_time),
            "yes" if r.fits else "no",
        ]
        for r in shown
    ]
    where = "no memory limit is known (a CPU profile, or memory_runtime: cpu)" if limit is None else f"{limit}"
    print(
        titled_table(
            f"{cfg.source}: changes planned by {cfg.ext.cost_strategy!r} under {where}; "
            f"{len(rows)} candidates, {sum(r.fits for r in rows)} fit",
            ["change", "GPUs per replica", "largest stage", "of limit", "sim. step", "fits"],
            table_rows,
            Notes(),
        )
    )
    if len(shown) < len(rows):
        print(f"\n{left_out(rows, shown)}")
    if limit is not None and not any(r.fits for r in rows):
        print(
            "\nnothing here fits: what is left is a smaller `tokens.micro_batch_size` or sequence (it changes the "
            "training), or a GPU with more memory"
        )
    return EXIT_OK if any(r.fits for r in rows) else EXIT_INVALID
