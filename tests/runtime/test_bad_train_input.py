"""The rows of ``tests/test_bad_input.py`` that run ``nanotron-ext train`` as a real process (rank 0 of a
2-rank world: every case fails before the rendezvous). Here, in the Nanotron 0.2 pass, because they start
processes; the cases themselves stay in that file's table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_bad_input import TRAIN_CASES, Case, check_reply

from nanotron_ext.cli.common import EXIT_USAGE
from nanotron_ext.procs import free_port, local_env, rendezvous_env, run_local_ranks

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_train(argv: list[str]) -> tuple[int | None, str, str]:
    """``python -m nanotron_ext.cli train ARGV --steps 1`` as rank 0 of a 2-rank world; ``env:K=V`` arguments
    set environment variables instead."""
    env = local_env(REPO_ROOT, **rendezvous_env(0, 2, free_port()))
    for arg in [a for a in argv if a.startswith("env:")]:
        key, _, value = arg[4:].partition("=")
        env[key] = value
        argv.remove(arg)
    run = run_local_ranks(
        [sys.executable, "-m", "nanotron_ext.cli", *argv, "--steps", "1"],
        1,
        timeout=120,
        env=env,
        rendezvous=False,
        merge_output=False,
    )
    return run.ranks[0].returncode, run.ranks[0].stdout, run.ranks[0].stderr


def test_there_are_train_cases() -> None:
    assert len(TRAIN_CASES) >= 5, [c.id for c in TRAIN_CASES]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.id for c in TRAIN_CASES])
def test_bad_train_input(case: Case, tmp_path: Path) -> None:
    argv = case.argv(tmp_path)
    assert argv[0] == "train", f"case {case.id!r} is named 'train ...' but runs {argv[0]!r}"
    code, out, err = _run_train(argv)
    check_reply(case, code, out, err)


def test_train_output_check_runs_before_any_work(tmp_path: Path) -> None:
    code, out, err = _run_train(["train", "--metrics-out", str(tmp_path)])
    assert code == EXIT_USAGE and "step" not in out, (out, err)  # refused before the first step
