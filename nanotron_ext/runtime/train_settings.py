"""Everything a CPU training run needs, resolved and checked before any process group exists: the config, the
static plan, the world, Nanotron's model, parallelism and optimizer settings, the data and the LR schedule
(:func:`preflight`). The loop itself is :mod:`nanotron_ext.runtime.train`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.config_keys import get_dotted, installed_nanotron_keys
from nanotron_ext.errors import ConfigError, PlanningError, check_positive_int
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import Plan, cannot_train_message
from nanotron_ext.plan.v_plan import VPlan
from nanotron_ext.procs import RENDEZVOUS_VARIABLES, free_port, rendezvous_env
from nanotron_ext.runtime.data import (
    ByteTokenizer,
    PackedTextData,
    data_files_from_config,
    load_packed_windows,
)
from nanotron_ext.schedule import too_few_micro_batches

__all__ = ["TrainSettings", "lr_function", "preflight"]


@dataclass
class TrainSettings:
    """Everything a run needs, resolved and checked before any process group exists.

    Attributes:
        cfg: the planner config (command-line overrides applied).
        plan: the static plan computed from the config alone (the built model re-plans identically); a V under
            ``pp_engine: zbv``.
        steps: optimisation steps.
        seed: weight-init seed; ``data_seed``: data-order seed.
        world_size / rank: from the torchrun environment.
        model_config: Nanotron ``LlamaConfig`` (vocabulary padded as Nanotron's trainer pads it).
        parallel_config: Nanotron ``ParallelismArgs`` from the YAML.
        optimizer: AdamW settings and the LR schedule arguments.
        clip_grad: max global gradient norm or None.
        init_std: weight-init standard deviation.
        data_files / windows: the text files and their packed token windows.
        notes: things rank 0 prints before training (settings the CPU runtime changes).
        timeout_s: how long a rank waits for a silent peer (``$NANOTRON_EXT_TIMEOUT_S``, default 60).
        device: where this rank trains (``$NANOTRON_EXT_DEVICE``: ``cpu``, or ``cuda:N``).
        engine_was_auto: the YAML said ``pp_engine: auto`` (``auto`` is resolved in ``cfg``).
    """

    cfg: PlannerConfig
    plan: Plan | VPlan
    steps: int
    seed: int
    data_seed: int
    world_size: int
    rank: int
    model_config: Any
    parallel_config: Any
    optimizer: dict[str, Any]
    lr_schedule: Any
    clip_grad: float | None
    init_std: float
    data_files: list[Path]
    windows: Any
    notes: list[str] = field(default_factory=list)
    timeout_s: float = 60.0
    device: str = "cpu"
    engine_was_auto: bool = False

    @property
    def tokens_per_step(self) -> int:
        r = self.cfg.run
        return r.dp * r.n_micro_batches * r.micro_batch_size * r.sequence_length


def preflight(
    config_file: str | Path,
    *,
    cost_strategy: str | None = None,
    steps: int | None = None,
    seed: int | None = None,
    replan_after: int | str | None = None,
) -> TrainSettings:
    """Every check that needs no process group, in the order a user would fix them.

    All ranks read the same YAML, so all raise the same error here together; nothing is left waiting.

    Raises:
        ConfigError: malformed or incomplete YAML, unknown strategy, world size ≠ dp×pp×tp, 1F1B with fewer
            than pp-1 micro-batches, missing data, a setting the CPU runtime cannot honour.
        PlanningError: the strategy's plan cannot train (e.g. a stage without parameters).
    """
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import AUTO_ENGINES, CONTIGUOUS_AUTO_ENGINES, resolve_engine, resolve_vocab_shards
    from nanotron_ext.plan.replan import with_replan_after
    from nanotron_ext.plan.v_plan import plan_for, strategy_note

    # The installed Nanotron's keys count as known: where its loader reads a key, it has the final word.
    cfg = load_config(config_file, cost_strategy=cost_strategy, nanotron_keys=installed_nanotron_keys())
    cfg = with_replan_after(cfg, replan_after)
    replans = cfg.ext.replan.after_steps is not None
    # A re-plan moves between contiguous splits, so auto starts on one.
    cfg, engine_choice = resolve_engine(cfg, CONTIGUOUS_AUTO_ENGINES if replans else AUTO_ENGINES)
    cfg, _ = resolve_vocab_shards(cfg)
    raw, run = cfg.nanotron, cfg.run
    steps, seed, data_seed = _steps_and_seeds(raw, steps, seed)

    # At exactly pp - 1 micro-batches 1F1B runs, never filling the pipeline; the plan carries a warning for that.
    shortfall = too_few_micro_batches(run.engine, run.pp, run.n_micro_batches)
    if shortfall is not None:
        raise ConfigError(shortfall)

    world_size, rank = _world_from_env(run.dp * run.pp * run.tp, cfg)
    timeout_s, device = _timeout_s(), _device()
    if cfg.ext.machine is not None:  # a profile timed on another device would misprice this run's plan
        machine_for(cfg, device=device.split(":")[0], backend="gloo")
    ByteTokenizer().check_model_vocab(cfg.model.vocab_size)
    files = data_files_from_config(raw, config_path=None if cfg.source.startswith("<") else cfg.source)

    # The static plan, from the config alone: a plan that cannot train stops every rank here, before a
    # process group or a weight exists. build_model() re-plans from the real model and must agree.
    plan = plan_for(inventory_from_config(cfg), cfg)
    if not plan.ok:
        raise PlanningError(cannot_train_message(plan))

    nanotron = _nanotron_settings(cfg, plan)
    if engine_choice is not None:  # said first: the engine that trains, and the runner-up
        nanotron["notes"] = [*engine_choice.lines(), *nanotron["notes"]]
    unused = strategy_note(cfg)
    if unused is not None:
        nanotron["notes"].append(unused)
    windows = load_packed_windows(files, run.sequence_length)
    PackedTextData(windows, run.micro_batch_size, 0, run.dp)  # raises if a replica's shard is too small
    return TrainSettings(
        cfg=cfg,
        plan=plan,
        steps=steps,
        seed=seed,
        data_seed=data_seed,
        world_size=world_size,
        rank=rank,
        data_files=files,
        windows=windows,
        timeout_s=timeout_s,
        device=device,
        engine_was_auto=engine_choice is not None,
        **nanotron,
    )


def _timeout_s() -> float:
    # The context module imports torch; read the setting through it only once the cheap checks passed.
    from nanotron_ext.runtime.context import timeout_from_env

    return timeout_from_env()


def _device() -> str:
    """This rank's device from ``$NANOTRON_EXT_DEVICE``, checked before any process group exists."""
    from nanotron_ext.runtime.device import device_from_env, host_staging

    device = device_from_env()
    host_staging(device)  # checks $NANOTRON_EXT_HOST_STAGING too
    return str(device)


def _steps_and_seeds(raw: dict[str, Any], steps: int | None, seed: int | None) -> tuple[int, int, int]:
    """``(steps, weight seed, data seed)``: the command line's values, else the YAML's."""
    steps = steps if steps is not None else get_dotted(raw, "tokens.train_steps", 1)
    check_positive_int("--steps (tokens.train_steps)", steps)
    general_seed = get_dotted(raw, "general.seed", 42)
    data_seed = seed if seed is not None else get_dotted(raw, "data.seed", general_seed)
    seed = seed if seed is not None else general_seed
    for name, value in (("seed", seed), ("data.seed", data_seed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r} must be a non-negative integer, e.g. {name.rsplit('.', 1)[-1]}: 42")
    return steps, seed, data_seed


def _optimizer_settings(cfg: PlannerConfig) -> tuple[dict[str, Any], Any, list[str], float | None]:
    """(Adam's settings, Nanotron's ``LRSchedulerArgs``, scheduler keys left unused, ``clip_grad``) of the YAML."""
    from nanotron.config import LRSchedulerArgs

    raw = cfg.nanotron
    opt = get_dotted(raw, "optimizer", {}) or {}
    # Upstream main keeps Adam's settings under optimizer.optimizer_factory; 0.2 next to the others.
    opt = {**opt, **(opt.get("optimizer_factory") or {})}
    lr_raw = opt.get("learning_rate_scheduler")
    if not isinstance(lr_raw, dict) or "learning_rate" not in lr_raw:
        raise ConfigError(f"{cfg.source}: required key 'optimizer.learning_rate_scheduler.learning_rate' is missing")
    lr_raw, unused_lr = _known_fields(LRSchedulerArgs, lr_raw)
    try:
        lr_schedule = LRSchedulerArgs(**lr_raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg.source}: invalid optimizer.learning_rate_scheduler: {exc}") from exc
    clip = opt.get("clip_grad")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ConfigError(f"optimizer.clip_grad={clip!r} must be a positive number, e.g. clip_grad: 1.0, or null")
    return opt, lr_schedule, unused_lr, clip


def _nanotron_settings(cfg: PlannerConfig, plan: Plan | VPlan) -> dict[str, Any]:
    """Model, parallelism, optimizer and schedule settings through Nanotron's own config classes (which
    validate them), plus notes on the settings the CPU runtime changes."""
    # Importing nanotron pulls in torch: a second or two, so only after the cheap checks.
    from nanotron.config import LlamaConfig, ParallelismArgs

    from nanotron_ext.runtime.engine import engine_for

    raw, run = cfg.nanotron, cfg.run
    if cfg.model.family != "llama":
        raise ConfigError(
            f"{cfg.source}: the CPU trainer builds Llama models, and this config describes a {cfg.model.family} "
            f"model; `nanotron-ext plan` and `simulate` price it, and Nanotron's own trainer trains it"
        )
    # A current (upstream main) config names keys 0.2's classes do not have; those the CPU model has no use for
    # are left out, and said so.
    model_config_raw, unused = _known_fields(LlamaConfig, get_dotted(raw, "model.model_config", {}))
    try:
        model_config = LlamaConfig(**{**model_config_raw, "vocab_size": cfg.model.vocab_size})
    except TypeError as exc:
        raise ConfigError(f"{cfg.source}: model.model_config is not a Nanotron 0.2 LlamaConfig: {exc}") from exc

    par = raw.get("parallelism") or {}
    try:
        parallel_config = ParallelismArgs(
            # An engine instance: Nanotron's loader knows only "1f1b" and "afab" by name, not our "zb1p".
            dp=run.dp,
            pp=run.pp,
            tp=run.tp,
            pp_engine=engine_for(plan),
            # Asynchronous TP communication overlaps CUDA streams (Nanotron asserts CUDA_DEVICE_MAX_CONNECTIONS=1).
            tp_mode=run.tp_mode,
            tp_linear_async_communication=False,
        )
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{cfg.source}: invalid 'parallelism:' settings: {exc}") from exc

    opt, lr_schedule, unused_lr, clip = _optimizer_settings(cfg)
    return {
        "model_config": model_config,
        "parallel_config": parallel_config,
        "optimizer": {
            "learning_rate": float(lr_schedule.learning_rate),
            "weight_decay": float(opt.get("weight_decay", 0.0) or 0.0),
            "adam_eps": float(opt.get("adam_eps", 1e-8)),
            "adam_betas": (float(opt.get("adam_beta1", 0.9)), float(opt.get("adam_beta2", 0.95))),
        },
        "lr_schedule": lr_schedule,
        "clip_grad": None if clip is None else float(clip),
        "init_std": float((get_dotted(raw, "model.init_method", {}) or {}).get("std", 0.02)),
        "notes": _cpu_notes(run)
        + (
            [
                "parallelism.tp_linear_async_communication ignored: it overlaps CUDA streams; the CPU trainer "
                "communicates synchronously"
            ]
            if par.get("tp_linear_async_communication")
            else []
        )
        + (
            [
                "data_stages (upstream main's data section) is not read: the CPU trainer reads data.dataset "
                "(a local text file or folder), the bundled corpus when it is absent"
            ]
            if "data_stages" in raw
            else []
        )
        + [
            f"{where} keys the CPU trainer does not use: {', '.join(keys)}"
            for where, keys in (("model.model_config", unused), ("optimizer.learning_rate_scheduler", unused_lr))
            if keys
        ],
    }


def _known_fields(cls: Any, values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` split into the fields dataclass ``cls`` has and the names of the others."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}, sorted(k for k in values if k not in names)


def _cpu_notes(run: Any) -> list[str]:
    notes = []
    if run.zero_stage != 0:
        # ZeRO-1 only shards optimizer state (same updates); Nanotron's ZeRO optimizer is not exercised over gloo.
        notes.append(
            f"optimizer.zero_stage={run.zero_stage} ignored: the CPU trainer keeps full optimizer "
            "state on every DP replica (same updates, no sharding)"
        )
    if run.accumulate_grad_in_fp32:
        notes.append(
            "optimizer.accumulate_grad_in_fp32 ignored: Nanotron's fp32 accumulator is CUDA-only and "
            "the CPU trainer's parameters are fp32 already"
        )
    if run.dtype != "float32":
        notes.append(f"model.dtype={run.dtype} ignored: the CPU trainer computes in float32")
    return notes


def _world_from_env(needed: int, cfg: PlannerConfig) -> tuple[int, int]:
    """``(world_size, rank)`` from torchrun's variables; a 1-process run may go without torchrun."""
    r = cfg.run
    shape = f"dp×pp×tp = {r.dp}×{r.pp}×{r.tp} = {needed}"
    if not any(k in os.environ for k in RENDEZVOUS_VARIABLES):
        if needed != 1:
            raise ConfigError(
                f"{cfg.source} asks for {shape} processes; launch them with torchrun: "
                f"`torchrun --nproc_per_node={needed} -m nanotron_ext.cli train --config-file {cfg.source}`"
            )
        # A single process needs no launcher: stand in for torchrun's rendezvous variables.
        os.environ.update(rendezvous_env(0, 1, free_port()))
    missing = [k for k in RENDEZVOUS_VARIABLES if k not in os.environ]
    if missing:
        raise ConfigError(f"torchrun environment incomplete: {', '.join(missing)} not set; launch with torchrun")
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world_size != needed:
        raise ConfigError(
            f"WORLD_SIZE={world_size} but {cfg.source} asks for {shape} processes: launch "
            f"`torchrun --nproc_per_node={needed} ...`, or change parallelism.dp/pp/tp so that their product "
            f"is {world_size}"
        )
    return world_size, rank


def lr_function(schedule: Any, total_steps: int) -> Callable[[int], float]:
    """``lr(step)`` of Nanotron's schedule, on every rank, frozen ones (no optimizer) included.

    Nanotron's ``lr_scheduler_builder`` hides the formula in a closure; build it on a one-weight probe
    optimizer (never stepped) and read the factor back, rather than copy the formula.
    """
    import torch
    from nanotron.helpers import lr_scheduler_builder

    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=schedule.learning_rate)

    class _Named:  # lr_scheduler_builder wants Nanotron's optimizer interface
        @staticmethod
        def get_base_optimizer() -> torch.optim.Optimizer:
            return probe

    factor = lr_scheduler_builder(_Named(), schedule, total_steps).lr_lambdas[0]
    return lambda step: float(schedule.learning_rate * factor(step))
