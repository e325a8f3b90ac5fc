"""The pipeline's worst moment on one stage: the micro-batch being computed, followed block by block through its
forward and its backward, next to the other micro-batches in flight, the gradients alive then and the block's
temporaries (:func:`pipeline_moment`; :mod:`nanotron_ext.costs.memory_estimate` adds the static terms).

Gradients exist during forwards once a backward has run (1F1B's steady state). Before that (AFAB, or all forwards
first) the first backward makes them block by block from the last, each in place of ``.grad``. A recomputed decoder
layer (``parallelism.recompute_layer``) holds what it recomputes at the start of its backward, before any of its own
gradients exist, and its gradients at the end, after those tensors are freed: two moments, never both at once.
Measured on upstream's Llama (``benchmarks/gpu_path_memory.py --device cpu --quick``, vocabulary 8192): counting
the layer's own gradients at its start over-counted the peak by one layer's gradients (1.167x, docs/memory.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nanotron_ext.blocks import BlockInfo, held_parameters, tied_copy
from nanotron_ext.config import MemoryRuntime, ModelShape, RunShape
from nanotron_ext.costs.analytic import ParamBytes, param_bytes
from nanotron_ext.costs.block_memory import BlockMemory, block_memory, largest_param, weight_pending
from nanotron_ext.schedule import ONE_F_ONE_B_FAMILY, ZERO_BUBBLE

__all__ = ["PerBlock", "StageParameters", "per_block", "pipeline_moment", "stage_parameters"]


class PerBlock(NamedTuple):
    """What a stage's estimate reads of each of its blocks: what it saves and holds, its largest trainable tensor
    (elements), what one deferred W keeps (0 outside zb1p and zb2p), and what its backward recomputes and holds
    before its first gradient (bytes; 0 unless it is a recomputed decoder layer)."""

    memory: list[BlockMemory]
    largest: list[int]
    pending: list[float]
    recomputed: list[float]

    def part(self, s: int, e: int) -> PerBlock:
        """The blocks ``[s, e)``."""
        return PerBlock(*(column[s:e] for column in self))


def per_block(blocks: Sequence[BlockInfo], m: ModelShape, run: RunShape, runtime: MemoryRuntime) -> PerBlock:
    """:class:`PerBlock` of ``blocks`` under ``run``."""
    zero_bubble = run.engine in ZERO_BUBBLE
    memory = [block_memory(b, m, run, runtime) for b in blocks]
    recomputed = [0.0] * len(blocks)
    if run.recompute_layer:
        # What recomputation adds to a block's backward (block_memory's rule; 0 for blocks it does not recompute).
        plain = dataclasses.replace(run, recompute_layer=False)
        recomputed = [
            x.backward_temp - block_memory(b, m, plain, runtime).backward_temp for b, x in zip(blocks, memory)
        ]
    return PerBlock(
        memory,
        [largest_param(b, m, run) for b in blocks],
        [weight_pending(b, m, run) if zero_bubble else 0.0 for b in blocks],
        recomputed,
    )


@dataclass(frozen=True)
class StageParameters:
    """The static terms of a stage, per block where the moments need them.

    Attributes:
        params: parameters held on the rank (a tied weight held twice counted once).
        trainable: trainable parameters per block (a tied ``lm_head`` counts 0: the embedding holds the tensor).
        grads: ``.grad`` bytes per block, alive once a backward has made them.
        allocated: gradient bytes allocated before training and kept (fp32 accumulation, DDP buckets).
    """

    params: int
    trainable: list[int]
    grads: list[float]
    allocated: float


def stage_parameters(blocks: Sequence[BlockInfo], m: ModelShape, per: ParamBytes) -> StageParameters:
    """Parameters, trainable counts and gradient bytes of the stage's blocks (see :class:`StageParameters`)."""
    params = held_parameters(blocks, m.tie_word_embeddings)[0]
    trainable = [b.trainable for b in blocks]
    copy = tied_copy(blocks, m.tie_word_embeddings)
    if copy is not None:  # one tensor on this rank: its gradient and state belong to the embedding
        trainable[copy] = 0
    # Buffers made before training (fp32 accumulation, DDP buckets) are alive throughout; .grad only once a
    # backward has made it.
    allocated = sum(trainable) * per.gradients_allocated
    grads = [x * (per.gradients - per.gradients_allocated) for x in trainable]
    return StageParameters(params=params, trainable=trainable, grads=grads, allocated=allocated)


def pipeline_moment(
    per: PerBlock,
    run: RunShape,
    stage: int,
    pp: int,
    n: int,
    held: StageParameters,
    retain_sends: bool,
) -> tuple[float, tuple[float, float, float]]:
    """One micro-batch's activations, and the (activations, gradients, temporaries) alive at the pipeline's
    worst moment (zeros for an empty stage), with ``n`` micro-batches in flight."""
    mems = per.memory
    if not mems:
        return 0.0, (0.0, 0.0, 0.0)
    held_in = 0.0 if mems[0].input_saved else mems[0].input
    held_out = mems[-1].output
    activations = held_in + sum(x.saved for x in mems) + held_out
    sent = 0.0
    if retain_sends:
        # CPUP2P keeps every sent tensor until the step ends: outputs beyond those still held, and the
        # gradients sent back for the stage's input.
        sent = (run.n_micro_batches - n) * held_out * (stage < pp - 1) + run.n_micro_batches * mems[0].input * (
            stage > 0
        )
    worst = max(_candidates(per, run, n, held, held_in, held_out, activations), key=sum)
    return activations, (worst[0], worst[1] + held.allocated, worst[2] + sent)


def _candidates(
    per: PerBlock,
    run: RunShape,
    n: int,
    held: StageParameters,
    held_in: float,
    held_out: float,
    activations: float,
) -> list[tuple[float, float, float]]:
    """Every moment of the micro-batch being computed, block by block, forward then backward, as (activations,
    gradients, temporaries); the worst is the stage's pipeline peak."""
    trainable, grads = held.trainable, held.grads
    weight_bytes = param_bytes(run).weights
    # 1F1B with more micro-batches than it holds runs a backward before its next forward: from then on every
    # gradient exists during forwards too. Otherwise (AFAB, or all forwards first) the first backward makes
    # them block by block from the last, each in place (no fresh copy to add), while every micro-batch is held.
    grads_early = run.engine in ONE_F_ONE_B_FAMILY and run.n_micro_batches > n  # zb1p: counted as 1F1B (more)
    g_all = sum(grads)
    saved_so_far = held_in
    # zb1p: during a micro-batch's B, the products of every block already back-propagated (and the one in
    # progress) wait in the store for its W, besides the deferred W's of earlier micro-batches.
    pending = per.pending
    candidates = []
    for i, (x, largest) in enumerate(zip(per.memory, per.largest)):
        saved_so_far += x.saved
        current = sum(pending[i:])
        own_input = x.input if i > 0 and not x.input_saved else 0.0
        others = (n - 1) * activations
        fresh = largest * weight_bytes if trainable[i] else 0.0
        candidates.append((others + saved_so_far, g_all if grads_early else 0.0, own_input + x.forward_temp + x.output))
        backward = others + saved_so_far + held_out + current
        if grads_early:
            candidates.append((backward, g_all, x.output + x.backward_temp))
            continue
        # The first backward: the block's gradient is made in place of .grad (no fresh copy).
        made = sum(grads[i:])
        temporaries = x.output + x.backward_temp - fresh
        if per.recomputed[i]:
            # Its start holds what it recomputed and none of its own gradients; its end, the reverse.
            candidates.append((backward, made - grads[i], temporaries))
            candidates.append((backward, made, temporaries - per.recomputed[i]))
        else:
            candidates.append((backward, made, temporaries))
        if n >= 2:  # a later backward: every gradient exists, one micro-batch fewer held
            candidates.append(
                ((n - 2) * activations + saved_so_far + held_out + current, g_all, x.output + x.backward_temp)
            )
    return candidates
