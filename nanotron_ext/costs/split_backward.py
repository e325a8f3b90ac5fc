"""A block's W as zb1p and zb2p run it, measured: its backward with the weight gradients deferred
(:mod:`nanotron_ext.zero_bubble.store`), then the deferred pass alone.

Without it the simulator splits a measured backward by FLOPs (input gradient : weight gradient), which the engine
contradicted on the SmolLM-135M shape: the lm_head's W ran 7-9 % over that price and the decoders' B 1-7 % over
theirs, in their fastest steps (``benchmarks/zb_measured_cpu.py``, issue 31, 2026-11-26). Measured standalone, the
W is 45-46 % of a decoder's backward and 52-53 % of the lm_head's there (two calibrations), where FLOPs say 48 % and
50 %. Timed in every other round (:class:`nanotron_ext.costs.profiled._Run`), it makes the blocks of that shape
take 37 s to calibrate instead of 31.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from nanotron_ext.blocks import DEFERS_WEIGHT_GRADIENT, BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.block_inputs import _make_inputs, _outputs_needing_backward, _sync, flush_caches

__all__ = ["splits", "time_weight_pass"]


def splits(block: BlockInfo, module: Any) -> bool:
    """Whether zero-bubble defers part of ``block``'s backward: a role whose linears defer their weight gradient
    (:data:`~nanotron_ext.blocks.DEFERS_WEIGHT_GRADIENT`), built as a module with a parameter that trains."""
    import torch

    return (
        block.role in DEFERS_WEIGHT_GRADIENT
        and isinstance(module, torch.nn.Module)
        and any(p.requires_grad for p in module.parameters())
    )


def time_weight_pass(
    block: BlockInfo,
    module: Any,
    cfg: PlannerConfig,
    device: Any,
    input_grad: bool,
    gen: Any,
    clock: Callable[[], float],
) -> float:
    """Seconds of ``block``'s W for one micro-batch: a forward, its backward with the weight gradients deferred,
    then (cold caches, as in a pipeline, where other work ran since) the deferred pass alone, timed. 0 without
    running anything when no linear of the module can defer (the engine then keeps the whole backward in B). The
    gradients accumulate as the whole backward's do; the module is left as it was built."""
    import torch

    from nanotron_ext.zero_bubble.store import (
        ZeroBubbleFallbackWarning,
        accumulate_weight_gradients,
        install_store,
        remove_store,
    )

    with warnings.catch_warnings():  # a linear the store cannot defer keeps its W in B, here as in the engine
        warnings.simplefilter("ignore", ZeroBubbleFallbackWarning)
        store = install_store(module)
    try:
        if not store.modules:
            return 0.0
        inputs = _make_inputs(block.role, cfg, getattr(torch, cfg.run.dtype), device, input_grad, gen)
        out = module(**inputs)
        tensors = _outputs_needing_backward(out)
        grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in tensors]
        with store.backward_of(0):
            torch.autograd.backward(tensors, grads)
        del out, tensors, grads, inputs
        products = store.pop(0)
        flush_caches(device)
        _sync(device)
        t0 = clock()
        accumulate_weight_gradients(products)
        _sync(device)
        return clock() - t0
    finally:
        store.clear()
        remove_store(module)
