"""Functions run inside spawned ranks by ``test_timing.py``, ``test_profiled.py`` and ``test_op_clock.py`` (see
``runtime/spawn.py``).

Free of pytest imports: each rank loads this file by path and calls one function. Return values are plain
dicts so they unpickle in the test process without this module.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

#: A small model whose decoder layers dominate, so that moving them moves the load: 9 blocks
#: (embedding, decoder.0-3, final_norm, lm_head, cast, loss).
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEQ_LEN = 64
MICRO_BATCH = 2
N_MICRO = 4


def timing_cases(cases: dict[str, list[int]], n_steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Train ``SMALL`` at pp=2 with each block→rank split in ``cases``; time every step with ``StepTimer``.

    Returns:
        ``{case: {"records": per-rank lists of record dicts (rank 0 only, else None), "summary": ...}}``.
    """
    import torch
    from nanotron.config import LlamaConfig

    from nanotron_ext.runtime import (
        GlooParallelContext,
        build_cpu_llama,
        build_optimizer,
        random_micro_batches,
    )
    from nanotron_ext.runtime.timing_summary import summarize, timed_train_steps

    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1) as ctx:
        for name, ranks in cases.items():
            torch.manual_seed(0)
            model = build_cpu_llama(LlamaConfig(**SMALL), ctx, block_ranks=ranks)
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
            losses, per_rank = timed_train_steps(
                model,
                ctx,
                "1f1b",
                random_micro_batches(model, ctx, SMALL["vocab_size"], MICRO_BATCH, SEQ_LEN),
                N_MICRO,
                optimizer,
                n_steps=n_steps,
                warmup=warmup,
                grad_accumulator=grad_acc,
            )
            out[name] = {
                "losses": losses,
                "records": None if per_rank is None else [[r.to_dict() for r in recs] for recs in per_rank],
                "summary": None if per_rank is None else summarize(per_rank).to_dict(),
            }
    return out


#: Scripted (forward, backward) seconds per block role: blocks cost [2, 6, 6, 1, 2, 1, 2] in the tiny model's
#: order (embedding, decoder.0-1, final_norm, lm_head, cast, loss). Best pp=2 split, by hand: the prefix sums are
#: 2, 8, 14, ... of 20, so cutting after decoder.0 gives max(8, 12) = 12, every other cut more: (0,0,1,1,1,1,1).
SCRIPT_A = {
    "embedding": (1.0, 1.0),
    "decoder": (2.0, 4.0),
    "final_norm": (0.5, 0.5),
    "lm_head": (1.0, 1.0),
    "cast": (0.5, 0.5),
    "loss": (1.0, 1.0),
}
#: The same with a heavy lm_head: [2, 6, 6, 1, 100, 1, 2] of 118; cutting before the lm_head gives
#: max(15, 103) = 103, after it 115, earlier cuts more: (0,0,0,0,1,1,1).
SCRIPT_B = {**SCRIPT_A, "lm_head": (40.0, 60.0)}


class ScriptedTime:
    """A clock for the profiler (``measured.clock``) and block modules that advance it by scripted seconds.

    ``factory`` is a ``module_factory`` for :func:`nanotron_ext.costs.profiled.measure_blocks`: each block's module
    moves ``now`` forward by its role's forward seconds when called, and by its backward seconds when autograd
    runs its backward; a block with weights has one (trainable) parameter, so the optimizer step runs too (and
    takes no scripted time). The profiler's own code (warm-up, medians, cache, broadcast) runs unchanged.
    """

    def __init__(self, script: dict[str, tuple[float, float]]) -> None:
        self.script = script
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def factory(self, block: Any, cfg: Any, tp_pg: Any) -> Any:
        import torch

        clock = self

        class Tick(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, seconds: float) -> Any:
                ctx.seconds = seconds
                return x.clone()

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                clock.now += ctx.seconds
                return grad, None

        fwd, bwd = self.script[block.role]

        class Scripted(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(())) if block.params else None

            def forward(self, **inputs: Any) -> Any:
                clock.now += fwd
                out = torch.zeros(())
                for t in inputs.values():
                    if t.is_floating_point():
                        out = out + t.sum()
                if self.weight is not None:
                    out = out + self.weight
                return Tick.apply(out, bwd)

        return Scripted()


def with_factory(measure_blocks: Any, factory: Any) -> Any:
    """``measure_blocks`` building every module with ``factory`` (``profile_blocks`` passes its own, None)."""

    def measure(blocks: Any, cfg: Any, **kwargs: Any) -> Any:
        return measure_blocks(blocks, cfg, **{**kwargs, "module_factory": factory})

    return measure


def profiled_plan(cache_root: str) -> dict[str, Any]:
    """Plan the bundled tiny model with ``profiled`` at pp=2 while the ranks' blocks take different times.

    Rank 0's blocks take ``SCRIPT_A``'s seconds, rank 1's ``SCRIPT_B``'s (as if rank 1 were another machine);
    both read the scripted clock. Each rank also plans from its *own* measurements, without the broadcast, to
    show that rank 1 alone would choose another split.

    Returns:
        The rank's plan, its local-only plan, and how many blocks it measured while planning.
    """
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.costs import profiled
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.strategies import optimal_assignment

    rank = int(os.environ["RANK"])
    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1) as ctx:
        scripted = ScriptedTime(SCRIPT_A if rank == 0 else SCRIPT_B)
        calls = {"n": 0}
        real_measure = with_factory(profiled.measure_blocks, scripted.factory)

        def measure(blocks, cfg, **kwargs):
            calls["n"] += len(blocks)
            return real_measure(blocks, cfg, **kwargs)

        # This process only; it exits afterwards.
        profiled.measure_blocks = measure
        profiled.clock = scripted.clock
        cfg = load_config(bundled_config()).with_overrides(profile_cache=os.path.join(cache_root, f"rank{rank}"))
        blocks = inventory_from_config(cfg)
        plan = make_plan(blocks, cfg, "profiled")
        measured_while_planning = calls["n"]
        # Each rank on its own: its tp_pg (size 1) to build on, a cache of its own.
        local = profiled.profile_blocks(
            blocks, cfg, tp_pg=ctx.tp_pg, cache_dir=os.path.join(cache_root, f"local{rank}"), repeats=3
        )
        local_ranks = optimal_assignment(blocks, cfg, [t.total for t in local], "s", trainable_per_stage=True).ranks
        result = {
            "rank": rank,
            "plan_ranks": list(plan.block_ranks),
            "plan_costs": list(plan.block_costs),
            "plan_ok": plan.ok,
            "local_ranks": list(local_ranks),
            "measured_while_planning": measured_while_planning,
        }
    return result


def profiled_fails_on_rank0(cache_root: str) -> dict[str, Any]:
    """Plan with ``profiled`` at pp=2 while building the lm_head's module fails on global rank 0 only.

    Returns:
        ``{"rank", "error"}``: the ``PlanningError`` this rank raised, as ``"PlanningError: message"``. Any other
        exception propagates (the test then fails), and a rank left waiting in the broadcast is killed at the
        spawn helper's deadline.
    """
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.costs import profiled
    from nanotron_ext.errors import PlanningError
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import GlooParallelContext

    rank = int(os.environ["RANK"])
    scripted = ScriptedTime(SCRIPT_A)

    def failing_factory(block: Any, cfg: Any, tp_pg: Any) -> Any:
        if rank == 0 and block.role == "lm_head":
            raise RuntimeError(f"scripted failure on rank {rank}: cannot build {block.name}")
        return scripted.factory(block, cfg, tp_pg)

    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1):
        profiled.measure_blocks = with_factory(profiled.measure_blocks, failing_factory)
        profiled.clock = scripted.clock
        cfg = load_config(bundled_config()).with_overrides(profile_cache=os.path.join(cache_root, f"rank{rank}"))
        try:
            make_plan(inventory_from_config(cfg), cfg, "profiled")
            result = {"rank": rank, "error": None}
        except PlanningError as exc:
            result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    return result


def malloc_policy_in_the_runtime() -> dict[str, Any]:
    """This rank's malloc policy before and inside the CPU runtime's context (``nanotron_ext.allocator``)."""
    from nanotron_ext.allocator import malloc_policy
    from nanotron_ext.runtime import GlooParallelContext

    before = malloc_policy()
    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1):
        inside = malloc_policy()
    return {"before": before, "inside": inside}


#: OpClock's cases (``test_op_clock.py``). SMALL's blocks: embedding, decoder.0-3, final_norm, lm_head, cast, loss; four
#: and five on the two stages.
SPLIT = [0, 0, 0, 0, 1, 1, 1, 1, 1]


def clocked_steps(engine: str, clocked: bool, frozen: tuple[str, ...] = (), steps: int = 2) -> dict[str, Any]:
    """``steps`` training steps of SMALL at pp=2 under ``engine``, every one timed by an ``OpClock`` when ``clocked``
    (else none), the parameters whose names start with one of ``frozen`` frozen. Returns the losses, every
    parameter's bytes after training, and (rank 0, clocked) every rank's recorded steps as dicts."""
    import torch
    from nanotron.config import LlamaConfig

    from nanotron_ext.runtime import (
        GlooParallelContext,
        build_cpu_llama,
        build_optimizer,
        random_micro_batches,
        train_step,
    )
    from nanotron_ext.runtime.op_clock import OpClock

    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1) as ctx:
        torch.manual_seed(0)
        model = build_cpu_llama(
            LlamaConfig(**SMALL),
            ctx,
            block_ranks=SPLIT,
            freeze=lambda name, _: name.startswith(frozen) if frozen else False,
        )
        optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
        batches = random_micro_batches(model, ctx, SMALL["vocab_size"], MICRO_BATCH, SEQ_LEN)
        losses, gathered, records = [], None, None
        if clocked:
            with OpClock(model, ctx) as clock:
                for _ in range(steps):
                    with clock.step():
                        losses.append(
                            train_step(model, ctx, engine, batches, N_MICRO, optimizer, grad_accumulator=grad_acc)
                        )
                gathered = clock.gather()
                records = clock.timer.gather()
        else:
            losses = [
                train_step(model, ctx, engine, batches, N_MICRO, optimizer, grad_accumulator=grad_acc)
                for _ in range(steps)
            ]
        weights = {n: p.detach().clone().numpy().tobytes() for n, p in model.named_parameters()}
    return {
        "rank": int(os.environ["RANK"]),
        "losses": losses,
        "weights": weights,
        "steps": None if gathered is None else [[dataclasses.asdict(s) for s in rank] for rank in gathered],
        "records": None if records is None else [[r.to_dict() for r in rank] for rank in records],
    }
