"""zb1p's weight-gradient store: linears that compute their input gradient in B and leave the weight gradient for W.

Zero-bubble pipelining (Qi et al., ICLR 2024) splits a backward into B, the gradient with respect to the stage's
input (which the previous stage waits for), and W, the gradient with respect to the weights (which nobody waits
for), and runs W later. As in the paper's Megatron fork and DeepSeek's DualPipe, W is a queue of deferred
products filled inside each linear's backward and emptied by the schedule, not a split of the autograd graph
(``torch.distributed.pipelining``'s way, which fails on custom ``autograd.Function`` s such as Nanotron's
tensor-parallel linears).

:func:`install_store` attaches a :class:`WeightGradStore` to a model. Then, for every linear it knows:

* Nanotron's ``TensorParallelColumnLinear`` and ``TensorParallelRowLinear`` (either mode, any TP size, with or
  without ``async_communication``) run as Nanotron's synchronous path -- the differentiable TP collective of
  their mode around one :class:`DeferredLinear` -- so B does the input gradient and its collective;
* a plain ``torch.nn.Linear`` runs as one :class:`DeferredLinear`;
* a module whose class sets ``defers_weight_gradients = True`` (the vocabulary shards) calls :func:`linear`
  itself;

while the store is open for a backward (:meth:`WeightGradStore.backward_of`), their backward computes the input
gradient and pushes one :class:`WeightGradProduct` (the parameters, the input and the output gradient) instead of
the weight gradient. The engine's W step pops one micro-batch's products (:meth:`WeightGradStore.pop`). When the
store is not open (another engine, a plain ``loss.backward()``), the same backward computes both at once.

Everything else keeps its weight gradient in B: embeddings and norms have no split backward, and any other
``nn.Linear`` subclass (a custom forward the store cannot see into) runs unchanged: correct, with no W to
defer; :func:`install_store` names such modules once in a :class:`ZeroBubbleFallbackWarning`.
"""

from __future__ import annotations

import types
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "STORE_ATTR",
    "accumulate_weight_gradients",
    "DeferredLinear",
    "WeightGradProduct",
    "WeightGradStore",
    "ZeroBubbleFallbackWarning",
    "install_store",
    "linear",
    "remove_store",
    "store_of",
]

#: The attribute of a model (and of each linear it serves) that holds the store.
STORE_ATTR = "nanotron_ext_weight_grad_store"
_NAME_ATTR = "nanotron_ext_module_name"


class ZeroBubbleFallbackWarning(UserWarning):
    """A trainable linear the store does not know: its weight gradient is computed in B (correct, not deferred)."""


@dataclass
class WeightGradProduct:
    """One linear's deferred weight gradient for one micro-batch: ``grad_output^T @ input`` (and its bias's sum).

    Attributes:
        module: the linear's name in the model, for messages.
        weight: the weight, or None when it is frozen.
        bias: the bias, or None when absent or frozen.
        input: the linear's input as ``[tokens, in_features]`` (the all-gathered one under TP ``REDUCE_SCATTER``).
        grad_output: the gradient of its output as ``[tokens, out_features]``.
    """

    module: str
    weight: nn.Parameter | None
    bias: nn.Parameter | None
    input: torch.Tensor
    grad_output: torch.Tensor

    def weight_gradient(self) -> torch.Tensor:
        return self.grad_output.t().matmul(self.input)

    def bias_gradient(self) -> torch.Tensor:
        return self.grad_output.sum(dim=0)

    def parts(self) -> list[tuple[nn.Parameter, Callable[[], torch.Tensor]]]:
        """``(parameter, what computes its gradient for this micro-batch)`` for the weight and the bias that train."""
        out: list[tuple[nn.Parameter, Callable[[], torch.Tensor]]] = []
        if self.weight is not None:
            out.append((self.weight, self.weight_gradient))
        if self.bias is not None:
            out.append((self.bias, self.bias_gradient))
        return out


class WeightGradStore:
    """The deferred weight-gradient products of one model: one entry per backward, first in, first out."""

    def __init__(self) -> None:
        self._open: list[WeightGradProduct] | None = None
        self._queue: deque[tuple[int, list[WeightGradProduct]]] = deque()
        #: The modules that defer their weight gradient to this store (set by :func:`install_store`).
        self.modules: list[str] = []

    @property
    def deferring(self) -> bool:
        """True inside :meth:`backward_of`: linears push their weight gradients instead of computing them."""
        return self._open is not None

    @contextmanager
    def backward_of(self, micro_batch: int) -> Iterator[None]:
        """Collect what the backward of ``micro_batch`` run inside defers; queued when the block ends cleanly.

        Raises:
            RuntimeError: a backward is already being collected (B steps do not nest).
        """
        if self._open is not None:
            raise RuntimeError(
                f"the weight-gradient store is already collecting a backward when B of micro-batch {micro_batch} "
                f"starts; B steps run one at a time (a backward inside a linear's backward is not supported)"
            )
        self._open = []
        try:
            yield
            self._queue.append((micro_batch, self._open))
        finally:
            self._open = None

    def push(self, product: WeightGradProduct) -> None:
        """Defer one product (called from a linear's backward while :attr:`deferring`)."""
        if self._open is None:
            raise RuntimeError(
                f"{product.module}: a weight gradient was pushed outside a B step; "
                f"check WeightGradStore.deferring before pushing"
            )
        self._open.append(product)

    def pop(self, micro_batch: int) -> list[WeightGradProduct]:
        """The products of the oldest deferred backward, which must be ``micro_batch``'s.

        Raises:
            RuntimeError: nothing is deferred, or the oldest deferred backward is another micro-batch's (the
                engine's W steps must follow its B steps' order).
        """
        if not self._queue:
            raise RuntimeError(
                f"W of micro-batch {micro_batch}: no backward's weight gradients are deferred; a W "
                f"step must follow the B step of its micro-batch"
            )
        oldest, products = self._queue[0]
        if oldest != micro_batch:
            raise RuntimeError(
                f"W of micro-batch {micro_batch}, but the oldest deferred backward is micro-batch "
                f"{oldest}'s; W steps run in the order of their B steps (first in, first out)"
            )
        self._queue.popleft()
        return products

    def pending(self) -> list[int]:
        """The micro-batches whose weight gradients are still deferred, oldest first."""
        return [micro_batch for micro_batch, _ in self._queue]

    def clear(self) -> None:
        """Drop every deferred product (after a failed step, so the next one starts empty)."""
        self._queue.clear()
        self._open = None


class DeferredLinear(torch.autograd.Function):
    """``F.linear(input, weight, bias)`` whose backward defers the weight gradient while its store is open."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradStore,
        name: str,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.params, ctx.store, ctx.name = (weight, bias), store, name
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_input = grad_output.matmul(weight) if needs_input else None
        if not (needs_weight or needs_bias):
            return grad_input, None, None, None, None
        product = WeightGradProduct(
            module=ctx.name,
            weight=ctx.params[0] if needs_weight else None,
            bias=ctx.params[1] if needs_bias else None,
            input=input.reshape(-1, input.shape[-1]),
            grad_output=grad_output.reshape(-1, grad_output.shape[-1]),
        )
        if ctx.store.deferring:
            ctx.store.push(product)
            return grad_input, None, None, None, None
        return (
            grad_input,
            product.weight_gradient() if needs_weight else None,
            product.bias_gradient() if needs_bias else None,
            None,
            None,
        )


def accumulate_weight_gradients(
    products: list[WeightGradProduct], timed: Callable[[str], AbstractContextManager[None]] | None = None
) -> None:
    """One micro-batch's W: each parameter's deferred gradient accumulated through autograd, one parameter at a time
    (as autograd's backward accumulates them: one weight gradient alive at once). A parameter used twice in the
    micro-batch gets the sum of its parts in one accumulation, as in autograd.

    ``timed``: a clock's context per parameter, given the name of the linear that deferred it first (the in-run
    profile puts each W on its block: :mod:`nanotron_ext.integration.op_clock`); the arithmetic is the same with it."""
    groups: dict[int, tuple[nn.Parameter, str, list[Callable[[], torch.Tensor]]]] = {}
    for product in products:
        for param, part in product.parts():
            groups.setdefault(id(param), (param, product.module, []))[2].append(part)
    for param, module, parts in groups.values():
        with timed(module) if timed is not None else nullcontext():
            grad = parts[0]()
            for part in parts[1:]:
                grad = grad + part()
            torch.autograd.backward([param], [grad])
            del grad


def store_of(module: nn.Module) -> WeightGradStore | None:
    """The store attached to ``module`` (a model or one of its linears) by :func:`install_store`, if any."""
    return getattr(module, STORE_ATTR, None)


def linear(
    module: nn.Module, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``, with the weight gradient deferred when ``module`` has a store (see the module docstring).

    A module calling this from its ``forward`` declares ``defers_weight_gradients = True`` on its class.
    """
    store = store_of(module)
    if store is None:
        return F.linear(input, weight, bias)
    return DeferredLinear.apply(input, weight, bias, store, getattr(module, _NAME_ATTR, type(module).__name__))


def _plain_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(self, x, self.weight, self.bias)


def _column_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Nanotron's ``column_linear`` (any mode, async or not) as its synchronous path, with a deferred W."""
    from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
        differentiable_all_gather,
        differentiable_identity,
    )
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode

    if self.mode is TensorParallelLinearMode.ALL_REDUCE:
        x = differentiable_identity(x, group=self.pg)
    elif self.mode is TensorParallelLinearMode.REDUCE_SCATTER:
        x = differentiable_all_gather(x, group=self.pg)
    else:
        raise ValueError(
            f"{getattr(self, _NAME_ATTR, 'a column linear')}: tp mode {self.mode} is neither "
            f"ALL_REDUCE nor REDUCE_SCATTER; zb1p and zb2p know only Nanotron's two modes"
        )
    return linear(self, x, self.weight, self.bias)


def _row_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Nanotron's ``row_linear`` (any mode, async or not) as its synchronous path, with a deferred W."""
    from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import (
        differentiable_all_reduce_sum,
        differentiable_reduce_scatter_sum,
    )
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode

    out = linear(self, x, self.weight, self.bias)
    if self.mode is TensorParallelLinearMode.ALL_REDUCE:
        return differentiable_all_reduce_sum(out, group=self.pg)
    if self.mode is TensorParallelLinearMode.REDUCE_SCATTER:
        return differentiable_reduce_scatter_sum(out, group=self.pg)
    raise ValueError(
        f"{getattr(self, _NAME_ATTR, 'a row linear')}: tp mode {self.mode} is neither ALL_REDUCE "
        f"nor REDUCE_SCATTER; zb1p and zb2p know only Nanotron's two modes"
    )


_FORWARDS = (_plain_linear_forward, _column_forward, _row_forward)


def _forward_for(module: nn.Module) -> Callable[..., torch.Tensor] | None | bool:
    """The deferred forward for a linear the store knows; True for a module that defers by itself; False for a
    linear it does not know; None for anything else (no split backward: its W stays in B)."""
    from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear, TensorParallelRowLinear

    cls = type(module)
    if getattr(cls, "defers_weight_gradients", False):
        return True
    if isinstance(module, TensorParallelColumnLinear) and cls.forward is TensorParallelColumnLinear.forward:
        return _column_forward
    if isinstance(module, TensorParallelRowLinear) and cls.forward is TensorParallelRowLinear.forward:
        return _row_forward
    if isinstance(module, nn.Linear):
        return _plain_linear_forward if cls.forward is nn.Linear.forward else False
    return None


def install_store(model: nn.Module, store: WeightGradStore | None = None) -> WeightGradStore:
    """Attach a store to ``model`` (a DDP wrapper's module) and make the linears it knows defer their W to it.

    Idempotent: a model that has a store keeps it. Trainable ``nn.Linear`` subclasses with their own ``forward``
    keep their weight gradient in B; they are named once in a :class:`ZeroBubbleFallbackWarning`.

    Returns:
        The model's store.
    """
    model = getattr(model, "module", model)
    existing = store_of(model)
    if existing is not None:
        return existing
    store = store if store is not None else WeightGradStore()
    unknown = []
    for name, module in model.named_modules():
        forward = _forward_for(module)
        if forward is False:
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                unknown.append(f"{name} ({type(module).__name__})")
            continue
        if forward is None:
            continue
        setattr(module, STORE_ATTR, store)
        setattr(module, _NAME_ATTR, name)
        store.modules.append(name)
        if forward is not True:
            module.forward = types.MethodType(forward, module)
    setattr(model, STORE_ATTR, store)
    if unknown:
        warnings.warn(
            f"pp_engine zb1p/zb2p: {len(unknown)} trainable linear(s) with a forward the weight-gradient store does "
            f"not know compute their weight gradient in B (correct, but that W fills no bubble): {', '.join(unknown)}. "
            f"To defer it, call nanotron_ext.zero_bubble.linear(self, x, weight, bias) in its forward and set "
            f"defers_weight_gradients = True on its class",
            ZeroBubbleFallbackWarning,
            stacklevel=2,
        )
    return store


def remove_store(model: nn.Module) -> None:
    """Undo :func:`install_store`: every linear computes its weight gradient in B again."""
    model = getattr(model, "module", model)
    for module in model.modules():
        if STORE_ATTR in module.__dict__:
            del module.__dict__[STORE_ATTR]
        module.__dict__.pop(_NAME_ATTR, None)
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ in _FORWARDS:
            del module.__dict__["forward"]
