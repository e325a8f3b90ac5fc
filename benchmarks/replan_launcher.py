"""Issues 42 and 53 through the launcher: ``torchrun -m nanotron_ext.run --cpu-debug run_train.py --replan-after K``,
upstream Nanotron's own trainer on CPU over gloo, re-planning after K steps, trying the candidates against its plan in
turns (each move a re-launch in the same processes) and keeping the one it measured faster.

The SmolLM-135M shape of ``replan_cpu.py`` (8 layers, sequence 128, micro-batch 1, fp32, tied embeddings), m = 4,
1F1B, pp = 2, written in upstream's config format. Each round trains, in turn: a *start* on a deliberately bad layout
(``--replan-after K``, ``min_gain: 0``) and its *twin* (the same with ``min_gain: 0.99``: it re-plans at the same step
and stays). Every move is a resume under another split, which is exact, so the start must end on its twin's weights
bit for bit whatever it keeps. Per round it prints, from the record the launcher writes beside the checkpoints
(``nanotron_ext_replan.json``): what was tried, the trial's verdict, the plan kept, the median step after the trial
against the twin's over the same steps, and the trial's cost.

Checks (exit 1 when one fails): every start ends on its twin's weights; it moves and ends faster than its twin.

Usage (upstream Nanotron installed, ``../shared`` beside the project for its ``run_train.py``)::

    OMP_NUM_THREADS=1 python benchmarks/replan_launcher.py [--rounds 3] [--steps 32] [--after 6] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]

import torch  # noqa: E402
from _common import RESULTS, finish, print_command  # noqa: E402
from upstream.e2e import launch, tiny_config, whole_weights  # noqa: E402

from nanotron_ext.integration.replan import RECORD_NAME  # noqa: E402
from nanotron_ext.report import table  # noqa: E402

#: Most decoder layers on the last stage (replan_cpu.py's bad start).
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


def _train(folder: Path, steps: int, after: int, min_gain: float) -> dict[str, Any]:
    """One launch of the bad start; the launcher's re-plan record and where its last checkpoint is."""
    folder.mkdir(parents=True)
    ext = {"cost_strategy": "layout", "layout": BAD, "replan": {"min_gain": min_gain}}
    run = launch(tiny_config(folder, steps=steps, **SMOLLM, ext=ext), "--replan-after", str(after), timeout=3600)
    if run.rc != 0:
        raise SystemExit(run.out[-4000:])
    record = json.loads((folder / "checkpoints" / RECORD_NAME).read_text())
    return {"record": record, "weights": str(folder / "checkpoints" / str(steps))}


def _row(k: int, run: dict[str, Any], twin: dict[str, Any]) -> dict[str, Any]:
    r, t = run["record"], twin["record"]
    last = r["trial"]["turns"][-1]["timed_steps"][-1] if r["trial"] else r["after_step"]
    window = [s for s in map(int, r["step_seconds"]) if s >= last + 2]
    run_s = statistics.median(r["step_seconds"][str(s)] for s in window)
    twin_s = statistics.median(t["step_seconds"][str(s)] for s in window if str(s) in t["step_seconds"])
    wa, wb = whole_weights(Path(run["weights"])), whole_weights(Path(twin["weights"]))
    return {
        "round": k,
        "tried": [c["split"] for c in r["candidates"]],
        "verdict": (r["outcome"] or {}).get("verdict", r["verdict"]),
        "kept": r["kept"]["split"],
        "window": [min(window), max(window)] if window else None,
        "run_s": run_s,
        "twin_s": twin_s,
        "same_weights": wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa),
        "moves": r["cost"]["moves"],
        "move_s": r["cost"]["move_seconds"],
        "other_steps": r["cost"]["steps_on_other_plans"],
        "replan_s": r["seconds"]["profile"] + r["seconds"]["plan"],
    }


def _print(rows: list[dict[str, Any]]) -> None:
    head = ["round", "tried", "verdict", "kept", "steps", "run ms", "twin ms", "run/twin", "bits = twin", "moves"]
    cells = [
        [
            str(r["round"]),
            ", ".join(r["tried"]),
            r["verdict"],
            r["kept"],
            "-" if r["window"] is None else f"{r['window'][0]}-{r['window'][1]}",
            f"{r['run_s'] * 1e3:.0f}",
            f"{r['twin_s'] * 1e3:.0f}",
            f"{r['run_s'] / r['twin_s']:.3f}",
            "yes" if r["same_weights"] else "NO",
            f"{r['moves']} ({r['move_s']:.1f} s, {r['other_steps']} steps elsewhere; re-plan {r['replan_s']:.1f} s)",
        ]
        for r in rows
    ]
    print(table(head, cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--after", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS / "replan_launcher.json")
    args = parser.parse_args(argv)
    print_command(argv)
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="replan_launcher_") as tmp:
        for k in range(1, args.rounds + 1):
            twin = _train(Path(tmp) / f"twin{k}", args.steps, args.after, 0.99)
            run = _train(Path(tmp) / f"run{k}", args.steps, args.after, 0.0)
            rows.append(_row(k, run, twin))
            print(f"\nround {k} of {args.rounds}", flush=True)
            _print(rows[-1:])
    for r in rows:
        if not r["same_weights"]:
            failures.append(f"round {r['round']}: the start did not end on its twin's weights")
        if r["kept"] == BAD or r["run_s"] >= r["twin_s"]:
            failures.append(f"round {r['round']}: kept {r['kept']}, {r['run_s'] / r['twin_s']:.3f}x the twin's step")
    return finish(args.out, rows, failures)


if __name__ == "__main__":
    raise SystemExit(main())
