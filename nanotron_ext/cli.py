"""``nanotron-ext`` command line.

* ``nanotron-ext plan [CONFIG] [--cost-strategy NAME] [--pp N] [--compare] [--json]`` — dry run: no GPU,
  no process group. Exit 0 when the plan is valid, 1 when it has errors, 2 on usage errors.
* ``nanotron-ext train --config-file X.yaml`` — CPU training on Nanotron's engine (under ``torchrun``).
* ``nanotron-ext simulate CONFIG --out timeline.png`` — bubble-time simulation and pictures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import Plan, make_plan
from nanotron_ext.report import human_count, table
from nanotron_ext.strategies import available_strategies, comparable_strategies

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def bundled_config(name: str = "tiny_llama_large_vocab.yaml") -> Path:
    """Path of a config shipped with the package."""
    return Path(str(resources.files("nanotron_ext") / "configs" / name))


def add_config_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    if positional:
        p.add_argument("config", nargs="?", help="Nanotron YAML (default: the bundled tiny large-vocab example)")
    p.add_argument("--cost-strategy", dest="cost_strategy", metavar="NAME",
                   help=f"overrides the YAML; one of {', '.join(available_strategies())} or package.module:attr")
    p.add_argument("--pp", type=int, help="overrides parallelism.pp")


def config_from_args(args: argparse.Namespace, path: str | None) -> PlannerConfig:
    return load_config(path or bundled_config(), cost_strategy=args.cost_strategy, pp=args.pp)


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, args.config)
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
    if args.json:
        print(plan.to_json())
    else:
        print(_header(cfg, plan))
        print(plan.table())
        print(_verdict(plan))
        tradeoff = frozen_tradeoff(cfg, blocks)
        if tradeoff:
            print(tradeoff)
    return EXIT_OK if plan.ok else EXIT_INVALID


def _header(cfg: PlannerConfig, plan: Plan) -> str:
    m, r = cfg.model, cfg.run
    return (f"{cfg.source}\n  model: {m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}"
            f" | pp={r.pp} dp={r.dp} tp={r.tp} engine={r.engine} micro-batches={r.n_micro_batches}"
            f" | strategy: {plan.strategy}\n")


def _verdict(plan: Plan) -> str:
    lines = ["", f"block -> stage: {list(plan.block_ranks)}",
             f"slowest stage vs optimum: {plan.vs_optimum:.3f}x   1F1B bubble estimate: {plan.bubble_estimate:.1%}"]
    lines += [str(f) for f in plan.findings]
    lines.append("VALID: every stage has parameters to train" if plan.ok else "INVALID: this plan cannot train")
    return "\n".join(lines)


def frozen_tradeoff(cfg: PlannerConfig, blocks) -> str | None:
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


def _compare(cfg: PlannerConfig, blocks, *, as_json: bool) -> int:
    rows, out, selected_ok = [], [], False
    for name in comparable_strategies(cfg.ext.cost_strategy):
        try:
            plan = make_plan(blocks, cfg, name)
        except NanotronExtError as exc:
            rows.append([name, "-", "-", "-", "-", "-", f"cannot plan: {first_line(exc)}"])
            out.append({"strategy": name, "ok": False, "error": str(exc)})
            continue
        codes = ", ".join(f"{f.code}@{f.stage}" if f.stage is not None else f.code for f in plan.findings)
        rows.append([name, plan.stage_map(), f"{plan.vs_optimum:.3f}x", f"{100 * plan.spread:.0f}%",
                     f"{100 * plan.bubble_estimate:.1f}%", human_count(min(s.trainable for s in plan.stages)),
                     ("OK" if plan.ok else "INVALID") + (f" ({codes})" if codes else "")])
        out.append(plan.to_dict())
        selected_ok |= name == cfg.ext.cost_strategy and plan.ok
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches\n")
        print(table(["strategy", "stages (block ranges)", "slowest/opt", "spread", "bubble est.",
                     "min trainable", "verdict"], rows))
    return EXIT_OK if selected_ok else EXIT_INVALID


def first_line(exc: object, width: int = 72) -> str:
    """The first line of an error message, cut to ``width`` characters with an ellipsis (for table cells)."""
    line = str(exc).splitlines()[0]
    return line if len(line) <= width else line[: width - 1] + "…"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanotron-ext", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the per-stage plan and verdict (dry run)")
    add_config_args(p)
    p.add_argument("--compare", action="store_true", help="every strategy side by side")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)
    # Imported here: both subcommands import this module for its config helpers.
    from nanotron_ext import simulate_cli, train

    train.add_subcommand(sub)
    simulate_cli.add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"nanotron-ext: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NanotronExtError as exc:
        print(f"nanotron-ext: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
