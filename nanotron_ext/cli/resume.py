"""``nanotron-ext plan CONFIG --checkpoint DIR``: the plan a checkpoint was trained with beside the plan a resume
under CONFIG would train, what differs, and whether the recorded split is kept; first, the check a resume makes of
the checkpoint's files (each present, of the size and checksum its save recorded). The resume's plan is the one the
launcher would train: a V under ``pp_engine: zbv`` (or ``auto`` choosing it), else a contiguous split. A checkpoint
Nanotron saved alone (no plan record) is described as the launcher resumes it: its state placed by name onto the
config's plan, said in a note."""

from __future__ import annotations

import json
from dataclasses import replace

from nanotron_ext.checkpoint import (
    check_same_model,
    choose_plan,
    kept_vocab_shards,
    locate_checkpoint,
    record_for,
    verify_checkpoint,
)
from nanotron_ext.checkpoint.record import side_by_side
from nanotron_ext.checkpoint.resume import launch_engine
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, legend
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import CheckpointError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import resolve_vocab_shards
from nanotron_ext.plan.v_plan import plan_for

__all__ = ["plan_against_checkpoint"]


def plan_against_checkpoint(cfg: PlannerConfig, checkpoint: str, *, as_json: bool = False) -> int:
    """Print the checkpoint's recorded plan beside the one a resume under ``cfg`` trains; returns the exit code
    (0 when that plan can train, 1 when not).

    Raises:
        CheckpointError: ``checkpoint`` holds no checkpoint, a half-written one, one whose files are not those its
            save wrote, or one of another model.
        PlanningError: no plan of ``cfg`` trains (a V that fits nowhere, say).
    """
    source = locate_checkpoint(checkpoint)
    if source is None:
        raise CheckpointError(
            f"--checkpoint {checkpoint}: no checkpoint there (neither a latest.txt nor a checkpoint "
            f"folder); give a checkpoints folder or one step's folder"
        )
    verdict = verify_checkpoint(source)  # the resume's own check, in one process
    check_same_model(source, cfg)
    kept = kept_vocab_shards(source, cfg, cfg.ext.resume_plan)
    if kept is not None:
        cfg = cfg.with_overrides(vocab_shards=kept)
    cfg, _ = launch_engine(cfg)  # as the launcher resolves pp_engine: auto
    cfg, _ = resolve_vocab_shards(cfg)
    blocks = inventory_from_config(cfg)
    machine = machine_for(cfg)
    choice = choose_plan(plan_for(blocks, cfg), blocks, cfg, source, machine, mode=cfg.ext.resume_plan)
    now = replace(record_for(choice.plan, cfg, machine), step=None, complete=True)
    recorded = source.record
    differences = None if recorded is None else recorded.differences(now)
    if as_json:
        print(
            json.dumps(
                {
                    "checkpoint": str(source.folder),
                    "recorded": None if recorded is None else recorded.to_dict(),
                    "files_verified": verdict.files if verdict.verified else None,
                    "resume": now.to_dict(),
                    "kept": choice.kept,
                    "note": choice.note,
                    "differences": None if differences is None else [d.__dict__ for d in differences],
                },
                indent=2,
            )
        )
    else:
        print(f"{cfg.source}\n  {source.label}: {source.folder}\n  {verdict.line()}\n  {legend()}\n")
        print(side_by_side(recorded, now, now_title="resume under this config"))
        if differences is None:
            print(f"\nnote: {choice.note}")
            print("what differs: not known (the checkpoint records no plan); each tensor is placed by its name")
        else:
            print(f"\n{choice.note}")
            print("what differs:" + ("".join(f"\n  {d}" for d in differences) if differences else " nothing"))
    return EXIT_OK if choice.plan.ok else EXIT_INVALID
