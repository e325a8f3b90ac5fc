"""Checkpoints through Nanotron's own trainer: what the launcher adds to its saves and resumes.

Saving (every checkpoint, once: Nanotron's trainer saves its last step twice where it is also an interval's, the
launcher once):

* the plan record (:mod:`nanotron_ext.checkpoint.record`) is written with ``complete: false`` before Nanotron writes
  a file, and with ``complete: true`` once every rank has written all of its files (before ``latest.txt`` moves),
  listing each file with its size and checksum, taken as the bytes were written
  (:class:`nanotron_ext.integration.checkpoint_io.SaveRecorder`); once Nanotron has written ``model_config.json``
  too, the record is written a last time with it;
* a vocabulary chain's shards are saved as the row shards of Nanotron's ``lm_head``
  (``model/model/lm_head/pp_block/model_weight_pp-rank-R-of-P_tp-rank-I-of-K.safetensors``, with the rows each
  holds in the header), so upstream's own ``load_weights`` (and its HF conversion) reads them into a plain model.

Resuming:

* the checkpoint folder is found as Nanotron finds it, and a half-written one is refused before anything loads
  (:func:`nanotron_ext.checkpoint.locate_checkpoint`; Nanotron's trainer is handed the same folder);
* before Nanotron reads a file of it, every file the record lists is proved (present, its size, its checksum), the
  reading shared out over the ranks, and every rank stops with the same message if one is not; then each loader is
  made collective, so a failure while loading stops every rank with a message naming the file (exit code 3);
* the plan: the recorded split by default (:func:`nanotron_ext.checkpoint.choose_plan`), said in one line;
* when the state's layout is the one it was saved with, Nanotron's own loaders run unchanged; otherwise (another
  split, pp, tp, ZeRO-1 dp, number of vocabulary shards, or a checkpoint without a record) the launcher's: every
  rank's live parameters are gathered, the mapping is proved complete on every rank at once (or every rank stops
  with the same message before a tensor is loaded), then weights, optimizer states and the learning-rate schedule
  are placed by name, and rank 0 prints the count.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanotron_ext.checkpoint import (
    LM_HEAD,
    Need,
    PlanRecord,
    ResumeSource,
    SavedCheckpoint,
    choose_plan,
    count_placements,
    placement_problems,
    record_for,
)
from nanotron_ext.checkpoint.boxes import Piece, full_box, slices_pairs_str
from nanotron_ext.checkpoint.digest import SavedFile
from nanotron_ext.checkpoint.files import weight_name
from nanotron_ext.checkpoint.reshard import (
    fill_weight,
    optimizer_state_dict,
    scheduler_state_dict,
)
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import CheckpointError
from nanotron_ext.integration.checkpoint_io import (
    SaveRecorder,
    gathered_files,
)
from nanotron_ext.integration.live_state import chain_of, live_optimizer, local_needs, vocab_bounds
from nanotron_ext.machine import machine_for

__all__ = ["ResumeState"]


class ResumeState:
    """What the launcher knows of this run's checkpoints, shared by the build, load and save hooks."""

    def __init__(
        self, cfg: PlannerConfig, source: ResumeSource | None, *, mode: str, say: Callable[[str], None]
    ) -> None:
        self.cfg, self.source, self.mode, self.say = cfg, source, mode, say
        self.model: Any = None
        self.context: Any = None
        self.record: PlanRecord | None = None  # the new plan's, once built
        self.ours = False  # the launcher's loader places the state (the layout changed)
        self.optimizer: Any = None
        self.saved: SavedCheckpoint | None = None
        self.needs: dict[str, Need] = {}  # this rank's live parameters by local name (and tied name)
        self.world_pg: Any = None  # the world group, once Nanotron has made it
        self.verified = False  # the resumed checkpoint's files were proved before loading
        self.recorder: SaveRecorder | None = None  # this rank's files of the save under way
        self.last_saved: int | None = None  # the step this run saved last

    # --- planning -------------------------------------------------------------------------------------------

    def choose(self, today: Any, blocks: Any, cfg: PlannerConfig) -> Any:
        """The plan the resume trains (``patch_nanotron``'s ``choose_plan``); rank 0 says which, in one line."""
        if self.source is None:
            return today
        choice = choose_plan(today, blocks, cfg, self.source, machine_for(cfg), mode=self.mode)  # type: ignore[arg-type]
        if _rank() == 0:
            self.say(f"nanotron_ext: {choice.note}")
        return choice.plan

    def after_build(self, model: Any, context: Any) -> None:
        """Record the built plan, and decide whose loader reads the checkpoint."""
        self.model, self.context = model, context
        self.record = record_for(
            model.nanotron_ext_plan,
            self.cfg,
            machine_for(self.cfg),
            tp=context.tp_pg.size(),
            dp=context.dp_pg.size(),
            vocab_bounds=vocab_bounds(model),
        )
        if self.source is not None:
            recorded = self.source.record
            self.ours = recorded is None or not recorded.same_state_layout(self.record)

    # --- loading --------------------------------------------------------------------------------------------

    def loads(self, what: str) -> bool:
        """Whether Nanotron's config loads ``what`` on resume (``checkpoints.load_optimizer``, ...)."""
        return bool((self.cfg.nanotron.get("checkpoints") or {}).get(what, True))

    def _active(self, root_folder: Any) -> bool:
        return self.ours and self.source is not None and Path(root_folder) == self.source.folder

    def load_weights(self, model: Any, parallel_context: Any, root_folder: Any, load_optimizer: bool) -> None:
        """Check on every rank that the checkpoint maps completely onto the new plan, then load this rank's
        weights; rank 0 prints the count.

        Raises:
            CheckpointError: on every rank, the same message, before any tensor is loaded.
        """
        import torch.distributed as dist

        assert self.source is not None and self.record is not None
        mine = local_needs(model, parallel_context)
        gathered: list[Any] = [None] * dist.get_world_size(parallel_context.world_pg)
        dist.all_gather_object(gathered, [n for n, _ in mine], group=parallel_context.world_pg)
        needs = [n for rank_needs in gathered for n in rank_needs]
        try:
            saved = SavedCheckpoint.scan(self.source.folder)
            problems = placement_problems(saved, needs, optimizer=load_optimizer)
        except CheckpointError as exc:
            problems, saved = [str(exc)], None
        if problems:
            raise CheckpointError(self._cannot(problems))
        assert saved is not None
        with torch.no_grad():
            for need, param in mine:
                fill_weight(saved, need, param.data)
        self.saved = saved
        self.needs = {n.local_name: n for n, _ in mine} | {n.name: n for n, _ in mine if n.tied}
        if _rank() == 0:
            count = count_placements(saved, needs, optimizer=load_optimizer)
            self.say(
                f"nanotron_ext: {self.source.label} -> split {self.record.layout} (pp={self.record.pp}, "
                f"tp={self.record.tp}, dp={self.record.dp}): {count.line()}"
            )

    def _cannot(self, problems: list[str]) -> str:
        assert self.source is not None and self.record is not None
        recorded, now = self.source.record, self.record
        listed = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        head = (
            f"cannot resume {self.source.label} ({_where(recorded) if recorded else 'saved without a plan record'}) "
            f"under the new plan ({_where(now)}); nothing was loaded."
        )
        if recorded is None:
            fix = "resume under the plan it was saved with, or change what the lines above name"
            return f"{head}\n  {listed}\n  fix: {fix}"
        differs = "; ".join(str(d) for d in recorded.differences(now)) or "nothing in the plan"
        return (
            f"{head} What differs: {differs}.\n  {listed}\n  fix: keep the recorded plan (pp={recorded.pp}, "
            f"vocab_shards: {recorded.vocab_shards}, resume_plan: keep), or change what the lines above name"
        )

    def load_optimizer(self, optimizer: Any) -> None:
        """Place the optimizer state (moments, step, fp32 master, group hyperparameters) by name."""
        assert self.saved is not None
        live = live_optimizer(optimizer, self.needs, self.context)
        if live.entries:
            state = optimizer_state_dict(self.saved, live)
            if "map_location" in inspect.signature(optimizer.load_state_dict).parameters:
                optimizer.load_state_dict(state, map_location="cpu")
            else:  # Nanotron 0.2's (the CPU runtime's move to a re-planned split): the state is on the CPU already
                optimizer.load_state_dict(state)

    def load_lr_scheduler(self, lr_scheduler: Any, *, initial_step: bool = True) -> None:
        """Give the scheduler the saved step and each group its saved rates, then (``initial_step``) step it once
        as Nanotron's loader does; a run that moves in-process continues the schedule where it was
        (``initial_step=False``: Nanotron's extra step would skip one learning rate)."""
        assert self.saved is not None and self.optimizer is not None
        live = live_optimizer(self.optimizer, self.needs, self.context)
        by_index = {e.index: e.need for e in live.entries}
        groups = [[by_index[i] for i in g["params"]] for g in live.param_groups]
        state = scheduler_state_dict(self.saved, lr_scheduler.state_dict(), groups)
        lr_scheduler.load_state_dict(state)
        if initial_step:
            lr_scheduler._initial_step()  # as nanotron.serialize.optimizer.load_lr_scheduler does
        else:  # load_state_dict leaves the groups' rates as they were built: give them the saved ones
            for group, lr in zip(self.optimizer.param_groups, lr_scheduler.get_last_lr()):
                group["lr"] = lr

    # --- saving ---------------------------------------------------------------------------------------------

    def mark(self, folder: Path, step: int, *, complete: bool, files: dict[str, SavedFile] | None = None) -> None:
        """Write the plan record into a checkpoint folder (world rank 0), listing ``files`` when given."""
        if self.record is None or _rank() != 0:
            return
        from dataclasses import replace

        folder.mkdir(parents=True, exist_ok=True)
        listed = None if files is None else tuple(files.values())
        replace(self.record, step=step, complete=complete, files=listed).write(folder)

    def complete(self, folder: Path, step: int, group: Any, *, last: bool) -> None:
        """Mark the checkpoint complete with every rank's files (a collective); the ``last`` time, with any file
        that no writer recorded too, its size only, and a warning naming it."""
        assert self.recorder is not None
        files = gathered_files(self.recorder, group)
        if last and _rank() == 0:
            unrecorded = self.recorder.unrecorded(files)
            for f in unrecorded:
                self.say(
                    f"nanotron_ext: warning: {f.path} was written into checkpoint {step} by a writer the "
                    f"launcher does not hash: its record keeps its size, not its checksum"
                )
            files = dict(sorted((files | {f.path: f for f in unrecorded}).items()))
        self.mark(folder, step, complete=True, files=files)

    def save_chain_as_lm_head(self, model: Any, parallel_context: Any, root_folder: Path) -> None:
        """Rewrite this rank's vocabulary shards (saved by Nanotron under ``vocab_shards/``) as row shards of the
        lm_head, the layout upstream's loader reads into a plain model."""
        import torch.distributed as dist
        from nanotron.constants import CHECKPOINT_VERSION
        from safetensors.torch import save_file

        chain = chain_of(model)
        if not chain or dist.get_rank(getattr(parallel_context, "dp_cp_pg", parallel_context.dp_pg)) != 0:
            return  # no chain; or not a rank Nanotron saves weights on (dp rank 0 only)
        rank, pp = dist.get_rank(parallel_context.pp_pg), parallel_context.pp_pg.size()
        rows = chain[-1].module_kwargs["hi"]
        for index, block in enumerate(chain):
            if block.rank != rank:
                continue
            weight = block.pp_block.weight
            local = tuple(weight.shape)
            piece = Piece(
                full_box(local), ((block.module_kwargs["lo"], block.module_kwargs["hi"]), *full_box(local[1:]))
            )
            path = root_folder / "model" / weight_name(LM_HEAD, rank, pp, index, len(chain))
            path.parent.mkdir(parents=True, exist_ok=True)
            save = save_file if self.recorder is None else self.recorder.save_safetensors  # hashed as written
            save(
                {"data": weight.detach().cpu().contiguous()},
                str(path),
                metadata={
                    "version": str(CHECKPOINT_VERSION),
                    "local_global_slices_pairs": slices_pairs_str([piece]),
                    "unsharded_shape": str((rows, *local[1:])),
                },
            )
            old = root_folder / "model" / weight_name(f"model.vocab_shards.{index}.pp_block.weight")
            old.unlink(missing_ok=True)
            if self.recorder is not None:
                self.recorder.forget(old)
            for folder in (old.parent, old.parent.parent, old.parent.parent.parent):  # .../vocab_shards/{i}/pp_block
                try:
                    folder.rmdir()
                except OSError:
                    break  # not empty (another shard's rank has not moved its file yet), or already gone


def _where(record: PlanRecord) -> str:
    return f"{record.layout}, pp={record.pp}, tp={record.tp}, dp={record.dp}"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
