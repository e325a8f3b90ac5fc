"""What ``zb_measured_cpu.py`` and ``zbv_measured_cpu.py`` share: the model (SmolLM-135M's shape, shortened), their
flags, the launch of their two ranks, and the median's interval their gains are read with."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from nanotron_ext import stats
from nanotron_ext.allocator import MALLOC_ENV
from nanotron_ext.procs import local_env, run_local_ranks

ROOT = Path(__file__).resolve().parents[2]
#: The benchmark whose ranks :func:`launch` starts by default.
SCRIPT = ROOT / "benchmarks" / "zb_measured_cpu.py"
PP = 2
WORLD_TIMEOUT_S = 1500.0


def raw_config(layers: int, seq: int, m: int) -> dict[str, Any]:
    """SmolLM-135M's YAML at pp=2, fp32, micro-batch 1, ``layers`` layers, sequence ``seq``, ``m`` micro-batches."""
    raw = yaml.safe_load((ROOT / "nanotron_ext" / "configs" / "smollm_135m.yaml").read_text())
    raw["parallelism"].update(dp=1, tp=1, pp=PP, pp_engine="1f1b")
    raw["tokens"].update(sequence_length=seq, micro_batch_size=1, batch_accumulation_per_replica=m)
    raw["model"]["dtype"] = "float32"
    raw["model"]["model_config"]["num_hidden_layers"] = layers
    raw.setdefault("optimizer", {})["accumulate_grad_in_fp32"] = False
    return raw


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): :func:`nanotron_ext.stats.median_interval` with the median first."""
    low, high, coverage = stats.median_interval(xs, level)
    return statistics.median(xs), low, high, coverage


def launch(spec: dict[str, Any], script: str = str(SCRIPT), timeout: float = WORLD_TIMEOUT_S) -> dict[str, Any]:
    """``script``'s ``worker`` (``zb_measured_cpu.py``'s by default) in two fresh processes; rank 0's JSON."""
    with tempfile.TemporaryDirectory(prefix=f"{Path(script).stem}_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**MALLOC_ENV, **local_env(ROOT)}
        run = run_local_ranks(
            [sys.executable, str(Path(script).resolve()), "--worker", str(spec_path), str(out_path)],
            PP,
            timeout=timeout,
            grace=0,
            env=env,
            cwd=ROOT,
        )
        if not run.ok or not out_path.exists():
            raise RuntimeError(("timed out" if run.deadline_hit else "failed") + ":\n" + run.describe())
        return json.loads(out_path.read_text())


def run_args(description: str, argv: Sequence[str]) -> argparse.Namespace:
    """The arguments of the measured-engine benchmarks, with defaults resolved: ``rounds``, ``layers``, ``seq``,
    ``ms`` (sorted micro-batch counts), ``warmup``, ``out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per model (default 9; quick 3)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; quick 4)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 128; quick 64)")
    parser.add_argument("--m", type=int, action="append", default=None, help="micro-batches (default 4 and 8)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    parser.add_argument("--quick", action="store_true", help="4 layers, sequence 64, 3 rounds")
    parser.add_argument("--out", default=None, help="also write the raw JSON here")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 9)
    args.layers, args.seq = args.layers or (4 if args.quick else 8), args.seq or (64 if args.quick else 128)
    args.ms = sorted(set(args.m or [4, 8]))
    if args.rounds < 1 or args.layers < 2 or args.seq < 1 or min(args.ms) < PP - 1:
        parser.error(f"--rounds and --seq must be >= 1, --layers >= 2 and --m >= {PP - 1}")
    return args
