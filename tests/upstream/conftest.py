"""Fixtures of the tests against upstream Nanotron main (collected in the upstream pass only)."""

from __future__ import annotations

import os

import pytest
import torch
from nanotron.parallel import ParallelContext


@pytest.fixture(scope="module")
def parallel_context():
    """Upstream's own ParallelContext on a one-process gloo group (its set_device is the CUDA call it makes)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    original = ParallelContext.set_device
    ParallelContext.set_device = lambda self: None  # test-side stand-in: no GPU to select
    try:
        yield ParallelContext(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)
    finally:
        ParallelContext.set_device = original
        torch.distributed.destroy_process_group()
