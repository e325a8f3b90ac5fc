"""Measured on CPU with Nanotron's engine: step time and bubble per strategy, and simulated ÷ measured.

For each scenario, two real processes (gloo, one thread each) run Nanotron 0.2's 1F1B engine at pp=2 on the
CPU runtime (``nanotron_ext.runtime``). Every strategy's plan (``make_plan``) is built as a model in the same
two processes; all models stay alive and take turns, round after round (each turn: untimed re-warm steps, then
timed steps), so load from other processes on a shared machine slows every split alike.
``nanotron_ext.runtime.timing.StepTimer`` records each rank's busy and idle time. Strategies whose plans are
identical are trained once.

* measured step: median over timed steps of the full ``train_step`` (engine, tied-gradient sync, optimizer; no
  clipping, see the note in :func:`worker`), slowest rank;
* measured pipeline: the engine's part of the step (``train_batch_iter`` and its sends), slowest rank;
* measured bubble: ``Σ idle / (pp × step)``;
* simulated step: ``nanotron_ext.simulate.simulate`` (1F1B: Nanotron's send/receive program, rendezvous
  transfers), fed with

  - each stage's forward/backward per micro-batch, summed from its blocks' ``profiled`` timings, measured on
    rank 0 of the same processes before every round, median over rounds;
  - one transfer across the plan's cut, measured between the two ranks through Nanotron's P2P with the
    tensors that cross it (metadata, fresh receive buffer and data, as in training), median over rounds;
  - each stage's update: its blocks' profiled AdamW steps, plus, where embedding and lm_head sit on different
    ranks and are tied, the measured all-reduce of that gradient;

  ``sim ÷ step`` therefore tests the whole model with measured block times, not a FLOP rate;
* its sources of error, apart: the pipeline part alone (simulated ÷ measured pipeline); each stage's busy
  time inside the pipeline ÷ ``m`` × its blocks' profiled forward + backward (do blocks timed alone predict a
  stage?); and the simulator fed with those in-pipeline stage times ÷ the measured pipeline (the schedule
  model alone);
* speed vs Nanotron: Nanotron's measured step ÷ this strategy's.

Nanotron's own rule leaves PP1 without parameters on the large-vocabulary model: Nanotron stops there
("no gradient on PP1"). It is run anyway with the optimizer skipped on that rank, to compare its step time.

Scenarios (shortened to fit a few minutes on 2 cores; fp32 because the CPU runtime trains in fp32):

* ``tiny-large-vocab``: ``nanotron_ext/configs/tiny_llama_large_vocab.yaml`` as shipped (2 layers, vocabulary
  50277, hidden 16, sequence 32, micro-batch 2, 4 micro-batches); 5 rounds, each turn 1 untimed + 3 timed
  steps (its ms-scale, memory-bound blocks run on a working set near the 32 MiB L3: after another model's
  turn the caches are cold, which a real run, training one model, never sees);
* ``SmolLM-135M-shaped``: ``nanotron_ext/configs/smollm_135m.yaml``'s shape (all 30 layers, hidden 576,
  9/3 heads, vocabulary 49152, tied embeddings) with sequence 128 (not 2048), micro-batch 1 (not 4) and 4
  micro-batches (not 8), fp32 (not bf16); 5 rounds of one timed step each;
* ``SmolLM-135M-shaped-m2``, only with ``--scenario SmolLM-135M-shaped-m2``: the same shape with 16 layers and
  2 micro-batches, where the default's split (``constrained``, objective ``step_time``) differs from the
  FLOP-optimal one (``constrained@slowest_stage``, the same split as Nanotron's rule); the two splits take
  turns for 12 rounds of 1 timed step, blocks profiled once, and a section after the checks compares their
  predicted and measured step times round by round.

The ranks run with glibc malloc told to keep freed memory (``MALLOC_ENV``; ``--system-malloc`` to leave the
defaults): with the defaults, how often a large tensor is page-faulted in again depends on the allocation
pattern (one block in a loop versus a pipeline holding several micro-batches), which skews profiled versus
measured times on this VM by 10–20 %, whatever the split.

Usage: ``python benchmarks/measured_cpu.py [--rounds R] [--warmup 1] [--scenario LABEL] [--profile-cache DIR]
[--quick] [--system-malloc]`` (``--quick``: SmolLM-shaped with 8 layers and sequence 64, for a fast look). Exit status 1
when a check printed at the end fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nanotron_ext import allocator
from nanotron_ext.machine import MachineProfile
from nanotron_ext.procs import local_env, run_local_ranks

ROOT = Path(__file__).resolve().parents[1]
#: The FLOP-rate model alone (1 TFLOP/s, no links): the planner's compute-only prediction, for comparison.
FLOP_RATE = MachineProfile(name="FLOP rate, p2p not priced", source="benchmarks/measured_cpu.py", flops_per_second=1e12)
CONFIGS = ROOT / "nanotron_ext" / "configs"
RESULTS = Path(__file__).resolve().parent / "results"
PP = 2
ENGINE = "1f1b"
STRATEGIES: tuple[str, ...] = ("nanotron", "uniform", "flops", "memory", "constrained", "profiled")
OURS: tuple[str, ...] = STRATEGIES[1:]
SIM_RANGE = (0.8, 1.2)
#: The default (``constrained``, objective step_time) and the FLOP-optimal split, compared where both appear.
OBJECTIVE_PAIR: tuple[str, str] = ("constrained", "constrained@slowest_stage")
#: "at least as fast" allows this much measurement noise (medians of a few steps on a shared 2-core machine).
NOISE = 0.03
WORLD_TIMEOUT_S = 420.0
#: glibc malloc settings for the ranks: keep freed memory, the policy calibration and the CPU runtime apply to
#: themselves (nanotron_ext.allocator); ``--system-malloc`` sets NANOTRON_EXT_SYSTEM_MALLOC=1 instead.
MALLOC_ENV = allocator.MALLOC_ENV
SYSTEM_MALLOC_ENV = {allocator.SYSTEM_MALLOC_VARIABLE: "1"}


@dataclass(frozen=True)
class Scenario:
    """A model and batch shape to train at pp=2."""

    label: str
    yaml_name: str
    sequence_length: int
    micro_batch_size: int
    n_micro_batches: int
    num_hidden_layers: int | None = None  # None: as in the YAML
    notes: str = ""
    #: Each plan's turn in a round: ``rewarm`` untimed steps, then ``steps_per_turn`` timed ones.
    rounds: int = 5
    steps_per_turn: int = 1
    rewarm: int = 0
    #: The plans to train; ``STRATEGY@OBJECTIVE`` plans ``STRATEGY`` under ``nanotron_ext.objective: OBJECTIVE``.
    strategies: tuple[str, ...] = STRATEGIES
    #: Run without ``--scenario`` (the objective comparison is asked for by name).
    default: bool = True
    #: Profile the blocks again before every round (else once, before training: shorter runs).
    profile_rounds: bool = True

    @property
    def steps(self) -> int:
        return self.rounds * self.steps_per_turn

    def raw_config(self) -> dict[str, Any]:
        """The YAML as a dict with this scenario's overrides (pp=2, 1F1B, fp32, shorter batch)."""
        raw = yaml.safe_load((CONFIGS / self.yaml_name).read_text())
        raw = copy.deepcopy(raw)
        raw["parallelism"].update(dp=1, tp=1, pp=PP, pp_engine=ENGINE)
        raw["tokens"].update(
            sequence_length=self.sequence_length,
            micro_batch_size=self.micro_batch_size,
            batch_accumulation_per_replica=self.n_micro_batches,
        )
        raw["model"]["dtype"] = "float32"
        raw.setdefault("optimizer", {})["accumulate_grad_in_fp32"] = False
        if self.num_hidden_layers is not None:
            raw["model"]["model_config"]["num_hidden_layers"] = self.num_hidden_layers
        return raw


def scenarios(quick: bool) -> list[Scenario]:
    smol_layers, smol_seq = (8, 64) if quick else (None, 128)
    return [
        # Its blocks are memory-bound, millisecond ops on a working set near the 32 MiB L3: a turn re-warms the
        # caches with one untimed step after the other plans' models ran, as a real run (one model) has them.
        Scenario(
            "tiny-large-vocab",
            "tiny_llama_large_vocab.yaml",
            32,
            2,
            4,
            notes="as shipped",
            rounds=5,
            steps_per_turn=3,
            rewarm=1,
        ),
        Scenario(
            "SmolLM-135M-shaped",
            "smollm_135m.yaml",
            smol_seq,
            1,
            4,
            num_hidden_layers=smol_layers,
            notes=f"{smol_layers or 30} layers, seq {smol_seq}, micro-batch 1, 4 micro-batches, fp32",
        ),
        # The objective comparison (issue 12): at 2 micro-batches the default's split (simulated step time)
        # differs from the FLOP-optimal one (objective slowest_stage, here also Nanotron's rule's split): the
        # FLOP-rate model predicts the FLOP split 6.0 % slower (16 layers; 6.3 % with all 30). Only the two
        # distinct splits are trained, one timed step each per round, so each round pairs two adjacent steps; 16 layers
        # and one profile keep the run to a few minutes.
        Scenario(
            "SmolLM-135M-shaped-m2",
            "smollm_135m.yaml",
            smol_seq,
            1,
            2,
            num_hidden_layers=12 if quick else 16,
            notes=f"{12 if quick else 16} layers, seq {smol_seq}, micro-batch 1, 2 micro-batches, fp32",
            rounds=12,
            steps_per_turn=1,
            strategies=("nanotron", "constrained", OBJECTIVE_PAIR[1]),
            default=False,
            profile_rounds=False,
        ),
    ]


# --- inside the two ranks ------------------------------------------------------------------------------


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
    """One transfer across each distinct cut of ``plans`` (keyed by :func:`_cut_key`), and ``"tied"``: the
    tied-gradient all-reduce (0 when the embeddings are not tied)."""
    out: dict[str, float] = {}
    for plan in plans.values():
        key = _cut_key(plan.block_ranks, [{"role": b.role} for b in blocks])
        if key not in out:
            out[key] = _measure_cut(ctx, _cut_tensors(key.split(":")[1], cfg))
    out["tied"] = _measure_tied_sync(ctx, cfg) if cfg.model.tie_word_embeddings else 0.0
    return out


def worker(spec_path: str, out_path: str) -> None:
    """One rank: profile (rank 0), plan every strategy, train each distinct plan with timing; rank 0 writes JSON."""
    import gc

    import torch
    import torch.distributed as dist

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.costs import block_memory, profiled
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import (
        GlooParallelContext,
        build_cpu_llama,
        build_optimizer,
        random_micro_batches,
        train_step,
    )
    from nanotron_ext.runtime.timing import StepTimer, summarize
    from nanotron_ext.simulate import simulate_plan

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
        plans = {}  # profiled: from the cache now
        for name in spec["strategies"]:
            strategy, _, objective = name.partition("@")
            plans[name] = make_plan(blocks, cfg.with_overrides(objective=objective or None), strategy)
        lcfg = llama_config_from_shape(cfg)
        # One model per distinct split, all alive at once, stepped round-robin: load from other processes on a
        # shared machine then slows every split alike instead of whichever happened to run during it.
        runs: dict[str, dict[str, Any]] = {}
        for name in spec["strategies"]:
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
        runs.clear()
        gc.collect()
        if rank == 0:
            out = {
                "label": spec["label"],
                "profile_s": profile_s,
                # Per block, the median over the rounds' profiles of forward, backward and optimizer step
                # apart; the first profile, before training, is the one the profiled strategy planned with.
                "timings": [
                    [
                        statistics.median(getattr(p[k], f) for p in profiles)
                        for f in ("forward", "backward", "optimizer")
                    ]
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
                "load_average": loads,
                "steps_per_turn": spec["steps_per_turn"],
            }
            Path(out_path).write_text(json.dumps(out))


# --- launching -----------------------------------------------------------------------------------------


def launch(
    spec: dict[str, Any], timeout: float = WORLD_TIMEOUT_S, malloc_env: bool = True, script: Path | None = None
) -> dict[str, Any]:
    """Run :func:`worker` in ``PP`` fresh processes with torchrun's environment; return rank 0's JSON.

    Args:
        spec: the scenario (see :func:`main`).
        timeout: seconds before every rank is killed.
        malloc_env: give the ranks :data:`MALLOC_ENV` (unless the caller's environment sets those already).
        script: the benchmark whose ``--worker SPEC OUT`` the ranks run (default: this one).

    Raises:
        RuntimeError: a rank failed or the run passed ``timeout`` seconds (every rank is killed then).
    """
    with tempfile.TemporaryDirectory(prefix="measured_cpu_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = local_env(ROOT)
        env = {**MALLOC_ENV, **env} if malloc_env else {**env, **SYSTEM_MALLOC_ENV}
        # grace=0: once a rank fails the scenario is lost, and its peers would only wait in a collective.
        run = run_local_ranks(
            [sys.executable, str(script or Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
            PP,
            timeout=timeout,
            grace=0,
            env=env,
            cwd=ROOT,
        )
        if not run.ok or not out_path.exists():
            reason = "timed out" if run.deadline_hit else "failed"
            raise RuntimeError(f"scenario {spec['label']!r} {reason}:\n" + run.describe())
        return json.loads(out_path.read_text())


# --- simulation and report -----------------------------------------------------------------------------


@dataclass
class Row:
    strategy: str
    split: str
    ok: bool
    findings: list[str]
    same_as: str | None
    step: float
    pipeline: float
    bubble: float
    pipeline_bubble: float
    sim_step: float  # pipeline + update (gradient sync, optimizer)
    sim_pipeline: float
    sim_bubble: float
    p2p: float
    update: list[float]  # per stage: simulated update (optimizer step + tied-gradient all-reduce)
    busy_ratio: list[float]  # per stage: measured busy in the pipeline ÷ m × profiled forward + backward
    sim_in_situ: float  # the simulator's pipeline, fed with the stage times measured in the pipeline
    notes: list[str] = field(default_factory=list)


def _cut_key(ranks: Sequence[int], blocks: Sequence[dict]) -> str:
    cut = next(i for i in range(1, len(ranks)) if ranks[i] != ranks[i - 1])
    return f"{cut}:{blocks[cut]['role']}"


def _split(ranks: Sequence[int], blocks: Sequence[dict]) -> str:
    from nanotron_ext.report import compact_names

    # " / " between stages: a "|" would split the markdown table cell.
    return " / ".join(compact_names([b["short"] for b, r in zip(blocks, ranks) if r == k]) for k in range(PP))


def analyse(result: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    """Rows of the table for one scenario, and the simulated schedules by strategy."""
    from nanotron_ext.simulate import StageTimes, simulate

    blocks, timings = result["blocks"], result["timings"]
    m, p2p = result["n_micro_batches"], result["p2p"]
    roles = [b["role"] for b in blocks]
    rows, sims = [], {}
    for name, plan in result["plans"].items():
        key = ",".join(map(str, plan["ranks"]))
        run = result["runs"][key]
        fwd, bwd, update = [0.0] * PP, [0.0] * PP, [0.0] * PP
        for (f, b, o), r in zip(timings, plan["ranks"]):
            fwd[r] += f
            bwd[r] += b
            update[r] += o
        if result["tied"]:
            tied_on = {plan["ranks"][roles.index("embedding")], plan["ranks"][roles.index("lm_head")]}
            if len(tied_on) > 1:  # both copies' ranks join the all-reduce
                for k in tied_on:
                    update[k] += p2p["tied"]
        transfer = p2p[_cut_key(plan["ranks"], blocks)]
        sim = simulate([StageTimes(fwd[k], bwd[k], update[k]) for k in range(PP)], m, ENGINE, transfer)
        sims[name] = (sim, plan)
        s = run["summary"]
        # Separates the two sources of error: per-block timings measured alone (busy ratio ≠ 1) versus the
        # schedule model (the simulator fed with in-pipeline stage times, scaled from the profiled split of
        # forward and backward, still misses the measured pipeline).
        ratio = [
            s["pipeline_busy"][k] / (m * (fwd[k] + bwd[k])) if fwd[k] + bwd[k] else float("nan") for k in range(PP)
        ]
        in_situ = simulate([StageTimes(fwd[k] * ratio[k], bwd[k] * ratio[k]) for k in range(PP)], m, ENGINE, transfer)
        rows.append(
            Row(
                name,
                _split(plan["ranks"], blocks),
                plan["ok"],
                plan["findings"],
                run["first"] if run["first"] != name else None,
                s["step"],
                s["pipeline"],
                s["bubble"],
                s["pipeline_bubble"],
                sim.step_time,
                sim.pipeline_time,
                sim.bubble_fraction,
                transfer,
                update,
                ratio,
                in_situ.pipeline_time,
            )
        )
    return rows, sims


def _valid_label(row: Row, trainable: list[int]) -> str:
    if row.ok:
        return "yes"
    empty = [k for k, t in enumerate(trainable) if t == 0]
    where = ", ".join(f"PP{k}" for k in empty) or "a stage"
    return f"NO: crashes (no gradient on {where}); run with {where}'s optimizer skipped"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds in which every plan takes a turn (default: 5 for both scenarios)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="LABEL",
        help="run only this scenario (repeatable): tiny-large-vocab, SmolLM-135M-shaped, "
        "SmolLM-135M-shaped-m2 (the objective comparison; not run by default)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--profile-cache",
        default=None,
        help="reuse this timing cache (default: a fresh one, so timings are of this run)",
    )
    parser.add_argument("--quick", action="store_true", help="SmolLM-shaped with 8 layers and sequence 64")
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc malloc's defaults (default: keep freed memory, see MALLOC_ENV)",
    )
    args = parser.parse_args(argv)
    if (args.rounds is not None and args.rounds < 1) or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    chosen = [
        sc for sc in scenarios(args.quick) if (sc.default if args.scenario is None else sc.label in args.scenario)
    ]
    if args.scenario is not None and len(chosen) != len(set(args.scenario)):
        known = ", ".join(sc.label for sc in scenarios(args.quick))
        parser.error(f"--scenario {args.scenario}: unknown label; known: {known}")
    if args.rounds is not None:
        chosen = [dataclasses.replace(sc, rounds=args.rounds) for sc in chosen]

    print(f"Reproduce: `python {shlex.join(['benchmarks/measured_cpu.py', *argv])}` (from the repository root)\n")
    import torch

    turns = "; ".join(
        f"{sc.label}: {sc.rounds} round(s) × ({sc.rewarm} untimed + {sc.steps_per_turn} timed)" for sc in chosen
    )
    print(
        f"Nanotron 0.2 1F1B engine on CPU (gloo), pp={PP}, 2 processes × 1 thread, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; per distinct plan {args.warmup} warm-up step(s), then rounds in which each plan "
        f"takes a turn ({turns}), medians of the timed steps; "
        f"glibc malloc: {'defaults' if args.system_malloc else 'freed memory kept (' + ', '.join(MALLOC_ENV) + ')'}.\n"
    )
    started = time.perf_counter()
    all_rows: dict[str, list[Row]] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nanotron_ext_profile_") as fresh_cache:
        for sc in chosen:
            t0, load_before = time.perf_counter(), os.getloadavg()[0]
            spec = {
                "label": sc.label,
                "raw": sc.raw_config(),
                "rounds": sc.rounds,
                "steps_per_turn": sc.steps_per_turn,
                "rewarm": sc.rewarm,
                "warmup": args.warmup,
                "strategies": list(sc.strategies),
                "profile_rounds": sc.profile_rounds,
                "cache": args.profile_cache or fresh_cache,
            }
            result = launch(spec, malloc_env=not args.system_malloc)
            results[sc.label] = result
            RESULTS.mkdir(parents=True, exist_ok=True)
            stem = sc.label.lower().replace("-", "_")
            (RESULTS / f"measured_cpu_{stem}.json").write_text(json.dumps(result, indent=1))
            rows, sims = analyse(result)
            all_rows[sc.label] = rows
            cuts = {k: v for k, v in result["p2p"].items() if k != "tied"}
            links = ", ".join(
                f"before {result['blocks'][int(k.split(':')[0])]['short']} {v * 1e3:.2f} ms"
                for k, v in sorted(cuts.items(), key=lambda kv: int(kv[0].split(":")[0]))
            )
            if result["tied"]:
                links += f"; tied-gradient all-reduce {result['p2p']['tied'] * 1e3:.1f} ms"
            print(
                f"- {sc.label} ({sc.notes}): {len(result['blocks'])} blocks, {result['n_micro_batches']} "
                f"micro-batches; profiled timings in {result['profile_s']:.1f} s; one p2p transfer (median over "
                f"rounds): {links}; "
                f"scenario wall {time.perf_counter() - t0:.0f} s; load average before/after "
                f"{load_before:.2f}/{os.getloadavg()[0]:.2f}",
                flush=True,
            )
            _timeline(sc, sims, rows, result["blocks"])

    print()
    _print_table(all_rows, results)
    ok = _print_checks(all_rows)
    for label, result in results.items():
        if all(name in result["plans"] for name in OBJECTIVE_PAIR):
            _print_objectives(label, result, all_rows[label])
    print(f"\nTotal wall time: {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def _timeline(sc: Scenario, sims: dict[str, Any], rows: list[Row], blocks: Sequence[dict]) -> None:
    """The simulated schedule of the profiled plan (else the default's) measured run, as a PNG in
    ``benchmarks/results``."""
    from nanotron_ext.simulate.timeline import plot_timeline

    shown = "profiled" if "profiled" in sims else "constrained"
    sim, plan = sims[shown]
    row = next(r for r in rows if r.strategy == shown)
    labels = []
    for k, part in enumerate(_split(plan["ranks"], blocks).split(" / ")):
        text = f"PP{k}: {part}"
        labels.append(text if len(text) <= 34 else text[:33] + "…")
    stem = sc.label.lower().replace("-", "_").replace(" ", "_")
    path = RESULTS / f"measured_cpu_{stem}_{shown}_timeline.png"
    plot_timeline(
        sim,
        path,
        stage_labels=labels,
        title=f"{sc.label}: {shown} split, 1F1B, pp={PP}, simulated from CPU block timings\n"
        f"measured step {row.step * 1e3:.0f} ms",
    )
    print(f"  timeline: {path.relative_to(ROOT)}")


def _print_table(all_rows: dict[str, list[Row]], results: dict[str, dict[str, Any]]) -> None:
    from nanotron_ext.report import table

    head = [
        "scenario",
        "strategy",
        "split (PP0 / PP1)",
        "plan valid?",
        "step ms",
        "sim step ms",
        "sim ÷ step",
        "pipeline ms",
        "sim pipeline ms",
        "sim ÷ pipeline",
        "bubble",
        "sim bubble",
        "sim p2p ms",
        "sim update ms (PP0, PP1)",
        "in-pipeline busy ÷ profiled (PP0, PP1)",
        "sim from in-pipeline stage times ÷ pipeline",
        "speed vs Nanotron",
    ]
    cells = []
    for label, rows in all_rows.items():
        nanotron = next(r for r in rows if r.strategy == "nanotron")
        for r in rows:
            trainable = results[label]["plans"][r.strategy]["trainable"]
            name = r.strategy + (f" (= {r.same_as})" if r.same_as else "")
            cells.append(
                [
                    label,
                    name,
                    r.split,
                    _valid_label(r, trainable),
                    f"{r.step * 1e3:.1f}",
                    f"{r.sim_step * 1e3:.1f}",
                    f"{r.sim_step / r.step:.2f}",
                    f"{r.pipeline * 1e3:.1f}",
                    f"{r.sim_pipeline * 1e3:.1f}",
                    f"{r.sim_pipeline / r.pipeline:.2f}",
                    f"{r.bubble:.1%}",
                    f"{r.sim_bubble:.1%}",
                    f"{r.p2p * 1e3:.2f}",
                    ", ".join(f"{x * 1e3:.1f}" for x in r.update),
                    ", ".join(f"{x:.2f}" for x in r.busy_ratio),
                    f"{r.sim_in_situ / r.pipeline:.2f}",
                    f"{nanotron.step / r.step:.2f}x",
                ]
            )
    print(table(head, cells, markdown=True))
    print(
        "\n(= X): same split as X, trained once. step: the full train_step (engine, tied-gradient sync, optimizer;"
        " no clipping); sim step: the simulated pipeline plus each stage's update (its blocks' profiled optimizer"
        " steps, plus the measured tied-gradient all-reduce where embedding and lm_head sit on different ranks)."
        " pipeline: the engine's part alone. bubble: Σ idle ÷ (pp × step).\nin-pipeline busy ÷ profiled: each"
        " stage's compute inside the pipeline ÷ m × its blocks' profiled forward + backward (1.00: the blocks timed"
        " alone predict the stage). sim from in-pipeline stage times: the simulator fed with those measured stage"
        " times instead (tests the schedule model alone)."
    )


def _out_of_range(all_rows: dict[str, list[Row]], ratio: Callable[[Row], float]) -> list[str]:
    lo, hi = SIM_RANGE
    return [
        f"{label}/{r.strategy} {ratio(r):.2f}"
        for label, rows in all_rows.items()
        for r in rows
        if not lo <= ratio(r) <= hi
    ]


def _print_checks(all_rows: dict[str, list[Row]]) -> bool:
    print()
    fast_ok = True
    for label, rows in all_rows.items():
        nanotron = next(r for r in rows if r.strategy == "nanotron")
        best = min((r for r in rows if r.strategy.split("@")[0] in OURS and r.ok), key=lambda r: r.step)
        holds = best.step <= nanotron.step * (1 + NOISE)
        fast_ok &= holds
        print(
            f"{'HOLDS' if holds else 'FAILS'}: {label}: best of ours ({best.strategy}, {best.step * 1e3:.1f} ms) vs "
            f"Nanotron's rule ({nanotron.step * 1e3:.1f} ms{'' if nanotron.ok else ', a plan Nanotron cannot train'}"
            f"): {nanotron.step / best.step:.3f}x"
        )
    lo, hi = SIM_RANGE
    step_ratios = [r.sim_step / r.step for rows in all_rows.values() for r in rows]
    bad_step = _out_of_range(all_rows, lambda r: r.sim_step / r.step)
    bad_pipe = _out_of_range(all_rows, lambda r: r.sim_pipeline / r.pipeline)
    bad_situ = _out_of_range(all_rows, lambda r: r.sim_in_situ / r.pipeline)
    banner = "=" * 100
    print(banner)
    print(
        f"CHECK 'best of ours is at least as fast as Nanotron's rule' (within {NOISE:.0%} noise) on every scenario: "
        f"{'YES' if fast_ok else 'NO'}"
    )
    print(
        f"CHECK 'simulated ÷ measured step time within {lo}–{hi}' on every row: {'YES' if not bad_step else 'NO'}"
        f" (range {min(step_ratios):.2f}–{max(step_ratios):.2f})"
        + ("" if not bad_step else " — out of range: " + ", ".join(bad_step))
    )
    print(
        f"      the engine's part alone, 'simulated ÷ measured pipeline within {lo}–{hi}': "
        f"{'YES' if not bad_pipe else 'NO'}" + ("" if not bad_pipe else " — out of range: " + ", ".join(bad_pipe))
    )
    print(
        f"      the schedule model alone, 'simulated from in-pipeline stage times ÷ measured pipeline within "
        f"{lo}–{hi}': {'YES' if not bad_situ else 'NO'}"
        + ("" if not bad_situ else " — out of range: " + ", ".join(bad_situ))
    )
    print(banner)
    return fast_ok and not bad_step


def _print_objectives(label: str, result: dict[str, Any], rows: list[Row]) -> None:
    """The default's split against the FLOP-optimal one: predicted and measured step times, round by round."""
    default, flop = OBJECTIVE_PAIR
    by_name = {r.strategy: r for r in rows}
    a, b = by_name[default], by_name[flop]
    print(f"\nObjectives on {label}: {default} (objective step_time, the default) vs {flop} (FLOP-optimal)")
    if a.same_as == flop or b.same_as == default:
        print("  same split: nothing to compare")
        return
    runs = {name: result["runs"][",".join(map(str, result["plans"][name]["ranks"]))] for name in OBJECTIVE_PAIR}
    per = result["steps_per_turn"]
    rounds = [
        [statistics.median(runs[name]["steps"][i : i + per]) for i in range(0, len(runs[name]["steps"]), per)]
        for name in OBJECTIVE_PAIR
    ]
    paired = [f / d for d, f in zip(*rounds)]  # FLOP split's step ÷ the default's, per round
    faster = sum(x > 1 for x in paired)
    flop_rate = result["flop_rate_sim"]
    print(f"  splits: {default}: {a.split}; {flop}: {b.split}")
    print(
        f"  predicted, FLOP-rate model (what the planner optimises): {flop} ÷ {default} = "
        f"{flop_rate[flop] / flop_rate[default]:.4f}"
    )
    print(
        f"  predicted, simulator fed with this run's measured block and link times: {b.sim_step * 1e3:.1f} ÷ "
        f"{a.sim_step * 1e3:.1f} ms = {b.sim_step / a.sim_step:.4f}"
    )
    print(
        f"  measured step (median of {len(runs[default]['steps'])} timed steps each): {b.step * 1e3:.1f} ÷ "
        f"{a.step * 1e3:.1f} ms = {b.step / a.step:.4f} ({(b.step - a.step) * 1e3:+.1f} ms for the FLOP split)"
    )
    print(
        f"  per round (median of the round's steps), {flop} ÷ {default}: "
        + ", ".join(f"{x:.3f}" for x in paired)
        + f"; median {statistics.median(paired):.4f}, range {min(paired):.3f}–{max(paired):.3f}; "
        f"the default faster in {faster} of {len(paired)} rounds (two-sided sign test p = "
        f"{_sign_test(faster, len(paired)):.3f})"
    )
    loads = result["load_average"]
    print(f"  1-minute load average inside the run: {min(loads):.2f}–{max(loads):.2f} on {os.cpu_count()} CPUs")


def _sign_test(k: int, n: int) -> float:
    """Two-sided p-value of ``k`` successes in ``n`` fair coin flips."""
    from math import comb

    tail = sum(comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


if __name__ == "__main__":
    sys.exit(main())
