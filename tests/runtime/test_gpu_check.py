"""``benchmarks/gpu_check.sh`` on this machine: without a CUDA device it stops at once, exit 2, with the reason
and the fix and nothing written; rehearsed on CPU (``GPU_CHECK_REHEARSAL=1``) every step the CPU can take runs
and the summary says what ran. What only a GPU can check: the steps themselves on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **env}, cwd=REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_stops_at_once_with_the_reason_and_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    done = _run(out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("gpu_check: no CUDA device: torch "), done.stderr
    assert "Run it on a machine with an NVIDIA GPU, its driver and a CUDA build of torch" in done.stderr
    # What it found is printed first: the GPUs (or that nvidia-smi is missing), torch, flash-attn.
    assert "CUDA available: False" in done.stdout and "flash-attn: " in done.stdout
    assert not out.exists(), "nothing is written without a GPU"


def test_rehearsal_on_cpu_runs_the_steps_and_says_it_was_no_gpu_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    done = _run(out, GPU_CHECK_REHEARSAL="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "REHEARSAL on CPU" in summary and "Result: every step ok" in summary
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    ran = {name for name, rc in steps.items() if rc == "0"}
    assert ran == {"calibrate_seed_alone", "calibrate_seed_pp2_gloo", "plan_seed", "simulate_seed", "train_seed_cpu",
                   "train_seed_cuda", "compare_seed_cuda_cpu"}, steps
    assert set(steps.values()) == {"0", "skipped"}
    same = json.loads((out / "train" / "seed_cuda_vs_cpu.json").read_text())
    assert same["same"] and same["max_rel_diff"] == 0.0  # the forced host staging changes no bit
    staged = json.loads((out / "train" / "seed_cuda.json").read_text())
    assert staged["p2p"] == "gloo, host-staged"
