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

import contextlib
import hashlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanotron_ext.errors import NanotronExtError, PlanningError
from nanotron_ext.plan import Plan
from nanotron_ext.plan.replan import short_run_note
from nanotron_ext.plan.v_plan import VPlan
from nanotron_ext.runtime.data import (
    PackedTextData,
)
from nanotron_ext.runtime.replan import Replanner, Trainee
from nanotron_ext.runtime.train_report import print_header, summary, transport, write_json
from nanotron_ext.runtime.train_settings import TrainSettings, lr_function, preflight

__all__ = ["TrainSettings", "preflight", "run_training"]


def _checksums(model: Any) -> dict[str, dict[str, Any]]:
    """SHA-256 of every local parameter's bytes (bit-identical ⇔ equal hashes)."""
    out = {}
    for name, param in model.named_parameters():
        data = param.detach().contiguous().cpu().numpy().tobytes()
        out[name] = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "trainable": bool(param.requires_grad),
            "numel": int(param.numel()),
        }
    return out


def _before_and_after(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each parameter this rank held at the start (its ``sha256`` then) or holds at the end (its ``sha256_after``):
    after a move to another split a rank ends with other parameters than it started with."""
    out = {}
    for name in {**before, **after}:
        info = before.get(name) or {k: v for k, v in after[name].items() if k != "sha256"}
        out[name] = {**info, **({"sha256_after": after[name]["sha256"]} if name in after else {})}
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
    replan_after: int | str | None = None,
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
        replan_after: overrides ``nanotron_ext.replan.after_steps`` (:mod:`nanotron_ext.runtime.replan`).

    Returns:
        The metrics dict: losses, gradient norms and the per-rank table are the same on every rank; step
        times and tokens/s are this rank's own.

    Raises:
        ConfigError / PlanningError: from :func:`preflight` (before any process group).
        PipelineValidationError: some rank would have no gradient (raised on every rank).
    """
    settings = preflight(config_file, cost_strategy=cost_strategy, steps=steps, seed=seed, replan_after=replan_after)
    import torch

    from nanotron_ext.runtime import GlooParallelContext

    run = settings.cfg.run
    # Failing, the context is torn down without a barrier (ranks may have died), and a collective's raw gloo
    # error comes out of the `with` as a message naming the silent rank.
    with GlooParallelContext(
        tensor_parallel_size=run.tp,
        pipeline_parallel_size=run.pp,
        data_parallel_size=run.dp,
        timeout_s=settings.timeout_s,
    ) as ctx:
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

    run = s.cfg.run
    data = PackedTextData(
        s.windows, run.micro_batch_size, dp_rank=dist.get_rank(ctx.dp_pg), dp_size=run.dp, seed=s.data_seed
    )
    pairs = iter(data)  # one data stream, continued by a model built after a move
    trainee = _trainee(s, ctx, pairs)
    before = _checksums(trainee.unwrapped) if metrics_out else {}
    if s.rank == 0:
        print_header(s, s.plan)
    replanner = _replanner(s, ctx, pairs)
    losses, grad_norms, times, lrs, trainee = _optimise(s, trainee, ctx, progress, replanner)

    s = trainee.settings
    after = _checksums(trainee.unwrapped) if metrics_out else {}
    local = {
        "world_rank": s.rank,
        "losses": losses,
        "grad_norms": grad_norms,
        "step_times_s": times,
        "has_optimizer": trainee.optimizer is not None,
        "is_ddp": trainee.model is not trainee.unwrapped,
        "checksums": _before_and_after(before, after),
    }
    gathered: list[dict[str, Any]] = [{} for _ in range(s.world_size)]
    dist.all_gather_object(gathered, local, group=ctx.world_pg)
    per_rank = [
        {**row, **{k: v for k, v in g.items() if k != "world_rank"}} for row, g in zip(trainee.rank_rows, gathered)
    ]
    metrics = _metrics(s, s.plan, trainee.unwrapped, per_rank, losses, grad_norms, times, lrs)
    if replanner is not None and replanner.session.choice is not None:
        metrics["replan"] = replanner.report()
    if s.rank == 0:
        print(summary(metrics), flush=True)
        if replanner is not None:
            for line in replanner.measured_lines():
                print(line, flush=True)
        if metrics_out:
            write_json(metrics_out, metrics)
        if plan_out:
            write_json(plan_out, s.plan.to_dict())
    return metrics


def _trainee(s: TrainSettings, ctx: Any, pairs: Iterator[Any], moved: Any = None) -> Trainee:
    """The model on ``s.plan``, checked, wrapped, with its optimizer, schedule and micro-batch stream; ``moved``:
    the ``ResumeState`` of a move's checkpoint, loaded onto it (:mod:`nanotron_ext.runtime.replan`)."""
    from nanotron.helpers import lr_scheduler_builder

    from nanotron_ext.runtime import build_optimizer, make_micro_batch, wrap_ddp
    from nanotron_ext.runtime.replan import load_optimizer, load_weights

    model, _, rank_rows = _build_checked_model(s, ctx, plan=s.plan if moved is not None else None)
    if moved is not None:
        load_weights(moved, model, ctx)
    model = wrap_ddp(model, ctx)
    optimizer, grad_accumulator = build_optimizer(model, ctx, **s.optimizer)
    scheduler = lr_scheduler_builder(optimizer, s.lr_schedule, s.steps) if optimizer is not None else None
    if moved is not None:
        load_optimizer(moved, optimizer, scheduler)
    stream = (make_micro_batch(model, ctx, input_ids=i, label_ids=lab) for i, lab in pairs)
    return Trainee(s, model, optimizer, grad_accumulator, scheduler, stream, rank_rows)


def _replanner(s: TrainSettings, ctx: Any, pairs: Iterator[Any]) -> Replanner | None:
    """The run's re-plan after K steps, or None where it has none (or is too short for one: rank 0 says so)."""
    k = s.cfg.ext.replan.after_steps
    if k is None:
        return None
    if s.steps <= k:
        if s.rank == 0:
            print(f"nanotron_ext: {short_run_note(k, s.steps)}", flush=True)
        return None
    return Replanner(
        s,
        ctx,
        lambda settings, c, state: _trainee(settings, c, pairs, state),
        engine_was_auto=s.engine_was_auto,
        say=_on_rank0(s.rank),
    )


def _on_rank0(rank: int) -> Any:
    return (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)


def _metrics(
    s: TrainSettings,
    plan: Plan | VPlan,
    model: Any,
    per_rank: list[dict[str, Any]],
    losses: list[float],
    grad_norms: list[float],
    times: list[float],
    lrs: list[float],
) -> dict[str, Any]:
    """The run's record (``--metrics-out``): the setup, per-step losses, norms, times and rates, the split."""
    from nanotron_ext.runtime import pipeline_blocks

    cfg, run = s.cfg, s.cfg.run
    block_map = {name: int(block.rank) for name, block in pipeline_blocks(model)}
    steady = times[1:] or times  # step 1 pays one-off costs (allocations, first P2P handshakes)
    metrics = {
        "config": str(cfg.source),
        "strategy": plan.strategy,
        "engine": run.engine,
        "dp": run.dp,
        "pp": run.pp,
        "tp": run.tp,
        "n_micro_batches": run.n_micro_batches,
        "micro_batch_size": run.micro_batch_size,
        "sequence_length": run.sequence_length,
        "steps": s.steps,
        "seed": s.seed,
        "data_seed": s.data_seed,
        "data_files": [str(f) for f in s.data_files],
        "device": s.device,
        "p2p": transport(s.device),
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


def _build_checked_model(s: TrainSettings, ctx: Any, *, plan: Plan | None = None) -> tuple[Any, Plan, list[dict]]:
    """Build with the planned split (``plan``: this one, a re-plan's), tie, initialise and freeze; then the
    collective every-rank-trains check."""
    import torch
    from nanotron.parallel.parameters import sanity_check

    from nanotron_ext import integration
    from nanotron_ext.runtime import cpu_llama, init_weights, mark_tied_parameters

    cfg = s.cfg
    device = torch.device(s.device)
    model = integration.build_model(
        lambda: cpu_llama(
            s.model_config,
            ctx,
            s.parallel_config,
            device,
            projector=cfg.ext.projector,
            vocab_shards=cfg.vocab_shards,
            recompute_layer=cfg.run.recompute_layer,
        ),
        ctx,
        dtype=torch.float32,
        device=device,
        config=cfg,
        plan=plan,
    )
    plan = model.nanotron_ext_plan
    # The config inventory and the model must agree exactly (a V on its chunks too: two Vs may share ranks).
    if (list(plan.block_ranks), getattr(plan, "bounds", None)) != (
        list(s.plan.block_ranks),
        getattr(s.plan, "bounds", None),
    ):
        raise PlanningError(
            f"the built model's plan {list(plan.block_ranks)} differs from the config's "
            f"{list(s.plan.block_ranks)}; inventory_from_model and inventory_from_config disagree"
        )
    mark_tied_parameters(model, ctx, s.parallel_config)
    sanity_check(root_module=model)
    init_weights(model, ctx, std=s.init_std)
    integration.apply_freeze_to_model(model, cfg)
    rank_rows = integration.check_every_rank_trains(model, ctx, allow_frozen_stages=cfg.ext.allow_frozen_stages)
    return model, plan, rank_rows


def _optimise(
    s: TrainSettings,
    trainee: Trainee,
    ctx: Any,
    progress: bool | None,
    replanner: Replanner | None,
) -> tuple[list[float], list[float], list[float], list[float], Trainee]:
    """Run the training steps; rank 0 prints a line per step (under a progress bar on a terminal).

    Returns:
        Per step: losses, gradient norms, seconds, learning rates; and what the last step trained with (another
        trainee after a move).
    """
    from nanotron_ext.runtime import train_step
    from nanotron_ext.runtime.device import synchronize

    run = s.cfg.run
    lr_at = lr_function(s.lr_schedule, s.steps)
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
        t = trainee
        start = time.perf_counter()
        with replanner.step(step, t) if replanner is not None else contextlib.nullcontext():
            loss = train_step(
                t.model,
                ctx,
                t.settings.parallel_config.pp_engine,
                t.stream,
                run.n_micro_batches,
                t.optimizer,
                grad_accumulator=t.accumulator,
                clip_grad=s.clip_grad,
                lr_scheduler=t.scheduler,
                grad_norms=grad_norms,
            )
            synchronize()  # on a GPU the step ends when its kernels (the optimizer's last) do
        elapsed = time.perf_counter() - start
        losses.append(loss)
        times.append(elapsed)
        lrs.append(lr)
        if not math.isfinite(loss):
            raise NanotronExtError(f"loss is {loss} at step {step}; lower the learning rate")  # same on all ranks
        if s.rank == 0:
            line = (
                f"step {step:>{len(str(s.steps))}}/{s.steps}  loss {loss:.4f}  grad-norm {grad_norms[-1]:.3g}"
                f"  lr {lr:.3g}  {elapsed * 1e3:.0f} ms  {s.tokens_per_step / elapsed:,.0f} tokens/s"
            )
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{s.tokens_per_step / elapsed:,.0f}")
                bar.update(1)
                bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
        if replanner is not None:
            trainee = replanner.after(step, trainee, elapsed)
    if bar is not None:
        bar.close()
    return losses, grad_norms, times, lrs, trainee
