"""Ranks of the vocabulary-shard chain tests (see ``test_vocab_chain.py``): the chain on Nanotron's engine against
the unsplit model, in one world of real processes over gloo.

Kept free of pytest imports: each rank loads this file by path and calls one function.
"""

from __future__ import annotations

from typing import Any

from tests.runtime import workers

SEQ_LEN, MICRO_BATCH, N_MICRO = 16, 2, 4
VOCAB = 1009  # prime: every K > 1 splits it unevenly


def _batches(model, ctx, seed: int, masked: bool, n: int):
    """``n`` micro-batches whose labels cover the whole vocabulary (so every shard holds some), with about a
    third of the labels masked out when ``masked``."""
    import torch

    from nanotron_ext.blocks import vocab_slices
    from nanotron_ext.runtime import make_micro_batch, random_token_batches

    # Every shard's first and last row, for K = 2, 3, 4: a label on a slice boundary must count in one shard.
    edges = sorted({x for k in (2, 3, 4) for lo, hi in vocab_slices(VOCAB, k) for x in (lo, hi - 1)})
    stream = random_token_batches(VOCAB, MICRO_BATCH, SEQ_LEN, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # the masks' own stream
    out = []
    for i in range(n):
        tokens = next(stream)
        if i == 0:
            tokens[1, 1 : 1 + len(edges)] = torch.tensor(edges)
        mask = torch.rand(MICRO_BATCH, SEQ_LEN, generator=gen) > (0.35 if masked else -1.0)
        mask[0, 0] = True
        if i == 0:
            mask[1, : len(edges)] = True
        out.append(make_micro_batch(model, ctx, input_ids=tokens[:, :-1], label_ids=tokens[:, 1:], label_mask=mask))
    return out


def _run(
    pp: int,
    dp: int,
    shards: int,
    ranks: list[int] | None,
    *,
    scale: float,
    masked: bool,
    steps: int,
    engine: str,
    seed: int = 7,
    sends: str = "nanotron",
) -> tuple[list[float], dict[str, Any]]:
    """Build, optionally scale the lm_head rows, train ``steps`` steps (0: one forward/backward, no update) and
    return (losses, every parameter's gradient under the unsplit model's names, gathered from all ranks)."""
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, train_step

    ctx = workers._context(1, pp, dp)
    torch.manual_seed(seed)
    config = workers.tiny_config(vocab_size=VOCAB, max_position_embeddings=64)
    model = build_cpu_llama(config, ctx, block_ranks=ranks, vocab_shards=shards, ddp=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lm_head" in name or "vocab_shards" in name:
                p.mul_(scale)
    optimizer = build_optimizer(model, ctx, learning_rate=1e-2)[0] if steps else None
    batches = _batches(model, ctx, seed, masked, N_MICRO * max(1, steps))
    losses = [
        train_step(model, ctx, engine, batches[i * N_MICRO : (i + 1) * N_MICRO], N_MICRO, optimizer, sends=sends)
        for i in range(max(1, steps))
    ]
    local = {}
    shard_grads = {}
    if steps:  # the optimizer has consumed the gradients; the losses are the result
        return losses, {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise AssertionError(f"pp={pp} K={shards} ranks={ranks}: {name} has no gradient; losses {losses}")
        if ".vocab_shards." in name:
            shard_grads[int(name.split(".vocab_shards.")[1].split(".")[0])] = p.grad.detach().clone()
        else:
            local[name] = p.grad.detach().clone()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, shard_grads))
    grads: dict[str, Any] = {}
    shards_all: dict[int, Any] = {}
    for named, by_shard in gathered:
        grads.update(named)
        shards_all.update(by_shard)
    if shards_all:
        grads["model.lm_head.pp_block.weight"] = torch.cat([shards_all[i] for i in sorted(shards_all)])
    return losses, grads


def chain_vs_unsplit(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case: the chain's losses and gradients, and the unsplit pp=1 model's on the same weights and data;
    returns, per case, the worst relative differences (rank 0 only, None elsewhere)."""
    import os

    import torch
    from nanotron import distributed as dist

    try:
        world = int(os.environ["WORLD_SIZE"])
        out: dict[str, Any] = {}
        for name, case in cases.items():
            common = {k: case[k] for k in ("scale", "masked", "steps", "engine")}
            losses, grads = _run(case["pp"], world // case["pp"], case["shards"], case["ranks"], **common)
            ref_losses, ref_grads = _run(1, world, 1, None, **common)
            assert sorted(grads) == sorted(ref_grads), (sorted(grads), sorted(ref_grads))
            grad_rel = {
                k: float((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-30)) for k in ref_grads
            }
            out[name] = {
                "losses": losses,
                "ref_losses": ref_losses,
                "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "grad_rel": grad_rel,
                "finite": all(torch.isfinite(torch.tensor(losses)))
                and all(bool(torch.isfinite(g).all()) for g in grads.values()),
            }
        return out if dist.get_rank() == 0 else {}
    finally:
        workers._destroy_contexts()


def send_orders(engine: str) -> dict[str, Any]:
    """The K=2 chain at pp=2 (4 tensors cross the cut, 3 gradients come back) under both send orders: each
    order's loss, every gradient, and the sequence of this rank's P2P calls ("s" per tensor sent, "r" per tensor
    received)."""
    from nanotron_ext.runtime import CPUP2P

    log: list[str] = []
    send, recv = CPUP2P.send_tensors, CPUP2P.recv_tensors

    def logged_send(self: Any, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
        log.extend("s" * len(tensors))
        return send(self, tensors, *args, **kwargs)

    def logged_recv(self: Any, num_tensors: int, *args: Any, **kwargs: Any) -> Any:
        log.extend("r" * num_tensors)
        return recv(self, num_tensors, *args, **kwargs)

    CPUP2P.send_tensors, CPUP2P.recv_tensors = logged_send, logged_recv  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        for order in ("nanotron", "eager"):
            log.clear()
            losses, grads = _run(
                2, 1, 2, [0, 0, 0, 0, 0, 1], scale=1.0, masked=True, steps=0, engine=engine, sends=order
            )
            out[order] = {"losses": losses, "grads": grads, "calls": "".join(log)}
        return out
    finally:
        CPUP2P.send_tensors, CPUP2P.recv_tensors = send, recv  # type: ignore[method-assign]
        workers._destroy_contexts()
