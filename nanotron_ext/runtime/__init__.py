"""Runtime: training on CPU through Nanotron 0.2's real engines — gloo context, P2P, building the CPU Llama of
:mod:`nanotron_ext.models`, data, the training loop, step timing and measured memory.

Everything parallel is Nanotron's own code (PipelineBlock, P2P, pipeline engines, tensor-parallel layers,
optimizer builders); only the parallel context and the model's attention/norm kernels are replaced.
"""

from nanotron_ext.integration.adapter import assign_blocks, pipeline_blocks
from nanotron_ext.models.llama import CPULlamaForTraining
from nanotron_ext.models.vocab_chain import VocabShard
from nanotron_ext.runtime.context import GlooParallelContext
from nanotron_ext.runtime.cpu_model import (
    build_cpu_llama,
    cpu_llama,
    init_weights,
    mark_tied_parameters,
    nanotron_block_ranks,
    wrap_ddp,
)
from nanotron_ext.runtime.data import random_micro_batches, random_token_batches
from nanotron_ext.runtime.engine import (
    build_optimizer,
    make_engine,
    make_micro_batch,
    train_step,
    train_steps,
)
from nanotron_ext.runtime.p2p import CPUP2P, wait_pending_sends

__all__ = [
    "CPULlamaForTraining",
    "CPUP2P",
    "GlooParallelContext",
    "VocabShard",
    "assign_blocks",
    "build_cpu_llama",
    "build_optimizer",
    "cpu_llama",
    "init_weights",
    "make_engine",
    "make_micro_batch",
    "mark_tied_parameters",
    "nanotron_block_ranks",
    "pipeline_blocks",
    "random_micro_batches",
    "random_token_batches",
    "train_step",
    "train_steps",
    "wait_pending_sends",
    "wrap_ddp",
]
