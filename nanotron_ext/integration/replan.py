"""``nanotron_ext.replan`` in Nanotron's own trainer (``python -m nanotron_ext.run``): after K steps of a launch the
run prices itself from its own steps, plans again under the same memory and, where the new plan is worth it, moves
there by a re-launch the launcher drives in the same processes (``docs/replan.md``).

1. Steps 2..K of the launch run under the engine's clock (:class:`~nanotron_ext.integration.op_clock.OpClock` inside
   :class:`TrainerStepTimer`); Nanotron's P2P and tied sync are not timed, so links, the tied all-reduce and the
   engine's overhead keep the base profile's figures (the config's ``machine``, else a standalone calibration).
2. When the trainer calls for step K + 1, the in-run profile and :func:`~nanotron_ext.plan.replan.choose_replan`
   decide, on every rank alike. A move saves step K with Nanotron's own ``save_checkpoint`` (the plan record, every
   file hashed; reused where the checkpoint interval already saved it) and raises :class:`MoveTo` out of the script.
3. The launcher (:mod:`nanotron_ext.run`) frees the trainer, installs the new plan (``layout`` of the new split, its
   engine, ``resume_plan: replan``) and runs the script again, resuming that checkpoint: the launcher's resume under
   another plan proves the files and the mapping and moves every weight, Adam state and the schedule.
4. The re-launched trainer's steps are timed on the wall clock; after the script ends rank 0 prints the measured
   step after the move against the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from nanotron_ext.config import PlannerConfig
from nanotron_ext.devices import synchronize
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan.replan import (
    ReplanChoice,
    choose_replan,
    measured_lines,
    replan_engines,
    replan_profiles,
    short_run_note,
)
from nanotron_ext.plan.types import Plan
from nanotron_ext.procs import peak_rss_mib

__all__ = ["LauncherReplan", "MoveTo", "TrainerStepTimer"]


class MoveTo(Exception):  # noqa: N818 (a signal to the launcher, not an error)
    """Raised out of the training script once the move's checkpoint is saved: the launcher runs the script again on
    ``choice.new``, resuming ``checkpoint``."""

    def __init__(self, choice: ReplanChoice, checkpoint: Path) -> None:
        super().__init__(
            f"replan: moving to {choice.new.split_text} ({choice.new.engine}) from checkpoint {checkpoint}"
        )
        self.choice, self.checkpoint = choice, checkpoint


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
    """The clock's step timer in Nanotron's trainer: steps start together (a barrier), end when the rank's kernels
    do; when the engine has finished (:meth:`pipeline_done`) the ranks wait for each other once more, so that the
    update after the pipeline (the tied and loss all-reduces, the optimizer) is timed without waiting on a rank whose
    pipeline ends later. The waits inside the pipeline are not measured (``waited`` is 0)."""

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
    """The re-plan of a launcher run, across its launches: the first times its steps and may raise :class:`MoveTo`;
    after a move, the re-launch times its steps for the measured lines.

    Args:
        cfg: the launch's planner config (engine and vocabulary shards resolved; ``replan.after_steps`` set).
        engine_was_auto: the YAML asked ``pp_engine: auto`` (the re-plan may then change the engine).
        say: prints on rank 0.
    """

    def __init__(self, cfg: PlannerConfig, *, engine_was_auto: bool, say: Callable[[str], None]) -> None:
        self.after_steps = cfg.ext.replan.after_steps
        self.engines = replan_engines(cfg, engine_was_auto=engine_was_auto)
        self.say = say
        self.choice: ReplanChoice | None = None
        self.seconds: dict[str, float] = {}
        self.timed: list[float] = []  # this rank's wall time of each timed step before the re-plan
        self.after: list[float] = []  # and of each step after it
        self.first_step: int | None = None  # the launch's first step (global)
        self.peak_rss: tuple[float, float] | None = None  # rank 0's peak resident MiB before and after the move
        self._rss_before = 0.0
        self._clock: Any = None
        self._timer: TrainerStepTimer | None = None
        self._trained = 0  # steps this launch trained
        self._skip = 0  # steps after the re-plan not to count: the next is a new build's first, or on one already
        self._moved_at: float | None = None

    def relaunch_config(self, cfg: PlannerConfig) -> PlannerConfig:
        """``cfg`` on the plan the run moves to: its split as a layout, its engine, the checkpoint's state moved onto
        it; no second re-plan."""
        assert self.choice is not None
        new = self.choice.new
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
        self._trained = 0

        def training_step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            if self._trained == 0:
                self._start(trainer, cfg)
            if self.choice is None and self.after_steps is not None and self._trained == self.after_steps:
                self._replan(trainer, plan_of(), cfg)
            start = time.perf_counter()
            if self._clock is not None:
                with self._clock.step(record=self._trained >= 1):
                    out = original(trainer, *args, **kwargs)
            else:
                out = original(trainer, *args, **kwargs)
            seconds = time.perf_counter() - start
            if self._clock is not None and self._trained >= 1:
                self.timed.append(seconds)
            elif self.choice is not None:  # after the re-plan
                if self._skip:
                    self._skip -= 1
                else:
                    self.after.append(seconds)
            self._trained += 1
            return out

        patches.set(trainer_cls, "training_step", training_step)

    def _start(self, trainer: Any, cfg: PlannerConfig) -> None:
        """The launch's first step: a move's restart ends here; the clock starts where a re-plan is to come."""
        if self.first_step is None:
            self.first_step = trainer.metadata.last_train_step + 1
        if self._moved_at is not None:
            self.seconds["restart"] = time.perf_counter() - self._moved_at
            self.peak_rss = (self._rss_before, peak_rss_mib())
            self._moved_at = None
        if self.choice is not None or self.after_steps is None:
            return
        steps = trainer.config.tokens.train_steps - trainer.metadata.last_train_step
        if steps <= self.after_steps:
            self.say(f"nanotron_ext: {short_run_note(self.after_steps, steps)}")
            self.after_steps = None
            return
        from nanotron_ext.integration.op_clock import OpClock

        self._timer = TrainerStepTimer(trainer.parallel_context.world_pg)
        self._clock = OpClock(
            getattr(trainer, "unwrapped_model", trainer.model),
            trainer.parallel_context,
            timer=self._timer,
            engine_name=lambda _: cfg.run.engine,
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

    def _replan(self, trainer: Any, plan: Plan, cfg: PlannerConfig) -> None:
        """After the launch's K-th step: price, decide and, on a move, save the step and raise :class:`MoveTo`."""
        start = time.perf_counter()
        gathered = self._clock.gather()
        self._clock.__exit__(None, None, None)
        self._clock = self._timer = None
        trainer.pipeline_engine.__dict__.pop("train_batch_iter", None)
        step = trainer.metadata.last_train_step
        with tempfile.TemporaryDirectory(prefix="nanotron-ext-replan-profile-") as tmp:
            whole, *halves = [
                cfg.with_overrides(machine=str(path))
                for path in replan_profiles(
                    cfg, plan.block_ranks, gathered, len(self.timed), torch_dist.get_rank(), Path(tmp)
                )
            ]
            self.seconds["profile"] = time.perf_counter() - start
            start = time.perf_counter()
            self.choice = choose_replan(
                whole, inventory_from_config(whole), plan, step=step, engines=self.engines, halves=halves
            )
            self.seconds["plan"] = time.perf_counter() - start
        for line in self.choice.lines():
            self.say(f"nanotron_ext: {line}" if line.startswith("replan") else line)
        self._skip = 1  # step K + 1, as the run's first step was: the first of a new build, or beside the re-plan
        if not self.choice.moves:
            return
        start = time.perf_counter()
        checkpoints = trainer.config.checkpoints
        folder = Path(checkpoints.checkpoints_path) / str(step)
        if step % checkpoints.checkpoint_interval != 0:  # else the trainer saved this step already
            iteration, trainer.iteration_step = trainer.iteration_step, step
            try:
                folder = Path(trainer.save_checkpoint() or folder)
            finally:
                trainer.iteration_step = iteration
        self.seconds["save"] = time.perf_counter() - start
        self._rss_before = peak_rss_mib()
        self._moved_at = time.perf_counter()
        raise MoveTo(self.choice, folder)

    def measured_lines(self) -> list[str]:
        """After the last launch: the move's cost, and the measured steps against the predictions (rank 0)."""
        if self.choice is None:
            return []
        lines = []
        if self.choice.moves and "restart" in self.seconds:
            s = self.seconds
            before, after = self.peak_rss or (float("nan"), float("nan"))
            lines.append(
                f"nanotron_ext: replan: the move took {s['save'] + s['restart']:.2f} s (save "
                f"{s['save']:.2f} s, re-launch, build and load {s['restart']:.2f} s); re-plan "
                f"{s['profile'] + s['plan']:.2f} s; rank 0's peak memory {before:.0f} -> {after:.0f} MiB"
            )
        return lines + [
            f"nanotron_ext: {line}"
            for line in measured_lines(self.choice, self.timed, self.after, first_timed=(self.first_step or 1) + 1)
        ]
