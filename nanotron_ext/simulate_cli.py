"""``nanotron-ext simulate``: turn a plan into per-stage times and simulate Nanotron's pipeline engine.

Per-stage times come from one of two sources (``--times``):

* ``flops`` (default), a **FLOP-rate model**: a stage's forward time is its blocks' forward FLOPs divided by
  one throughput (``--tflops``), its backward time the rest of its training FLOPs (freeze-aware, from
  :func:`nanotron_ext.costs.training_flops`) divided by the same throughput. Real kernels do not all run at
  one rate (attention, the loss and the embedding gather are slower per FLOP than large matmuls), so the
  numbers compare splits of the same model; they do not predict a wall-clock step.
* ``profiled``: each block's forward, backward and optimizer step **measured on this machine**
  (:mod:`nanotron_ext.profiled`: warm-up, median of repeats, cached); a stage's update is its blocks'
  optimizer steps (gradient sync is not measured). This predicts the step of a run on this device (see ``benchmarks/measured_cpu.py`` for
  how close it comes on CPU).

Either way, one p2p transfer is the largest activation a stage sends divided by a bandwidth (``--p2p-gbps``).

::

    nanotron-ext simulate CONFIG [--cost-strategy S] [--pp N] [--compare] [--times flops|profiled]
                                 [--tflops 400] [--p2p-gbps 50] [--out timeline.png]
                                 [--loads-out stage_loads.png] [--json]

Exit codes as ``plan``: 0 when the chosen plan is valid, 1 when it has errors (it is still simulated and
drawn), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nanotron_ext.cli import EXIT_INVALID, EXIT_OK, add_config_args, config_from_args, first_line
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs import trainable_before, training_flops
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError
from nanotron_ext.inventory import BlockInfo, inventory_from_config
from nanotron_ext.plan import Plan, make_plan
from nanotron_ext.report import table
from nanotron_ext.simulate import SimResult, StageTimes, ideal_bubble_fraction, simulate
from nanotron_ext.strategies import comparable_strategies

if TYPE_CHECKING:
    from nanotron_ext.profiled import BlockTiming

#: Default throughput, TFLOP/s: roughly what a bf16 training run achieves on one H100 (about 40 % of its
#: 989 TFLOP/s dense peak). Only ratios between splits matter for comparisons; absolute times scale with it.
DEFAULT_TFLOPS = 400.0
_DESCRIPTION = (
    "Simulate one training step of the plan under Nanotron's engine (the config's pp_engine and "
    "batch_accumulation_per_replica). --times flops (default), a FLOP-rate model: forward time = forward "
    "FLOPs / --tflops, backward time = the rest of the training FLOPs (freeze-aware) / --tflops; it compares "
    "splits of one model, it does not predict wall-clock time. --times profiled: every block's forward, "
    "backward and optimizer step measured on this machine (cached), which predicts the step here. "
    "p2p = largest activation sent / --p2p-gbps. Exit 0: valid plan; 1: the plan has errors (still simulated "
    "and drawn); 2: usage error."
)
TIME_SOURCES: tuple[str, ...] = ("flops", "profiled")


def stage_times_from_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    *,
    flops_per_second: float,
    p2p_bytes_per_second: float | None,
) -> tuple[list[StageTimes], float]:
    """Per-stage forward/backward time of one micro-batch, and the p2p time, under a FLOP-rate model.

    * forward of stage ``k`` = Σ ``flops_fwd`` of its blocks ÷ ``flops_per_second``;
    * backward = (Σ ``training_flops(blocks)`` of its blocks − its forward FLOPs) ÷ ``flops_per_second``,
      so frozen blocks pay no weight-gradient work and a frozen prefix no backward at all;
    * p2p = the largest ``output_bytes`` of the last block of a stage that sends (every stage but the last)
      ÷ ``p2p_bytes_per_second``; 0 when the bandwidth is ``None`` or ``pp == 1``. A gradient sent backward
      has the size of the activation sent forward, so one number serves both directions. The simulator
      takes one p2p time for every link, so this is the worst link's: a split that sends vocabulary-sized
      logits across a boundary pays that transfer on every link (an overestimate for the others).

    Args:
        plan: a plan made from ``blocks`` (:func:`nanotron_ext.plan.make_plan`).
        blocks: the inventory, in forward order.
        flops_per_second: one compute throughput for every block, FLOP/s.
        p2p_bytes_per_second: link bandwidth between neighbouring stages, bytes/s; ``None`` ignores p2p.

    Returns:
        (one :class:`~nanotron_ext.simulate.StageTimes` per stage in seconds, p2p seconds per transfer).

    Raises:
        ConfigError: a throughput or bandwidth that is not a positive finite number.
        PlanningError: ``blocks`` is not the inventory the plan was made from.

    Example:
        Blocks with forward FLOPs 1, 3 | 2, 1 (×10¹²) on 2 stages at 1 TFLOP/s: forwards take 4 s and 3 s.
    """
    _check_rate("flops_per_second", flops_per_second)
    if p2p_bytes_per_second is not None:
        _check_rate("p2p_bytes_per_second", p2p_bytes_per_second)
    _check_blocks(plan, blocks)
    train = training_flops(blocks)
    fwd = [0.0] * plan.pp
    total = [0.0] * plan.pp
    for b, t, r in zip(blocks, train, plan.block_ranks):
        fwd[r] += b.flops_fwd
        total[r] += t
    stages = [
        StageTimes(forward=fwd[k] / flops_per_second, backward=max(0.0, total[k] - fwd[k]) / flops_per_second)
        for k in range(plan.pp)
    ]
    return stages, _p2p_time(plan, blocks, p2p_bytes_per_second)


def stage_times_from_timings(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    timings: Sequence[BlockTiming],
    *,
    p2p_bytes_per_second: float | None,
) -> tuple[list[StageTimes], float]:
    """Per-stage times from measured per-block timings (:func:`nanotron_ext.profiled.block_timings`).

    A stage's forward, backward and update are the sums of its blocks' forward, backward and optimizer-step
    times; p2p as in :func:`stage_times_from_plan`.

    Raises:
        ConfigError: a bandwidth that is not a positive finite number.
        PlanningError: ``blocks`` or ``timings`` do not match the plan's blocks.
    """
    if p2p_bytes_per_second is not None:
        _check_rate("p2p_bytes_per_second", p2p_bytes_per_second)
    _check_blocks(plan, blocks)
    if len(timings) != len(blocks):
        raise PlanningError(f"{len(timings)} block timings for {len(blocks)} blocks; pass one per block")
    sums = [[0.0, 0.0, 0.0] for _ in range(plan.pp)]
    for t, r in zip(timings, plan.block_ranks):
        sums[r][0] += t.forward
        sums[r][1] += t.backward
        sums[r][2] += t.optimizer
    return [StageTimes(*values) for values in sums], _p2p_time(plan, blocks, p2p_bytes_per_second)


def _check_blocks(plan: Plan, blocks: Sequence[BlockInfo]) -> None:
    if len(blocks) != len(plan.block_ranks) or tuple(b.name for b in blocks) != tuple(plan.block_names):
        raise PlanningError(
            f"the plan covers {len(plan.block_ranks)} blocks but {len(blocks)} were given (or their names "
            f"differ); pass the inventory the plan was made from"
        )


def _p2p_time(plan: Plan, blocks: Sequence[BlockInfo], p2p_bytes_per_second: float | None) -> float:
    if p2p_bytes_per_second is None or plan.pp == 1:
        return 0.0
    last: dict[int, BlockInfo] = {}
    for b, r in zip(blocks, plan.block_ranks):
        last[r] = b
    # An empty stage sends nothing of its own.
    sent = max((last[k].output_bytes for k in range(plan.pp - 1) if k in last), default=0.0)
    return float(sent) / p2p_bytes_per_second


def _check_rate(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}={value!r} must be a positive, finite number")


def simulate_plan(
    plan: Plan,
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    flops_per_second: float | None = None,
    timings: Sequence[BlockTiming] | None = None,
    p2p_bytes_per_second: float | None = None,
    engine: str | None = None,
) -> SimResult:
    """Simulate one training step of ``plan`` under the config's engine and micro-batch count.

    Args:
        plan, blocks, cfg: the plan, the inventory it was made from, and the config.
        flops_per_second: FLOP-rate model (:func:`stage_times_from_plan`); or
        timings: measured per-block timings (:func:`stage_times_from_timings`); exactly one of the two.
        p2p_bytes_per_second: link bandwidth, or None to ignore p2p.
        engine: overrides the config's ``pp_engine``.

    Raises:
        ConfigError: bad rates, both or neither of ``flops_per_second`` and ``timings``, or 1F1B with fewer
            than ``pp − 1`` micro-batches (Nanotron asserts this).
    """
    if (flops_per_second is None) == (timings is None):
        raise ConfigError("simulate_plan needs exactly one of flops_per_second= (FLOP-rate model) and timings=")
    if timings is not None:
        stages, p2p = stage_times_from_timings(plan, blocks, timings, p2p_bytes_per_second=p2p_bytes_per_second)
    else:
        stages, p2p = stage_times_from_plan(
            plan, blocks, flops_per_second=float(flops_per_second), p2p_bytes_per_second=p2p_bytes_per_second
        )
    try:
        return simulate(
            stages, cfg.run.n_micro_batches, engine or cfg.run.engine, p2p, grad_cuts=gradient_cuts(plan, blocks)
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def gradient_cuts(plan: Plan, blocks: Sequence[BlockInfo]) -> list[bool]:
    """Per cut between stages ``k`` and ``k + 1``: does a gradient cross it back (is anything on stages ``0..k``
    trainable)? Nanotron sends no gradient across a cut behind a frozen prefix."""
    before = trainable_before(blocks)
    # Ranks never decrease along the blocks, so the blocks of stages 0..k are the first "count ≤ k" ones.
    return [before[sum(r <= k for r in plan.block_ranks)] for k in range(plan.pp - 1)]


def format_seconds(seconds: float) -> str:
    """``0.0123`` → ``12.3 ms``: three significant digits in s, ms or µs."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns" if seconds else "0 s"


def stage_labels(plan: Plan, width: int = 34) -> list[str]:
    """``stage 0: embedding, decoder.0-2`` per stage, cut to ``width`` characters for plots."""
    out = []
    for s in plan.stages:
        text = f"stage {s.stage}: {s.label}"
        out.append(text if len(text) <= width else text[: width - 1] + "…")
    return out


def add_subcommand(subparsers: Any) -> None:
    """Register ``simulate`` on the ``nanotron-ext`` parser's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate the pipeline schedule of a plan (FLOP-rate model) and draw its timeline",
        description=_DESCRIPTION,
    )
    add_config_args(p)
    p.add_argument(
        "--compare",
        action="store_true",
        help="simulate every strategy; table of step time and bubble, plus a stage-load PNG",
    )
    p.add_argument(
        "--times",
        choices=TIME_SOURCES,
        default="flops",
        help="where stage times come from: flops (FLOP-rate model, default) or profiled (every block measured "
        "on this machine, cached in nanotron_ext.profile_cache or ~/.cache/nanotron_ext)",
    )
    p.add_argument(
        "--tflops",
        type=float,
        default=None,
        metavar="X",
        help=f"with --times flops: compute throughput in TFLOP/s for every block (default {DEFAULT_TFLOPS:g}: "
        "about what bf16 training reaches on one H100)",
    )
    p.add_argument(
        "--p2p-gbps",
        dest="p2p_gbps",
        type=float,
        default=None,
        metavar="Y",
        help="p2p bandwidth between neighbouring stages in GB/s (10^9 bytes/s); default: p2p ignored",
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
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Handler of ``nanotron-ext simulate``; returns the exit code."""
    from nanotron_ext.timeline import plot_stage_loads, plot_timeline

    cfg = config_from_args(args, args.config)
    bandwidth = None if args.p2p_gbps is None else _positive(args.p2p_gbps, "--p2p-gbps") * 1e9
    blocks = inventory_from_config(cfg)
    if args.times == "profiled":
        if args.tflops is not None:
            raise ConfigError("--tflops sets the FLOP-rate model's throughput; drop it with --times profiled")
        from nanotron_ext.profiled import block_timings

        source: dict[str, Any] = {"timings": block_timings(blocks, cfg)}
        model_text = "block times profiled on this machine (forward, backward, optimizer step)"
    else:
        tflops = DEFAULT_TFLOPS if args.tflops is None else args.tflops
        source = {"flops_per_second": _positive(tflops, "--tflops") * 1e12}
        model_text = f"FLOP-rate model at {tflops:g} TFLOP/s"
    chosen = cfg.ext.cost_strategy
    ideal = ideal_bubble_fraction(cfg.run.pp, cfg.run.n_micro_batches)
    out: dict[str, Any] = {
        "config": cfg.source,
        "strategy": chosen,
        "engine": cfg.run.engine,
        "pp": cfg.run.pp,
        "n_micro_batches": cfg.run.n_micro_batches,
        "times": args.times,
        "tflops": source["flops_per_second"] / 1e12 if "flops_per_second" in source else None,
        "p2p_gbps": args.p2p_gbps,
        "ideal_bubble_fraction": ideal,
    }
    text: list[str] = [
        f"{cfg.source}: pp={cfg.run.pp}, {cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches; "
        f"{model_text}" + (f", p2p {args.p2p_gbps:g} GB/s" if args.p2p_gbps is not None else ", p2p ignored"),
        "",
    ]

    code = EXIT_OK
    try:
        plan = make_plan(blocks, cfg, chosen)
    except PlanningError as exc:
        plan, code = None, EXIT_INVALID
        out.update(ok=False, error=str(exc))
        text.append(f"strategy {chosen!r}: no valid plan\n  {exc}")
    if plan is not None:
        result = simulate_plan(plan, blocks, cfg, p2p_bytes_per_second=bandwidth, **source)
        png = plot_timeline(
            result,
            args.out,
            stage_labels=stage_labels(plan),
            title=f"{_model_name(cfg)}: {plan.strategy}, {cfg.run.engine.upper()}, "
            f"pp={plan.pp}, {cfg.run.n_micro_batches} micro-batches",
        )
        code = EXIT_OK if plan.ok else EXIT_INVALID
        out.update(ok=plan.ok, plan=plan.to_dict(), simulation=result.to_dict(), timeline=str(png))
        text += [
            f"strategy: {plan.strategy}",
            _stage_table(plan, result),
            "",
            str(result),
            "",
            f"pipeline bubble {result.pipeline_bubble_fraction:.1%} vs ideal (p-1)/(m+p-1) = {ideal:.1%} "
            f"({100 * (result.pipeline_bubble_fraction - ideal):+.1f} points); "
            + (
                f"with the update, bubble {result.bubble_fraction:.1%}; "
                if result.step_time > result.pipeline_time
                else ""
            )
            + f"step {format_seconds(result.step_time)}",
        ]
        text += [str(f) for f in plan.findings]
        text.append(
            "VALID: every stage has parameters to train" if plan.ok else "INVALID: this plan cannot train"
        )
        text.append(f"timeline: {png}")

    if args.compare:
        rows, loads, entries = _compare(cfg, blocks, source, bandwidth)
        out["compare"] = entries
        text += [
            "",
            f"every strategy ({cfg.run.engine}, {cfg.run.n_micro_batches} micro-batches, "
            f"ideal bubble {ideal:.1%}):",
            "",
            table(
                [
                    "strategy",
                    "stages (block ranges)",
                    "slowest stage F+B ms",
                    "step ms",
                    "vs best",
                    "bubble",
                    "verdict",
                ],
                rows,
            ),
        ]
        if loads:
            n = len(next(iter(loads.values())))
            png = plot_stage_loads(
                [f"stage {k}" for k in range(n)],
                loads,
                args.loads_out,
                title=f"{_model_name(cfg)}, pp={cfg.run.pp}: forward + backward time per "
                f"micro-batch ({model_text})",
                ylabel="ms per micro-batch (F + B)",
            )
            out["stage_loads"] = str(png)
            text.append(f"stage loads: {png}")

    print(json.dumps(out, indent=2, default=str) if args.json else "\n".join(text))
    return code


def _compare(
    cfg: PlannerConfig, blocks: Sequence[BlockInfo], source: dict[str, Any], bandwidth: float | None
) -> tuple[list[list[object]], dict[str, list[float]], list[dict[str, Any]]]:
    runs: list[tuple[str, Plan | None, SimResult | None, str]] = []
    for name in comparable_strategies(cfg.ext.cost_strategy):
        try:
            plan = make_plan(blocks, cfg, name)
        except NanotronExtError as exc:
            runs.append((name, None, None, str(exc)))
            continue
        runs.append(
            (
                name,
                plan,
                simulate_plan(plan, blocks, cfg, p2p_bytes_per_second=bandwidth, **source),
                "",
            )
        )
    steps = [r.step_time for _, _, r, _ in runs if r is not None]
    best = min(steps) if steps else 0.0
    rows: list[list[object]] = []
    loads: dict[str, list[float]] = {}
    entries: list[dict[str, Any]] = []
    for name, plan, result, error in runs:
        if plan is None or result is None:
            rows.append([name, "-", "-", "-", "-", "-", f"cannot plan: {first_line(error)}"])
            entries.append({"strategy": name, "ok": False, "error": error})
            continue
        per_stage = [s.forward + s.backward for s in result.stages]
        codes = ", ".join(f"{f.code}@{f.stage}" if f.stage is not None else f.code for f in plan.findings)
        rows.append(
            [
                name,
                plan.stage_map(),
                _ms(max(per_stage)),
                _ms(result.step_time),
                f"{result.step_time / best:.3f}x" if best else "-",
                f"{result.bubble_fraction:.1%}",
                ("OK" if plan.ok else "INVALID") + (f" ({codes})" if codes else ""),
            ]
        )
        loads[name] = [1e3 * t for t in per_stage]
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
    return rows, loads, entries


def _stage_table(plan: Plan, result: SimResult) -> str:
    rows = [
        [s.stage, s.label, _ms(t.forward), _ms(t.backward), _ms(t.update)] for s, t in zip(plan.stages, result.stages)
    ]
    return table(["stage", "blocks", "forward ms/mb", "backward ms/mb", "update ms/step"], rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _model_name(cfg: PlannerConfig) -> str:
    return cfg.source.rsplit("/", 1)[-1].removesuffix(".yaml")


def _positive(value: float, flag: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} {value!r} must be a positive number")
    return value
