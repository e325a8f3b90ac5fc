"""The runtime's two send orders (``nanotron_ext.runtime.send_order``) on Nanotron's engines over gloo, 2 real
processes, on the K=2 vocabulary chain at pp=2 (4 tensors cross the cut, 3 gradients come back): ``eager`` posts
each micro-batch's tensors of a cut together and changes nothing else (the same messages, loss and gradients)."""

from __future__ import annotations

import re

import nanotron.parallel.pipeline_parallel.engine as nanotron_engine
import pytest
import torch
from nanotron.parallel.pipeline_parallel.state import PipelineTrainBatchState

from nanotron_ext.runtime.send_order import EagerSendState, send_order, state_type

from . import vocab_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

#: Tensors PP0 sends per micro-batch (hidden states and the three softmax statistics), and PP1 sends back.
ACTIVATIONS, GRADIENTS = 4, 3


@pytest.fixture(scope="module", params=["1f1b", "zb1p"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    out = run_distributed(vocab_workers.send_orders, 2, args=(request.param,), timeout=120)
    return [{**rank, "engine": request.param} for rank in out]


def _send_runs(calls: str) -> list[int]:
    return [len(run) for run in re.findall("s+", calls)]


def test_same_messages_loss_and_gradients(runs: list[dict]) -> None:
    for rank in runs:
        nanotron, eager = rank["nanotron"], rank["eager"]
        assert sorted(nanotron["calls"]) == sorted(eager["calls"])  # the same tensors, only reordered
        assert nanotron["losses"] == eager["losses"]
        assert sorted(nanotron["grads"]) == sorted(eager["grads"]) and nanotron["grads"]
        for name, grad in nanotron["grads"].items():
            assert torch.equal(grad, eager["grads"][name]), name


@pytest.mark.parametrize(("rank", "per_micro_batch"), [(0, ACTIVATIONS), (1, GRADIENTS)])
def test_eager_posts_a_cut_together(runs: list[dict], rank: int, per_micro_batch: int) -> None:
    eager = _send_runs(runs[rank]["eager"]["calls"])
    assert eager and all(n % per_micro_batch == 0 for n in eager), runs[rank]["eager"]["calls"]
    # Under 1F1B Nanotron's own order splits them (one send per communication call), which is what eager changes;
    # zb1p's engine already flushes PP0's queue after each compute step.
    nanotron = _send_runs(runs[rank]["nanotron"]["calls"])
    if runs[rank]["engine"] == "1f1b":
        assert any(n % per_micro_batch for n in nanotron), runs[rank]["nanotron"]["calls"]


def test_the_state_class_is_swapped_only_inside() -> None:
    original = nanotron_engine.PipelineTrainBatchState
    with send_order("eager") as cls:
        assert cls is EagerSendState and nanotron_engine.PipelineTrainBatchState is EagerSendState
    assert nanotron_engine.PipelineTrainBatchState is original is PipelineTrainBatchState
    with pytest.raises(RuntimeError, match="boom"), send_order("eager"):
        raise RuntimeError("boom")
    assert nanotron_engine.PipelineTrainBatchState is original
    assert state_type("nanotron") is PipelineTrainBatchState


def test_unknown_order_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"send_order 'fast' is unknown; use one of \['eager', 'nanotron'\]"):
        state_type("fast")  # type: ignore[arg-type]
