"""``nanotron_ext.replan`` in ``nanotron-ext train``: after K steps the run prices itself from its own steps, plans
again under the same memory, and moves to the faster plan in the same processes (``docs/replan.md``).

1. Steps 2..K run under the engine's clock (:class:`~nanotron_ext.runtime.op_clock.OpClock`, which changes no bit of
   the training; step 1 pays one-off costs and is not timed).
2. After step K: the in-run profile of those steps (:func:`nanotron_ext.machine.in_run.in_run_profile`) on top of
   the config's machine profile, or of a standalone calibration taken now where the config has none; then
   :func:`nanotron_ext.plan.replan.choose_replan` prices the plan the run trains and the fastest one under its
   memory, and decides. Every rank reaches the same decision (rank 0's profile and noise, broadcast).
3. A move to another engine on the same split swaps the engine between two steps: no state moves. A move to another
   split is a resume under another plan, in the same processes, through the launcher's resume path
   (:class:`nanotron_ext.integration.checkpoints.ResumeState`): Nanotron's serializers save step K with the plan
   record and every file hashed as written; the new split is built and checked (every rank trains); the files are
   proved and the state is proved to map completely onto the new split before anything loads; then weights, Adam's
   moments and step, and the schedule load by name, and the old model is freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan.replan import (
    ReplanChoice,
    choose_replan,
    measured_lines,
    replan_engines,
    replan_profiles,
)
from nanotron_ext.procs import peak_rss_mib
from nanotron_ext.report import human_bytes
from nanotron_ext.runtime.train_settings import TrainSettings

__all__ = ["ReplanOutcome", "Replanner", "Trainee", "load_optimizer", "load_weights", "save_for_move"]


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


@dataclasses.dataclass(frozen=True)
class ReplanOutcome:
    """What the re-plan decided, and what each part of it took (seconds, this rank's clock)."""

    choice: ReplanChoice
    seconds: dict[str, float]
    timed_steps: int | None = None  # the steps the clock recorded (rank 0; None elsewhere)
    checkpoint_bytes: int | None = None  # the move's checkpoint, every rank's files
    peak_rss_mib: tuple[float, float] | None = None  # this process's peak resident memory before and after the move

    def to_dict(self) -> dict[str, Any]:
        c = self.choice
        return {
            "after_step": c.step,
            "verdict": c.verdict.value,
            "moved": c.moves,
            "old": {"split": c.old.split_text, "engine": c.old.engine, "predicted_step_s": c.old_step},
            "new": {"split": c.new.split_text, "engine": c.new.engine, "predicted_step_s": c.new_step},
            "predicted_gain": c.gain,
            "noise": c.noise,
            "min_gain": c.min_gain,
            "cap_bytes": c.cap_bytes,
            "seconds": self.seconds,
            "timed_steps": self.timed_steps,
            "checkpoint_bytes": self.checkpoint_bytes,
            "peak_rss_mib": None if self.peak_rss_mib is None else list(self.peak_rss_mib),
        }


class Replanner:
    """Times the first K steps of a run, re-plans after step K and moves (see the module docstring).

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
        self.after_steps = settings.cfg.ext.replan.after_steps
        self.ctx, self.rebuild, self.say = ctx, rebuild, say
        self.engines = replan_engines(settings.cfg, engine_was_auto=engine_was_auto)
        self.clock: Any = None
        self.timed: list[float] = []  # this rank's wall time of each timed step
        self.outcome: ReplanOutcome | None = None

    @contextlib.contextmanager
    def step(self, step: int, trainee: Trainee) -> Iterator[None]:
        """Run training step ``step`` under the clock until the re-plan (step 1 untimed)."""
        if self.after_steps is None or step > self.after_steps:
            yield
            return
        if self.clock is None:
            from nanotron_ext.runtime.op_clock import OpClock

            self.clock = OpClock(trainee.model, self.ctx).__enter__()
        start = time.perf_counter()
        with self.clock.step(record=step > 1):
            yield
        if step > 1:
            self.timed.append(time.perf_counter() - start)

    def after(self, step: int, trainee: Trainee) -> Trainee:
        """After step ``step``: at K, re-plan and return what the next steps train with (a new trainee after a move
        to another split, the same one otherwise)."""
        if step != self.after_steps:
            return trainee
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        gathered = self.clock.gather()
        self.clock.__exit__(None, None, None)
        self.clock = None
        s = trainee.settings
        with tempfile.TemporaryDirectory(prefix="nanotron-ext-replan-profile-") as tmp:
            whole, *halves = [
                s.cfg.with_overrides(machine=str(path))
                for path in replan_profiles(s.cfg, s.plan.block_ranks, gathered, len(self.timed), s.rank, Path(tmp))
            ]
            seconds["profile"] = time.perf_counter() - start
            start = time.perf_counter()
            choice = choose_replan(
                whole, inventory_from_config(whole), s.plan, step=step, engines=self.engines, halves=halves
            )
            seconds["plan"] = time.perf_counter() - start
        for line in choice.lines():
            self.say(f"nanotron_ext: {line}" if line.startswith("replan") else line)
        outcome = ReplanOutcome(choice, seconds, None if gathered is None else len(gathered[0]))
        if choice.moves and list(choice.new.block_ranks) == list(s.plan.block_ranks):  # the engine only
            self.say(f"  the engine changes to {choice.new.engine} on the same split: no state moves")
            trainee = dataclasses.replace(trainee, settings=_settings_for(s, choice))
        elif choice.moves:
            before = peak_rss_mib()
            trainee, size = self._move(trainee, _settings_for(s, choice), step, seconds)
            outcome = dataclasses.replace(outcome, checkpoint_bytes=size, peak_rss_mib=(before, peak_rss_mib()))
            self.say(
                f"  moved in {seconds['save'] + seconds['build_and_load']:.2f} s (save {seconds['save']:.2f} s, "
                f"build and load {seconds['build_and_load']:.2f} s; checkpoint {human_bytes(size)}); re-plan "
                f"{seconds['profile'] + seconds['plan']:.2f} s; rank 0's peak memory {before:.0f} -> "
                f"{outcome.peak_rss_mib[1]:.0f} MiB"
            )
        self.outcome = outcome
        return trainee

    def measured(self, times: list[float]) -> tuple[list[float], list[float]]:
        """This rank's timed steps before the re-plan, and its steps after it from K + 2 on (step K + 1 is the first
        on a new build, as step 1 was)."""
        return self.timed, times[(self.after_steps or 0) + 1 :]

    def report(self, times: list[float]) -> dict[str, Any]:
        """The metrics' ``replan`` entry: the decision, what each part took, and the measured steps."""
        assert self.outcome is not None
        before, after = self.measured(times)
        return {
            **self.outcome.to_dict(),
            "measured_step_s_before": statistics.fmean(before),
            "measured_step_s_after": statistics.fmean(after) if after else None,
        }

    def measured_lines(self, times: list[float]) -> list[str]:
        """Rank 0's measured steps against what the re-plan predicted."""
        assert self.outcome is not None
        return [
            f"nanotron_ext: {line}"
            for line in measured_lines(self.outcome.choice, *self.measured(times), first_timed=2)
        ]

    def _move(self, old: Trainee, settings: TrainSettings, step: int, seconds: dict[str, float]) -> tuple[Trainee, int]:
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
            seconds["save"] = time.perf_counter() - start
            start = time.perf_counter()
            source = locate_checkpoint(folder)
            assert source is not None and source.record is not None  # complete: every rank wrote its part
            size = sum(f.size for f in source.record.files or ())
            state = ResumeState(settings.cfg, source, mode="replan", say=self.say)
            _release(old)  # the old split's weights and moments go before the new ones are built
            new = self.rebuild(settings, self.ctx, state)
            seconds["build_and_load"] = time.perf_counter() - start
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


def _settings_for(s: TrainSettings, choice: ReplanChoice) -> TrainSettings:
    """The run's settings on the new plan: its engine and split (the config's other keys unchanged)."""
    from nanotron_ext.runtime.engine import engine_for

    cfg = s.cfg.with_overrides(engine=choice.new.engine)
    return dataclasses.replace(
        s,
        cfg=cfg,
        plan=choice.new,
        parallel_config=dataclasses.replace(s.parallel_config, pp_engine=engine_for(choice.new)),
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
