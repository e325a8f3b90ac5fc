"""Ranks of the zbv exactness tests (see ``test_zbv_engine.py``): the same model, data and weights trained by
Nanotron's 1F1B engine on a contiguous split and by our ZB-V engine on a V, in one world of real gloo processes.
The two place the blocks differently, so each step's gradients are gathered from every PP rank before comparing.

Kept free of pytest imports: each rank loads this file by path and calls one function.
"""

from __future__ import annotations

import os
from typing import Any

from tests.runtime import workers, zb_workers


def _gathered(run: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """The run's gradients of every step, from every PP rank of this rank's pipeline, in one dict per step."""
    import torch.distributed as torch_dist

    ctx = workers._context(case.get("tp", 1), case["pp"], case.get("dp", 1))
    parts: list[Any] = [None] * ctx.pp_pg.size()
    torch_dist.all_gather_object(parts, run["grads"], group=ctx.pp_pg)
    steps = [{k: v for part in per_step for k, v in part.items()} for per_step in zip(*parts)]
    for step in steps:  # one tensor under two names (tied ends on one rank): listed under both, as where apart
        for alias, name in case.get("aliases", {}).items():
            if alias not in step and name in step:
                step[alias] = step[name]
    return {**run, "grads": steps}


def compare_v(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case under 1F1B (on ``ref_ranks``) and zbv (on ``v_stages``): the worst gradient difference over the
    whole model, both engines' losses, how many products each W applied, and the V's order on this rank."""
    from nanotron_ext.zero_bubble.v_engine import ZeroBubbleVPipelineEngine

    try:
        out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
        for name, case in cases.items():
            ref = zb_workers._train("1f1b", {**case, "v_stages": None, "block_ranks": case["ref_ranks"]}, False)
            engine = ZeroBubbleVPipelineEngine(sends_wait=case.get("sends_wait", False))
            v = zb_workers._train(engine, case, False)
            out[name] = {
                **zb_workers._against(_gathered(ref, case), _gathered(v, case)),
                "trace": [str(op) for op in engine.trace],
            }
        return out
    finally:
        workers._destroy_contexts()


#: The tag of the receipt a waiting send expects back (activations and gradients use 1 and 2).
RECEIPT_TAG = 3


def run_orders(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One training step of each case's V at its ``n_micro`` under zbv: the ops this rank ran, in order, and the
    transfers it made (kind by tag, peer, bytes), each receive with what its peer sent. With ``sends_wait`` the
    engine holds its sends to their order, and each send waits until its receive is done, as Nanotron's does on a
    GPU (the receiver sends a receipt back)."""
    import torch
    from nanotron import distributed as dist

    from nanotron_ext.runtime import CPUP2P, build_cpu_llama, build_optimizer, train_step
    from nanotron_ext.zero_bubble.v_engine import ZeroBubbleVPipelineEngine

    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    send, recv = CPUP2P.send_tensors, CPUP2P.recv_tensors
    try:
        for name, case in cases.items():
            ctx = workers._context(1, case["pp"], 1)
            transfers: list[tuple[str, int, int, int]] = []
            wait = case.get("sends_wait", False)

            def sent(
                self: Any,
                tensors: list[Any],
                to_rank: int,
                tag: int = 0,
                transfers: list = transfers,
                wait: bool = wait,
            ) -> Any:
                transfers.append(("send", tag, to_rank, tensors[0].numel()))
                result = send(self, tensors, to_rank=to_rank, tag=tag)
                if wait:
                    recv(self, num_tensors=1, from_rank=to_rank, tag=RECEIPT_TAG)
                return result

            def received(
                self: Any,
                num_tensors: int,
                from_rank: int,
                tag: int = 0,
                transfers: list = transfers,
                wait: bool = wait,
            ) -> Any:
                result = recv(self, num_tensors=num_tensors, from_rank=from_rank, tag=tag)
                transfers.append(("recv", tag, from_rank, result[0].numel()))
                if wait:
                    send(self, [torch.ones(1)], to_rank=from_rank, tag=RECEIPT_TAG)
                return result

            torch.manual_seed(0)
            model = build_cpu_llama(workers.tiny_config(**case.get("config", {})), ctx, v_stages=case["v_stages"])
            optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
            engine = ZeroBubbleVPipelineEngine(sends_wait=wait)
            CPUP2P.send_tensors, CPUP2P.recv_tensors = sent, received
            try:
                train_step(
                    model,
                    ctx,
                    engine,
                    workers.micro_batches(model, ctx, 0),
                    case["n_micro"],
                    optimizer,
                    grad_accumulator=grad_acc,
                )
            finally:
                CPUP2P.send_tensors, CPUP2P.recv_tensors = send, recv
            out[name] = {
                "trace": [tuple(op) for op in engine.trace],
                "transfers": transfers,
                "pp_rank": dist.get_rank(ctx.pp_pg),
            }
        return out
    finally:
        workers._destroy_contexts()


def zbv_on_a_contiguous_split() -> str:
    """Train a step under zbv on a model built without a V; the error this rank raises."""
    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, train_step

    try:
        ctx = workers._context(1, 2, 1)
        model = build_cpu_llama(workers.tiny_config(), ctx, block_ranks=[0, 0, 1, 1, 1, 1, 1])
        optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-3)
        try:
            train_step(model, ctx, "zbv", workers.micro_batches(model, ctx, 0), 4, optimizer, grad_accumulator=grad_acc)
        except ValueError as exc:
            return str(exc)
        return "trained"
    finally:
        workers._destroy_contexts()
