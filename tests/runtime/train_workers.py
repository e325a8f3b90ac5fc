"""Helpers for the trainer tests: run ``nanotron-ext train`` as real processes, write YAML variants, and the
functions that spawned ranks run for ``test_integration.py``.

Two launchers:

* :func:`launch_ranks` starts one ``python -m nanotron_ext.cli train`` process per rank with torchrun's
  environment variables and keeps each rank's stdout/stderr apart, so a test can check that *every* rank
  printed its error (torchrun itself stops the other workers as soon as one fails, which can cut a slower
  rank's message short);
* :func:`torchrun` runs the documented command, ``torchrun --standalone --nproc_per_node=N -m
  nanotron_ext.cli train ...``.

Both go through ``nanotron_ext.procs.run_local_ranks``: a hard timeout (a rank that hangs is killed
with whatever it started and reported, never waited on forever). Kept free of
pytest imports: spawned ranks load this file by path.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_ext.procs import LocalRun, local_env, run_local_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = REPO_ROOT / "nanotron_ext" / "configs" / "tiny_llama_large_vocab.yaml"


@dataclass
class RankRun:
    """One rank's process: exit code (None if killed at the deadline) and its output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False


@dataclass
class Launch:
    """A whole launch: every rank, the wall time, and rank 0's metrics/plan files if asked for."""

    ranks: list[RankRun]
    elapsed_s: float
    metrics: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)

    def describe(self) -> str:
        """Every rank's exit code and output tail, for assertion messages."""
        parts = []
        for r in self.ranks:
            tail = "\n".join((r.stdout + "\n" + r.stderr).strip().splitlines()[-30:])
            parts.append(f"--- rank {r.rank}: returncode={r.returncode} timed_out={r.timed_out}\n{tail}")
        return "\n".join(parts)


def _with_outputs(args: list[str], out_dir: Path) -> tuple[list[str], Path, Path]:
    metrics, plan = out_dir / "metrics.json", out_dir / "plan.json"
    return [*args, "--metrics-out", str(metrics), "--plan-out", str(plan)], metrics, plan


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def launch_ranks(
    args: list[str],
    world_size: int,
    *,
    timeout: float = 60.0,
    torchrun_env: bool = True,
    outputs: bool = True,
) -> Launch:
    """Run ``python -m nanotron_ext.cli train *args`` as ``world_size`` ranks (torchrun's environment).

    Args:
        args: arguments after ``train``.
        world_size: number of rank processes.
        timeout: wall-clock limit for the whole launch; ranks still running then are killed.
        torchrun_env: set RANK/WORLD_SIZE/MASTER_*; False runs one bare process (no launcher at all).
        outputs: add ``--metrics-out``/``--plan-out`` in a temporary folder and read them back.

    Returns:
        Every rank's outcome, and rank 0's metrics and plan when written.
    """
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_train_") as tmp:
        argv, metrics_path, plan_path = _with_outputs(args, Path(tmp)) if outputs else (args, None, None)
        # No grace period: every rank runs to its own end (or the deadline), so each prints its own error.
        # Imported here, not at the top: ranks load this file by path, without tests/ on sys.path.
        from runtime.forkserver import start

        run = run_local_ranks(
            [sys.executable, "-m", "nanotron_ext.cli", "train", *argv],
            world_size,
            timeout=timeout,
            env=local_env(REPO_ROOT),
            rendezvous=torchrun_env,
            merge_output=False,
            cwd=REPO_ROOT,
            start=start,
        )
        return Launch(
            _rank_runs(run),
            run.elapsed_s,
            _read_json(metrics_path) if metrics_path else None,
            _read_json(plan_path) if plan_path else None,
        )


def torchrun(args: list[str], nproc: int, *, timeout: float = 90.0) -> Launch:
    """The documented command: ``torchrun --standalone --nproc_per_node=N -m nanotron_ext.cli train *args``.

    Returns:
        A :class:`Launch` with a single entry holding torchrun's own exit code and output.
    """
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    launcher = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_torchrun_") as tmp:
        argv, metrics_path, plan_path = _with_outputs(args, Path(tmp))
        run = run_local_ranks(
            [*launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", "nanotron_ext.cli", "train", *argv],
            1,
            timeout=timeout,
            env=local_env(REPO_ROOT),
            rendezvous=False,
            merge_output=False,
            cwd=REPO_ROOT,
        )
        return Launch(_rank_runs(run), run.elapsed_s, _read_json(metrics_path), _read_json(plan_path))


def _rank_runs(run: LocalRun) -> list[RankRun]:
    return [RankRun(r.rank, r.returncode, r.stdout, r.stderr, r.killed) for r in run.ranks]


def _deep_update(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def write_config(path: Path, changes: dict[str, Any] | None = None) -> Path:
    """A copy of the bundled tiny large-vocab YAML with ``changes`` merged in (nested dicts merge)."""
    import yaml

    raw = yaml.safe_load(TINY_YAML.read_text())
    path.write_text(yaml.safe_dump(_deep_update(copy.deepcopy(raw), copy.deepcopy(changes or {}))))
    return path


def final_weights(metrics: dict[str, Any]) -> dict[str, str]:
    """Every parameter's hash after training (``--metrics-out``), from whichever rank holds it at the end (after a
    re-plan's move that may be another rank than at the start)."""
    return {
        name: c["sha256_after"]
        for rank in metrics["ranks"]
        for name, c in rank["checksums"].items()
        if "sha256_after" in c
    }


def constant_lr(lr: float) -> dict[str, Any]:
    """YAML changes for a constant learning rate (no warm-up, no decay)."""
    return {
        "optimizer": {
            "learning_rate_scheduler": {
                "learning_rate": lr,
                "lr_warmup_steps": 0,
                "lr_warmup_style": "constant",
                "min_decay_lr": lr,
            }
        }
    }


# --------------------------------------------------------------------------------------------------------------
# Functions spawned ranks run (tests/runtime/spawn.py loads this file by path in each rank).


def _planner_config(changes: dict[str, Any] | None = None):
    import yaml

    from nanotron_ext.config import config_from_dict

    raw = yaml.safe_load(TINY_YAML.read_text())
    return config_from_dict(_deep_update(raw, copy.deepcopy(changes or {})), source="tiny")


def _llama_config(cfg):
    from nanotron.config import LlamaConfig

    return LlamaConfig(**{**cfg.nanotron["model"]["model_config"], "vocab_size": cfg.model.vocab_size})


def _inventory_rows(blocks) -> list[dict[str, Any]]:
    return [
        {
            "name": b.name,
            "role": b.role,
            "params": b.params,
            "trainable": b.trainable,
            "parameters": [(p.name, p.numel, p.trainable) for p in b.parameters],
        }
        for b in blocks
    ]


def _collective_check(model: Any, ctx: Any) -> tuple[str | None, list[dict]]:
    """The collective check's message on this rank (None when it passes), and its rows with frozen stages allowed."""
    from nanotron_ext import integration

    try:
        integration.check_every_rank_trains(model, ctx)
        message = None
    except integration.PipelineValidationError as exc:
        message = str(exc)
    return message, integration.check_every_rank_trains(model, ctx, allow_frozen_stages=True)


def integration_world(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """In a 2-rank world (pp=2): the runtime validator on Nanotron's greedy split, ``patch_nanotron`` driving
    Nanotron's own ``build_model`` call, and model-vs-config inventories for each config variant."""
    import torch
    from nanotron.models import base as nanotron_base

    from nanotron_ext import integration
    from nanotron_ext.inventory import inventory_from_config, inventory_from_model
    from nanotron_ext.runtime import GlooParallelContext, assign_blocks, cpu_llama, pipeline_blocks

    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1) as ctx:
        cfg = _planner_config()
        config = _llama_config(cfg)

        def builder(projector: bool = False, llama=config):
            return cpu_llama(llama, ctx, projector=projector)

        # 1. Nanotron's greedy ranks: every weight on PP rank 0. The collective check must fail on both ranks.
        greedy = assign_blocks(builder(), ctx, [0, 0, 0, 0, 0, 1, 1])
        out["validator"], out["validator_allowed_rows"] = _collective_check(greedy, ctx)

        # 1b. The constrained split with the lm_head frozen by its module path: PP rank 1 holds the lm_head's
        # weights but nothing trainable. Without allow_frozen_stages the check must fail on both ranks.
        frozen_cfg = _planner_config({"nanotron_ext": {"freeze": {"modules": ["model.lm_head"]}}})
        frozen = assign_blocks(builder(), ctx, [0, 0, 0, 0, 1, 1, 1])
        out["frozen_count"] = integration.apply_freeze_to_model(frozen, frozen_cfg)
        out["frozen_validator"], out["frozen_allowed_rows"] = _collective_check(frozen, ctx)

        # 2. patch_nanotron: Nanotron's own build_model call now places blocks with our plan.
        original = nanotron_base.build_model
        undo = integration.patch_nanotron(cfg)
        out["patched_is_ours"] = nanotron_base.build_model is integration.build_model
        try:
            model = nanotron_base.build_model(
                model_builder=builder, parallel_context=ctx, dtype=torch.float32, device=torch.device("cpu")
            )
        finally:
            undo()
        out["restored"] = nanotron_base.build_model is original
        out["patched_ranks"] = [block.rank for _, block in pipeline_blocks(model)]
        out["patched_plan_ranks"] = list(model.nanotron_ext_plan.block_ranks)
        out["patched_local_params"] = sum(p.numel() for p in model.parameters())

        # 3. inventory_from_model (blocks built on meta) vs inventory_from_config, per variant.
        out["inventories"] = {}
        for name, changes in variants.items():
            vcfg = _planner_config(changes)
            unbuilt = builder(projector=vcfg.ext.projector, llama=_llama_config(vcfg))
            out["inventories"][name] = {
                "model": _inventory_rows(inventory_from_model(unbuilt, vcfg)),
                "config": _inventory_rows(inventory_from_config(vcfg)),
                "allocated": sum(p.numel() for p in unbuilt.parameters()),
            }
        return out
