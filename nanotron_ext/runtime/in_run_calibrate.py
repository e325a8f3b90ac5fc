"""``nanotron-ext calibrate --in-run``: price a config's blocks from real training steps of Nanotron's engine.

Under torchrun with the config's ``pp × dp × tp`` ranks, on the CPU runtime (gloo, Nanotron 0.2's engines and ours):

1. the standalone calibration (:func:`nanotron_ext.machine.calibrate.calibrate`: every block alone, the links, the
   all-reduces), or a profile given with ``--machine``, as the base;
2. for the config's own split (or, with ``probes``, each of :func:`nanotron_ext.plan.probes.probe_splits`): the model
   built on that split, ``warmup`` untimed steps, then ``steps`` steps timed by
   :class:`~nanotron_ext.runtime.op_clock.OpClock` under the config's engine, on random tokens;
3. :func:`nanotron_ext.machine.in_run.in_run_profile` on rank 0, broadcast: every rank returns the same profile.

Entry point: :func:`calibrate_in_run`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import MachineProfile, key_for, load_machine
from nanotron_ext.machine.calibrate import calibrate
from nanotron_ext.machine.in_run import IN_RUN_STEPS, IN_RUN_WARMUP_STEPS, InRunSplit
from nanotron_ext.machine.in_run_shared import shared_in_run_profile, split_steps
from nanotron_ext.plan import CONTIGUOUS_AUTO_ENGINES, make_plan, resolve_engine
from nanotron_ext.plan.probes import Probe, probe_splits
from nanotron_ext.procs import RENDEZVOUS_VARIABLES
from nanotron_ext.schedule import V_ENGINE

__all__ = ["SplitRun", "build_split", "calibrate_in_run", "in_run_splits", "profile_in_context"]


def in_run_splits(cfg: PlannerConfig, *, probes: bool) -> list[Probe]:
    """The splits an in-run calibration trains: the config's plan, or its probe splits (the plan first).

    Raises:
        PlanningError: the config's plan cannot train.
    """
    from nanotron_ext.errors import PlanningError
    from nanotron_ext.plan import cannot_train_message

    blocks = inventory_from_config(cfg)
    plan = make_plan(blocks, cfg)
    if not plan.ok:
        raise PlanningError(cannot_train_message(plan))
    return probe_splits(blocks, plan.block_ranks) if probes else [Probe("plan", tuple(plan.block_ranks))]


def calibrate_in_run(
    cfg: PlannerConfig,
    *,
    probes: bool = False,
    steps: int = IN_RUN_STEPS,
    warmup_steps: int = IN_RUN_WARMUP_STEPS,
    base: str | None = None,
    warmup: int = 2,
    repeats: int = 11,
    progress: bool = True,
) -> MachineProfile:
    """The in-run profile of ``cfg`` on this machine (collective: every rank calls it and gets the same profile).

    Args:
        cfg: the config; its engine (``auto`` resolved) runs the steps.
        probes: train the probe splits instead of the config's split alone.
        steps / warmup_steps: timed and untimed training steps per split.
        base: a profile file to build on (its key must be this run's); None: calibrate the blocks, links and
            all-reduces first, with ``warmup`` and ``repeats`` as ``calibrate`` takes them.
        progress: a progress bar on rank 0.

    Raises:
        ConfigError: ``pp_engine: zbv``, not under torchrun, the world is not ``pp × dp × tp``, bad counts, a base
            for another setup.
        PlanningError: the config's plan cannot train.
        RunFailure: a rank failed (every rank raises).
    """
    for name, value, least in (("--steps", steps, 1), ("--warmup-steps", warmup_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"calibrate --in-run: {name}={value!r} must be an integer >= {least}, e.g. {name} 4")
    if cfg.run.engine == V_ENGINE:
        raise ConfigError(
            "calibrate --in-run times contiguous splits, not a V yet: calibrate the config under "
            "pp_engine zb1p (its blocks' B and W, at this pp, price the V's chunks) and give that "
            "profile as `machine:` to the zbv config"
        )
    if not all(v in os.environ for v in RENDEZVOUS_VARIABLES):
        raise ConfigError(
            "calibrate --in-run trains the config's split through Nanotron's engine: run it under "
            f"torchrun with pp*dp*tp = {cfg.run.pp * cfg.run.dp * cfg.run.tp} ranks, e.g. "
            f"`torchrun --nproc_per_node={cfg.run.pp * cfg.run.dp * cfg.run.tp} -m nanotron_ext.cli "
            f"calibrate CONFIG --in-run --out FILE`"
        )
    cfg, _ = resolve_engine(cfg, CONTIGUOUS_AUTO_ENGINES)  # it times contiguous splits
    splits = in_run_splits(cfg, probes=probes)
    from nanotron_ext.runtime.context import GlooParallelContext, timeout_from_env
    from nanotron_ext.runtime.device import device_from_env

    run = cfg.run
    with GlooParallelContext(
        tensor_parallel_size=run.tp,
        pipeline_parallel_size=run.pp,
        data_parallel_size=run.dp,
        timeout_s=timeout_from_env(),
    ) as ctx:
        device = device_from_env().type
        if base is not None:
            profile = load_machine(base)
            profile.check_key(key_for(cfg, device=device, backend="gloo"), origin=repr(base))
        else:
            profile = calibrate(cfg, warmup=warmup, repeats=repeats, progress=progress)
        rank = int(os.environ["RANK"])
        return profile_in_context(
            cfg, ctx, profile, splits, steps=steps, warmup_steps=warmup_steps, progress=progress and rank == 0
        )


def profile_in_context(
    cfg: PlannerConfig,
    ctx: Any,
    base: MachineProfile,
    splits: list[Probe],
    *,
    steps: int = IN_RUN_STEPS,
    warmup_steps: int = IN_RUN_WARMUP_STEPS,
    progress: bool = False,
) -> MachineProfile:
    """The in-run profile of ``splits`` on top of ``base``, in an existing gloo context (collective; every rank
    returns the same profile). What :func:`calibrate_in_run` does once its context and base exist; a benchmark that
    trains in the same processes calls it directly."""
    with _bar(len(splits) * (steps + warmup_steps), enabled=progress) as bar:
        runs = [_time_split(cfg, split, ctx, steps, warmup_steps, bar) for split in splits]
    return shared_in_run_profile(cfg, runs, base, int(os.environ["RANK"]), what="calibrate --in-run")


def build_split(cfg: PlannerConfig, block_ranks: Sequence[int], ctx: Any, *, seed: int = 0) -> SplitRun:
    """``cfg``'s model built on ``block_ranks`` (frozen as the config says, DDP where dp > 1), its optimizer and a
    stream of random micro-batches: what one split trains with (collective)."""
    import torch

    from nanotron_ext.integration import apply_freeze_to_model
    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, random_micro_batches, wrap_ddp

    torch.manual_seed(seed)
    model = build_cpu_llama(
        llama_config_from_shape(cfg),
        ctx,
        block_ranks=list(block_ranks),
        ddp=False,
        projector=cfg.ext.projector,
        vocab_shards=cfg.vocab_shards,
        recompute_layer=cfg.run.recompute_layer,
    )
    apply_freeze_to_model(model, cfg, inventory_from_config(cfg))
    model = wrap_ddp(model, ctx)
    optimizer, accumulator = build_optimizer(model, ctx, learning_rate=1e-5)
    batches = random_micro_batches(
        model, ctx, cfg.model.vocab_size, cfg.run.micro_batch_size, cfg.run.sequence_length, seed=seed
    )
    return SplitRun(model, optimizer, accumulator, batches)


class SplitRun(NamedTuple):
    """A split's model, optimizer, gradient accumulator and micro-batch stream."""

    model: Any
    optimizer: Any
    accumulator: Any
    batches: Iterator[Any]

    def step(self, cfg: PlannerConfig, ctx: Any, engine: str | None = None) -> float:
        """One training step under ``engine`` (default: the config's); its loss."""
        from nanotron_ext.runtime import train_step

        return train_step(
            self.model,
            ctx,
            engine or cfg.run.engine,
            self.batches,
            cfg.run.n_micro_batches,
            self.optimizer,
            grad_accumulator=self.accumulator,
        )


def _time_split(cfg: PlannerConfig, split: Probe, ctx: Any, steps: int, warmup_steps: int, bar: Any) -> InRunSplit:
    """One split built, warmed up and timed; its steps gathered on rank 0 (an empty split elsewhere)."""
    from nanotron_ext.runtime.op_clock import OpClock

    bar.set_postfix_str(f"{split.name}: building")
    run = build_split(cfg, split.block_ranks, ctx)
    with OpClock(run.model, ctx) as clock:
        for i in range(warmup_steps + steps):
            bar.set_postfix_str(f"{split.name}: {'warm-up' if i < warmup_steps else 'timed'} step")
            with clock.step(record=i >= warmup_steps):
                run.step(cfg, ctx)
            bar.update()
        gathered = clock.gather()
    del run, clock
    gc.collect()
    return split_steps(split.block_ranks, gathered)


@contextlib.contextmanager
def _bar(total: int, *, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(
        total=total, desc="calibrate --in-run", unit="step", file=sys.stderr, disable=not enabled, dynamic_ncols=True
    )
    try:
        yield bar
    finally:
        bar.close()
