"""What runs inside the two ranks of one ``measured_cpu.py`` scenario (gloo, one thread each): profile the blocks
(rank 0, broadcast), plan every strategy, build one model per distinct split (all alive at once), train them in
rounds (blocks and links measured again before each), and on rank 0 write a JSON of everything measured."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcpu.scenarios import ENGINE, FLOP_RATE, PP
from mcpu.splits import cut_key

# --- links between the two ranks ------------------------------------------------------------------------


def _cut_tensors(first_on_next: str, cfg: Any) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtypes Nanotron sends forward across a cut whose next block has role ``first_on_next``."""
    b, s, h, v = cfg.run.micro_batch_size, cfg.run.sequence_length, cfg.model.hidden_size, cfg.model.vocab_size
    if first_on_next == "decoder":
        return [((s, b, h), "float32"), ((b, s), "bool")]  # hidden states and the sequence mask
    if first_on_next in ("cast", "loss"):
        return [((s, b, v), "float32")]  # logits
    return [((s, b, h), "float32")]


def _measure_cut(ctx: Any, tensors: list[tuple[tuple[int, ...], str]], reps: int = 9) -> float:
    """Median one-way time (s) of sending ``tensors`` from PP rank 0 to PP rank 1 through Nanotron's P2P.

    A fresh ``CPUP2P`` and fresh tensors per transfer, as in training: metadata messages, a new receive buffer
    (first-touch page faults included) and the data, then the same back as the reply.
    """
    import torch
    import torch.distributed as dist

    from nanotron_ext.runtime import CPUP2P

    p2p = CPUP2P(ctx.pp_pg)
    rank = dist.get_rank(ctx.pp_pg)
    times = []
    dist.barrier(group=ctx.pp_pg)
    for i in range(reps + 2):
        t0 = time.perf_counter()
        for sender in (0, 1):  # there and back: half the round trip is one transfer
            if rank == sender:
                payload = [torch.ones(shape, dtype=getattr(torch, dtype)) for shape, dtype in tensors]
                p2p.send_tensors(payload, to_rank=1 - sender)
                p2p.wait_pending()
            else:
                p2p.recv_tensors(num_tensors=len(tensors), from_rank=sender)
        if i >= 2:  # first two: connection and allocator warm-up
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _measure_tied_sync(ctx: Any, cfg: Any, reps: int = 5) -> float:
    """Median time (s) of the tied-embedding gradient all-reduce between the two PP ranks (``vocab × hidden``
    fp32), what ``sync_tied_weights_gradients`` does each step when embedding and lm_head sit on different
    ranks."""
    import torch
    import torch.distributed as dist

    grad = torch.ones(cfg.model.vocab_size, cfg.model.hidden_size)
    times = []
    for i in range(reps + 1):
        dist.barrier(group=ctx.pp_pg)
        t0 = time.perf_counter()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.pp_pg)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_links(ctx: Any, cfg: Any, plans: dict[str, Any], blocks: Sequence[Any]) -> dict[str, float]:
    """One transfer across each distinct cut of ``plans`` (keyed by :func:`mcpu.splits.cut_key`), and ``"tied"``: the
    tied-gradient all-reduce (0 when the embeddings are not tied)."""
    out: dict[str, float] = {}
    for plan in plans.values():
        key = cut_key(plan.block_ranks, [{"role": b.role} for b in blocks])
        if key not in out:
            out[key] = _measure_cut(ctx, _cut_tensors(key.split(":")[1], cfg))
    out["tied"] = _measure_tied_sync(ctx, cfg) if cfg.model.tie_word_embeddings else 0.0
    return out


# --- the rank's run ---------------------------------------------------------------------------------------


def worker(spec_path: str, out_path: str) -> None:
    """One rank: profile (rank 0), plan every strategy, train each distinct plan with timing; rank 0 writes JSON."""
    import gc

    import torch
    import torch.distributed as dist

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.costs import profiled
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.runtime import GlooParallelContext

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with GlooParallelContext(1, PP, 1, timeout_s=300) as ctx:
        rank = dist.get_rank()
        cfg = config_from_dict(spec["raw"], source=spec["label"]).with_overrides(profile_cache=spec["cache"])
        blocks = inventory_from_config(cfg)
        t0 = time.perf_counter()
        # Rank 0 measures and broadcasts; more repeats than the strategy's default, for steadier medians.
        timings = profiled.block_timings(blocks, cfg, warmup=3, repeats=9)
        profile_s = time.perf_counter() - t0
        plans = _plans(blocks, cfg, spec["strategies"])  # profiled: from the cache now
        runs = _build_runs(cfg, ctx, plans, spec["strategies"])
        profiles, links, loads = _train_rounds(spec, runs, ctx, cfg, blocks, plans, timings)
        summaries = _summaries(runs)
        runs.clear()
        gc.collect()
        if rank == 0:
            measured = {"profile_s": profile_s, "profiles": profiles, "links": links, "loads": loads}
            out = _result(spec, cfg, blocks, plans, timings, measured, summaries)
            Path(out_path).write_text(json.dumps(out))


def _plans(blocks: Sequence[Any], cfg: Any, names: Sequence[str]) -> dict[str, Any]:
    """Each name's plan; ``STRATEGY@OBJECTIVE`` plans ``STRATEGY`` under that objective."""
    from nanotron_ext.plan import make_plan

    plans = {}
    for name in names:
        strategy, _, objective = name.partition("@")
        plans[name] = make_plan(blocks, cfg.with_overrides(objective=objective or None), strategy)
    return plans


def _build_runs(cfg: Any, ctx: Any, plans: dict[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One model per distinct split (keyed by its block ranks), same init, each with its optimizer, data and timer;
    ``first``: the first name that planned it."""
    import torch

    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, random_micro_batches
    from nanotron_ext.runtime.timing import StepTimer

    lcfg = llama_config_from_shape(cfg)
    # One model per distinct split, all alive at once, stepped round-robin: load from other processes on a
    # shared machine then slows every split alike instead of whichever happened to run during it.
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        key = ",".join(map(str, plans[name].block_ranks))
        if key in runs:
            continue
        torch.manual_seed(0)
        model = build_cpu_llama(lcfg, ctx, block_ranks=list(plans[name].block_ranks))
        optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
        runs[key] = {
            "first": name,
            "model": model,
            "optimizer": optimizer,
            "grad_acc": grad_acc,
            "batches": random_micro_batches(
                model, ctx, lcfg.vocab_size, cfg.run.micro_batch_size, cfg.run.sequence_length
            ),
            "timer": StepTimer(model, ctx),
            "losses": [],
        }
    return runs


def _train_rounds(
    spec: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    ctx: Any,
    cfg: Any,
    blocks: Sequence[Any],
    plans: dict[str, Any],
    timings: Any,
) -> tuple[list[Any], list[dict[str, float]], list[float]]:
    """The warm-up turn, then the rounds; returns each round's block profile and links, and the load average at
    every turn's start."""
    from nanotron_ext.costs import profiled

    # Every plan takes its turn in every round, so load from other processes hits the plans alike. Blocks
    # and links are measured again before each round (blocks into a fresh cache), and the simulator gets
    # the median over rounds: this VM's speed drifts by 10-20 % over tens of seconds, and timings taken only
    # before training would compare one moment's speed with another's.
    turns = [[False] * spec["warmup"]] + [
        [False] * spec["rewarm"] + [True] * spec["steps_per_turn"] for _ in range(spec["rounds"])
    ]
    profiles, links, loads = [], [], []
    for i, turn in enumerate(turns):
        loads.append(os.getloadavg()[0])
        if i > 0:
            if spec["profile_rounds"]:
                with tempfile.TemporaryDirectory(prefix="measured_cpu_round_") as fresh:
                    profiles.append(profiled.block_timings(blocks, cfg, cache_dir=fresh, warmup=3, repeats=9))
            elif not profiles:
                profiles.append(timings)  # the planning profile serves every round
            links.append(_measure_links(ctx, cfg, plans, blocks))
        for run in runs.values():
            for record in turn:
                _step(run, ctx, cfg, record)
    return profiles, links, loads


def _step(run: dict[str, Any], ctx: Any, cfg: Any, record: bool) -> None:
    """One training step of ``run``'s model, timed (kept when ``record``)."""
    from nanotron_ext.runtime import train_step

    with run["timer"] as timer, timer.step(record=record):
        run["losses"].append(
            train_step(
                run["model"],
                ctx,
                ENGINE,
                run["batches"],
                cfg.run.n_micro_batches,
                run["optimizer"],
                grad_accumulator=run["grad_acc"],
                # No clipping: the runtime's clip crashes on a rank whose only weights are tied
                # copies owned by another rank (SmolLM's lm_head alone on PP1); see the report.
                clip_grad=None,
            )
        )


def _summaries(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every run's losses and timing summary, on rank 0 (collective: every rank gathers its timers)."""
    from nanotron_ext.runtime.timing_summary import summarize

    summaries = {}
    for key, run in runs.items():
        per_rank = run["timer"].gather()
        summaries[key] = {
            "first": run["first"],
            "losses": run["losses"],
            "summary": summarize(per_rank).to_dict() if per_rank is not None else None,
            # Every timed step, in order (slowest rank): step i is in round i // steps_per_turn.
            "steps": [max(r.step for r in recs) for recs in zip(*per_rank)] if per_rank is not None else None,
        }
    return summaries


def _result(
    spec: dict[str, Any],
    cfg: Any,
    blocks: Sequence[Any],
    plans: dict[str, Any],
    timings: Any,
    measured: dict[str, Any],
    summaries: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Rank 0's JSON: the profiles, links, plans, runs and the FLOP-rate model's predictions."""
    from nanotron_ext.costs import block_memory
    from nanotron_ext.simulate import simulate_plan

    profiles, links = measured["profiles"], measured["links"]
    return {
        "label": spec["label"],
        "profile_s": measured["profile_s"],
        # Per block, the median over the rounds' profiles of forward, backward and optimizer step
        # apart; the first profile, before training, is the one the profiled strategy planned with.
        "timings": [
            [statistics.median(getattr(p[k], f) for p in profiles) for f in ("forward", "backward", "optimizer")]
            for k in range(len(blocks))
        ],
        "planning_timings": [[t.forward, t.backward, t.optimizer] for t in timings],
        "round_timings": [[[t.forward, t.backward, t.optimizer] for t in p] for p in profiles],
        # What a block sends when a cut follows it: the memory model's output, as the planner prices it.
        "blocks": [
            {
                "name": b.name,
                "short": b.short,
                "role": b.role,
                "output_bytes": block_memory(b, cfg.model, cfg.run).output,
            }
            for b in blocks
        ],
        "p2p": {key: statistics.median(r[key] for r in links) for key in links[0]},
        "round_p2p": links,
        "tied": cfg.model.tie_word_embeddings,
        "n_micro_batches": cfg.run.n_micro_batches,
        "plans": {
            name: {
                "ranks": list(p.block_ranks),
                "ok": p.ok,
                "findings": [f.code for f in p.findings if f.severity == "error"],
                "trainable": [s.trainable for s in p.stages],
            }
            for name, p in plans.items()
        },
        "runs": summaries,
        # The planner's own prediction: each plan simulated with the FLOP-rate model (p2p ignored).
        "flop_rate_sim": {
            name: simulate_plan(p, blocks, cfg, machine=FLOP_RATE).step_time for name, p in plans.items()
        },
        "load_average": measured["loads"],
        "steps_per_turn": spec["steps_per_turn"],
    }
