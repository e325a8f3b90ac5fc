"""ZB-V (issue 43, first part: the schedule, simulated) against 1F1B, zb1p and zb2p, on equal stages and on the public
shapes. No engine runs ZB-V yet: these are the simulator's figures (``nanotron_ext.schedule.zbv``).

Part 1, equal stages (no p2p, no update): a rank's work per micro-batch ``F = 2``, ``B + W = 4`` (two chunks of
1 and 2), ``W`` half, 0.4 or a quarter of the backward; each engine's pipeline step against the floor of a
synchronised step, ``(pp - 1) F + m (F + B + W)`` for the 1F1B family and ``(pp - 1) F / 2 + m (F + B + W)`` for
the V (its first activation reaches the last rank after half-stages), and the most activations a rank holds, in
chunk units (a chunk: half of a rank's stage; 1F1B's first rank holds ``2 min(pp, m)``).

Part 2, the public shapes (``nanotron_ext/configs``) at PP 4 and 8 with ``m = 2·pp`` on the analytic H100 model:
1F1B, zb1p and zb2p each on its own default plan (``simulate_plan``); the V on the FLOP-balanced split of the
blocks into ``2·pp`` chunks (``cost_strategy: flops`` at ``pp = 2·pp``; stage ``s`` on rank ``s``, then back up),
priced by the same machine, p2p per cut included. The split is not yet chosen for the V (issue 43's third item), and
its memory in bytes is not yet estimated: the rows print the V's peak in chunk-activations only.

Usage: ``python benchmarks/zbv_simulated.py``
"""

from __future__ import annotations

from _common import CONFIGS, SHAPES, print_command, progress

from nanotron_ext.config import load_config
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.report import table
from nanotron_ext.schedule.simulator import StageTimes, simulate
from nanotron_ext.schedule.zbv import simulate_zbv
from nanotron_ext.simulate import plan_stage_times, simulate_plan

PPS = (4, 8)
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
                rows.append([f"{share:g}", pp, m,
                             *(f"{family[e].pipeline_time / floor_1f1b:.3f}" for e in ONE_F_ONE_B_FAMILY),
                             f"{v.pipeline_time / floor_v:.3f}",
                             f"{v.pipeline_time / family['zb1p'].pipeline_time:.3f}",
                             f"{v.pipeline_time / family['zb2p'].pipeline_time:.3f}",
                             f"{2 * max(family['1f1b'].peak_in_flight)} / {2 * max(family['zb2p'].peak_in_flight)}"
                             f" / {max(v.peak_held)}"])
    print("Equal stages, no p2p: each engine's step ÷ its floor; zbv ÷ zb1p and ÷ zb2p; the most activations a rank "
          "holds (chunks: 1F1B and zb2p from F to B, zbv from F to W)\n")
    print(table(["W ÷ backward", "pp", "m", "1f1b", "zb1p", "zb2p", "zbv", "zbv ÷ zb1p", "zbv ÷ zb2p",
                 "held 1f1b / zb2p / zbv"], rows, markdown=True))


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
        chunked = load_config(CONFIGS / file, pp=2 * pp).with_overrides(n_micro_batches=m, engine="zb1p",
                                                                         cost_strategy="flops")
        blocks = inventory_from_config(chunked)
        try:
            plan = make_plan(blocks, chunked, suggest_fixes=False)
            times = plan_stage_times(plan, blocks, chunked)
        except NanotronExtError as exc:
            rows.append([name, pp, m, "-", "-", "-", "-", "-", "-", "-", f"no V: {exc}"[:60]])
            continue
        v = simulate_zbv(times.stages, m, times.p2p)
        ms = {e: f"{steps[e] * 1e3:.1f}" if e in steps else "-" for e in ONE_F_ONE_B_FAMILY}
        rows.append([name, pp, m, ms["1f1b"], ms["zb1p"], ms["zb2p"], f"{v.step_time * 1e3:.1f}",
                     f"{v.step_time / steps['zb1p']:.3f}" if "zb1p" in steps else "-",
                     f"{v.step_time / steps['zb2p']:.3f}" if "zb2p" in steps else "-",
                     f"{v.pipeline_bubble_fraction:.1%}", f"{max(v.peak_held)} of {2 * pp}"])
    print("\nPublic shapes, m = 2·pp, analytic H100: simulated step (ms) of each engine's default plan, and of ZB-V "
          "on the FLOP-balanced 2·pp chunks\n")
    print(table(["shape", "pp", "m", "1f1b", "zb1p", "zb2p", "zbv", "zbv ÷ zb1p", "zbv ÷ zb2p", "zbv pipeline bubble",
                 "zbv held (chunks)"], rows, markdown=True))


def main() -> None:
    print_command()
    equal_stages()
    public_shapes()


if __name__ == "__main__":
    main()
