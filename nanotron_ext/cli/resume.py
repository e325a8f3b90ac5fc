"""``nanotron-ext plan CONFIG --checkpoint DIR``: the plan a checkpoint was trained with beside the plan a resume
under CONFIG would train, what differs, and whether the recorded split is kept; first, the check a resume makes of
the checkpoint's files (each present, of the size and checksum its save recorded)."""

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
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, legend
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import CheckpointError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import CONTIGUOUS_AUTO_ENGINES, make_plan, resolve_engine, resolve_vocab_shards

__all__ = ["plan_against_checkpoint"]


def plan_against_checkpoint(cfg: PlannerConfig, checkpoint: str, *, as_json: bool = False) -> int:
    """Print the checkpoint's recorded plan beside the one a resume under ``cfg`` trains; returns the exit code
    (0 when that plan can train, 1 when not).

    Raises:
        CheckpointError: ``checkpoint`` holds no checkpoint, a half-written one, one without a plan record (saved by
            Nanotron alone), one whose files are not those its save wrote, or one of another model.
    """
    source = locate_checkpoint(checkpoint)
    if source is None:
        raise CheckpointError(
            f"--checkpoint {checkpoint}: no checkpoint there (neither a latest.txt nor a checkpoint "
            f"folder); give a checkpoints folder or one step's folder"
        )
    if source.record is None:
        raise CheckpointError(
            f"{source.folder} has no nanotron_ext plan record: Nanotron saved it alone, so the split "
            f"it was trained with is not recorded; a resume through the launcher places its state by "
            f"name onto the config's plan"
        )
    verdict = verify_checkpoint(source)  # the resume's own check, in one process
    check_same_model(source, cfg)
    kept = kept_vocab_shards(source, cfg, cfg.ext.resume_plan)
    if kept is not None:
        cfg = cfg.with_overrides(vocab_shards=kept)
    cfg, _ = resolve_engine(cfg, CONTIGUOUS_AUTO_ENGINES)  # a resume runs through the launcher
    cfg, _ = resolve_vocab_shards(cfg)
    blocks = inventory_from_config(cfg)
    machine = machine_for(cfg)
    choice = choose_plan(make_plan(blocks, cfg), blocks, cfg, source, machine, mode=cfg.ext.resume_plan)
    now = replace(record_for(choice.plan, cfg, machine), step=None, complete=True)
    differences = source.record.differences(now)
    if as_json:
        print(
            json.dumps(
                {
                    "checkpoint": str(source.folder),
                    "recorded": source.record.to_dict(),
                    "files_verified": verdict.files if verdict.verified else None,
                    "resume": now.to_dict(),
                    "kept": choice.kept,
                    "note": choice.note,
                    "differences": [d.__dict__ for d in differences],
                },
                indent=2,
            )
        )
    else:
        print(f"{cfg.source}\n  {source.label}: {source.folder}\n  {verdict.line()}\n  {legend()}\n")
        print(source.record.side_by_side(now, now_title="resume under this config"))
        print(f"\n{choice.note}")
        if differences:
            print("what differs:\n" + "\n".join(f"  {d}" for d in differences))
        else:
            print("what differs: nothing")
    return EXIT_OK if choice.plan.ok else EXIT_INVALID
