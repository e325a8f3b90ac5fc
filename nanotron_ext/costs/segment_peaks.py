"""Many segments' peaks at once: :class:`~nanotron_ext.costs.memory_estimate.SegmentMemory`'s estimate of the
segments ``[s, e)`` of one stage in a few array operations, for the split searches that check every segment
against a memory cap (tens of thousands of segments, about 25 µs each one by one).

The rule is :mod:`~nanotron_ext.costs.pipeline_moment`'s and :mod:`~nanotron_ext.costs.memory_estimate`'s, regrouped:
each moment of block ``i`` inside ``[s, e)`` is a term of the segment (``X(s, e)``: the other micro-batches, the
stage's held input and output, prefix sums) plus a term of the block (``Y(i)``), so a kind of moment's worst over the
segment is ``X(s, e) + max Y`` over ``s <= i < e``: a range maximum, one lookup in a sparse table. A segment that
holds an embedding and the lm_head tied to it (one tensor: the copy's terms change) is estimated one by one.
``tests/test_search_speedups.py`` holds the two equal for every segment of the bundled models, under every engine,
runtime, recomputation and ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import RunShape
from nanotron_ext.costs.analytic import param_bytes
from nanotron_ext.costs.pipeline_moment import PerBlock
from nanotron_ext.costs.prefix_sums import prefix_sums
from nanotron_ext.schedule import ONE_F_ONE_B_FAMILY, ZERO_BUBBLE

__all__ = ["SegmentPeaks"]


class _RangeMax:
    """``max(v[s:e])`` for many ``s < e`` at once (``-inf`` where ``s >= e``): a sparse table of maxima over
    power-of-two windows."""

    def __init__(self, v: np.ndarray) -> None:
        n = len(v)
        levels = [np.asarray(v, dtype=np.float64)]
        width = 1
        while 2 * width <= n:
            row = levels[-1]
            levels.append(np.maximum(row[:-width], row[width:]))
            width *= 2
        self._table = np.full((len(levels), max(n, 1)), -np.inf)
        for j, row in enumerate(levels):
            self._table[j, : len(row)] = row

    def __call__(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        length = e - s
        some = length > 0
        j = np.zeros_like(length)
        j[some] = np.floor(np.log2(length[some])).astype(length.dtype)
        last = np.where(some, e - (1 << j), 0)
        first = np.where(some, s, 0)
        return np.where(some, np.maximum(self._table[j, first], self._table[j, last]), -np.inf)


class SegmentPeaks:
    """The estimated peak (bytes, overhead included) of many segments ``[s, e)`` of one inventory on one stage.

    Args:
        blocks: the inventory.
        per: what the estimate reads of each block (:func:`~nanotron_ext.costs.pipeline_moment.per_block`).
        run: the run's shape (engine, micro-batches, pp, bytes per parameter).
        flight: micro-batches in flight per stage; ``deferred``: deferred W's per stage.
        overhead: the runtime overhead allowance, bytes; ``buffers``: the runtime's small tensors, bytes.
        optimizer: ``foreach``, ``for_loop`` or ``fused``; ``retain_sends``: the CPU runtime's P2P keeps what it sent.
        tied: whether the config ties the lm_head to the embedding.
        one_by_one: ``peak(stage, s, e)`` of one segment: for the segments holding a tied pair.
    """

    def __init__(
        self,
        blocks: Sequence[BlockInfo],
        per: PerBlock,
        run: RunShape,
        flight: Sequence[int],
        deferred: Sequence[int],
        *,
        overhead: float,
        buffers: float,
        optimizer: str,
        retain_sends: bool,
        tied: bool,
        one_by_one: Callable[[int, int, int], float],
    ) -> None:
        self.run, self.flight, self.deferred = run, list(flight), list(deferred)
        self.overhead, self.buffers, self.optimizer, self.retain_sends = overhead, buffers, optimizer, retain_sends
        self.one_by_one = one_by_one
        mem = per.memory
        saved = np.array([x.saved for x in mem], dtype=np.float64)
        self.input = np.array([x.input for x in mem], dtype=np.float64)
        self.input_saved = np.array([x.input_saved for x in mem], dtype=bool)
        self.output = np.array([x.output for x in mem], dtype=np.float64)
        forward_temp = np.array([x.forward_temp for x in mem], dtype=np.float64)
        backward_temp = np.array([x.backward_temp for x in mem], dtype=np.float64)
        trainable = np.array([b.trainable for b in blocks], dtype=np.int64)
        self.bytes = param_bytes(run)
        grads = trainable * (self.bytes.gradients - self.bytes.gradients_allocated)
        pending = np.asarray(per.pending, dtype=np.float64)
        recomputed = np.asarray(per.recomputed, dtype=np.float64)
        largest = np.asarray(per.largest, dtype=np.float64)
        self.saved, self.pending, self.grads = prefix_sums(saved), prefix_sums(pending), prefix_sums(grads)
        self.trainable = prefix_sums(trainable, np.int64)
        self.params = prefix_sums([b.params for b in blocks], np.int64)
        self.persistent = prefix_sums([x.persistent for x in mem])
        after = self.saved[1:]  # what blocks s..i saved, less what blocks before s did
        # The block's own term of each moment (pipeline_moment._candidates): its forward (its own input counted
        # unless it starts the segment), a backward with every gradient made, and the first backward's.
        self.forward = _RangeMax(after + forward_temp + self.output)
        own = np.where(self.input_saved, 0.0, self.input)
        self.forward_own = _RangeMax(after + forward_temp + self.output + own)
        self.backward = _RangeMax(after - self.pending[:-1] + self.output + backward_temp)
        fresh = np.where(trainable > 0, largest * self.bytes.weights, 0.0)
        # A recomputed block's first backward peaks at its start or at its end: the larger of the two loses the
        # smaller of its gradients and what it recomputed.
        lost = np.where(recomputed != 0, np.minimum(grads, recomputed), 0.0)
        first_backward = after - self.pending[:-1] - self.grads[:-1] + self.output + backward_temp - fresh - lost
        self.first_backward = _RangeMax(first_backward)
        self.largest_trained = _RangeMax(np.where(trainable > 0, largest, 0.0))
        roles = [b.role for b in blocks]
        self.embeddings = prefix_sums([r == "embedding" for r in roles], np.int64)
        self.heads = prefix_sums([r == "lm_head" for r in roles], np.int64)
        self.tied = tied

    def __call__(self, stage: int, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """The peaks of the segments ``[s[j], e[j])`` on ``stage`` (each ``s[j] < e[j]``)."""
        s, e = np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)
        run, n, pp = self.run, self.flight[stage], self.run.pp
        m = run.n_micro_batches
        held_in = np.where(self.input_saved[s], 0.0, self.input[s])
        held_out = self.output[e - 1]
        activations = held_in + (self.saved[e] - self.saved[s]) + held_out
        trainable = self.trainable[e] - self.trainable[s]
        g_all = self.grads[e] - self.grads[s]
        allocated = trainable * self.bytes.gradients_allocated
        sent = 0.0
        if self.retain_sends:
            sent = (m - n) * held_out * (stage < pp - 1) + m * self.input[s] * (stage > 0)
        early = run.engine in ONE_F_ONE_B_FAMILY and m > n
        base = (n - 1) * activations + held_in - self.saved[s]
        first = np.maximum(self.forward(s, s + 1), self.forward_own(s + 1, e))
        worst = base + (g_all if early else 0.0) + first
        later = held_in - self.saved[s] + held_out + self.pending[e] + g_all + self.backward(s, e)
        if early:
            worst = np.maximum(worst, (n - 1) * activations + later)
        else:
            made = base + held_out + self.pending[e] + self.grads[e] + self.first_backward(s, e)
            worst = np.maximum(worst, made)
            if n >= 2:
                worst = np.maximum(worst, (n - 2) * activations + later)
        weights = (self.params[e] - self.params[s]) * self.bytes.weights
        held = weights + trainable * self.bytes.optimizer + (self.persistent[e] - self.persistent[s]) + self.buffers
        pending = self.deferred[stage] * (self.pending[e] - self.pending[s]) if run.engine in ZERO_BUBBLE else 0.0
        pipeline = held + worst + allocated + sent + pending + self.overhead
        optimizer = held + g_all + allocated + self._optimizer_temporaries(s, e, trainable) + self.overhead
        peaks = np.maximum(pipeline, optimizer)
        if self.tied:
            pair = ((self.embeddings[e] - self.embeddings[s]) > 0) & ((self.heads[e] - self.heads[s]) > 0)
            for j in np.flatnonzero(pair):
                peaks[j] = self.one_by_one(stage, int(s[j]), int(e[j]))
        return peaks

    def _optimizer_temporaries(self, s: np.ndarray, e: np.ndarray, trainable: np.ndarray) -> np.ndarray | float:
        """:func:`~nanotron_ext.costs.memory_estimate._optimizer_temporaries` of the segments."""
        largest = self.largest_trained(s, e)
        state = self.bytes.state
        if self.optimizer == "for_loop":
            return 2.0 * largest * state
        if self.optimizer == "foreach":
            return np.maximum(2.0 * largest, trainable) * state
        return 0.0
