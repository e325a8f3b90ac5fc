"""Functions run inside spawned ranks by ``test_timing.py`` and ``test_profiled.py`` (see ``runtime/spawn.py``).

Free of pytest imports: each rank loads this file by path and calls one function. Return values are plain
dicts so they unpickle in the test process without this module.
"""

from __future__ import annotations

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


def _micro_batches(model: Any, ctx: Any, vocab: int, seed: int = 0):
    import torch

    from nanotron_ext.runtime import make_micro_batch

    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=gen)
        yield make_micro_batch(model, ctx, input_ids=tokens[:, :-1], label_ids=tokens[:, 1:])


def timing_cases(cases: dict[str, list[int]], n_steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Train ``SMALL`` at pp=2 with each block→rank split in ``cases``; time every step with ``StepTimer``.

    Returns:
        ``{case: {"records": per-rank lists of record dicts (rank 0 only, else None), "summary": ...}}``.
    """
    import torch
    from nanotron.config import LlamaConfig

    from nanotron_ext.runtime import GlooParallelContext, build_cpu_llama, build_optimizer
    from nanotron_ext.runtime.timing import summarize, timed_train_steps

    ctx = GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1)
    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    try:
        for name, ranks in cases.items():
            torch.manual_seed(0)
            model = build_cpu_llama(LlamaConfig(**SMALL), ctx, block_ranks=ranks)
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
            losses, per_rank = timed_train_steps(
                model,
                ctx,
                "1f1b",
                _micro_batches(model, ctx, SMALL["vocab_size"]),
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
    except BaseException:
        ctx.destroy(barrier=False)  # do not wait in a barrier for a peer that may be stuck
        raise
    ctx.destroy()
    return out


def profiled_plan(cache_root: str, perturb_rank: int) -> dict[str, Any]:
    """Plan the bundled tiny model with ``profiled`` at pp=2 while this rank's measurements may be skewed.

    On ``perturb_rank`` every decoder layer is reported 1000× slower than measured, as if its timer ran slow
    (a loaded or different machine). Each rank also plans from its *own* measurements, without the broadcast,
    to show that the perturbation would change the plan.

    Returns:
        The rank's plan, its local-only plan, how many blocks it measured while planning, and the timings.
    """
    import dataclasses

    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.costs import measured as profiled
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.strategies import optimal_assignment

    ctx = GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=1)
    rank = int(os.environ["RANK"])
    try:
        calls = {"n": 0}
        real_measure = profiled.measure_block

        def measure(block, cfg, **kwargs):
            calls["n"] += 1
            timing = real_measure(block, cfg, **kwargs)
            if rank == perturb_rank and block.role == "decoder":
                timing = dataclasses.replace(timing, forward=timing.forward * 1000, backward=timing.backward * 1000)
            return timing

        profiled.measure_block = measure  # this process only; it exits afterwards
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
    except BaseException:
        ctx.destroy(barrier=False)
        raise
    ctx.destroy()
    return result
