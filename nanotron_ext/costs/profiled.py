"""Measured costs: each block's forward, backward and optimizer-step time on this machine.

Analytic FLOPs miss what real kernels do: a thin ``[t, h] × [h, V]`` lm_head is memory-bound, attention and
the loss are slower per FLOP than large matmuls, the embedding's backward fills a dense ``V × h`` gradient.
The ``profiled`` strategy builds each block's module standalone (:mod:`nanotron_ext.costs.standalone`; by default
the CPU Llama modules of :mod:`nanotron_ext.models.profiled_blocks`, with Nanotron's tensor-parallel layers on a
one-process group), feeds it
inputs of the shape one micro-batch has (``micro_batch_size × sequence_length``, Nanotron's ``[seq, batch,
hidden]`` layout), and times forward and backward separately: warm-up rounds, then the fastest of ``repeats``
rounds (:func:`nanotron_ext.stats.fastest`: what moves least on a shared machine), every block taking its turn
in each round. The backward follows what trains: a frozen parameter gets no
weight gradient, and a block's input only asks for a gradient when something before it trains, so a frozen prefix
costs forward only (the same rule as :func:`nanotron_ext.costs.analytic.training_flops`).

Each timed call starts with cold caches and hot inputs, as inside a pipeline (:mod:`nanotron_ext.costs.block_inputs`).
Timings are cached on disk, keyed by everything a block's time depends on; identical decoder layers share one key
and are measured once (:mod:`nanotron_ext.costs.timing_cache`; ``nanotron_ext.profile_cache`` or
``~/.cache/nanotron_ext``).

In a distributed run only global rank 0 measures; the timings are broadcast, so every rank computes the same
plan even when their machines (or their load) differ. Without a process group it measures locally.

Limitations: blocks are measured unsharded (tensor-parallel size 1): with ``tp > 1`` every matmul block
shrinks about alike, so the split stays balanced, but TP communication is not measured. Measurement runs
on CUDA when it is available, otherwise on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.allocator import keep_freed_memory
from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.costs.block_inputs import _make_inputs, _outputs_needing_backward, _sync, flush_caches
from nanotron_ext.costs.split_backward import splits, time_weight_pass
from nanotron_ext.costs.standalone import ModuleFactory, _groups, _local_group, _standalone_module
from nanotron_ext.costs.timing_cache import (
    DEFAULT_CACHE_DIR,
    PROFILE_VERSION,
    BlockTiming,
    CacheWarning,
    _device,
    _hash,
    _read_cache,
    _write_cache,
    cache_dir_for,
    profile_key,
)
from nanotron_ext.errors import ConfigError, PlanningError
from nanotron_ext.stats import fastest, fastest_spread

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CACHE_DIR",
    "PROFILE_VERSION",
    "BlockTiming",
    "CacheWarning",
    "ModuleFactory",
    "block_timings",
    "cache_dir_for",
    "measure_block",
    "measure_blocks",
    "profile_blocks",
    "profile_key",
]

DEFAULT_WARMUP = 2
#: Timed rounds: each figure is their fastest, its spread the gap between the fastest of the first 5 and of the last 6.
DEFAULT_REPEATS = 11

#: The clock every measurement reads (a module attribute so that tests can substitute a fake one).
clock: Callable[[], float] = time.perf_counter


# --- building and measuring one block ------------------------------------------------------------------


def measure_block(
    block: BlockInfo,
    cfg: PlannerConfig,
    *,
    input_grad: bool,
    tp_pg: Any,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    device: torch.device | None = None,
    module_factory: ModuleFactory | None = None,
) -> BlockTiming:
    """One block timed alone: :func:`measure_blocks` of that block."""
    return measure_blocks(
        [(block, input_grad)],
        cfg,
        tp_pg=tp_pg,
        warmup=warmup,
        repeats=repeats,
        device=device,
        module_factory=module_factory,
    )[0]


def measure_blocks(
    blocks: Sequence[tuple[BlockInfo, bool]],
    cfg: PlannerConfig,
    *,
    tp_pg: Any,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    device: torch.device | None = None,
    module_factory: ModuleFactory | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[BlockTiming]:
    """Build each block's module standalone and time, round after round, every block once: its forward and
    backward for one micro-batch, then its optimizer step (AdamW, as Nanotron's default optimizer, over the
    parameters that train).

    The blocks take turns in each round, the first one rotating, so that a slow stretch of the machine hits every
    block alike instead of the one measured then (issue 32: timed one block after another, two calibrations of one
    machine predicted steps 25 % apart). Blocks whose weights and optimizer states would not fit in half the free
    memory together are timed in groups that do.

    Args:
        blocks: ``(block, whether its input needs a gradient)`` pairs.
        cfg: model and batch shape, dtype.
        tp_pg: a one-process group for Nanotron's tensor-parallel layers.
        warmup: untimed rounds first (allocator, kernel selection, caches).
        repeats: timed rounds; each figure keeps their fastest, and its spread (:class:`BlockTiming`).
        device: where to run; CUDA when available, else CPU.
        module_factory: builds the block's module; default the CPU Llama's block
            (:func:`nanotron_ext.models.profiled_blocks.build_block_module`).
        on_round: called after every round (warm-up ones included) with how many blocks it timed: progress.

    Returns:
        One :class:`BlockTiming` per pair, in order.

    Raises:
        PlanningError: a block role that cannot be built standalone.
        ConfigError: ``warmup < 0`` or ``repeats < 1``.
    """
    if warmup < 0 or repeats < 1:
        raise ConfigError(f"profiling needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    device = device or _device()
    if device.type == "cpu":  # timed in the state the CPU runtime trains in (nanotron_ext.allocator)
        keep_freed_memory()
    out: list[BlockTiming] = []
    for group in _groups([b for b, _ in blocks], device):
        runs = [
            _Run(blocks[i][0], blocks[i][1], _standalone_module(blocks[i][0], cfg, tp_pg, device, module_factory))
            for i in group
        ]
        for r in range(warmup + repeats):
            for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
                run.once(cfg, device, timed=r >= warmup)
            if on_round is not None:
                on_round(len(runs))
        out += [run.timing() for run in runs]
        del runs
    return out


class _Run:
    """One block's module, optimizer and timings while :func:`measure_blocks` takes its rounds."""

    def __init__(self, block: BlockInfo, input_grad: bool, module: Any) -> None:
        import torch

        self.block, self.input_grad, self.module = block, input_grad, module
        self.gen = torch.Generator().manual_seed(0)
        self.optimizer: Any = None
        self.times: tuple[list[float], list[float], list[float]] = ([], [], [])
        #: zero-bubble's W of each timed round, for a block whose backward it splits (split_backward.py).
        self.splits = splits(block, module)
        self.weights: list[float] = []

    def once(self, cfg: PlannerConfig, device: Any, *, timed: bool) -> None:
        """Forward, backward and optimizer step once, each starting with cold caches; recorded when ``timed``."""
        import torch

        # Cold weights and saved activations, hot inputs: in a pipeline a block's input was just made by the block
        # before it (or received), everything else was evicted since the block last ran.
        flush_caches(device)
        inputs = _make_inputs(self.block.role, cfg, getattr(torch, cfg.run.dtype), device, self.input_grad, self.gen)
        _sync(device)
        t0 = clock()
        out = self.module(**inputs)
        _sync(device)
        forward = clock() - t0
        tensors = _outputs_needing_backward(out)
        backward = 0.0
        if tensors:
            flush_caches(device)
            grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in tensors]
            _sync(device)
            t0 = clock()
            torch.autograd.backward(tensors, grads)
            _sync(device)
            backward = clock() - t0
        del out, tensors, inputs
        # W in every other timed round, the first included (len: the timed rounds so far): each costs one more
        # forward and backward.
        if self.splits and timed and len(self.times[0]) % 2 == 0:
            self.weights.append(
                time_weight_pass(self.block, self.module, cfg, device, self.input_grad, self.gen, clock)
            )
        # Weight gradients accumulate across rounds, as they do across micro-batches within a step.
        step = self._step(device)
        if timed:
            for times, seconds in zip(self.times, (forward, backward, step)):
                times.append(seconds)

    def _step(self, device: Any) -> float:
        """Seconds of one ``AdamW.step()`` over the parameters that have a gradient (0 if none)."""
        import torch

        if self.optimizer is None:
            params = [p for p in getattr(self.module, "parameters", list)() if p.requires_grad and p.grad is not None]
            if not params:
                return 0.0
            # torch's AdamW, as Nanotron's default optimizer; unfused, as the CPU runtime builds it (Nanotron takes
            # `fused` from optimizer.torch_adam_is_fused). A tiny lr keeps the values sane.
            self.optimizer = torch.optim.AdamW(params, lr=1e-8, fused=False)
        flush_caches(device)
        t0 = clock()
        self.optimizer.step()
        _sync(device)
        return clock() - t0

    def timing(self) -> BlockTiming:
        best = [max(0.0, fastest(t)) for t in self.times]
        spread = tuple(fastest_spread(t) for t in self.times)  # 0 where the fastest is 0
        weight = max(0.0, fastest(self.weights)) if self.weights else None
        return BlockTiming(*best, spread, weight)  # type: ignore[arg-type]


# --- many blocks, cache, distributed -------------------------------------------------------------------


def profile_blocks(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    tp_pg: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    module_factory: ModuleFactory | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[BlockTiming]:
    """Per-block timings on this process: from the cache where present, measured (and cached) otherwise.

    Each distinct key (see :func:`profile_key`) is measured once, so identical decoder layers cost one
    measurement.

    Args:
        blocks: the inventory, in forward order.
        cfg: the config.
        tp_pg: a one-process group to build tensor-parallel layers on; when None and nothing is initialised, a
            temporary one is made.
        cache_dir: overrides :func:`cache_dir_for`.
        warmup: untimed runs per measurement.
        repeats: timed runs per measurement.
        module_factory: builds each measured block's module (see :func:`measure_block`).
        on_round: progress, see :func:`measure_blocks`.

    Returns:
        One :class:`BlockTiming` per block.
    """
    directory = Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_for(cfg)
    keys = [profile_key(b, cfg, input_grad=g) for b, g in zip(blocks, trainable_before(blocks))]
    found: dict[str, BlockTiming] = {}
    missing: dict[str, tuple[BlockInfo, dict[str, Any]]] = {}
    for block, key in zip(blocks, keys):
        digest = _hash(key)
        if digest in found or digest in missing:
            continue
        cached = _read_cache(directory / f"{digest}.json")
        if cached is not None:
            found[digest] = cached
        else:
            missing[digest] = (block, key)
    if missing:
        # A group is only needed (and only made) when something must be measured.
        group_cm = contextlib.nullcontext(tp_pg) if tp_pg is not None else _local_group()
        with group_cm as group:
            timings = measure_blocks(
                [(block, key["input_grad"]) for block, key in missing.values()],
                cfg,
                tp_pg=group,
                warmup=warmup,
                repeats=repeats,
                module_factory=module_factory,
                on_round=on_round,
            )
            for (digest, (_, key)), timing in zip(missing.items(), timings):
                found[digest] = timing
                try:
                    _write_cache(directory / f"{digest}.json", key, timing)
                except OSError as exc:  # an unwritable cache only costs a re-measurement next time
                    warnings.warn(
                        f"cannot write the profiled timing cache entry {directory / f'{digest}.json'} "
                        f"({exc.strerror or exc}); the block will be measured again next run. Fix "
                        f"the folder or set nanotron_ext.profile_cache",
                        CacheWarning,
                        stacklevel=2,
                    )
    return [found[_hash(key)] for key in keys]


def block_timings(blocks: Sequence[BlockInfo], cfg: PlannerConfig, **kwargs: Any) -> list[BlockTiming]:
    """Per-block timings that are identical on every rank.

    With an initialised process group, global rank 0 measures (or reads its cache) and broadcasts the result;
    every rank must call this (it is collective). Without one, this process measures.

    Args:
        blocks: the inventory.
        cfg: the config.
        **kwargs: passed to :func:`profile_blocks` on the measuring rank (``cache_dir``, ``warmup``, ``repeats``).

    Returns:
        One :class:`BlockTiming` per block.

    Raises:
        PlanningError: measuring failed (on every rank, with rank 0's reason).
    """
    try:
        import torch.distributed as dist
    except ImportError as exc:  # the planner core itself does not need torch
        raise PlanningError(f"the profiled strategy needs torch and nanotron installed: {exc}") from exc
    if not dist.is_initialized():
        return profile_blocks(blocks, cfg, **kwargs)
    # Every rank joins the group's creation (torch requires it); only rank 0 uses it. gloo, because the blocks
    # may be measured on CPU whatever the default backend is.
    group = dist.new_group(ranks=[0], backend="gloo")
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            timings = profile_blocks(blocks, cfg, tp_pg=group, **kwargs)
            payload[0] = {"ok": [dataclasses.astuple(t) for t in timings]}
        except Exception as exc:  # every rank must leave the broadcast, and raise the same error
            payload[0] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(payload, src=0)
    result = payload[0]
    if "error" in result:
        raise PlanningError(f"profiling on global rank 0 failed: {result['error']}")
    return [BlockTiming(*values) for values in result["ok"]]
