"""Issue 42 through the launcher: ``torchrun -m nanotron_ext.run --cpu-debug run_train.py --replan-after K``, upstream
Nanotron's own trainer on CPU over gloo, re-planning after K steps and moving by a re-launch in the same processes.

The SmolLM-135M shape of ``replan_cpu.py`` (8 layers, sequence 128, micro-batch 1, fp32, tied embeddings), m = 4,
1F1B, pp = 2, written in upstream's config format. Each round trains, in turn: a *start* on a deliberately bad layout
(``--replan-after K``, ``min_gain: 0``); the same start with ``min_gain: 0.99``, which stays on it (the *bits
reference*: a resume under another split is exact, so the start that moved must end on its weights bit for bit);
and the plan the start moved to as a layout string, trained from step 1 with the same ``--replan-after K`` (the run
started on the best plan: it must stay). Its weights are not compared: Nanotron initialises a split's weights from
its ranks' random streams, so two splits start apart. Per run it prints what the launcher printed: the verdict, the
predicted steps, the measured steps before and after, and the move's cost.

Checks (exit 1 when one fails): every move ends on its bits reference's weights; the median of measured ÷ predicted
after the move is within 5 %, and the step after the move at or under the step before; every run started on the
moved-to plan stays.

Usage (upstream Nanotron installed, ``../shared`` beside the project for its ``run_train.py``)::

    OMP_NUM_THREADS=1 python benchmarks/replan_launcher.py [--rounds 3] [--steps 16] [--after 6] [--out PATH]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]

import torch  # noqa: E402
from _common import RESULTS, check_moves, finish, print_command  # noqa: E402
from upstream.e2e import launch, tiny_config, whole_weights  # noqa: E402

from nanotron_ext.report import table  # noqa: E402

#: Measured after the move ÷ predicted must lie within 1 ± this (median over rounds).
TOLERANCE = 0.05
#: Most decoder layers on the last stage (replan_cpu.py's pp = 2 start).
BAD = "E,t*2|t*6,N,H,C,X"
#: The SmolLM-135M shape, shrunk as replan_cpu.py's (nanotron_ext/configs/smollm_135m.yaml: hidden 576, 9 heads,
#: 3 KV heads, vocabulary 49152, tied), on upstream's example config.
SMOLLM = {
    "model__model_config__hidden_size": 576,
    "model__model_config__intermediate_size": 1536,
    "model__model_config__num_hidden_layers": 8,
    "model__model_config__num_attention_heads": 9,
    "model__model_config__num_key_value_heads": 3,
    "model__model_config__vocab_size": 49152,
    "model__model_config__tie_word_embeddings": True,
    "model__model_config__max_position_embeddings": 2048,
    "model__init_method": {"std": 0.02},
    "tokens__sequence_length": 128,
    "tokens__micro_batch_size": 1,
    "tokens__batch_accumulation_per_replica": 4,
    "optimizer__clip_grad": None,
}
_TIME = r"([0-9.]+) (ms|s)"


def _seconds(value: str, unit: str) -> float:
    return float(value) / (1e3 if unit == "ms" else 1.0)


def _train(folder: Path, layout: str, steps: int, after: int, min_gain: float) -> dict[str, Any]:
    folder.mkdir(parents=True)
    config = tiny_config(
        folder,
        steps=steps,
        **SMOLLM,
        ext={"cost_strategy": "layout", "layout": layout, "replan": {"min_gain": min_gain}},
    )
    run = launch(config, "--replan-after", str(after), timeout=1800)
    if run.rc != 0:
        raise SystemExit(run.out[-4000:])
    out = run.out
    now = re.search(rf"^  now:  (\S+)  (\S+)  predicted {_TIME}", out, re.M)
    best = re.search(rf"^  best: (\S+)  (\S+)  predicted {_TIME}", out, re.M)
    before = re.search(rf"replan: steps \d+-\d+ on .* measured {_TIME} a step", out)
    later = re.search(rf"replan: steps \d+-\d+ after the (?:move|re-plan), on (\S+) .*measured {_TIME} a step", out)
    cost = re.search(
        r"replan: the move took ([0-9.]+) s \(save ([0-9.]+) s, re-launch, build and load ([0-9.]+) s\); "
        r"re-plan ([0-9.]+) s; rank 0's peak memory (\d+) -> (\d+) MiB",
        out,
    )
    replan = re.search(r"replan: .*re-plan ([0-9.]+) s", out)
    if now is None or before is None or later is None:
        raise SystemExit(f"the launcher's re-plan lines are missing:\n{out[-4000:]}")
    moved = "moving to the new plan" in out
    verdict = "move" if moved else next(v for v in ("fastest plan", "below min_gain", "within the noise") if v in out)
    return {
        "layout": layout,
        "verdict": verdict,
        "moved": moved,
        "split": later[1],
        "predicted_from_s": _seconds(now[3], now[4]),
        "predicted_to_s": _seconds(best[3], best[4]) if best else _seconds(now[3], now[4]),
        "before_s": _seconds(before[1], before[2]),
        "after_s": _seconds(later[2], later[3]),
        "move_s": float(cost[1]) if cost else None,
        "save_s": float(cost[2]) if cost else None,
        "restart_s": float(cost[3]) if cost else None,
        "replan_s": float(cost[4]) if cost else (float(replan[1]) if replan else None),
        "rss_mib": [int(cost[5]), int(cost[6])] if cost else None,
        "weights": str(folder / "checkpoints" / str(steps)),
    }


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    wa, wb = whole_weights(Path(a["weights"])), whole_weights(Path(b["weights"]))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--after", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "replan_launcher.json")
    args = parser.parse_args(argv)
    print_command(argv)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="replan_launcher_") as tmp:
        for k in range(args.rounds):
            start = _train(Path(tmp) / f"start{k}", BAD, args.steps, args.after, 0.0)
            stays = _train(Path(tmp) / f"stays{k}", BAD, args.steps, args.after, 0.99)
            ref = _train(Path(tmp) / f"ref{k}", start["split"], args.steps, args.after, 0.03)
            start["bits_equal_reference"] = _same_weights(start, stays)
            rows += [
                {"run": "bad layout", **start},
                {"run": "  at min_gain 0.99", **stays},
                {"run": "  started on its end", **ref},
            ]
            if not start["moved"] or not start["bits_equal_reference"]:
                failures.append(
                    f"round {k + 1}: the start {'did not move' if not start['moved'] else 'moved'}"
                    f"{'' if start['bits_equal_reference'] else ' without its reference weights'}"
                )
            if ref["moved"]:
                failures.append(f"round {k + 1}: the run started on the start's end moved again")

            def f(x: Any, spec: str, scale: float = 1.0) -> str:
                return "-" if x is None else format(x * scale, spec)

            print(f"\nround {k + 1} of {args.rounds}", flush=True)
            print(
                table(
                    [
                        "run",
                        "verdict",
                        "trains",
                        "pred. from",
                        "pred. to",
                        "before",
                        "after",
                        "after/pred",
                        "after/before",
                        "weights = stays",
                        "re-plan",
                        "save",
                        "re-launch",
                        "peak RSS",
                    ],
                    [
                        [
                            r["run"],
                            r["verdict"],
                            r["split"],
                            f(r["predicted_from_s"], ".0f", 1e3),
                            f(r["predicted_to_s"], ".0f", 1e3),
                            f(r["before_s"], ".0f", 1e3),
                            f(r["after_s"], ".0f", 1e3),
                            f(r["after_s"] / (r["predicted_to_s"] if r["moved"] else r["predicted_from_s"]), ".3f"),
                            f(r["after_s"] / r["before_s"], ".3f"),
                            {None: "-", True: "yes", False: "NO"}[r.get("bits_equal_reference")],
                            f(r["replan_s"], ".1f"),
                            f(r["save_s"], ".2f"),
                            f(r["restart_s"], ".2f"),
                            "-" if r["rss_mib"] is None else f"{r['rss_mib'][0]}->{r['rss_mib'][1]}",
                        ]
                        for r in rows[-3:]
                    ],
                ),
                flush=True,
            )
    moved = [r for r in rows if r["moved"] and r["run"] == "bad layout"]
    if moved:
        print()
        failures += check_moves(
            "bad layout",
            [r["after_s"] / r["predicted_to_s"] for r in moved],
            [r["after_s"] / r["before_s"] for r in moved],
            TOLERANCE,
        )
    return finish(args.out, rows, failures)


if __name__ == "__main__":
    raise SystemExit(main())
