"""The weight-gradient store alone, in one process (no process group): deferral, its order, the fallback warning.

The engine on real pipelines is tested in ``tests/runtime/test_zero_bubble.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanotron_ext.zero_bubble import (
    WeightGradStore,
    ZeroBubbleFallbackWarning,
    install_store,
    remove_store,
    store_of,
)
from nanotron_ext.zero_bubble.store import accumulate_weight_gradients


class _Opaque(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 2.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))


def _reference_grads(x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = _model()
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_b_defers_linear_weights_and_w_gives_1f1bs_gradients() -> None:
    x = torch.randn(4, 2, 6, requires_grad=True)
    model = _model()
    store = install_store(model)
    with store.backward_of(0):
        model(x).square().sum().backward()
    # B: the input gradient and the norm's weight gradient; no linear weight or bias gradient yet.
    assert x.grad is not None and model[1].weight.grad is not None
    assert model[0].weight.grad is None and model[0].bias.grad is None and model[2].weight.grad is None
    products = store.pop(0)
    assert [p.module for p in products] == ["2", "0"]  # backward order
    for product in products:
        for param, part in product.parts():
            torch.autograd.backward([param], [part()])
    for name, grad in _reference_grads(x.detach().requires_grad_()).items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-6, atol=1e-7)


def test_outside_a_b_step_the_same_linears_compute_both_gradients() -> None:
    x = torch.randn(3, 6)
    model = _model()
    install_store(model)
    model(x).square().sum().backward()
    assert store_of(model).pending() == []
    for name, grad in _reference_grads(x).items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-6, atol=1e-7)


def test_frozen_weights_defer_nothing() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    store = install_store(model)
    with store.backward_of(0):
        model(torch.randn(3, 6)).sum().backward()
    assert [(p.module, p.weight is None, p.bias is None) for p in store.pop(0)] == [("0", True, False)]


def test_w_steps_must_follow_b_order() -> None:
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="no backward's weight gradients are deferred"):
        store.pop(0)
    for j in (0, 1):
        with store.backward_of(j):
            pass
    with pytest.raises(RuntimeError, match="W of micro-batch 1, but the oldest deferred backward is micro-batch 0"):
        store.pop(1)
    assert store.pop(0) == [] and store.pending() == [1]
    with store.backward_of(2), pytest.raises(RuntimeError, match="already collecting a backward"):
        with store.backward_of(3):
            pass
    with pytest.raises(ValueError), store.backward_of(4):
        raise ValueError("a failed B queues nothing")
    assert store.pending() == [1, 2]


def test_an_unknown_linear_warns_once_naming_it_and_keeps_w_in_b() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Opaque(4, 4), _Opaque(4, 4))
    model[2].requires_grad_(False)  # frozen: nothing to warn about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = install_store(model)
        install_store(model)  # idempotent: no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, ZeroBubbleFallbackWarning)]
    assert len(messages) == 1 and "1 trainable linear(s)" in messages[0] and "1 (_Opaque)" in messages[0]
    with store.backward_of(0):
        model(torch.randn(2, 4)).sum().backward()
    assert model[1].weight.grad is not None  # its W ran in B
    assert [p.module for p in store.pop(0)] == ["0"]


def test_remove_store_restores_plain_linears() -> None:
    model = _model()
    install_store(model)
    assert "forward" in model[0].__dict__
    remove_store(model)
    assert store_of(model) is None and "forward" not in model[0].__dict__ and store_of(model[0]) is None


def test_a_weight_two_deferred_linears_share_gets_both_parts() -> None:
    # One parameter behind two linears of one micro-batch, both deferring (a tied embedding does not test this: its
    # embedding end defers nothing). W must add both products, as autograd's backward does.
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second)
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    expected = first.weight.grad.clone()
    first.weight.grad = first.bias.grad = None
    store = install_store(model)
    with store.backward_of(0):
        model(x).square().sum().backward()
    assert first.weight.grad is None
    products = store.pop(0)
    assert [p.weight is first.weight for p in products] == [True, True]
    accumulate_weight_gradients(products)
    torch.testing.assert_close(first.weight.grad, expected, rtol=1e-6, atol=0)


def test_a_backward_that_fails_leaves_nothing_deferred() -> None:
    # A step that fails inside a B: the next W must not find half of that backward's products.
    model = _model()
    store = install_store(model)
    with pytest.raises(ValueError, match="a failed backward"), store.backward_of(0):
        model(torch.randn(2, 6)).sum().backward()
        raise ValueError("a failed backward")
    assert store.pending() == [] and not store.deferring
    with store.backward_of(1):  # and the next B collects as usual
        model(torch.randn(2, 6)).sum().backward()
    assert store.pending() == [1] and [p.module for p in store.pop(1)] == ["2", "0"]
