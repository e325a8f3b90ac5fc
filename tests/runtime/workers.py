"""Functions executed inside the spawned ranks of the runtime tests (see ``spawn.py``).

Kept free of pytest imports: each rank loads this file by path and calls one function. Several scenarios share
one world (one process start-up each) to keep the suite fast on 2 cores.
"""

from __future__ import annotations

import os
from typing import Any

TINY = {
    "hidden_size": 16,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 50277,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

SEQ_LEN = 32
MICRO_BATCH = 2
N_MICRO = 4
SUB_VOCAB = 256  # tokens are drawn from a small id range so a tiny model has something learnable
POOL = 16  # distinct random sequences, cycled


def tiny_config(**overrides: Any):
    from nanotron.config import LlamaConfig

    return LlamaConfig(**{**TINY, **overrides})


def micro_batches(model, ctx, seed: int):
    """Endless micro-batches over ``POOL`` fixed random sequences, identical on every rank for a given seed."""
    from nanotron_ext.runtime import random_micro_batches

    return random_micro_batches(model, ctx, SUB_VOCAB, MICRO_BATCH, SEQ_LEN, seed, pool=POOL)


_CONTEXTS: dict[tuple[int, int, int], Any] = {}


def _context(tp: int, pp: int, dp: int):
    # Several layouts can live in one world: each context only adds process groups.
    from nanotron_ext.runtime import GlooParallelContext

    key = (tp, pp, dp)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = GlooParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    return _CONTEXTS[key]


def _destroy_contexts() -> None:
    for ctx in _CONTEXTS.values():
        ctx.destroy()
        break  # one destroy tears down the whole default group
    _CONTEXTS.clear()


def train_case(
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    block_ranks: list[int] | None = None,
    engine: str = "1f1b",
    n_steps: int = 5,
    seed: int = 1234,
    lr: float = 1e-2,
    config: dict[str, Any] | None = None,
    projector: bool = False,
    check_tied: bool = False,
) -> dict[str, Any]:
    """Build the tiny model (``block_ranks`` via assign_blocks, None = Nanotron's split), train, report."""
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, pipeline_blocks, train_steps

    ctx = _context(tp, pp, dp)
    torch.manual_seed(seed)
    model = build_cpu_llama(tiny_config(**(config or {})), ctx, block_ranks=block_ranks, projector=projector)
    optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=lr)
    unwrapped = model.module if hasattr(model, "module") else model
    out: dict[str, Any] = {
        "block_names": [name for name, _ in pipeline_blocks(model)],
        "block_ranks": [block.rank for _, block in pipeline_blocks(model)],
        "local_params": sum(p.numel() for p in unwrapped.parameters()),
        "has_optimizer": optimizer is not None,
        "is_ddp": model is not unwrapped,
    }
    out["losses"] = train_steps(
        model,
        ctx,
        engine,
        micro_batches(model, ctx, seed),
        n_micro_batches=N_MICRO,
        optimizer=optimizer,
        grad_accumulator=grad_acc,
        n_steps=n_steps,
        clip_grad=1.0,
    )
    if check_tied:
        # Embedding and lm_head may live on different PP ranks; gather both copies and compare.
        blocks = dict(pipeline_blocks(unwrapped))
        pp_rank = dist.get_rank(ctx.pp_pg)
        if blocks["model.token_position_embeddings"].rank == pp_rank:
            weight = unwrapped.model.token_position_embeddings.pp_block.token_embedding.weight
        else:
            weight = unwrapped.model.lm_head.pp_block.weight
        gathered = [torch.empty_like(weight.data) for _ in range(ctx.pp_pg.size())]
        dist.all_gather(gathered, weight.data.contiguous(), group=ctx.pp_pg)
        out["tied"] = bool(weight.is_tied)
        out["tied_max_abs_diff"] = max(float((g - gathered[0]).abs().max()) for g in gathered)
    return out


def run_cases(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run several ``train_case``s in this world, in order; returns ``{case name: result}`` for this rank."""
    try:
        return {
            "rank": int(os.environ["RANK"]),
            **{name: train_case(**kwargs) for name, kwargs in cases.items()},
        }
    finally:
        _destroy_contexts()


def nanotron_split(pp: int) -> dict[str, Any]:
    """Test a: Nanotron's own build_model on CPULlamaForTraining, assign_blocks' input checks, and training
    with Nanotron's split (the rank without parameters builds no optimizer and must not crash)."""
    import torch
    from nanotron.models.base import build_model

    from nanotron_ext.runtime import assign_blocks, cpu_llama, nanotron_block_ranks, pipeline_blocks

    ctx = _context(1, pp, 1)
    try:
        config = tiny_config()
        model = build_model(
            model_builder=lambda: cpu_llama(config, ctx),
            parallel_context=ctx,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        blocks = pipeline_blocks(model)
        errors = {}
        bad_inputs = {
            "too_short": [0, 1],
            "out_of_range": [0, 0, 0, 0, 0, 0, pp],
            "backwards": [0, 1, 0, 1, 1, 1, 1],
        }
        for label, ranks in bad_inputs.items():
            try:
                assign_blocks(cpu_llama(config, ctx), ctx, ranks)
            except ValueError as exc:
                errors[label] = str(exc)
        return {
            "names": [name for name, _ in blocks],
            "ranks": [block.rank for _, block in blocks],
            "helper_ranks": nanotron_block_ranks(config, pp, ctx),
            "input_pp_rank": model.input_pp_rank,
            "output_pp_rank": model.output_pp_rank,
            "local_params": sum(p.numel() for p in model.parameters()),
            "param_names": sorted(name for name, _ in model.named_parameters()),
            "errors": errors,
            "train": train_case(pp=pp, block_ranks=None, n_steps=2),
        }
    finally:
        _destroy_contexts()


def engine_trace(cases: dict[str, dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    """Record, on this rank, the program Nanotron's real engine runs in one training step, per case.

    Each case is ``{"pp", "engine", "block_ranks", "n_micro_batches"}`` and optionally ``"freeze_stage0"``
    (PP rank 0's weights do not train). Transfers of floating-point tensors are recorded at the ``CPUP2P`` calls
    (an activation goes to a higher PP rank, a gradient to a lower one); the boolean ``sequence_mask`` that
    travels with a decoder's hidden states is left out, as the simulator counts one transfer per micro-batch
    and cut. Forwards and backwards are recorded when the engine's ``forward`` / ``backward`` return (a
    forward's receive happens inside it), zb1p's W steps when they take their micro-batch from the store. The k-th
    record of a kind is micro-batch k: every queue in Nanotron's engine is first-in-first-out.
    """
    try:
        return {name: _trace_one_step(**case) for name, case in cases.items()}
    finally:
        _destroy_contexts()


def _trace_one_step(
    pp: int, engine: str, block_ranks: list[int], n_micro_batches: int, freeze_stage0: bool = False
) -> list[tuple[str, int]]:
    import collections

    import torch
    from nanotron import distributed as dist
    from nanotron.parallel.pipeline_parallel.engine import PipelineEngine

    from nanotron_ext.runtime import CPUP2P, build_cpu_llama, build_optimizer, train_step
    from nanotron_ext.zero_bubble import WeightGradStore

    ctx = _context(1, pp, 1)
    me = dist.get_rank(ctx.pp_pg)
    trace: list[tuple[str, int]] = []
    counts: collections.Counter[str] = collections.Counter()

    def record(kind: str) -> None:
        trace.append((kind, counts[kind]))
        counts[kind] += 1

    originals = {
        (CPUP2P, "send_tensors"): CPUP2P.send_tensors,
        (CPUP2P, "recv_tensors"): CPUP2P.recv_tensors,
        (PipelineEngine, "forward"): PipelineEngine.forward,
        (PipelineEngine, "backward"): PipelineEngine.backward,
        (WeightGradStore, "pop"): WeightGradStore.pop,  # zb1p's W step takes its micro-batch's products
    }

    def send_tensors(self: Any, tensors: list[Any], to_rank: int, *args: Any, **kwargs: Any) -> Any:
        if tensors[0].is_floating_point():
            record("send_act" if to_rank > me else "send_grad")
        return originals[(CPUP2P, "send_tensors")](self, tensors, to_rank, *args, **kwargs)

    def recv_tensors(self: Any, num_tensors: int, from_rank: int, *args: Any, **kwargs: Any) -> Any:
        result = originals[(CPUP2P, "recv_tensors")](self, num_tensors, from_rank, *args, **kwargs)
        if result[0].is_floating_point():
            record("recv_act" if from_rank < me else "recv_grad")
        return result

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = originals[(PipelineEngine, "forward")](self, *args, **kwargs)
        record("F")
        return result

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = originals[(PipelineEngine, "backward")](self, *args, **kwargs)
        record("B")
        return result

    def pop(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = originals[(WeightGradStore, "pop")](self, *args, **kwargs)
        record("W")
        return result

    wrappers = {
        (CPUP2P, "send_tensors"): send_tensors,
        (CPUP2P, "recv_tensors"): recv_tensors,
        (PipelineEngine, "forward"): forward,
        (PipelineEngine, "backward"): backward,
        (WeightGradStore, "pop"): pop,
    }
    torch.manual_seed(0)
    model = build_cpu_llama(tiny_config(), ctx, block_ranks=block_ranks)
    if freeze_stage0 and me == 0:
        for param in model.parameters():
            param.requires_grad_(False)
    optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
    for (cls, attr), wrapper in wrappers.items():
        setattr(cls, attr, wrapper)
    try:
        train_step(
            model, ctx, engine, micro_batches(model, ctx, 0), n_micro_batches, optimizer, grad_accumulator=grad_acc
        )
    finally:
        for (cls, attr), original in originals.items():
            setattr(cls, attr, original)
    return trace


def echo_env() -> dict[str, str]:
    """Spawn-helper self-test: report the torchrun-like environment."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    return {key: os.environ[key] for key in keys}


def fail_on_rank_one_else_hang() -> None:
    """Spawn-helper self-test: rank 1 raises, rank 0 blocks forever (like a peer stuck in a collective)."""
    import time

    if os.environ["RANK"] == "1":
        raise RuntimeError("boom on rank 1")
    while True:
        time.sleep(0.1)


def measure_memory(raw: dict[str, Any], block_ranks: list[int]) -> dict[str, Any]:
    """Train the planned split of the YAML dict ``raw`` for two steps; return this rank's measured memory."""
    from nanotron_ext.config import config_from_dict
    from nanotron_ext.runtime.memory_measure import measure_training_memory

    return measure_training_memory(config_from_dict(raw), block_ranks, steps=2)


def context_exit_seconds(fail_rank: int, hold_s: float) -> dict[str, Any]:
    """``with GlooParallelContext(...)`` on 2 ranks: rank 0 holds the block ``hold_s`` seconds, rank
    ``fail_rank`` (-1: none) raises inside it. Returns this rank's seconds from the block's end to after the
    ``with`` (its teardown), whether the error came out, and whether the default group is gone."""
    import time

    import torch.distributed as torch_dist

    from nanotron_ext.runtime import GlooParallelContext

    rank = int(os.environ["RANK"])
    raised = False
    end = time.monotonic()
    try:
        with GlooParallelContext(1, 2, 1, timeout_s=20):
            if rank == 0:
                time.sleep(hold_s)
            end = time.monotonic()
            if rank == fail_rank:
                raise KeyError("planned failure")
    except KeyError:
        raised = True
    return {"exit_s": time.monotonic() - end, "raised": raised, "initialized": torch_dist.is_initialized()}
