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


@pytest.fixture(scope="session")
def plan_a(tmp_path_factory):
    """Plan A of ``test_resume.py``: pp=2 on E,t|t,L, six uninterrupted steps saving at 2, 4 and 6; trained once for
    every module that resumes from it (``test_resume.py``, ``test_zbv_launcher.py``, ``test_resume_files.py``).
    Returns (the run, its folder); its checkpoints are read, never written, by the tests."""
    from upstream.test_resume import LAYOUT_A, _train

    return _train(tmp_path_factory.mktemp("plan_a"), ext=LAYOUT_A)
