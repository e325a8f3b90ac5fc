"""The in-run profile priced again from a scenario's own clocked steps under each statistic over steps
(``nanotron_ext.machine.in_run``: the mean of every sample, the median of each step's mean), and every split
predicted under each, against its measured median step: offline, from what ``in_run_accuracy.py --raw`` keeps.

Usage: ``python benchmarks/in_run/estimators.py RAW.json [RAW.json ...]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from in_run.report import step_times  # noqa: E402
from nanotron_ext.config import load_config  # noqa: E402
from nanotron_ext.inventory import inventory_from_config  # noqa: E402
from nanotron_ext.machine import load_machine  # noqa: E402
from nanotron_ext.machine.in_run import (  # noqa: E402
    InRunSplit,
    in_run_profile,
    mean_of_samples,
    median_of_steps,
)
from nanotron_ext.machine.in_run_records import BlockOps, RankStep, Receive, Send  # noqa: E402
from nanotron_ext.partition.layout_string import layout_string  # noqa: E402
from nanotron_ext.plan import plan_with_ranks  # noqa: E402
from nanotron_ext.report import table  # noqa: E402
from nanotron_ext.simulate import simulate_plan  # noqa: E402

STATISTICS = {"mean of samples": mean_of_samples, "median of steps": median_of_steps}


def rank_step(d: dict[str, Any]) -> RankStep:
    """A :class:`RankStep` from its ``dataclasses.asdict``."""
    return RankStep(
        d["pp_rank"],
        d["engine"],
        tuple(BlockOps(b["block"], tuple(b["forward"]), tuple(b["backward"]), tuple(b["weight"])) for b in d["blocks"]),
        tuple(tuple(c) for c in d["calls"]),
        d["update"],
        tuple(Send(**s) for s in d["sends"]),
        tuple(Receive(**r) for r in d["receives"]),
        None if d["tied_sync"] is None else tuple(d["tied_sync"]),
        d["clock"],
    )


def ratios(result: dict[str, Any]) -> list[list[str]]:
    """One row per run (the profile's own marked): its layout, measured median and predicted ÷ measured under each
    statistic."""
    spec = result["spec"]
    with tempfile.TemporaryDirectory() as tmp:  # the run's config and standalone profile, as it kept them
        config, standalone = Path(tmp) / "config.yaml", Path(tmp) / "standalone.json"
        config.write_text(result["config_yaml"])
        standalone.write_text(json.dumps(result["profiles_json"]["standalone"]))
        cfg, base = load_config(config), load_machine(standalone)
    blocks = inventory_from_config(cfg)
    clocked = next(run for run in result["runs"].values() if run["clocked"])
    split = InRunSplit(tuple(clocked["block_ranks"]), tuple(tuple(map(rank_step, s)) for s in clocked["steps"]))
    profiles = {
        name: in_run_profile(cfg, blocks, [split], base, source="estimators", statistic=stat)
        for name, stat in STATISTICS.items()
    }
    own = tuple(clocked["block_ranks"]), clocked["engine"], clocked["m"]
    rows = []
    for run in result["runs"].values():
        ranks = tuple(run["block_ranks"])
        if run["clocked"]:
            continue
        c = cfg.with_overrides(engine=run["engine"], n_micro_batches=run["m"])
        plan = plan_with_ranks(blocks, c, ranks, "measured", suggest_fixes=False)
        measured = statistics.median(step_times(run["records"]))
        predicted = [
            simulate_plan(plan, blocks, c, machine=p, device=spec["device"], backend="gloo").step_time
            for p in profiles.values()
        ]
        name = (layout_string([b.role for b in blocks], ranks) or "?") + (
            " (profile's run)" if (ranks, run["engine"], run["m"]) == own else ""
        )
        rows.append(
            [name, run["engine"], str(run["m"]), f"{measured * 1e3:.0f}", *(f"{p / measured:.3f}" for p in predicted)]
        )
    return rows


def main(argv: list[str]) -> int:
    for path in argv:
        for label, result in json.loads(Path(path).read_text()).items():
            print(f"\n{path}: {label} (predicted ÷ measured median step)")
            print(table(["split", "engine", "m", "measured ms", *STATISTICS], ratios(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
