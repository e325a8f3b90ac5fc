"""What the launcher installs into Nanotron's trainer for checkpoints (the resume and the save they drive are a
:class:`~nanotron_ext.integration.checkpoints.ResumeState`'s): on a resume, the folder the launcher checked handed to
Nanotron once every rank proved its files, the state placed by plan, and any loader's failure stopping every rank
alike; on a save, the plan record written first as incomplete, every file hashed as written, the record completed once
every rank has written, the vocabulary chain saved as an lm_head, and a step saved once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanotron_ext.integration.checkpoint_io import SaveRecorder, guarded_load, verify_on_every_rank
from nanotron_ext.integration.checkpoints import ResumeState
from nanotron_ext.integration.upstream_fixes import Patches

__all__ = ["install_checkpoints"]


def install_checkpoints(patches: Patches, trainer: Any, state: ResumeState) -> None:
    """Install the save and load hooks of the module docstring into ``nanotron.trainer``."""
    _install_loads(patches, trainer, state)
    _install_saves(patches, trainer, state)


def _install_loads(patches: Patches, trainer: Any, state: ResumeState) -> None:
    """The resume's hooks: the checked folder to Nanotron, the state placed by plan, a failure stopping every rank."""
    if state.source is not None:
        parse = trainer.parse_ckpt_path

        def parse_ckpt_path(config: Any, parallel_context: Any) -> Any:
            # Nanotron is handed the folder the launcher checked (it would take a half-written one for none), once
            # every rank knows its files are those the save wrote: the first moment every rank is in the world group.
            if state.source is None:
                return parse(config, parallel_context)
            state.world_pg = parallel_context.world_pg
            state.verified = verify_on_every_rank(state.source, state.world_pg, state.say).verified
            return state.source.folder

        patches.set(trainer, "parse_ckpt_path", parse_ckpt_path)

    load_weights = trainer.load_weights

    def load_weights_by_plan(model: Any, parallel_context: Any, root_folder: Any, *args: Any, **kwargs: Any) -> Any:
        if not state._active(root_folder):
            return load_weights(model, parallel_context, root_folder, *args, **kwargs)
        state.load_weights(model, parallel_context, root_folder, state.loads("load_optimizer"))
        return {}

    patches.set(trainer, "load_weights", load_weights_by_plan)
    for name, ours, argument in (
        ("load_optimizer", state.load_optimizer, "optimizer"),
        ("load_lr_scheduler", state.load_lr_scheduler, "lr_scheduler"),
    ):
        patches.set(trainer, name, _by_plan(state, getattr(trainer, name), ours, argument))
    build_optimizer = trainer.init_optimizer_and_grad_accumulator

    def init_optimizer_and_grad_accumulator(*args: Any, **kwargs: Any) -> Any:
        optimizer, accumulator = build_optimizer(*args, **kwargs)
        state.optimizer = optimizer
        return optimizer, accumulator

    patches.set(trainer, "init_optimizer_and_grad_accumulator", init_optimizer_and_grad_accumulator)
    if state.source is not None:  # outermost: a failure in any loader, ours or Nanotron's, stops every rank alike
        for name, what in (
            ("load_weights", "its weights"),
            ("load_optimizer", "its optimizer states"),
            ("load_lr_scheduler", "its learning-rate schedule"),
            ("load_meta", "its step and consumed samples"),
        ):
            if hasattr(trainer, name):
                patches.set(
                    trainer,
                    name,
                    guarded_load(
                        getattr(trainer, name), what, state.source, lambda: state.world_pg, lambda: state.verified
                    ),
                )


def _install_saves(patches: Patches, trainer: Any, state: ResumeState) -> None:
    """The save's hooks: the plan record first (incomplete), every file hashed as written, the record completed."""
    import nanotron.serialize.main as serialize_main

    save_checkpoint = trainer.DistributedTrainer.save_checkpoint

    def save_checkpoint_with_record(self: Any) -> Any:
        folder = Path(self.config.checkpoints.checkpoints_path) / str(self.iteration_step)
        if state.last_saved == self.iteration_step:
            # save_final_state after the last interval's save: the same state (every rank alike), written and
            # logged once, and never cut off half-rewritten where a whole checkpoint stood.
            return folder
        state.mark(folder, self.iteration_step, complete=False)
        state.recorder = SaveRecorder(folder)
        try:
            with state.recorder.writing():
                out = save_checkpoint(self)
            # Nanotron wrote model_config.json after latest.txt moved: the record lists it too, written last.
            state.complete(folder, self.iteration_step, self.parallel_context.world_pg, last=True)
        finally:
            state.recorder = None
        state.last_saved = self.iteration_step
        return out

    patches.set(trainer.DistributedTrainer, "save_checkpoint", save_checkpoint_with_record)
    save_random_states = trainer.save_random_states

    def save_random_states_then_complete(*args: Any, parallel_context: Any, root_folder: Any, **kwargs: Any) -> Any:
        # The last files of a checkpoint before Nanotron moves latest.txt: once every rank is here, it is whole.
        out = save_random_states(*args, parallel_context=parallel_context, root_folder=root_folder, **kwargs)
        step = Path(root_folder).name
        state.complete(Path(root_folder), int(step) if step.isdigit() else -1, parallel_context.world_pg, last=False)
        return out

    patches.set(trainer, "save_random_states", save_random_states_then_complete)
    save_weights = serialize_main.save_weights

    def save_weights_with_chain(model: Any, parallel_context: Any, root_folder: Any) -> Any:
        out = save_weights(model=model, parallel_context=parallel_context, root_folder=root_folder)
        state.save_chain_as_lm_head(model, parallel_context, Path(root_folder))
        return out

    patches.set(serialize_main, "save_weights", save_weights_with_chain)


def _by_plan(
    state: ResumeState, original: Callable[..., Any], ours: Callable[[Any], None], argument: str
) -> Callable[..., Any]:
    """Nanotron's loader ``original`` (called with keywords by its trainer), or the launcher's ``ours`` on the
    object it loads when the launcher places this checkpoint's state."""

    def load(*args: Any, root_folder: Any, **kwargs: Any) -> Any:
        if not state._active(root_folder):
            return original(*args, root_folder=root_folder, **kwargs)
        return ours(kwargs[argument])

    return load
