"""ZB-V (issue 43) against 1F1B, zb1p and zb2p, on equal stages and on the public shapes: the simulator's figures
(``nanotron_ext.schedule.zbv``); ``benchmarks/zbv_measured_cpu.py`` runs the engines.

Part 1, equal stages (no p2p, no update): a rank's work per micro-batch ``F = 2``, ``B + W = 4`` (two chunks of
1 and 2), ``W`` half, 0.4 or a quarter of the backward; each engine's pipeline step against the floor of a
synchronised step, ``(pp - 1) F + m (F + B + W)`` for the 1F1B family and ``(pp - 1) F / 2 + m (F + B + W)`` for
the V (its first activation reaches the last rank after half-stages), and the most activations a rank holds, in
chunk units (a chunk: half of a rank's stage; 1F1B's first rank holds ``2 min(pp, m)``).

Part 2, the public shapes (``nanotron_ext/configs``) at PP 4 and 8 with ``m = 2·pp`` on the analytic H100 model:
1F1B, zb1p and zb2p each on its own default plan (``simulate_plan``); the V on the FLOP-balanced split of the
blocks into ``2·pp`` chunks (``cost_strategy: flops`` at ``pp = 2·pp``; stage ``s`` on rank ``s``, then back up),
priced by the same machine, p2p per cut included; then on the split a descent from those chunks reaches
(``nanotron_ext.partition.v_split``: one cut moved by one or two blocks at a time while the simulated V step falls,
every chunk keeping a block with weights). The descent sees no memory.

Part 3, the same shapes under 1F1B's peak in bytes: each rank of the V estimated with both chunks' terms at the
moments they coincide (``nanotron_ext.costs.v_memory``), the split searched by branch and bound from the FLOP chunks
(``nanotron_ext.partition.v_search``), with its gap to the bound where the budget ran out.

Part 4, ``pp_engine: auto`` on the same shapes and the analytic H100 (79.18 GiB a GPU): the engine it takes, and
each engine's step and peak (its plan as ``nanotron-ext plan --engine auto`` makes it; the V with
``make_v_plan``'s budget).

Usage: ``python benchmarks/zbv_simulated.py [--auto-only]``
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from _common import CONFIGS, SHAPES, print_command, progress

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition import bounds_from_ranks
from nanotron_ext.partition.v_search import search_v_split, v_lower_bound
from nanotron_ext.partition.v_split import descend_v_split, v_budget, v_floors, v_peaks, v_simulate
from nanotron_ext.plan import AUTO_ENGINES, choose_engine, make_plan
from nanotron_ext.report import table
from nanotron_ext.schedule.simulator import StageTimes, simulate
from nanotron_ext.schedule.zbv import simulate_zbv
from nanotron_ext.simulate import plan_stage_times, simulate_plan
from nanotron_ext.strategies.step_time import schedule_problem

PPS = (4, 8)
#: The most splits search_v_split simulates, by pp (a pp-8 step of m = 16 takes about 0.13 s to simulate).
SEARCH_EVALS = {4: 300, 8: 60}
ONE_F_ONE_B_FAMILY = ("1f1b", "zb1p", "zb2p")


def equal_stages() -> None:
    rows = []
    for share in (0.5, 0.4, 0.25):
        for pp in PPS:
            for m in (2 * pp, 4 * pp):
                whole = StageTimes(2.0, 4.0, weight=4.0 * share)
                family = {e: simulate([whole] * pp, m, e) for e in ONE_F_ONE_B_FAMILY}
                v = simulate_zbv([StageTimes(1.0, 2.0, weight=2.0 * share)] * (2 * pp), m)
                floor_1f1b, floor_v = (pp - 1) * 2.0 + m * 6.0, (pp - 1) * 1.0 + m * 6.0
                rows.append(
                    [
                        f"{share:g}",
                        pp,
                        m,
                        *(f"{family[e].pipeline_time / floor_1f1b:.3f}" for e in ONE_F_ONE_B_FAMILY),
                        f"{v.pipeline_time / floor_v:.3f}",
                        f"{v.pipeline_time / family['zb1p'].pipeline_time:.3f}",
                        f"{v.pipeline_time / family['zb2p'].pipeline_time:.3f}",
                        f"{2 * max(family['1f1b'].peak_in_flight)} / {2 * max(family['zb2p'].peak_in_flight)}"
                        f" / {max(v.peak_held)}",
                    ]
                )
    print(
        "Equal stages, no p2p: each engine's step ÷ its floor; zbv ÷ zb1p and ÷ zb2p; the most activations a rank "
        "holds (chunks: 1F1B and zb2p from F to B, zbv from F to W)\n"
    )
    print(
        table(
            [
                "W ÷ backward",
                "pp",
                "m",
                "1f1b",
                "zb1p",
                "zb2p",
                "zbv",
                "zbv ÷ zb1p",
                "zbv ÷ zb2p",
                "held 1f1b / zb2p / zbv",
            ],
            rows,
            markdown=True,
        )
    )


def public_shapes() -> None:
    rows = []
    cases = [(name, file, pp) for name, file in SHAPES for pp in PPS]
    for name, file, pp in progress(cases, desc="shapes"):
        m = 2 * pp
        base = load_config(CONFIGS / file, pp=pp).with_overrides(n_micro_batches=m)
        steps: dict[str, float] = {}
        for engine in ONE_F_ONE_B_FAMILY:
            cfg = base.with_overrides(engine=engine)
            blocks = inventory_from_config(cfg)
            try:
                steps[engine] = simulate_plan(make_plan(blocks, cfg), blocks, cfg).step_time
            except NanotronExtError:
                continue
        chunked = load_config(CONFIGS / file, pp=2 * pp).with_overrides(
            n_micro_batches=m, engine="zb1p", cost_strategy="flops"
        )
        blocks = inventory_from_config(chunked)
        try:
            plan = make_plan(blocks, chunked, suggest_fixes=False)
            times = plan_stage_times(plan, blocks, chunked)
        except NanotronExtError as exc:
            rows.append([name, pp, m, "-", "-", "-", "-", "-", "-", "-", f"no V: {exc}"[:60]])
            continue
        v = simulate_zbv(times.stages, m, times.p2p)
        flops = tuple(bounds_from_ranks(plan.block_ranks, 2 * pp))
        moved = descend_v_split(schedule_problem(blocks, chunked), flops, valid=_weights_on_every_chunk(blocks))
        ms = {e: f"{steps[e] * 1e3:.1f}" if e in steps else "-" for e in ONE_F_ONE_B_FAMILY}
        against = _against(steps)

        rows.append(
            [
                name,
                pp,
                m,
                ms["1f1b"],
                ms["zb1p"],
                ms["zb2p"],
                f"{v.step_time * 1e3:.1f}",
                against("zb1p", v.step_time),
                f"{v.pipeline_bubble_fraction:.1%}",
                f"{moved.step * 1e3:.1f}",
                against("zb1p", moved.step),
                against("zb2p", moved.step),
                moved.evaluated,
                f"{max(v.peak_held)} of {2 * pp}",
            ]
        )
    print(
        "\nPublic shapes, m = 2·pp, analytic H100: simulated step (ms) of each engine's default plan; ZB-V on the "
        "FLOP-balanced 2·pp chunks, then on the chunks a descent from them reaches (descend_v_split: splits timed)\n"
    )
    print(
        table(
            [
                "shape",
                "pp",
                "m",
                "1f1b",
                "zb1p",
                "zb2p",
                "zbv flops",
                "÷ zb1p",
                "its bubble",
                "zbv descent",
                "÷ zb1p",
                "÷ zb2p",
                "timed",
                "zbv held (chunks)",
            ],
            rows,
            markdown=True,
        )
    )


def under_memory() -> None:
    """ZB-V split for its step under 1F1B's peak in bytes (each rank's two chunks at the moments they coincide),
    by the branch-and-bound search from the FLOP-balanced chunks; against the FLOP chunks' own peak."""
    rows = []
    cases = [(name, file, pp) for name, file in SHAPES for pp in PPS]
    for name, file, pp in progress(cases, desc="under memory"):
        peaks, steps = _family_peaks(file, pp)
        rows.append(_v_under_memory(name, file, pp, peaks["1f1b"], _against(steps)))
    _print_under_memory(rows)


def _family_peaks(file: str, pp: int) -> tuple[dict[str, float], dict[str, float]]:
    """The largest stage peak and the simulated step of each 1F1B-family engine's default plan, m = 2·pp (an engine
    with no plan left out)."""
    peaks: dict[str, float] = {}
    steps: dict[str, float] = {}
    for engine in ONE_F_ONE_B_FAMILY:
        cfg = load_config(CONFIGS / file, pp=pp).with_overrides(n_micro_batches=2 * pp, engine=engine)
        blocks = inventory_from_config(cfg)
        try:
            plan = make_plan(blocks, cfg, suggest_fixes=False)
        except NanotronExtError:
            continue
        peaks[engine] = max(stage.memory.peak for stage in plan.stages)
        steps[engine] = simulate_plan(plan, blocks, cfg).step_time
    return peaks, steps


def _v_under_memory(name: str, file: str, pp: int, cap: float, against: Callable[[str, float], str]) -> list[Any]:
    """The table's row of one shape: the V's best split under ``cap`` bytes a rank, from the FLOP chunks."""
    m = 2 * pp
    chunked = load_config(CONFIGS / file, pp=2 * pp).with_overrides(
        n_micro_batches=m, engine="zb1p", cost_strategy="flops"
    )
    blocks = inventory_from_config(chunked)
    plan = make_plan(blocks, chunked, suggest_fixes=False)
    flops = tuple(bounds_from_ranks(plan.block_ranks, 2 * pp))
    problem = schedule_problem(blocks, chunked)
    flops_peak = max(x.peak for x in v_peaks(blocks, chunked, flops, v_simulate(problem, flops)))
    tries = _search_under(problem, blocks, chunked, flops, cap, pp)
    eager, found = min(tries.items(), key=lambda kv: kv[1].step)
    head = [name, pp, m, f"{cap / GIB:.1f}", f"{flops_peak / GIB:.1f}"]
    timed = sum(t.evaluated for t in tries.values())
    if found.bounds is None:
        return [*head, "none fits", *["-"] * 8, timed]
    result = v_simulate(problem, found.bounds, eager, v_budget(blocks, chunked, found.bounds, cap))
    v_peak = max(x.peak for x in v_peaks(blocks, chunked, found.bounds, result))
    return [
        *head,
        f"{v_peak / GIB:.1f}",
        f"{found.step * 1e3:.1f}",
        against("zb1p", found.step),
        against("zb2p", found.step),
        f"{found.step / v_lower_bound(problem, found.bounds):.3f}",
        f"{result.pipeline_bubble_fraction:.1%}",
        max(result.peak_held),
        "at once" if eager else "deferred",
        "proven" if found.proven else f"≤ {found.gap:.1%}",
        timed,
    ]


def _search_under(
    problem: Any, blocks: Sequence[BlockInfo], chunked: PlannerConfig, flops: tuple[int, ...], cap: float, pp: int
) -> dict[tuple[int, ...], Any]:
    """``search_v_split`` from ``flops`` with every rank under ``cap`` bytes, by whether the loss chunk's W runs at
    once (the key: the chunks whose W is eager)."""

    def fits(bounds: Sequence[int], result: Any) -> bool:
        return max(x.peak for x in v_peaks(blocks, chunked, bounds, result)) <= cap

    weights = _weights_on_every_chunk(blocks)

    def valid(bounds: Sequence[int]) -> bool:
        return weights(bounds) and max(v_floors(blocks, chunked, bounds)) <= cap

    def budgets(bounds: Sequence[int]) -> Any:
        return v_budget(blocks, chunked, bounds, cap)

    # The scheduler under each rank's budget in bytes, the loss chunk's W deferred or run at once.
    return {
        eager: search_v_split(
            problem, flops, valid=valid, fits=fits, max_evals=SEARCH_EVALS[pp], eager=eager, budgets=budgets
        )
        for eager in ((), (2 * pp - 1,))
    }


def _print_under_memory(rows: list[list[Any]]) -> None:
    print(
        "\nUnder 1F1B's peak, analytic H100 (GiB: the largest rank's estimate): ZB-V's best split found by "
        "search_v_split from the FLOP chunks, each rank scheduled under its budget in bytes (v_budget), the loss "
        "chunk's W deferred or run at once, whichever is faster (its gap to the lower bound when the search's "
        f"budget ran out); at most {SEARCH_EVALS[4]} splits simulated per search at pp 4, {SEARCH_EVALS[8]} at pp 8; "
        "÷ bound: the step over the split's floor (v_lower_bound: no order of those chunks is faster); held: the "
        "most chunk-activations a rank holds from F to W (1F1B's count: 2·pp)\n"
    )
    print(
        table(
            [
                "shape",
                "pp",
                "m",
                "1f1b GiB",
                "zbv flops GiB",
                "zbv GiB",
                "zbv ms",
                "÷ zb1p",
                "÷ zb2p",
                "÷ bound",
                "bubble",
                "held",
                "loss W",
                "best?",
                "timed",
            ],
            rows,
            markdown=True,
        )
    )


def _weights_on_every_chunk(blocks: Sequence[BlockInfo]) -> Callable[[Sequence[int]], bool]:
    weights = [b.params > 0 for b in blocks]
    return lambda bounds: all(any(weights[s:e]) for s, e in zip(bounds, bounds[1:]))


def _against(steps: dict[str, float]) -> Callable[[str, float], str]:
    return lambda engine, step: f"{step / steps[engine]:.3f}" if engine in steps else "-"


def auto_picks() -> None:
    """What ``pp_engine: auto`` takes on each public shape at PP 4 and 8, ``m = 2·pp``, on the analytic H100."""
    rows = []
    for name, file, pp in progress([(n, f, pp) for n, f in SHAPES for pp in PPS], desc="auto"):
        cfg = load_config(CONFIGS / file, pp=pp).with_overrides(n_micro_batches=2 * pp, engine="auto")
        try:
            choice = choose_engine(cfg)
        except NanotronExtError:
            rows.append([name, pp, 2 * pp, "none fits", *["-"] * len(AUTO_ENGINES)])
            continue
        cells = {
            o.engine: "-"
            if o.step_time is None or o.peak is None
            else f"{o.step_time * 1e3:.1f} / {o.peak / GIB:.1f}{'' if o.fits else ' over'}"
            for o in choice.options
        }
        rows.append([name, pp, 2 * pp, choice.engine, *(cells[e] for e in AUTO_ENGINES)])
    print(
        "\npp_engine: auto on the analytic H100 (79.18 GiB a GPU), m = 2·pp: the engine taken; each engine's "
        "simulated step (ms) / largest rank's peak (GiB), 'over' where it does not fit\n"
    )
    print(table(["shape", "pp", "m", "auto", *AUTO_ENGINES], rows, markdown=True))


def main() -> None:
    import sys

    print_command()
    if "--auto-only" not in sys.argv[1:]:
        equal_stages()
        public_shapes()
        under_memory()
    auto_picks()


if __name__ == "__main__":
    main()
