"""Measured costs: each block's forward, backward and optimizer-step time on this machine.

Analytic FLOPs miss what real kernels do: a thin ``[t, h] × [h, V]`` lm_head is memory-bound, attention and
the loss are slower per FLOP than large matmuls, the embedding's backward fills a dense ``V × h`` gradient.
The ``profiled`` strategy builds each block's module standalone (by default the CPU Llama modules of
:mod:`nanotron_ext.models.profiled_blocks`, with Nanotron's tensor-parallel layers on a one-process group), feeds it
inputs of the shape one micro-batch has (``micro_batch_size × sequence_length``, Nanotron's ``[seq, batch,
hidden]`` layout), and times forward and backward separately: a few warm-up runs, then the median of
``repeats``. The backward follows what trains: a frozen parameter gets no weight gradient, and a block's input
only asks for a gradient when some block before it is trainable, so a frozen prefix costs forward only
(the same rule as :func:`nanotron_ext.costs.analytic.training_flops`).

Each timed forward, backward and optimizer step starts with cold caches (:func:`flush_caches`, as Triton's
``do_bench`` clears the GPU's L2) and hot inputs: inside a pipeline the other blocks, micro-batches and ranks run
between two calls of a block and evict its weights and saved activations, while its input (or output gradient) was
just made by its neighbour. On the seed model's first stage (memory-bound blocks of a few hundred microseconds)
warm-cache timings were half of what the blocks took in Nanotron's engine (2.2 against 4.4 ms per micro-batch);
timed this way, 4.1 ms.

Timings are cached on disk as one small JSON file per measurement, keyed by a hash of everything a block's
time depends on (model shape, batch shape, dtype, torch version, device, thread count, block role, which
parameters train, whether the input needs a gradient); identical decoder layers share one key and are
measured once. The cache lives in ``nanotron_ext.profile_cache`` or ``~/.cache/nanotron_ext``.

In a distributed run only global rank 0 measures; the timings are broadcast, so every rank computes the same
plan even when their machines (or their load) differ. Without a process group it measures locally.

Limitations: blocks are measured unsharded (tensor-parallel size 1): with ``tp > 1`` every matmul block
shrinks about alike, so the split stays balanced, but TP communication is not measured. Measurement runs
on CUDA when it is available, otherwise on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.errors import ConfigError, PlanningError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CACHE_DIR",
    "BlockTiming",
    "CacheWarning",
    "ModuleFactory",
    "block_timings",
    "cache_dir_for",
    "measure_block",
    "profile_blocks",
    "profile_key",
]

#: Bump when the way blocks are measured changes, so that older cache entries are not reused.
PROFILE_VERSION = 3  # 2: the optimizer step is timed too; 3: with cold caches
DEFAULT_CACHE_DIR = Path("~/.cache/nanotron_ext")
DEFAULT_WARMUP = 2
DEFAULT_REPEATS = 5
#: ``factory(block, cfg, tp_pg)`` builds the module (or callable) that one block runs, for timing.
ModuleFactory = Callable[[BlockInfo, PlannerConfig, Any], Callable[..., Any]]

#: The clock every measurement reads (a module attribute so that tests can substitute a fake one).
clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class BlockTiming:
    """Measured time of one block for one micro-batch, in seconds.

    Attributes:
        forward: median forward time.
        backward: median backward time (0 when no gradient flows through the block).
        optimizer: median time of an AdamW step over the block's trainable parameters (0 when none train);
            once per training step, not per micro-batch.
    """

    forward: float
    backward: float
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        """Forward + backward: the per-micro-batch pipeline work the planner balances."""
        return self.forward + self.backward


# --- keys and cache ------------------------------------------------------------------------------------


def _trainable_flags(block: BlockInfo) -> list[tuple[str, bool]]:
    """``(local parameter name, trainable)`` pairs, names relative to the block's module."""
    if not block.parameters:
        return [("*", block.trainable > 0)] if block.params else []
    marker = ".pp_block."
    return sorted(
        (p.name.split(marker, 1)[1] if marker in p.name else p.name, bool(p.trainable)) for p in block.parameters
    )


def _device() -> torch.device:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def profile_key(block: BlockInfo, cfg: PlannerConfig, *, input_grad: bool) -> dict[str, Any]:
    """Everything a block's measured time depends on, as a JSON-able dict (its hash is the cache key).

    The layer count is left out (one decoder layer does not depend on how many there are), so is the block's
    name: identical decoder layers share one key.

    Args:
        block: the block.
        cfg: the config (model shape, batch shape, dtype).
        input_grad: whether the block's input needs a gradient (something before it trains).

    Returns:
        The key's fields.
    """
    import torch

    shape = dataclasses.asdict(cfg.model)
    shape.pop("num_hidden_layers")
    return {
        "version": PROFILE_VERSION,
        "role": block.role,
        "params": block.params,
        "model": shape,
        "micro_batch_size": cfg.run.micro_batch_size,
        "sequence_length": cfg.run.sequence_length,
        "dtype": cfg.run.dtype,
        "torch": torch.__version__,
        "device": _device().type,
        "threads": torch.get_num_threads(),
        "trainable": _trainable_flags(block),
        "input_grad": bool(input_grad),
    }


def _hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def cache_dir_for(cfg: PlannerConfig) -> Path:
    """The timing cache directory: ``nanotron_ext.profile_cache`` or ``~/.cache/nanotron_ext``."""
    return Path(cfg.ext.profile_cache or DEFAULT_CACHE_DIR).expanduser()


#: A cached time above this (seconds per block and micro-batch) is corrupt, not slow.
MAX_CACHED_SECONDS = 1e4


def _read_cache(path: Path) -> BlockTiming | None:
    """A cache entry, or None when there is none or it is unusable (then it is measured again).

    An entry that exists but cannot be used (not a file, not JSON, a missing field, a time that is not a
    finite number in ``[0, MAX_CACHED_SECONDS]``, or a zero forward time) gets a warning naming the file.
    """
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text())
        values = {k: data[k] for k in ("forward", "backward", "optimizer")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _bad_entry(path, f"{type(exc).__name__}: {exc}")
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= MAX_CACHED_SECONDS
        ):
            return _bad_entry(path, f"{name}={value!r} is not a time in seconds (finite, 0 to {MAX_CACHED_SECONDS:g})")
    if values["forward"] <= 0:
        return _bad_entry(path, f"forward={values['forward']!r}: a block's forward always takes some time")
    return BlockTiming(float(values["forward"]), float(values["backward"]), float(values["optimizer"]))


def _bad_entry(path: Path, why: str) -> None:
    warnings.warn(f"profiled timing cache entry {path} is unusable ({why}); measuring that block again and "
                  f"replacing it",
                  CacheWarning, stacklevel=3)
    return None


class CacheWarning(UserWarning):
    """A ``profiled`` cache entry was unusable and is measured again."""


def _write_cache(path: Path, key: dict[str, Any], timing: BlockTiming) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees half a file; the temporary file never outlives a
    # failure (e.g. the entry's path is a folder, so the rename fails).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(timing) | {"key": key}, f, indent=1)
        if path.is_dir() and not path.is_symlink():
            raise IsADirectoryError(f"{path} is a directory")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- building and measuring one block ------------------------------------------------------------------


def _module_factory(factory: ModuleFactory | None) -> ModuleFactory:
    """``factory``, or the CPU Llama's blocks (torch SDPA attention runs on CPU and GPU).

    Imported here, not at the top: they need torch and Nanotron, which planning loads only when it measures.
    """
    if factory is not None:
        return factory
    from nanotron_ext.models.profiled_blocks import build_block_module

    return build_block_module


def _make_inputs(role: str, cfg: PlannerConfig, dtype: Any, device: Any, input_grad: bool, gen: Any) -> dict:
    import torch

    b, s = cfg.run.micro_batch_size, cfg.run.sequence_length
    h, v = cfg.model.hidden_size, cfg.model.vocab_size
    mask = torch.ones(b, s, dtype=torch.bool, device=device)

    def act(*shape: int, float_dtype: Any = dtype) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=float_dtype)
        return x.requires_grad_(input_grad)

    if role == "embedding":
        return {"input_ids": torch.randint(0, v, (b, s), generator=gen).to(device), "input_mask": mask}
    if role == "projector":
        return {"input_embeds": act(s, b, h)}
    if role == "decoder":
        return {"hidden_states": act(s, b, h), "sequence_mask": mask}
    if role == "final_norm":
        return {"input": act(s, b, h)}
    if role == "lm_head":
        return {"x": act(s, b, h)}
    if role == "cast":
        return {"x": act(s, b, v)}
    if role == "vocab_shard":
        # A middle shard (nanotron_ext.models.vocab_chain): statistics in, statistics out; labels anywhere.
        stats = {"running_max": act(s, b, float_dtype=torch.float32).detach(),
                 "running_sumexp": act(s, b, float_dtype=torch.float32).abs(),
                 "target_logit": act(s, b, float_dtype=torch.float32)}
        labels = torch.randint(0, v, (b, s), generator=gen).to(device)
        return {"hidden_states": act(s, b, h), "label_ids": labels, **stats}
    # loss: Nanotron's cast_to_fp32 hands it fp32 logits.
    labels = torch.randint(0, v, (b, s), generator=gen).to(device)
    return {"sharded_logits": act(s, b, v, float_dtype=torch.float32), "label_ids": labels, "label_mask": mask}


def _outputs_needing_backward(out: Any) -> list[torch.Tensor]:
    import torch

    values = list(out.values()) if isinstance(out, dict) else [out]
    # Only tensors with a graph behind them: the cast of an fp32 tensor returns its input, a leaf.
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Bytes written to evict the caches: at least this, and twice the last-level cache where the OS tells it.
FLUSH_BYTES_MIN = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # cuda: Triton's do_bench (H100's L2 is 50 MB)
_flush_buffers: dict[str, torch.Tensor] = {}


def flush_caches(device: Any) -> None:
    """Write a buffer larger than the last-level cache of ``device`` (untimed), so the next timed call starts
    cold, as a block does inside a pipeline."""
    import torch

    key = str(device)
    if key not in _flush_buffers:
        n_bytes = max(FLUSH_BYTES_MIN.get(device.type, FLUSH_BYTES_MIN["cpu"]),
                      2 * _last_level_cache_bytes() if device.type == "cpu" else 0)
        _flush_buffers[key] = torch.zeros(n_bytes // 4, dtype=torch.float32, device=device)
    _flush_buffers[key].add_(1.0)
    _sync(device)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for CPU 0 (0 where it reports none)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = entry.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


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
    """Build one block's module standalone; time its forward and backward for one micro-batch, then its
    optimizer step (AdamW, as Nanotron's default optimizer, over the parameters that train).

    Args:
        block: the block (its role and which parameters train).
        cfg: model and batch shape, dtype.
        input_grad: whether the block's input needs a gradient.
        tp_pg: a one-process group for Nanotron's tensor-parallel layers.
        warmup: untimed runs first (allocator, kernel selection, caches).
        repeats: timed runs; the median is kept.
        device: where to run; CUDA when available, else CPU.
        module_factory: builds the block's module; default the CPU Llama's block (:func:`nanotron_ext.models.profiled_blocks.build_block_module`).

    Returns:
        Median forward, backward and optimizer-step seconds.

    Raises:
        PlanningError: a block role that cannot be built standalone.
        ConfigError: ``warmup < 0`` or ``repeats < 1``.
    """

    if warmup < 0 or repeats < 1:
        raise ConfigError(f"profiling needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    device = device or _device()
    module = _standalone_module(block, cfg, tp_pg, device, module_factory)
    forward, backward = _time_forward_backward(module, block, cfg, device, input_grad, warmup, repeats)
    # Weight gradients accumulate across repeats, as they do across micro-batches within a step.
    return BlockTiming(
        max(0.0, statistics.median(forward)),
        max(0.0, statistics.median(backward)),
        _time_optimizer_step(module, device, warmup, repeats),
    )


def _standalone_module(block: BlockInfo, cfg: PlannerConfig, tp_pg: Any, device: Any,
                       factory: ModuleFactory | None) -> Any:
    """The block's module on ``device`` in the config's dtype, its parameters trainable as the block's are."""
    import torch

    module = _module_factory(factory)(block, cfg, tp_pg)
    if isinstance(module, torch.nn.Module):
        module = module.to(device=device, dtype=getattr(torch, cfg.run.dtype))
        trainable = dict(_trainable_flags(block))
        for name, param in module.named_parameters():
            param.requires_grad_(trainable.get(name, trainable.get("*", block.trainable > 0)))
    return module


def _time_forward_backward(module: Any, block: BlockInfo, cfg: PlannerConfig, device: Any, input_grad: bool,
                           warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each timed forward and backward (fresh random inputs each run, the warm-up runs left out)."""
    import torch

    dtype = getattr(torch, cfg.run.dtype)
    gen = torch.Generator().manual_seed(0)
    forward, backward = [], []
    for i in range(warmup + repeats):
        # Cold weights and saved activations, hot inputs: in a pipeline a block's input was just made by the block
        # before it (or received), everything else was evicted since the block last ran.
        flush_caches(device)
        inputs = _make_inputs(block.role, cfg, dtype, device, input_grad, gen)
        _sync(device)
        t0 = clock()
        out = module(**inputs)
        _sync(device)
        t1 = clock()
        tensors = _outputs_needing_backward(out)
        t2 = t3 = 0.0
        if tensors:
            flush_caches(device)
            grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in tensors]
            _sync(device)
            t2 = clock()
            torch.autograd.backward(tensors, grads)
            _sync(device)
            t3 = clock()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t3 - t2)
        del out, tensors, inputs
    return forward, backward


def _time_optimizer_step(module: Any, device: Any, warmup: int, repeats: int) -> float:
    """Median seconds of ``AdamW.step()`` over the module's parameters that have a gradient (0 if none)."""
    import torch

    params = [p for p in getattr(module, "parameters", list)() if p.requires_grad and p.grad is not None]
    if not params:
        return 0.0
    # torch's AdamW, as Nanotron's default optimizer; unfused, as the CPU runtime builds it (Nanotron takes
    # `fused` from optimizer.torch_adam_is_fused). A tiny lr keeps the values sane.
    optimizer = torch.optim.AdamW(params, lr=1e-8, fused=False)
    times = []
    for i in range(warmup + repeats):
        flush_caches(device)
        t0 = clock()
        optimizer.step()
        _sync(device)
        t1 = clock()
        if i >= warmup:
            times.append(t1 - t0)
    return max(0.0, statistics.median(times))


# --- many blocks, cache, distributed -------------------------------------------------------------------


@contextlib.contextmanager
def _local_group() -> Iterator[Any]:
    """A one-process gloo group when no process group exists; torn down afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("_local_group is only for processes without a process group")
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def profile_blocks(
    blocks: Sequence[BlockInfo],
    cfg: PlannerConfig,
    *,
    tp_pg: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    repeats: int = DEFAULT_REPEATS,
    module_factory: ModuleFactory | None = None,
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
            for digest, (block, key) in missing.items():
                timing = measure_block(
                    block, cfg, input_grad=key["input_grad"], tp_pg=group, warmup=warmup, repeats=repeats,
                    module_factory=module_factory,
                )
                found[digest] = timing
                try:
                    _write_cache(directory / f"{digest}.json", key, timing)
                except OSError as exc:  # an unwritable cache only costs a re-measurement next time
                    warnings.warn(f"cannot write the profiled timing cache entry {directory / f'{digest}.json'} "
                                  f"({exc.strerror or exc}); the block will be measured again next run. Fix "
                                  f"the folder or set nanotron_ext.profile_cache", CacheWarning, stacklevel=2)
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
            payload[0] = {"ok": [(t.forward, t.backward, t.optimizer) for t in timings]}
        except Exception as exc:  # every rank must leave the broadcast, and raise the same error
            payload[0] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(payload, src=0)
    result = payload[0]
    if "error" in result:
        raise PlanningError(f"profiling on global rank 0 failed: {result['error']}")
    return [BlockTiming(*values) for values in result["ok"]]
