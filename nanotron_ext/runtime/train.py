"""The CPU training loop: a Nanotron YAML's model trained through Nanotron 0.2's real pipeline engines.

Every rank does the same thing:

1. :func:`preflight` checks everything that needs no process group — the strategy, the static plan (built
   from the config alone), the world size, 1F1B's micro-batch count, the data files — so a bad input makes
   *every* rank fail at once with the same message and nothing can hang;
2. create the gloo ``ParallelContext``, build the model with :func:`nanotron_ext.integration.build_model`
   (plan + static validation before allocation), tie, initialise, freeze, and run the collective
   :func:`~nanotron_ext.integration.check_every_rank_trains`;
3. wrap in DDP, build Nanotron's optimizer and LR schedule, and run the training steps with the YAML's
   engine, micro-batch count and gradient clipping.

Rank 0 prints per-step loss, gradient norm, step time and tokens per second, then a summary table, and
writes the metrics (block→rank map, per-rank parameter counts and losses, a SHA-256 of every parameter
before and after training) and the plan as JSON when asked. ``nanotron-ext train`` (:mod:`nanotron_ext.cli.train`)
is the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_ext.blocks import short_name
from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.config_keys import get_dotted, installed_nanotron_keys
from nanotron_ext.errors import ConfigError, NanotronExtError, PlanningError, check_positive_int
from nanotron_ext.outputs import atomic_write_text
from nanotron_ext.plan import Plan, cannot_train_message
from nanotron_ext.procs import RENDEZVOUS_VARIABLES, free_port, rendezvous_env
from nanotron_ext.report import compact_names, human_count, table
from nanotron_ext.runtime.data import (
    ByteTokenizer,
    PackedTextData,
    data_files_from_config,
    load_packed_windows,
)
from nanotron_ext.schedule import too_few_micro_batches

__all__ = ["TrainSettings", "preflight", "run_training"]



@dataclass
class TrainSettings:
    """Everything a run needs, resolved and checked before any process group exists.

    Attributes:
        cfg: the planner config (command-line overrides applied).
        plan: the static plan computed from the config alone (the built model re-plans identically).
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
    """

    cfg: PlannerConfig
    plan: Plan
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
) -> TrainSettings:
    """Every check that needs no process group, in the order a user would fix them.

    All ranks read the same YAML, so all raise the same error here together; nothing is left waiting.

    Raises:
        ConfigError: malformed or incomplete YAML, unknown strategy, world size ≠ dp×pp×tp, 1F1B with fewer
            than pp-1 micro-batches, missing data, a setting the CPU runtime cannot honour.
        PlanningError: the strategy's plan cannot train (e.g. a stage without parameters).
    """
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan, resolve_vocab_shards

    # The installed Nanotron's keys count as known: where its loader reads a key, it has the final word.
    cfg = load_config(config_file, cost_strategy=cost_strategy, nanotron_keys=installed_nanotron_keys())
    cfg, _ = resolve_vocab_shards(cfg)
    raw, run = cfg.nanotron, cfg.run
    steps, seed, data_seed = _steps_and_seeds(raw, steps, seed)

    # At exactly pp - 1 micro-batches 1F1B runs, never filling the pipeline; the plan carries a warning for that.
    shortfall = too_few_micro_batches(run.engine, run.pp, run.n_micro_batches)
    if shortfall is not None:
        raise ConfigError(shortfall)

    world_size, rank = _world_from_env(run.dp * run.pp * run.tp, cfg)
    timeout_s, device = _timeout_s(), _device()
    ByteTokenizer().check_model_vocab(cfg.model.vocab_size)
    files = data_files_from_config(raw, config_path=None if cfg.source.startswith("<") else cfg.source)

    # The static plan, from the config alone: a plan that cannot train stops every rank here, before a
    # process group or a weight exists. build_model() re-plans from the real model and must agree.
    plan = make_plan(inventory_from_config(cfg), cfg)
    if not plan.ok:
        raise PlanningError(cannot_train_message(plan))

    nanotron = _nanotron_settings(cfg)
    windows = load_packed_windows(files, run.sequence_length)
    PackedTextData(windows, run.micro_batch_size, 0, run.dp)  # raises if a replica's shard is too small
    return TrainSettings(
        cfg=cfg, plan=plan, steps=steps, seed=seed, data_seed=data_seed, world_size=world_size, rank=rank,
        data_files=files, windows=windows, timeout_s=timeout_s, device=device, **nanotron,
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
            raise ConfigError(f"{name}={value!r} must be a non-negative integer")
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
        raise ConfigError(f"optimizer.clip_grad={clip!r} must be a positive number or null")
    return opt, lr_schedule, unused_lr, clip


def _nanotron_settings(cfg: PlannerConfig) -> dict[str, Any]:
    """Model, parallelism, optimizer and schedule settings through Nanotron's own config classes (which
    validate them), plus notes on the settings the CPU runtime changes."""
    # Importing nanotron pulls in torch: a second or two, so only after the cheap checks.
    from nanotron.config import LlamaConfig, ParallelismArgs

    from nanotron_ext.runtime.engine import make_engine

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
            dp=run.dp, pp=run.pp, tp=run.tp, pp_engine=make_engine(run.engine),
            # Asynchronous TP communication overlaps CUDA streams (Nanotron asserts CUDA_DEVICE_MAX_CONNECTIONS=1).
            tp_mode=run.tp_mode, tp_linear_async_communication=False,
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
        "notes": _cpu_notes(run) + (
            ["parallelism.tp_linear_async_communication ignored: it overlaps CUDA streams; the CPU trainer "
             "communicates synchronously"] if par.get("tp_linear_async_communication") else []
        ) + (
            ["data_stages (upstream main's data section) is not read: the CPU trainer reads data.dataset "
             "(a local text file or folder), the bundled corpus when it is absent"] if "data_stages" in raw else []
        ) + [
            f"{where} keys the CPU trainer does not use: {', '.join(keys)}"
            for where, keys in (("model.model_config", unused), ("optimizer.learning_rate_scheduler", unused_lr)) if keys
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
        notes.append(f"optimizer.zero_stage={run.zero_stage} ignored: the CPU trainer keeps full optimizer "
                     "state on every DP replica (same updates, no sharding)")
    if run.accumulate_grad_in_fp32:
        notes.append("optimizer.accumulate_grad_in_fp32 ignored: Nanotron's fp32 accumulator is CUDA-only and "
                     "the CPU trainer's parameters are fp32 already")
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


def _lr_schedule(schedule: Any, total_steps: int) -> Callable[[int], float]:
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


def _checksums(model: Any) -> dict[str, dict[str, Any]]:
    """SHA-256 of every local parameter's bytes (bit-identical ⇔ equal hashes)."""
    out = {}
    for name, param in model.named_parameters():
        data = param.detach().contiguous().cpu().numpy().tobytes()
        out[name] = {"sha256": hashlib.sha256(data).hexdigest(), "trainable": bool(param.requires_grad),
                     "numel": int(param.numel())}
    return out


def run_training(
    config_file: str | Path,
    *,
    cost_strategy: str | None = None,
    steps: int | None = None,
    seed: int | None = None,
    metrics_out: str | Path | None = None,
    plan_out: str | Path | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train on this rank; collective, so every rank of the world must call it.

    Args:
        config_file: Nanotron YAML with our keys.
        cost_strategy: overrides the YAML's strategy.
        steps: overrides ``tokens.train_steps``.
        seed: overrides ``general.seed`` and ``data.seed``.
        metrics_out: JSON file rank 0 writes (see module docstring).
        plan_out: JSON file rank 0 writes with the plan the model was built with.
        progress: show a tqdm bar on rank 0; default: when stderr is a terminal.

    Returns:
        The metrics dict: losses, gradient norms and the per-rank table are the same on every rank; step
        times and tokens/s are this rank's own.

    Raises:
        ConfigError / PlanningError: from :func:`preflight` (before any process group).
        PipelineValidationError: some rank would have no gradient (raised on every rank).
    """
    settings = preflight(config_file, cost_strategy=cost_strategy, steps=steps, seed=seed)
    import torch

    from nanotron_ext.runtime import GlooParallelContext

    run = settings.cfg.run
    # Failing, the context is torn down without a barrier (ranks may have died), and a collective's raw gloo
    # error comes out of the `with` as a message naming the silent rank.
    with GlooParallelContext(tensor_parallel_size=run.tp, pipeline_parallel_size=run.pp,
                             data_parallel_size=run.dp, timeout_s=settings.timeout_s) as ctx:
        torch.manual_seed(settings.seed)  # init draws per-parameter streams from this seed (same on every rank)
        return _train(settings, ctx, metrics_out=metrics_out, plan_out=plan_out, progress=progress)


def _train(
    s: TrainSettings,
    ctx: Any,
    *,
    metrics_out: str | Path | None,
    plan_out: str | Path | None,
    progress: bool | None,
) -> dict[str, Any]:
    """Build, freeze, validate, wrap and train on an existing context; rank 0 prints and writes files."""
    from nanotron import distributed as dist

    from nanotron_ext.runtime import build_optimizer, make_micro_batch, wrap_ddp

    run = s.cfg.run
    model, plan, rank_rows = _build_checked_model(s, ctx)
    before = _checksums(model) if metrics_out else {}

    model = wrap_ddp(model, ctx)
    unwrapped = getattr(model, "module", model)
    optimizer, grad_accumulator = build_optimizer(model, ctx, **s.optimizer)
    data = PackedTextData(s.windows, run.micro_batch_size, dp_rank=dist.get_rank(ctx.dp_pg), dp_size=run.dp,
                          seed=s.data_seed)
    stream = (make_micro_batch(model, ctx, input_ids=i, label_ids=lab) for i, lab in data)
    if s.rank == 0:
        _print_header(s, plan)
    losses, grad_norms, times, lrs = _optimise(s, model, ctx, stream, optimizer, grad_accumulator, progress)

    after = _checksums(unwrapped) if metrics_out else {}
    local = {
        "world_rank": s.rank,
        "losses": losses,
        "grad_norms": grad_norms,
        "step_times_s": times,
        "has_optimizer": optimizer is not None,
        "is_ddp": model is not unwrapped,
        "checksums": {n: {**before[n], "sha256_after": after[n]["sha256"]} for n in before},
    }
    gathered: list[dict[str, Any]] = [{} for _ in range(s.world_size)]
    dist.all_gather_object(gathered, local, group=ctx.world_pg)
    per_rank = [{**row, **{k: v for k, v in g.items() if k != "world_rank"}} for row, g in zip(rank_rows, gathered)]
    metrics = _metrics(s, plan, unwrapped, per_rank, losses, grad_norms, times, lrs)
    if s.rank == 0:
        print(_summary(metrics), flush=True)
        if metrics_out:
            _write_json(metrics_out, metrics)
        if plan_out:
            _write_json(plan_out, plan.to_dict())
    return metrics


def _metrics(s: TrainSettings, plan: Plan, model: Any, per_rank: list[dict[str, Any]], losses: list[float],
             grad_norms: list[float], times: list[float], lrs: list[float]) -> dict[str, Any]:
    """The run's record (``--metrics-out``): the setup, per-step losses, norms, times and rates, the split."""
    from nanotron_ext.runtime import pipeline_blocks

    cfg, run = s.cfg, s.cfg.run
    block_map = {name: int(block.rank) for name, block in pipeline_blocks(model)}
    steady = times[1:] or times  # step 1 pays one-off costs (allocations, first P2P handshakes)
    metrics = {
        "config": str(cfg.source),
        "strategy": plan.strategy,
        "engine": run.engine,
        "dp": run.dp, "pp": run.pp, "tp": run.tp,
        "n_micro_batches": run.n_micro_batches,
        "micro_batch_size": run.micro_batch_size,
        "sequence_length": run.sequence_length,
        "steps": s.steps,
        "seed": s.seed,
        "data_seed": s.data_seed,
        "data_files": [str(f) for f in s.data_files],
        "device": s.device,
        "p2p": _transport(s.device),
        "tokens_per_step": s.tokens_per_step,
        "losses": losses,
        "grad_norms": grad_norms,
        "learning_rates": lrs,
        "step_times_s": times,
        "tokens_per_s": [s.tokens_per_step / t for t in times],
        "mean_tokens_per_s": s.tokens_per_step * len(steady) / sum(steady),
        "block_names": list(block_map),
        "block_ranks": list(block_map.values()),
        "block_to_rank": block_map,
        "ranks": per_rank,
    }
    return metrics


def _build_checked_model(s: TrainSettings, ctx: Any) -> tuple[Any, Plan, list[dict]]:
    """Build with the planned split, tie, initialise and freeze; then the collective every-rank-trains check."""
    import torch
    from nanotron.parallel.parameters import sanity_check

    from nanotron_ext import integration
    from nanotron_ext.runtime import cpu_llama, init_weights, mark_tied_parameters

    cfg = s.cfg
    device = torch.device(s.device)
    model = integration.build_model(
        lambda: cpu_llama(s.model_config, ctx, s.parallel_config, device, projector=cfg.ext.projector,
                          vocab_shards=cfg.vocab_shards, recompute_layer=cfg.run.recompute_layer),
        ctx, dtype=torch.float32, device=device, config=cfg,
    )
    plan: Plan = model.nanotron_ext_plan
    if plan.block_ranks != s.plan.block_ranks:  # the config inventory and the model must agree exactly
        raise PlanningError(f"the built model's plan {list(plan.block_ranks)} differs from the config's "
                            f"{list(s.plan.block_ranks)}; inventory_from_model and inventory_from_config disagree")
    mark_tied_parameters(model, ctx, s.parallel_config)
    sanity_check(root_module=model)
    init_weights(model, ctx, std=s.init_std)
    integration.apply_freeze_to_model(model, cfg)
    rank_rows = integration.check_every_rank_trains(model, ctx, allow_frozen_stages=cfg.ext.allow_frozen_stages)
    return model, plan, rank_rows


def _optimise(
    s: TrainSettings, model: Any, ctx: Any, stream: Iterator[Any], optimizer: Any, grad_accumulator: Any,
    progress: bool | None,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Run the training steps; rank 0 prints a line per step (under a progress bar on a terminal).

    Returns:
        Per step: losses, gradient norms, seconds, learning rates.
    """
    from nanotron.helpers import lr_scheduler_builder

    from nanotron_ext.runtime import train_step
    from nanotron_ext.runtime.device import synchronize

    run = s.cfg.run
    scheduler = lr_scheduler_builder(optimizer, s.lr_schedule, s.steps) if optimizer is not None else None
    lr_at = _lr_schedule(s.lr_schedule, s.steps)
    bar = None
    if s.rank == 0 and (progress if progress is not None else sys.stderr.isatty()):
        from tqdm import tqdm

        bar = tqdm(total=s.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    losses: list[float] = []
    grad_norms: list[float] = []
    times: list[float] = []
    lrs: list[float] = []
    for step in range(1, s.steps + 1):
        lr = lr_at(step - 1)
        start = time.perf_counter()
        loss = train_step(model, ctx, run.engine, stream, run.n_micro_batches, optimizer,
                          grad_accumulator=grad_accumulator, clip_grad=s.clip_grad, lr_scheduler=scheduler,
                          grad_norms=grad_norms)
        synchronize()  # on a GPU the step ends when its kernels (the optimizer's last) do
        elapsed = time.perf_counter() - start
        losses.append(loss)
        times.append(elapsed)
        lrs.append(lr)
        if not math.isfinite(loss):
            raise NanotronExtError(f"loss is {loss} at step {step}; lower the learning rate")  # same on all ranks
        if s.rank == 0:
            line = (f"step {step:>{len(str(s.steps))}}/{s.steps}  loss {loss:.4f}  grad-norm {grad_norms[-1]:.3g}"
                    f"  lr {lr:.3g}  {elapsed * 1e3:.0f} ms  {s.tokens_per_step / elapsed:,.0f} tokens/s")
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{s.tokens_per_step / elapsed:,.0f}")
                bar.update(1)
                bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    return losses, grad_norms, times, lrs


def _write_json(path: str | Path, data: Any) -> None:
    # Temporary file + rename: a reader (or a killed run) never leaves half a JSON file behind.
    atomic_write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _transport(device: str) -> str:
    """``gloo`` or ``gloo, host-staged`` (:func:`nanotron_ext.runtime.device.describe_transport`)."""
    import torch

    from nanotron_ext.runtime.device import describe_transport

    return describe_transport(torch.device(device))


def _device_label(device: str) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else device


def _print_header(s: TrainSettings, plan: Plan) -> None:
    r = s.cfg.run
    files = ", ".join(f.name for f in s.data_files)
    print(
        f"nanotron-ext train: {s.cfg.source}\n"
        f"  world {s.world_size} = dp {r.dp} × pp {r.pp} × tp {r.tp} | engine {r.engine} | {r.n_micro_batches} "
        f"micro-batches × {r.micro_batch_size} × {r.sequence_length} tokens | strategy {plan.strategy} | "
        f"{s.steps} steps | seed {s.seed}\n"
        f"  data: {files} ({human_count(s.windows.size)} tokens, {len(s.windows)} windows), byte tokenizer\n"
        f"  device: {_device_label(s.device)} | P2P: {_transport(s.device)} | attention: torch SDPA\n",
        flush=True,
    )
    print(plan.table())
    print(f"\nblock -> stage: {list(plan.block_ranks)}")
    for finding in plan.findings:
        print(finding)
    for note in s.notes:
        print(f"note: {note}")
    print(flush=True)


def _summary(m: dict[str, Any]) -> str:
    losses, times = m["losses"], m["step_times_s"]
    k = min(3, len(losses))
    rows = [
        ["steps", m["steps"]],
        [f"loss, first {k} steps (mean)", f"{sum(losses[:k]) / k:.4f}"],
        [f"loss, last {k} steps (mean)", f"{sum(losses[-k:]) / k:.4f}"],
        ["final loss", f"{losses[-1]:.4f}"],
        ["mean step time (after step 1)", f"{1e3 * sum(times[1:] or times) / len(times[1:] or times):.0f} ms"],
        ["tokens per step", m["tokens_per_step"]],
        ["tokens/s (after step 1)", f"{m['mean_tokens_per_s']:,.0f}"],
    ]
    ranks = [
        [r["world_rank"], r["pp_rank"], r["dp_rank"], r["tp_rank"], _blocks_label(r["blocks"]),
         human_count(r["params"]), human_count(r["trainable"]), "yes" if r["has_optimizer"] else "no (frozen)",
         "yes" if r["is_ddp"] else "no"]
        for r in m["ranks"]
    ]
    return (
        "\nsummary\n" + table(["metric", "value"], rows) + "\n\n"
        + table(["world", "pp", "dp", "tp", "blocks", "params", "trainable", "optimizer", "DDP"], ranks)
    )


def _blocks_label(names: list[str]) -> str:
    return compact_names([short_name(n) for n in names])
