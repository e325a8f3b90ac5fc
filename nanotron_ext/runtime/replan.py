"""``nanotron_ext.replan`` in ``nanotron-ext train``: the CPU runtime's clock and moves for the run's re-plan
(:class:`~nanotron_ext.integration.replan_session.ReplanSession` holds the decision, the trial and the report).

What is the runtime's own:

* the clock: steps 2..K run under :class:`~nanotron_ext.runtime.op_clock.OpClock` (the engine's clock with the
  runtime's P2P transfers and tied sync), which changes no bit of the training;
* the move, in the same processes: to another engine on the same split, the engine is swapped between two steps (no
  state moves); to another split, a resume under another plan through the launcher's resume path
  (:class:`nanotron_ext.integration.checkpoints.ResumeState`): Nanotron's serializers save the step with the plan
  record and every file hashed as written; the new split is built and checked (every rank trains); the files are
  proved and the state is proved to map completely onto the new split before anything loads; then weights, Adam's
  moments and step, and the schedule load by name, and the old model is freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nanotron_ext.errors import ConfigError
from nanotron_ext.integration.replan_session import Move, ReplanSession
from nanotron_ext.plan.types import Plan
from nanotron_ext.procs import peak_rss_mib
from nanotron_ext.report import human_bytes
from nanotron_ext.runtime.train_settings import TrainSettings

__all__ = ["Replanner", "Trainee", "load_optimizer", "load_weights", "save_for_move"]


@dataclasses.dataclass
class Trainee:
    """What the training steps run with; replaced whole when the run moves to another split."""

    settings: TrainSettings
    model: Any  # DDP-wrapped where dp > 1
    optimizer: Any
    accumulator: Any
    scheduler: Any
    stream: Iterator[Any]
    rank_rows: list[dict[str, Any]]  # the every-rank-trains check's table of its build

    @property
    def unwrapped(self) -> Any:
        return getattr(self.model, "module", self.model)


class Replanner:
    """The CPU runtime's side of a run's re-plan (see the module docstring).

    Args:
        settings: the run's settings (``cfg.ext.replan.after_steps`` set).
        ctx: its parallel context; rebuild: ``(settings, ctx, state) -> Trainee``, the run's own build on
            ``settings.plan`` (model, check, DDP, optimizer, schedule, its data stream continued) with the state of
            the move's checkpoint (``state``: its ``ResumeState``) loaded.
        engine_was_auto: the config asked ``pp_engine: auto`` (the re-plan may then change the engine).
        say: prints on rank 0.
    """

    def __init__(
        self,
        settings: TrainSettings,
        ctx: Any,
        rebuild: Callable[[TrainSettings, Any, Any], Trainee],
        *,
        engine_was_auto: bool,
        say: Callable[[str], None],
    ) -> None:
        self.ctx, self.rebuild, self.say = ctx, rebuild, say
        self.session = ReplanSession(
            settings.cfg,
            settings.plan,
            first_step=1,
            last_step=settings.steps,
            engine_was_auto=engine_was_auto,
            say=say,
        )
        self.clock: Any = None

    @contextlib.contextmanager
    def step(self, step: int, trainee: Trainee) -> Iterator[None]:
        """Run training step ``step``, under the clock until the re-plan."""
        if not self.session.clocked(step):
            yield
            return
        if self.clock is None:
            from nanotron_ext.runtime.op_clock import OpClock

            self.clock = OpClock(trainee.model, self.ctx).__enter__()
        with self.clock.step(record=self.session.recorded(step)):
            yield

    def after(self, step: int, trainee: Trainee, seconds: float) -> Trainee:
        """After step ``step`` (``seconds`` on this rank): at K re-plan; in the trial, share each turn's times; move
        where the next step runs on another plan. Returns what the next step trains with."""
        session = self.session
        session.record(step, seconds)
        if step == session.decide_after and session.choice is None:
            gathered = self.clock.gather()
            self.clock.__exit__(None, None, None)
            self.clock = None
            session.decide(step, gathered, trainee.settings.rank)
        session.turn_done(step, self._gather)
        target = session.next_move(step)
        if target is None:
            return trainee
        move = Move(step, target.split_text, target.engine)
        if list(target.block_ranks) == list(trainee.settings.plan.block_ranks):  # the engine only
            self.say(f"  the engine changes to {target.engine} on the same split: no state moves")
            trainee = dataclasses.replace(trainee, settings=_settings_for(trainee.settings, target))
        else:
            before = peak_rss_mib()
            trainee, move.checkpoint_bytes = self._move(trainee, _settings_for(trainee.settings, target), step, move)
            move.peak_rss_mib = (before, peak_rss_mib())
            s = move.seconds
            self.say(
                f"  moved to {target.split_text} ({target.engine}) after step {step} in "
                f"{s['save'] + s['build_and_load']:.2f} s (save {s['save']:.2f} s, build and load "
                f"{s['build_and_load']:.2f} s; checkpoint {human_bytes(move.checkpoint_bytes)}); rank 0's peak "
                f"memory {before:.0f} -> {move.peak_rss_mib[1]:.0f} MiB"
            )
        session.moved(step, target, move)
        return trainee

    def report(self) -> dict[str, Any]:
        """The metrics' ``replan`` record."""
        return self.session.to_dict()

    def measured_lines(self) -> list[str]:
        """Rank 0's lines after the last step: the trial's cost, the measured steps against the predictions."""
        return [f"nanotron_ext: {line}" for line in self.session.after_lines(first_timed=2)]

    def _gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.ctx.world_pg)
        dist.all_gather_object(out, obj, group=self.ctx.world_pg)
        return out

    def _move(self, old: Trainee, settings: TrainSettings, step: int, move: Move) -> tuple[Trainee, int]:
        """Save step ``step``, build the new split and load the state onto it (a resume under another plan).

        Returns:
            The new trainee, and the bytes of the move's checkpoint.
        """
        from nanotron_ext.checkpoint import locate_checkpoint
        from nanotron_ext.integration.checkpoints import ResumeState

        folder = _shared_folder(self.ctx) / str(step)
        try:
            start = time.perf_counter()
            save_for_move(old, self.ctx, folder, step, self.say)
            move.seconds["save"] = time.perf_counter() - start
            start = time.perf_counter()
            source = locate_checkpoint(folder)
            assert source is not None and source.record is not None  # complete: every rank wrote its part
            size = sum(f.size for f in source.record.files or ())
            state = ResumeState(settings.cfg, source, mode="replan", say=self.say)
            _release(old)  # the old split's weights and moments go before the new ones are built
            new = self.rebuild(settings, self.ctx, state)
            move.seconds["build_and_load"] = time.perf_counter() - start
        finally:
            _barrier(self.ctx)
            if settings.rank == 0:
                shutil.rmtree(folder.parent, ignore_errors=True)
        return new, size


def save_for_move(trainee: Trainee, ctx: Any, folder: Path, step: int, say: Callable[[str], None]) -> None:
    """Step ``step`` saved as the launcher saves a checkpoint: the plan record (``complete: false`` first), Nanotron's
    weights, optimizer and schedule files, each hashed as written, then the record complete with every file."""
    import torch
    import torch.distributed as dist
    from nanotron.serialize import save_optimizer, save_weights

    from nanotron_ext.checkpoint.files import rank_file_name
    from nanotron_ext.integration.checkpoint_io import SaveRecorder
    from nanotron_ext.integration.checkpoints import ResumeState

    state = ResumeState(trainee.settings.cfg, None, mode="keep", say=say)
    state.after_build(trainee.unwrapped, ctx)
    state.mark(folder, step, complete=False)
    _barrier(ctx)  # the folder and its record exist before any rank writes into it
    state.recorder = SaveRecorder(folder)
    with state.recorder.writing():
        save_weights(model=trainee.unwrapped, parallel_context=ctx, root_folder=folder)
        if trainee.optimizer is not None:
            save_optimizer(optimizer=trainee.optimizer, parallel_context=ctx, root_folder=folder)
        if trainee.scheduler is not None and dist.get_rank(ctx.dp_pg) == 0:
            # One file per pp/tp rank, as upstream main saves it: each rank's schedule drives its own optimizer's
            # groups (0.2's save_lr_scheduler keeps world rank 0's alone).
            name = rank_file_name(
                "lr_scheduler", dist.get_rank(ctx.pp_pg), ctx.pp_pg.size(), dist.get_rank(ctx.tp_pg), ctx.tp_pg.size()
            )
            (folder / "lr_scheduler").mkdir(parents=True, exist_ok=True)
            torch.save(trainee.scheduler.state_dict(), folder / "lr_scheduler" / name)
    state.complete(folder, step, ctx.world_pg, last=True)
    _barrier(ctx)


def load_weights(state: Any, model: Any, ctx: Any) -> None:
    """Prove the move's checkpoint and load its weights onto the new split's built model (``state``: its
    ``ResumeState``), as the launcher's resume does: the files, then the complete mapping (weights and optimizer
    state), then the weights. The optimizer and the schedule load once they exist (:func:`load_optimizer`)."""
    from nanotron_ext.integration.checkpoint_io import verify_on_every_rank

    state.after_build(model, ctx)
    verify_on_every_rank(state.source, ctx.world_pg, state.say)
    state.load_weights(model, ctx, state.source.folder, load_optimizer=True)


def load_optimizer(state: Any, optimizer: Any, scheduler: Any) -> None:
    """Adam's moments and step, each group's hyperparameters, and the schedule's step and rates, by name."""
    if optimizer is None:  # a rank that trains nothing has neither
        return
    state.optimizer = optimizer
    state.load_optimizer(optimizer)
    if scheduler is not None:
        state.load_lr_scheduler(scheduler, initial_step=False)


def _release(trainee: Trainee) -> None:
    """Drop what holds the old split's tensors (the caller still holds the trainee itself), and collect them."""
    trainee.model = trainee.optimizer = trainee.accumulator = trainee.scheduler = None
    trainee.stream = iter(())  # its generator holds the model
    gc.collect()


def _settings_for(s: TrainSettings, plan: Plan) -> TrainSettings:
    """The run's settings on ``plan``: its engine and split (the config's other keys unchanged)."""
    from nanotron_ext.runtime.engine import engine_for

    cfg = s.cfg.with_overrides(engine=plan.engine)
    return dataclasses.replace(
        s, cfg=cfg, plan=plan, parallel_config=dataclasses.replace(s.parallel_config, pp_engine=engine_for(plan))
    )


def _shared_folder(ctx: Any) -> Path:
    """A fresh folder rank 0 makes for the move's checkpoint, which every rank must see (one host)."""
    import torch.distributed as dist

    name = [tempfile.mkdtemp(prefix="nanotron-ext-replan-") if dist.get_rank(ctx.world_pg) == 0 else None]
    dist.broadcast_object_list(name, src=0, group=ctx.world_pg)
    folder = Path(name[0])
    seen = [None] * dist.get_world_size(ctx.world_pg)
    dist.all_gather_object(seen, folder.is_dir(), group=ctx.world_pg)
    if not all(seen):
        raise ConfigError(
            f"replan: ranks {[r for r, ok in enumerate(seen) if not ok]} cannot see {folder}, the folder "
            f"rank 0 made for the move's checkpoint; a re-plan moves state through one host's files: "
            f"run every rank of nanotron-ext train on one host, or drop nanotron_ext.replan"
        )
    return folder


def _barrier(ctx: Any) -> None:
    import torch.distributed as dist

    dist.barrier(group=ctx.world_pg)
