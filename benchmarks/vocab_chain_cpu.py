"""Measured on CPU with Nanotron's engine: the vocabulary-shard chain vs the best whole-block split, in one run.

The seed model (``nanotron_ext/configs/tiny_llama_large_vocab.yaml``: 2 layers, hidden 16, vocabulary 50277,
sequence 32, micro-batch 2, 4 micro-batches, 1F1B, fp32) at pp=2 on two real processes over gloo (one thread
each). The models live in the same two processes and take turns, round after round, in alternating order
(each turn: ``--rewarm`` untimed steps, then ``--steps`` timed ones), so load from other processes on a
shared machine slows all alike:

* ``whole blocks``: the default planner's split of the unsplit model (``vocab_shards: 1``, ``constrained``,
  step-time objective), i.e. the best split of whole blocks: ``embedding, decoder.0-1, final_norm |
  lm_head, cast, loss``;
* ``chain, FLOPs``: ``vocab_shards: auto`` with the same strategy (it picks K=2 here: ``embedding,
  decoder.0-1, final_norm, vocab.0 | vocab.1``);
* ``chain, profiled``: ``vocab_shards: auto`` with ``cost_strategy: profiled``: K and the split chosen on
  block times measured on rank 0 at the start of this run (the small decoder layers cost far more on CPU
  than their FLOPs say).

All start from the same weights (the shards hold the lm_head's rows) and train on the same tokens, so their
losses must agree; the script checks it. ``nanotron_ext.runtime.timing.StepTimer`` splits each rank's step into
busy time and waits (receives, sends, collectives, the closing barrier); printed: medians over the timed steps
of the step (slowest rank), the engine's pipeline part, and per stage busy time, the main thread's CPU time
over the step (busy well above CPU means the rank was runnable but descheduled: the machine is shared) and
the waits.

Usage: ``python benchmarks/vocab_chain_cpu.py [--rounds 8] [--steps 3] [--rewarm 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_cpu import ENGINE, PP, launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "nanotron_ext" / "configs" / "tiny_llama_large_vocab.yaml"
#: (label, vocab_shards, cost_strategy) of each model trained.
VARIANTS: tuple[tuple[str, Any, str], ...] = (
    ("whole blocks", 1, "constrained"),
    ("chain, FLOPs", "auto", "constrained"),
    ("chain, profiled", "auto", "profiled"),
)
SPLITS = tuple(v[0] for v in VARIANTS)


def worker(spec_path: str, out_path: str) -> None:
    """One rank: plan both, build both, train them in turns with timing; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.plan import make_plan, resolve_vocab_shards
    from nanotron_ext.runtime import (
        GlooParallelContext,
        build_cpu_llama,
        build_optimizer,
        random_micro_batches,
        train_step,
    )
    from nanotron_ext.runtime.timing import StepTimer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with GlooParallelContext(1, PP, 1, timeout_s=300) as ctx:
        runs: dict[str, dict[str, Any]] = {}
        for label, shards, strategy in VARIANTS:
            raw = {**spec["raw"], "nanotron_ext": {"vocab_shards": shards, "profile_cache": spec["cache"]}}
            raw["parallelism"] = {**raw["parallelism"], "cost_strategy": strategy}
            cfg, _ = resolve_vocab_shards(config_from_dict(raw, source=label))
            blocks = inventory_from_config(cfg)
            plan = make_plan(blocks, cfg)
            torch.manual_seed(0)
            model = build_cpu_llama(
                llama_config_from_shape(cfg), ctx, block_ranks=list(plan.block_ranks), vocab_shards=cfg.vocab_shards
            )
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
            runs[label] = {
                "model": model,
                "optimizer": optimizer,
                "grad_acc": grad_acc,
                "cfg": cfg,
                "plan": plan,
                "batches": random_micro_batches(
                    model, ctx, cfg.model.vocab_size, cfg.run.micro_batch_size, cfg.run.sequence_length
                ),
                "timer": StepTimer(model, ctx),
                "losses": [],
                "labels": [s.label for s in plan.stages],
            }
        loads = []
        for r in range(spec["rounds"]):
            loads.append(os.getloadavg()[0])
            order = SPLITS[r % len(SPLITS) :] + SPLITS[: r % len(SPLITS)]  # each goes first in turn
            for label in order:
                run = runs[label]
                for record in [False] * spec["rewarm"] + [True] * spec["steps"]:
                    with run["timer"] as timer, timer.step(record=record):
                        run["losses"].append(
                            train_step(
                                run["model"],
                                ctx,
                                ENGINE,
                                run["batches"],
                                run["cfg"].run.n_micro_batches,
                                run["optimizer"],
                                grad_accumulator=run["grad_acc"],
                                clip_grad=None,
                            )
                        )
        out = {}
        for label, run in runs.items():
            per_rank = run["timer"].gather()
            if per_rank is not None:
                out[label] = {
                    "ranks": list(run["plan"].block_ranks),
                    "stages": run["labels"],
                    "losses": run["losses"],
                    "vocab_shards": run["cfg"].vocab_shards,
                    "records": [[rec.to_dict() for rec in recs] for recs in per_rank],
                }
        if dist.get_rank() == 0:
            Path(out_path).write_text(json.dumps({"runs": out, "load_average": loads}))


def _worst_loss_gap(result: dict[str, Any]) -> float:
    ref = result["runs"]["whole blocks"]["losses"]
    return max(abs(x - y) / abs(y) for label in SPLITS[1:] for x, y in zip(result["runs"][label]["losses"], ref))


def _med(values: Sequence[float]) -> float:
    return statistics.median(values)


def report(result: dict[str, Any]) -> str:
    """The side-by-side table, the per-stage breakdown and the ratio."""
    lines = []
    head = f"{'split':<17}{'stages':<58}{'step ms':>9}{'pipeline ms':>13}"
    lines += [head, "-" * len(head)]
    summary = {}
    for label in SPLITS:
        run = result["runs"][label]
        recs = run["records"]
        steps = [max(r[i]["step"] for r in recs) for i in range(len(recs[0]))]
        pipes = [max(r[i]["pipeline"] for r in recs) for i in range(len(recs[0]))]
        summary[label] = (_med(steps), _med(pipes))
        lines.append(f"{label:<17}{' | '.join(run['stages']):<58}{_med(steps) * 1e3:>9.1f}{_med(pipes) * 1e3:>13.1f}")
    lines.append("")
    keys = ("busy", "cpu", "recv_wait", "send_wait", "collective_wait", "end_wait")
    widths = (9, 9, 11, 11, 12, 10)
    head = f"{'split':<17}{'stage':>6}" + "".join(
        f"{h:>{w}}" for h, w in zip(("busy ms", "CPU ms", "recv wait", "send wait", "collective", "end wait"), widths)
    )
    lines += [head, "-" * len(head)]
    for label in SPLITS:
        for stage, recs in enumerate(result["runs"][label]["records"]):
            cells = [_med([r[k] for r in recs]) * 1e3 for k in keys]
            lines.append(f"{label:<17}{stage:>6}" + "".join(f"{c:>{w}.1f}" for c, w in zip(cells, widths)))
    lines.append("")
    whole = summary["whole blocks"]
    for label in SPLITS[1:]:
        chain = summary[label]
        k = result["runs"][label]["vocab_shards"]
        lines.append(
            f"{label} (K={k}): step {chain[0] * 1e3:.1f} ms vs whole blocks {whole[0] * 1e3:.1f} ms -> "
            f"{whole[0] / chain[0]:.2f}x as fast (pipeline part {whole[1] / chain[1]:.2f}x)"
        )
    lines.append(
        f"losses agree over {len(result['runs']['whole blocks']['losses'])} steps: worst relative "
        f"difference {_worst_loss_gap(result):.1e}"
    )
    loads = result["load_average"]
    lines.append(f"load average (1 min) during the rounds: {min(loads):.1f} to {max(loads):.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per turn")
    parser.add_argument("--rewarm", type=int, default=1, help="untimed steps at the start of each turn")
    args = parser.parse_args(argv)
    raw = yaml.safe_load(CONFIG.read_text())
    raw.pop("nanotron_ext", None)
    print("$ python benchmarks/vocab_chain_cpu.py " + " ".join(argv))
    with tempfile.TemporaryDirectory(prefix="vocab_chain_profile_") as cache:  # measured afresh in this run
        spec = {
            "label": "vocab chain",
            "raw": raw,
            "rounds": args.rounds,
            "steps": args.steps,
            "rewarm": args.rewarm,
            "cache": cache,
        }
        result = launch(spec, script=Path(__file__).resolve())
    print(report(result))
    return 0 if _worst_loss_gap(result) < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
