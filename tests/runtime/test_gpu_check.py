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
import yaml

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **env},
        cwd=REPO,
    )


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
    assert ran == {
        "calibrate_seed_alone",
        "calibrate_seed_pp2_gloo",
        "plan_seed",
        "simulate_seed",
        "train_seed_cpu",
        "train_seed_cuda",
        "compare_seed_cuda_cpu",
        "calibrate_seed_in_run",
    }, steps
    assert set(steps.values()) == {"0", "skipped"}
    in_run = json.loads((out / "profiles" / "seed_pp2_in_run.json").read_text())  # issue 41, on the run's device
    assert in_run["method"] == "in-run" and in_run["key"]["device"] == "cpu"
    assert {"calibrate_smollm_pp2_in_run", "in_run_accuracy"} <= set(steps)
    same = json.loads((out / "train" / "seed_cuda_vs_seed_cpu.json").read_text())
    assert same["same"] and same["max_rel_diff"] == 0.0  # the forced host staging changes no bit
    staged = json.loads((out / "train" / "seed_cuda.json").read_text())
    assert staged["p2p"] == "gloo, host-staged"
    # The SmolLM run the GPU trains again under zb2p (skipped here), written beside the 1F1B one.
    zb2p = yaml.safe_load((out / "configs" / "smollm_135m_pp2_zb2p.yaml").read_text())
    one = yaml.safe_load((out / "configs" / "smollm_135m_pp2.yaml").read_text())
    assert zb2p["parallelism"].pop("pp_engine") == "zb2p" and one["parallelism"].pop("pp_engine", "1f1b") == "1f1b"
    assert zb2p["parallelism"] == one["parallelism"] and zb2p["model"] == one["model"]
    assert "train_smollm_pp2_zb2p_cuda" in steps and "compare_smollm_zb2p_1f1b_cuda" in steps


def test_compare_names_the_runs_and_fails_when_their_losses_differ(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    (tmp_path / "train").mkdir()
    for name, losses in {"a": [2.0, 1.0], "b": [2.0, 1.0005], "c": [2.0, 1.01]}.items():
        (tmp_path / "train" / f"{name}.json").write_text(json.dumps({"losses": losses}))
    assert gpu_check.compare(tmp_path, "a", "b") == 0  # 5e-4 relative: within LOSS_RTOL
    record = json.loads((tmp_path / "train" / "a_vs_b.json").read_text())
    assert record["same"] and record["run"] == "a" and record["reference"] == "b"
    assert gpu_check.compare(tmp_path, "c", "a") == 1
    assert not json.loads((tmp_path / "train" / "c_vs_a.json").read_text())["same"]
