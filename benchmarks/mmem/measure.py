"""One ``measured_memory.py`` scenario measured: plan it, run its ranks (each records every allocation of training
2 steps) and pair each rank's measurement with its stage's estimate; ``pp_engine: auto`` under a cap between two
engines' estimated peaks."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mmem.scenarios import ROOT, Scenario

#: The benchmark whose ``--worker`` the ranks run.
SCRIPT = ROOT / "benchmarks" / "measured_memory.py"
TIMEOUT_S = 300.0


def worker(spec_path: str, out_path: str) -> None:
    """One rank: measure the planned split; write this rank's measurements to ``out_path.RANK``."""
    from nanotron_ext.config import config_from_dict
    from nanotron_ext.runtime.memory_measure import measure_training_memory

    spec = json.loads(Path(spec_path).read_text())
    cfg = config_from_dict(spec["raw"], source=spec["label"])
    result = measure_training_memory(cfg, spec["block_ranks"], steps=2)
    Path(f"{out_path}.{os.environ['RANK']}").write_text(json.dumps(result))


def run_scenario(sc: Scenario) -> dict[str, Any]:
    """Plan, measure every rank, and pair each rank with its stage's estimate."""
    from nanotron_ext.config import config_from_dict
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.procs import local_env, run_local_ranks

    raw = sc.raw_config()
    cap = chosen = None
    if sc.cap_between is not None:
        raw, cap, chosen = _auto_under_a_cap(raw, sc.cap_between, fixed_split=sc.fixed_split)
    cfg = config_from_dict(raw, source=sc.label)
    plan = make_plan(inventory_from_config(cfg), cfg)
    world = cfg.run.dp * cfg.run.pp * cfg.run.tp
    with tempfile.TemporaryDirectory(prefix="measured_memory_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({"raw": raw, "label": sc.label, "block_ranks": list(plan.block_ranks)}))
        run = run_local_ranks(
            [sys.executable, str(SCRIPT), "--worker", str(spec_path), str(out_path)],
            world,
            timeout=TIMEOUT_S,
            grace=0,
            env=local_env(ROOT, NANOTRON_EXT_DEVICE=sc.device),
            cwd=ROOT,
        )
        if not run.ok:
            raise RuntimeError(f"scenario {sc.label!r} failed:\n{run.describe(tail=60)}")
        measured = [json.loads(Path(f"{out_path}.{r}").read_text()) for r in range(world)]
    rows = []
    for m in measured:
        est = plan.stages[m["pp_rank"]].memory
        assert est is not None
        rows.append(
            {
                "scenario": sc.label,
                "pp_rank": m["pp_rank"],
                "tp_rank": m["tp_rank"],
                "blocks": plan.stages[m["pp_rank"]].label,
                "estimate": est.to_dict(),
                "measured": m,
                "est_pipeline": est.pipeline_peak,
                "est_optimizer": est.optimizer_peak,
                "est_peak": est.peak,
                "ratio": est.peak / m["peak"],
            }
        )
    return {"label": sc.label, "block_ranks": list(plan.block_ranks), "rows": rows, "cap": cap, "auto": chosen}


def _auto_under_a_cap(
    raw: dict[str, Any], engines: tuple[str, str], *, fixed_split: bool
) -> tuple[dict[str, Any], float, Any]:
    """``raw`` under ``memory_cap_gib`` halfway between ``engines``' estimated peaks on ``flops``'s split, with the
    engine ``auto`` takes there (``fixed_split``: on that split, written as a ``layout``); the cap (bytes) and
    ``auto``'s choice (as a dict)."""
    from nanotron_ext.config import config_from_dict
    from nanotron_ext.costs.analytic import GIB
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.partition.layout_string import layout_string
    from nanotron_ext.plan import make_plan, resolve_engine

    raw = {**raw, "parallelism": {**raw["parallelism"], "cost_strategy": "flops"}}
    peaks = []
    for engine in engines:
        cfg = config_from_dict({**raw, "parallelism": {**raw["parallelism"], "pp_engine": engine}})
        blocks = inventory_from_config(cfg)
        plan = make_plan(blocks, cfg)
        peaks.append(max(s.memory_bytes for s in plan.stages))
        layout = layout_string([b.role for b in blocks], plan.block_ranks)
    cap = sum(peaks) / 2
    if fixed_split:
        raw = {
            **raw,
            "parallelism": {**raw["parallelism"], "cost_strategy": "layout"},
            "nanotron_ext": {**raw["nanotron_ext"], "layout": layout},
        }
    raw = {
        **raw,
        "parallelism": {**raw["parallelism"], "pp_engine": "auto"},
        "nanotron_ext": {**raw["nanotron_ext"], "memory_cap_gib": cap / GIB},
    }
    cfg, choice = resolve_engine(config_from_dict(raw))
    print("\n".join(choice.lines()) if choice is not None else "", file=sys.stderr, flush=True)
    return (
        {**raw, "parallelism": {**raw["parallelism"], "pp_engine": cfg.run.engine}},
        cap,
        None if choice is None else choice.to_dict(),
    )
