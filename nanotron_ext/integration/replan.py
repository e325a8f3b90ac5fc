"""``nanotron_ext.replan`` in Nanotron's own trainer (``python -m nanotron_ext.run``): the launcher's clock and
moves for the run's re-plan (:class:`~nanotron_ext.integration.replan_session.ReplanSession` holds the decision, the
trial and the report, as it does for the CPU runtime).

What is the launcher's own:

* the clock: steps 2..K of the launch run under :class:`~nanotron_ext.integration.op_clock.OpClock` inside
  :class:`TrainerStepTimer`; Nanotron's P2P and tied sync are not timed, so links, the tied all-reduce and the
  engine's overhead keep the base profile's figures (the config's ``machine``, else a standalone calibration);
* the move, a re-launch in the same processes: when the trainer calls for a step the session puts on another plan,
  Nanotron's own ``save_checkpoint`` saves the step before (the plan record, every file hashed; reused where the
  checkpoint interval saved it already) and :class:`MoveTo` leaves the script; the launcher (:mod:`nanotron_ext.run`)
  frees the trainer, installs the new plan (``layout`` of the new split, its engine, ``resume_plan: replan``) and
  runs the script again on that checkpoint, whose state the launcher's resume proves and moves. A checkpoint saved
  only for a move is removed once the run has resumed a later one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from nanotron_ext.config import PlannerConfig
from nanotron_ext.devices import synchronize
from nanotron_ext.integration.replan_session import Move, ReplanSession
from nanotron_ext.outputs import atomic_write_text
from nanotron_ext.plan.replan import short_run_note
from nanotron_ext.plan.types import Plan
from nanotron_ext.procs import peak_rss_mib

__all__ = ["RECORD_NAME", "LauncherReplan", "MoveTo", "TrainerStepTimer"]

#: The re-plan's record beside the checkpoints (the launcher has no ``--metrics-out``).
RECORD_NAME = "nanotron_ext_replan.json"


class MoveTo(Exception):  # noqa: N818 (a signal to the launcher, not an error)
    """Raised out of the training script once the move's checkpoint is saved: the launcher runs the script again on
    ``plan``, resuming ``checkpoint``."""

    def __init__(self, plan: Plan, checkpoint: Path) -> None:
        super().__init__(f"replan: moving to {plan.split_text} ({plan.engine}) from checkpoint {checkpoint}")
        self.plan, self.checkpoint = plan, checkpoint


@dataclasses.dataclass(frozen=True)
class TrainerStep:
    """One rank's timed step in Nanotron's trainer (seconds)."""

    step: float
    pipeline: float  # from the aligned start until the engine's train_batch_iter returned
    aligned: float  # the wait after it, until every rank's pipeline had ended
    pipeline_idle: float = 0.0  # the waits inside the pipeline: not measured (the blocks' spans leave them out)

    @property
    def busy(self) -> float:
        return self.step - self.aligned


class TrainerStepTimer:
    """The clock's step timer in Nanotron's trainer (not the CPU runtime's ``StepTimer``, which hooks that runtime's
    own P2P to time its waits; the trainer's P2P is Nanotron's): steps start together (a barrier), end when the
    rank's kernels do; when the engine has finished (:meth:`pipeline_done`) the ranks wait for each other once more,
    so that the update after the pipeline (the tied and loss all-reduces, the optimizer) is timed without waiting on a
    rank whose pipeline ends later. The waits inside the pipeline are not measured (``waited`` is 0)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.records: list[TrainerStep] = []
        self._pipeline_end: float | None = None
        self._aligned = 0.0

    def __enter__(self) -> TrainerStepTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @contextlib.contextmanager
    def step(self, record: bool = True) -> Iterator[None]:
        synchronize()
        torch_dist.barrier(group=self.group)  # untimed: every rank starts the step together
        self._pipeline_end, self._aligned = None, 0.0
        start = time.perf_counter()
        yield
        synchronize()
        end = time.perf_counter()
        if record:
            pipeline_end = self._pipeline_end if self._pipeline_end is not None else end
            self.records.append(TrainerStep(end - start, pipeline_end - start, self._aligned))

    def pipeline_done(self) -> None:
        """The engine has finished this rank's pipeline: mark it, then wait for every rank's (timed as idle)."""
        synchronize()
        self._pipeline_end = time.perf_counter()
        torch_dist.barrier(group=self.group)
        self._aligned = time.perf_counter() - self._pipeline_end

    def waited(self) -> float:
        return 0.0


class LauncherReplan:
    """The re-plan of a launcher run, across its launches (a move is a re-launch): the clock of the first launch's
    steps 2..K, and the moves the session's trial asks for.

    Args:
        cfg: the launch's planner config (engine and vocabulary shards resolved; ``replan.after_steps`` set).
        engine_was_auto: the YAML asked ``pp_engine: auto`` (the re-plan may then change the engine).
        say: prints on rank 0.
    """

    def __init__(self, cfg: PlannerConfig, *, engine_was_auto: bool, say: Callable[[str], None]) -> None:
        self.cfg, self.engine_was_auto, self.say = cfg, engine_was_auto, say
        self.session: ReplanSession | None = None
        self.first_step: int | None = None  # the first launch's first step (global)
        self._clock: Any = None
        self._timer: TrainerStepTimer | None = None
        self._move: Move | None = None  # the move under way: its re-launch's first step ends it
        self._moved_at = 0.0
        self._rss_before = 0.0
        self._move_only: list[Path] = []  # checkpoints saved for a move alone, removed once superseded
        self._resumed: Path | None = None  # the checkpoint the move under way resumes
        self.record_path: Path | None = None  # where rank 0 writes the session's record after the last launch

    def relaunch_config(self, cfg: PlannerConfig) -> PlannerConfig:
        """``cfg`` on the plan the run moves to: its split as a layout, its engine, the checkpoint's state moved onto
        it."""
        assert self.session is not None
        new = self.session.plan
        return cfg.with_overrides(
            cost_strategy="layout",
            layout=new.split_text,
            engine=new.engine,
            resume_plan="replan",
            replan=dataclasses.replace(cfg.ext.replan, after_steps=None),
        )

    def install(self, patches: Any, trainer_module: Any, plan_of: Callable[[], Plan], cfg: PlannerConfig) -> None:
        """Wrap ``DistributedTrainer.training_step`` of ``trainer_module`` (``plan_of``: the built plan)."""
        trainer_cls = trainer_module.DistributedTrainer
        original = trainer_cls.training_step
        first = [True]  # this launch's first step

        def training_step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            step = trainer.iteration_step
            if first[0]:
                first[0] = False
                self._launched(trainer, plan_of())
            session = self.session
            if session is not None:
                target = session.next_move(step - 1)
                if target is not None:
                    self._leave(trainer, step - 1, target)
            start = time.perf_counter()
            if self._clock is not None and session is not None and session.clocked(step):
                with self._clock.step(record=session.recorded(step)):
                    out = original(trainer, *args, **kwargs)
            else:
                out = original(trainer, *args, **kwargs)
            if session is not None:
                session.record(step, time.perf_counter() - start)
                if step == session.decide_after and session.choice is None:
                    self._decide(trainer, step)
                session.turn_done(step, lambda obj: _gather(trainer, obj))
            return out

        patches.set(trainer_cls, "training_step", training_step)

    def _launched(self, trainer: Any, plan: Plan) -> None:
        """A launch's first step: a move's re-launch ends here; the first launch starts the session and its clock."""
        if self._move is not None and self.session is not None:
            self._move.seconds["restart"] = time.perf_counter() - self._moved_at
            self._move.peak_rss_mib = (self._rss_before, peak_rss_mib())
            self.session.moved(self._move.after_step, self.session.plan, self._move)
            self._move = None
            self._remove_superseded(trainer)
            return
        if self.session is not None:
            return
        step = trainer.iteration_step
        self.first_step = step
        self.record_path = Path(trainer.config.checkpoints.checkpoints_path) / RECORD_NAME
        last = trainer.config.tokens.train_steps
        after = self.cfg.ext.replan.after_steps
        if after is None or last - step + 1 <= after:
            if after is not None:
                self.say(f"nanotron_ext: {short_run_note(after, last - step + 1)}")
            return
        self.session = ReplanSession(
            self.cfg, plan, first_step=step, last_step=last, engine_was_auto=self.engine_was_auto, say=self.say
        )
        from nanotron_ext.integration.op_clock import OpClock

        self._timer = TrainerStepTimer(trainer.parallel_context.world_pg)
        self._clock = OpClock(
            getattr(trainer, "unwrapped_model", trainer.model),
            trainer.parallel_context,
            timer=self._timer,
            engine_name=lambda _: plan.engine,
            overhead=False,
        ).__enter__()
        engine = trainer.pipeline_engine
        train_batch_iter = engine.train_batch_iter

        def timed_train_batch_iter(*args: Any, **kwargs: Any) -> Any:
            out = train_batch_iter(*args, **kwargs)
            if self._timer is not None:
                self._timer.pipeline_done()
            return out

        engine.train_batch_iter = timed_train_batch_iter

    def _decide(self, trainer: Any, step: int) -> None:
        """After the launch's K-th step: price and decide on every rank alike."""
        assert self.session is not None
        gathered = self._clock.gather()
        self._clock.__exit__(None, None, None)
        self._clock = self._timer = None
        trainer.pipeline_engine.__dict__.pop("train_batch_iter", None)
        self.session.decide(step, gathered, torch_dist.get_rank())

    def _leave(self, trainer: Any, step: int, target: Plan) -> None:
        """Save step ``step`` for the move to ``target`` and raise :class:`MoveTo` out of the script."""
        assert self.session is not None
        start = time.perf_counter()
        checkpoints = trainer.config.checkpoints
        folder = Path(checkpoints.checkpoints_path) / str(step)
        if step % checkpoints.checkpoint_interval != 0:  # else the trainer saved this step already
            iteration, trainer.iteration_step = trainer.iteration_step, step
            try:
                folder = Path(trainer.save_checkpoint() or folder)
            finally:
                trainer.iteration_step = iteration
            self._move_only.append(folder)
        self._resumed = folder
        self._move = Move(step, target.split_text, target.engine, {"save": time.perf_counter() - start})
        self.session.plan = target  # what the re-launch trains (the move is recorded once it has started)
        self._rss_before = peak_rss_mib()
        self._moved_at = time.perf_counter()
        raise MoveTo(target, folder)

    def _remove_superseded(self, trainer: Any) -> None:
        """Remove the checkpoints saved for a move alone, but the one this launch resumed (rank 0): a later complete
        checkpoint exists for each, so a resume loses nothing."""
        if torch_dist.get_rank() == 0:
            for folder in self._move_only:
                if folder != self._resumed:
                    shutil.rmtree(folder, ignore_errors=True)
        self._move_only = [f for f in self._move_only if f == self._resumed]

    def measured_lines(self) -> list[str]:
        """After the last launch: the trial's cost, the measured steps against the predictions (rank 0)."""
        if self.session is None:
            return []
        return [f"nanotron_ext: {line}" for line in self.session.after_lines(first_timed=(self.first_step or 1) + 1)]

    def write_record(self) -> Path | None:
        """After the last launch, on rank 0: the session's record (what ``--metrics-out`` holds under ``train``) as
        JSON beside the checkpoints; the path written, or None."""
        if self.session is None or self.session.choice is None or self.record_path is None:
            return None
        atomic_write_text(self.record_path, json.dumps(self.session.to_dict(), indent=1) + "\n")
        return self.record_path


def _gather(trainer: Any, obj: Any) -> list[Any]:
    group = trainer.parallel_context.world_pg
    out: list[Any] = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(out, obj, group=group)
    return out
