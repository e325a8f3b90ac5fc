"""Ranks of the zb1p and zb2p exactness tests (see ``test_zero_bubble.py``): the same model, data and weights
trained by Nanotron's 1F1B engine and by each of our zero-bubble engines, in one world of real processes over gloo.

Kept free of pytest imports: each rank loads this file by path and calls one function.
"""

from __future__ import annotations

import os
from typing import Any

from tests.runtime import workers

N_MICRO = 4
ZERO_BUBBLE_ENGINES = ("zb1p", "zb2p")


class _GradRecorder:
    """Stands where the optimizer goes in ``train_step``: copies every gradient the optimizer would see (after
    the pipeline, the dp and tied-weight syncs), then lets the real optimizer (if any) step."""

    def __init__(self, optimizer: Any, model: Any) -> None:
        self.optimizer, self.model, self.steps = optimizer, getattr(model, "module", model), []

    def step(self) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        if self.optimizer is not None:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            for p in self.model.parameters():
                p.grad = None


def _freeze(spec: str | None):
    if spec is None:
        return None
    return lambda name, param: any(part in name for part in spec.split(","))


def _parallel_config(tp_mode: str | None, tp_async: bool):
    if tp_mode is None:
        return None
    from nanotron.config import ParallelismArgs
    from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode

    return ParallelismArgs(
        dp=1,
        pp=1,
        tp=1,
        pp_engine="1f1b",
        tp_mode=TensorParallelLinearMode[tp_mode],
        tp_linear_async_communication=tp_async,
    )


def _train(engine: str, case: dict[str, Any], opaque: bool) -> dict[str, Any]:
    """Build the case's model, train ``steps`` steps under ``engine``; the losses, the gradients of every step,
    the products each W step applied, and the fallback warnings."""
    import warnings

    import torch
    from nanotron import distributed as dist

    from nanotron_ext.runtime import build_cpu_llama, build_optimizer, train_step
    from nanotron_ext.zero_bubble import WeightGradStore, ZeroBubbleFallbackWarning

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Nanotron asserts it for its async TP linears
    tp, pp, dp = case.get("tp", 1), case.get("pp", 1), case.get("dp", 1)
    ctx = workers._context(tp, pp, dp)
    torch.manual_seed(case.get("seed", 3))
    model = build_cpu_llama(
        workers.tiny_config(**case.get("config", {})),
        ctx,
        block_ranks=case.get("block_ranks"),
        v_stages=case.get("v_stages"),
        parallel_config=_parallel_config(case.get("tp_mode"), case.get("tp_async", False)),
        projector=opaque,
        freeze=_freeze(case.get("freeze")),
        vocab_shards=case.get("vocab_shards", 1),
        recompute_layer=case.get("recompute", False),
    )
    if opaque:
        _make_projector_opaque(model)
    optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-2)
    recorder = _GradRecorder(optimizer, model)
    if case.get("after_failed_step") and str(engine) in (*ZERO_BUBBLE_ENGINES, "zbv"):
        _leave_a_failed_steps_w(model)
    popped: list[int] = []
    pop = WeightGradStore.pop
    WeightGradStore.pop = lambda self, j: (lambda out: (popped.append(len(out)), out)[1])(pop(self, j))
    # Each dp replica its own data, so that a missing dp gradient sync shows.
    stream = workers.micro_batches(model, ctx, case.get("seed", 3) + 1000 * dist.get_rank(ctx.dp_pg))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [
                train_step(
                    model, ctx, engine, stream, case.get("n_micro", N_MICRO), recorder, grad_accumulator=grad_acc
                )
                for _ in range(case.get("steps", 2))
            ]
    finally:
        WeightGradStore.pop = pop
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, ZeroBubbleFallbackWarning)]
    tied = sorted(n for n, p in model.named_parameters() if getattr(p, "is_tied", False))
    return {"losses": losses, "grads": recorder.steps, "popped": popped, "fallbacks": fallbacks, "tied": tied}


def _leave_a_failed_steps_w(model: Any) -> None:
    """What a step that failed between micro-batch 0's B and its W leaves in the store: that backward's products,
    still deferred. Here one product of ones on the first deferring linear's weight; if the next step popped it, that
    weight's gradient would be off by the product's gradient (or the step would fail on the store's order)."""
    import torch

    from nanotron_ext.zero_bubble import WeightGradProduct, install_store, store_of

    store = install_store(model)  # the engine keeps the model's store (one per model)
    linear = next(
        m
        for m in getattr(model, "module", model).modules()
        if store_of(m) is store and getattr(m, "weight", None) is not None and m.weight.requires_grad
    )
    out_features, in_features = linear.weight.shape
    with store.backward_of(0):
        store.push(
            WeightGradProduct(
                "failed step", linear.weight, None, torch.ones(3, in_features), torch.ones(3, out_features)
            )
        )
    assert store.pending() == [0]


def _make_projector_opaque(model: Any) -> None:
    """The projector's ``nn.Linear`` becomes a subclass with its own forward: a linear the store does not know."""
    import torch.nn.functional as F
    from torch import nn

    class OpaqueLinear(nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN202 (a stand-in for any user linear)
            return F.linear(x, self.weight, self.bias)

    for module in getattr(model, "module", model).modules():
        if type(module) is nn.Linear:
            module.__class__ = OpaqueLinear


def _compare(case: dict[str, Any]) -> dict[str, Any]:
    """Each zero-bubble engine (zb1p, zb2p) against 1F1B on the case; ``case["ref"]`` overrides keys for the 1F1B
    run only."""
    opaque = case.get("opaque", False)
    ref = _train("1f1b", {**case, **case.get("ref", {})}, opaque)
    return {engine: _against(ref, _train(engine, case, opaque)) for engine in ZERO_BUBBLE_ENGINES}


def _against(ref: dict[str, Any], zb: dict[str, Any]) -> dict[str, Any]:
    """One zero-bubble run against the 1F1B run: the worst gradient difference, and what both recorded."""
    worst = 0.0
    names = []
    for ref_step, zb_step in zip(ref["grads"], zb["grads"]):
        names.append(sorted(ref_step))
        if sorted(ref_step) != sorted(zb_step):
            return {"error": f"gradients of {sorted(set(ref_step) ^ set(zb_step))} exist under one engine only"}
        for name, g in ref_step.items():
            scale = float(g.abs().max()) or 1.0
            worst = max(worst, float((zb_step[name] - g).abs().max()) / scale)
    return {
        "losses": ref["losses"],
        "zb_losses": zb["losses"],
        "grad_rel": worst,
        "names": names,
        "steps": len(zb["grads"]),
        "popped": zb["popped"],
        "fallbacks": zb["fallbacks"],
        "ref_fallbacks": ref["fallbacks"],
        "tied": zb["tied"],
    }


def compare_engines(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case under 1F1B, zb1p and zb2p on this rank (keyed by engine): the worst gradient difference (relative to
    each gradient's largest entry), both engines' losses, how many products each W applied, the warnings."""
    try:
        return {"rank": int(os.environ["RANK"]), **{name: _compare(case) for name, case in cases.items()}}
    finally:
        workers._destroy_contexts()
