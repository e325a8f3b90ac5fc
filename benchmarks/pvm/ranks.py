"""What runs inside the ranks of one ``predict_vs_measure.py`` scenario (one process per pipeline stage, gloo, one
thread each): calibrate, plan the splits, build one model per distinct split (all alive at once), train them in
interleaved rounds (recalibrating every few rounds), time one micro-batch's exchange across the cut, and on rank 0
predict every split and write a JSON of everything measured."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanotron_ext.config import config_from_dict
from nanotron_ext.models.profiled_blocks import llama_config_from_shape
from nanotron_ext.procs import exit_with_parent
from nanotron_ext.runtime import (
    CPUP2P,
    GlooParallelContext,
    build_cpu_llama,
    build_optimizer,
    random_micro_batches,
    train_step,
)
from nanotron_ext.runtime.timing import StepTimer
from pvm.calibration import busy_block_times, median_profile, take_profile
from pvm.predictions import describe_splits
from pvm.scenarios import ENGINE, RankSpec
from pvm.splits import PlannedSplit, auto_pick, plan_splits, split_key

#: The key suffix of a split's second run, with every queued send posted at once.
EAGER_SENDS = " [eager sends]"


class Progress:
    """Rank 0 writes ``{"done", "total"}`` to a file the launcher's progress bar reads (atomic replace)."""

    def __init__(self, path: str, active: bool, total: int) -> None:
        self.path, self.active, self.total, self.done = Path(path), active, total, 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.active:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"done": self.done, "total": self.total}))
            os.replace(tmp, self.path)


@dataclass
class Run:
    """One model trained in turns, with its optimizer, micro-batch stream and timer.

    Attributes:
        names: the splits this model is (none: a second run of a split's model under another send order).
        m: micro-batches per step; ``sends``: the runtime's send order; ``of``: the split a second run repeats.
        tensors: tensors this rank sent and received per step; ``shapes``: one micro-batch's sends (shape, dtype).
        exchange: item 3's timed exchange across the cut (:func:`exchange_times`), for the splits taken apart.
    """

    names: list[str]
    model: Any
    optimizer: Any
    grad_acc: Any
    m: int
    timer: Any
    batches: Any
    sends: str = "nanotron"
    of: str | None = None
    losses: list[Any] = field(default_factory=list)
    tensors: list[int] = field(default_factory=list)
    shapes: list[tuple[list[int], str]] = field(default_factory=list)
    exchange: dict[str, float] | None = None


def build_models(plans: dict[str, PlannedSplit], ctx: Any, eager_sends: Sequence[str] = ()) -> dict[str, Run]:
    """One model per distinct split (all alive at once), with its optimizer, micro-batch stream and timer; and
    for each split in ``eager_sends`` a second run of the same model with every queued send posted at once."""
    runs: dict[str, Run] = {}
    for name, (cfg, _, plan) in plans.items():
        key = split_key(cfg, plan)
        if key in runs:
            runs[key].names.append(name)
            continue
        torch.manual_seed(0)
        model = build_cpu_llama(
            llama_config_from_shape(cfg), ctx, block_ranks=list(plan.block_ranks), vocab_shards=cfg.vocab_shards
        )
        # A rank without trainable parameters (Nanotron's rule on the seed model) gets no optimizer.
        optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
        runs[key] = Run(
            [name],
            model,
            optimizer,
            grad_acc,
            cfg.run.n_micro_batches,
            StepTimer(model, ctx),
            random_micro_batches(model, ctx, cfg.model.vocab_size, cfg.run.micro_batch_size, cfg.run.sequence_length),
        )
    for name in eager_sends:
        key = split_key(plans[name].cfg, plans[name].plan)
        # The same model, optimizer and data: only the send order differs. No names: no prediction row.
        runs[key + EAGER_SENDS] = dataclasses.replace(
            runs[key], names=[], of=name, sends="eager", losses=[], timer=StepTimer(runs[key].model, ctx)
        )
    return runs


class P2PCount:
    """Tensors this process sends and receives through the runtime's ``CPUP2P`` (Nanotron's pipeline state sends
    and receives one tensor per call). Class-level wrappers, so the per-instance ones ``StepTimer`` installs for
    timing still run on top of them."""

    sent = received = 0
    shapes: list[tuple[list[int], str]] = []  # what this process sent, in order, since the last reset

    @classmethod
    def install(cls) -> None:
        send, recv = CPUP2P.send_tensors, CPUP2P.recv_tensors

        def counted_send(self: Any, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
            cls.sent += len(tensors)
            cls.shapes += [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
            return send(self, tensors, *args, **kwargs)

        def counted_recv(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.received += kwargs.get("num_tensors", args[0] if args else 1)
            return recv(self, *args, **kwargs)

        CPUP2P.send_tensors, CPUP2P.recv_tensors = counted_send, counted_recv  # type: ignore[method-assign]


def _turn(run: Run, ctx: Any, records: Sequence[bool]) -> None:
    """One turn of ``run``: a train step per entry of ``records``, timed where it is True."""
    for record in records:
        before, P2PCount.shapes = (P2PCount.sent, P2PCount.received), []
        with run.timer as timer, timer.step(record=record):
            run.losses.append(
                train_step(
                    run.model,
                    ctx,
                    ENGINE,
                    run.batches,
                    run.m,
                    run.optimizer,
                    grad_accumulator=run.grad_acc,
                    clip_grad=None,
                    sends=run.sends,
                )
            )
        run.tensors = [P2PCount.sent - before[0], P2PCount.received - before[1]]  # the same every step
        run.shapes = P2PCount.shapes[: len(P2PCount.shapes) // run.m]  # one micro-batch's sends


def train_rounds(
    runs: dict[str, Run], ctx: Any, spec: RankSpec, recalibrate: Callable[[], None], progress: Progress
) -> list[float]:
    """Every model takes its turn in every round, in an order that rotates (each goes first in turn);
    ``recalibrate`` after every ``calibrate_every`` rounds. Returns the load average before each round."""
    keys, loads = list(runs), []
    for r in range(spec.rounds):
        loads.append(os.getloadavg()[0])
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            first = [False] * spec.warmup if r == 0 else []
            _turn(runs[key], ctx, first + [False] * spec.rewarm + [True] * spec.steps_per_turn)
            progress.advance()
        if spec.calibrate_every and (r + 1) % spec.calibrate_every == 0:
            recalibrate()
            progress.advance()
    return loads


def exchange_times(ctx: Any, run: Run, repeats: int = 15) -> dict[str, float]:
    """pp=2: median seconds of one micro-batch's exchange across the cut, PP0's activations against PP1's
    gradients (the tensors this run sends), in Nanotron's order (one tensor per communication call, so each
    activation send waits for the previous gradient to arrive, and each gradient send for the next activation)
    and with every send posted first. Collective; the same on every rank."""
    shapes: list[Any] = [None, None]
    dist.all_gather_object(shapes, run.shapes)
    p2p, rank, out = CPUP2P(ctx.pp_pg), dist.get_rank(ctx.pp_pg), {}
    mine, theirs = shapes[rank], shapes[1 - rank]
    for order in ("one per call", "all sends first"):
        times = []
        for i in range(repeats + 2):
            dist.barrier(group=ctx.pp_pg)
            t0 = time.perf_counter()
            _exchange(
                p2p,
                rank,
                [torch.ones(s, dtype=getattr(torch, d)) for s, d in mine],
                len(theirs),
                interleaved=order == "one per call",
            )
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[order] = statistics.median(times)
    payload = [out]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(ctx.pp_pg, 0), group=ctx.pp_pg)
    return payload[0]


def _exchange(p2p: Any, rank: int, mine: list[Any], n_theirs: int, *, interleaved: bool) -> None:
    """PP0 sends activations and receives gradients, PP1 the reverse; ``interleaved``: alternately one of each
    (PP0 sends first, PP1 receives first), else every send posted before the first receive."""
    peer = 1 - rank
    if not interleaved:
        p2p.send_tensors(mine, to_rank=peer)
        p2p.recv_tensors(num_tensors=n_theirs, from_rank=peer)
    for i in range(max(len(mine), n_theirs) if interleaved else 0):
        for do_send in (True, False) if rank == 0 else (False, True):
            if do_send and i < len(mine):
                p2p.send_tensors([mine[i]], to_rank=peer)
            elif not do_send and i < n_theirs:
                p2p.recv_tensors(num_tensors=1, from_rank=peer)
    p2p.wait_pending()


def worker(spec_path: str, out_path: str) -> None:
    """One rank: calibrate, plan, build every split, train them in turns, predict; rank 0 writes the JSON."""
    exit_with_parent()
    spec = RankSpec.from_json(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with GlooParallelContext(1, spec.pp, 1, timeout_s=300) as ctx:
        rank0 = dist.get_rank() == 0
        cfg = config_from_dict(spec.raw, source=spec.label)
        shards = sorted({int(n.removeprefix("chain K=")) for n in spec.splits if n.startswith("chain K=")} | {1})
        cfgs = {k: cfg.with_overrides(vocab_shards=k) for k in shards}
        t0 = time.perf_counter()
        profiles = [take_profile(cfgs) for _ in range(spec.calibrations_first)]
        calibrate_s = (time.perf_counter() - t0) / spec.calibrations_first
        busy = busy_block_times(cfgs) if spec.decompose else {}
        if rank0:
            profiles[0].save(spec.planning_profile)
        dist.barrier()
        plans = plan_splits(spec.splits, cfg, spec.planning_profile, dict(spec.layouts))
        P2PCount.install()
        runs = build_models(plans, ctx, spec.eager_sends)
        progress = Progress(spec.progress, rank0, spec.n_calibrations + spec.rounds * len(runs))
        progress.advance()
        loads = train_rounds(runs, ctx, spec, lambda: profiles.append(take_profile(cfgs)), progress)
        measured = {}
        for key, run in runs.items():
            if spec.pp == 2 and set(run.names) & set(spec.decompose):
                run.exchange = exchange_times(ctx, run)
            measured[key] = _gathered(run)
        runs.clear()
        gc.collect()
        if rank0:
            median_profile(profiles).save(spec.median_profile)
            out = {
                "calibrate_s": calibrate_s,
                "load_average": loads,
                "runs": measured,
                "splits": describe_splits(plans, spec.planning_profile, spec.median_profile, spec.decompose, busy),
                "auto": auto_pick(cfg, spec.planning_profile, plans) if spec.auto else None,
                "auto_median": auto_pick(cfg, spec.median_profile, plans) if spec.auto else None,
                "profiles": [json.loads(p.to_json()) for p in profiles],
            }
            Path(out_path).write_text(json.dumps(out))


def _gathered(run: Run) -> dict[str, Any] | None:
    """Every rank's step records and tensors sent / received per step, on rank 0 (collective)."""
    tensors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tensors, run.tensors)
    per_rank = run.timer.gather()
    if per_rank is None:
        return None
    return {
        "names": run.names,
        "sends": run.sends,
        "of": run.of,
        "losses": run.losses,
        "tensors": tensors,
        "exchange": run.exchange,
        "records": [[rec.to_dict() for rec in recs] for recs in per_rank],
    }
