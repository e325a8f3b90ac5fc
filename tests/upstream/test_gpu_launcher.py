"""``benchmarks/gpu_launcher.py``, the launcher step of ``gpu_check.sh`` (issue 41), rehearsed on CPU with the
launcher's ``--cpu-debug``: upstream's run_train.py through ``python -m nanotron_ext.run`` at world 1 trains, saves a
checkpoint whose record verifies, and the script says so. What only a GPU checks: the same on CUDA over NCCL with
flash-attn's kernels stood in (``gpu_check.sh`` step ``launcher_cuda``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanotron_ext.procs import local_env

from .harness import upstream_tree

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

REPO = Path(__file__).resolve().parents[2]


def test_the_launcher_step_trains_saves_and_verifies_its_checkpoint(tmp_path: Path) -> None:
    run_train = upstream_tree() / "run_train.py"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(REPO / "benchmarks" / "gpu_launcher.py"),
            str(run_train),
            str(tmp_path),
            "--cpu-debug",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=local_env(REPO),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_launcher: trained through the launcher and saved checkpoint 4, " in done.stdout
    assert " files proved" in done.stdout
    config = yaml.safe_load((tmp_path / "gpu_launcher.yaml").read_text())
    assert config["parallelism"]["pp"] == 1 and config["checkpoints"]["checkpoints_path"] == str(
        tmp_path / "checkpoints"
    )
    assert (tmp_path / "checkpoints" / "4").is_dir()
