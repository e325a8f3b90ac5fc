"""Measured CPU memory of a training process: the high-water mark of live tensor bytes, from torch's allocator.

torch has no CPU counterpart of ``torch.cuda.max_memory_allocated``. Its profiler, with ``profile_memory``,
records every allocation and free of the CPU allocator (``c10::reportMemoryUsage``) with its size and time:
tensors made by any op, kernel workspaces, autograd's saved tensors and buffers, P2P receive buffers, the
optimizer's state and its temporaries. Their running sum is the allocator's live bytes; its maximum is the peak.

Start a :class:`MemoryRecorder` *before* the model is built, so that everything the rank allocates is counted
from zero (a free of memory allocated earlier would make the running sum undercount). ``mark(name)`` notes a
moment (a zero-length ``record_function`` range, on the profiler's clock); after ``stop()``,
``live_at(name)`` is the live bytes at that moment and ``peak_between(a, b)`` the high-water mark between two
marks.

Not counted: memory outside torch's allocator (gloo's own socket buffers, Python objects, the interpreter).

On a GPU (``NANOTRON_EXT_DEVICE=cuda``) :class:`CudaMemoryRecorder` gives the same trace from CUDA's caching
allocator: at each mark, the high-water mark since the previous one (``torch.cuda.max_memory_allocated``, then
reset) and the bytes allocated now, so ``peak_between`` is exact at mark granularity.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from nanotron_ext.config import PlannerConfig

__all__ = ["CudaMemoryRecorder", "MemoryRecorder", "MemoryTrace", "measure_training_memory"]

_MARK = "nanotron_ext.mark:"


@dataclass
class MemoryTrace:
    """Live allocator bytes over time.

    Attributes:
        times: event times (ns, profiler clock), ascending.
        live: live bytes right after each event.
        marks: mark name -> its time (ns).
    """

    times: list[int]
    live: list[int]
    marks: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The high-water mark over the whole recording (0 when nothing was allocated)."""
        return max(self.live, default=0)

    def live_at(self, mark: str) -> int:
        """Live bytes at ``mark``.

        Raises:
            KeyError: no such mark.
        """
        i = bisect.bisect_right(self.times, self._time(mark))
        return self.live[i - 1] if i else 0

    def peak_between(self, start: str, end: str) -> int:
        """The high-water mark between two marks, the live bytes at ``start`` included.

        Raises:
            KeyError: a mark is missing.
        """
        lo = bisect.bisect_right(self.times, self._time(start))
        hi = bisect.bisect_right(self.times, self._time(end))
        return max([self.live_at(start), *self.live[lo:hi]])

    def _time(self, mark: str) -> int:
        if mark not in self.marks:
            raise KeyError(f"no memory mark {mark!r}; marks are {sorted(self.marks)}")
        return self.marks[mark]


class MemoryRecorder:
    """Records every CPU allocation and free of this process while active (see the module docstring).

    Usage::

        rec = MemoryRecorder().start()
        model = build(...)
        rec.mark("built")
        ...
        trace = rec.stop()
        trace.peak, trace.live_at("built")
    """

    def __init__(self) -> None:
        self._prof: profile | None = None

    def start(self) -> MemoryRecorder:
        """Start recording; returns ``self``."""
        # Shapes and stacks are not needed: only the [memory] events (size, time) and the mark ranges.
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Note the current moment as ``name`` (later marks of the same name replace earlier ones)."""
        with record_function(_MARK + name):
            pass

    def stop(self) -> MemoryTrace:
        """Stop recording and return the trace.

        Raises:
            RuntimeError: not started.
        """
        if self._prof is None:
            raise RuntimeError("MemoryRecorder.stop() before start()")
        self._prof.__exit__(None, None, None)
        events = self._prof.profiler.kineto_results.events()
        self._prof = None
        allocations: list[tuple[int, int]] = []
        marks: dict[str, int] = {}
        for e in events:
            name = e.name()
            if name == "[memory]":
                if str(e.device_type()).endswith("CPU"):
                    allocations.append((e.start_ns(), e.nbytes()))
            elif name.startswith(_MARK):
                key = name[len(_MARK) :]
                marks[key] = max(marks.get(key, e.start_ns()), e.start_ns())
        allocations.sort(key=lambda a: a[0])
        times, live, total = [], [], 0
        for t, nbytes in allocations:
            total += nbytes
            times.append(t)
            live.append(total)
        return MemoryTrace(times=times, live=live, marks=marks)


class CudaMemoryRecorder:
    """:class:`MemoryRecorder`'s interface over CUDA's caching allocator on ``device`` (allocated tensor bytes)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._times: list[int] = []
        self._live: list[int] = []
        self._marks: dict[str, int] = {}

    def start(self) -> CudaMemoryRecorder:
        """Start recording (resets the device's peak statistics); returns ``self``."""
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._times, self._live, self._marks = [], [], {}
        self._event()
        return self

    def mark(self, name: str) -> None:
        """Note the current moment as ``name``: the peak since the last mark, then the bytes allocated now."""
        self._event()
        self._marks[name] = self._times[-1]

    def stop(self) -> MemoryTrace:
        """The trace from :meth:`start` to now."""
        self._event()
        return MemoryTrace(times=list(self._times), live=list(self._live), marks=dict(self._marks))

    def _event(self) -> None:
        torch.cuda.synchronize(self._device)
        t = len(self._times)
        # Two events a step: the high-water mark of the segment that ends here, then the level it ends at.
        self._times += [t, t + 1]
        self._live += [torch.cuda.max_memory_allocated(self._device), torch.cuda.memory_allocated(self._device)]
        torch.cuda.reset_peak_memory_stats(self._device)


def measure_training_memory(
    cfg: PlannerConfig,
    block_ranks: Sequence[int],
    *,
    steps: int = 2,
    dtype: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps of ``cfg``'s model with ``block_ranks`` on this rank and measure its memory.

    Collective: every rank of a torchrun-style world of ``dp × pp × tp`` processes calls it. The recorder
    starts right after the process groups exist, so the model, the optimizer and every step are counted.

    Args:
        cfg: the config (model shape, parallelism, batch; ``parallelism.tp_mode`` is honoured).
        block_ranks: the PP rank of every block (a plan's ``block_ranks``).
        steps: optimisation steps; from the second on, Adam's state is alive during the pipeline.
        dtype: parameter dtype (``float32`` or ``bfloat16``); ``cfg.run.dtype`` when None. AdamW then runs on the
            parameters in that dtype (no fp32 master weights: Nanotron's fp32 accumulator is CUDA-only).
        seed: seed of the weights and the token batches.

    Returns:
        This rank's measurements in bytes: ``peak`` (whole run), ``weights``, ``gradients`` and
        ``optimizer`` (tensor bytes of the parameters, their ``.grad`` before the last optimizer step, Adam's
        state), ``pipeline_peak`` and ``optimizer_peak`` (high-water marks of the last step's pipeline and
        optimizer step), ``step_start`` (live bytes when the last step began), plus ``pp_rank``, ``tp_rank``,
        ``params`` (local parameter count), ``device``. On CUDA the bytes are the caching allocator's
        (:class:`CudaMemoryRecorder`).

    Raises:
        ValueError: ``steps`` < 1 or an unsupported dtype.
    """
    from nanotron_ext.runtime.context import GlooParallelContext
    from nanotron_ext.runtime.data import random_micro_batches
    from nanotron_ext.runtime.device import device_from_env
    from nanotron_ext.runtime.engine import train_step

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    dtype = dtype or cfg.run.dtype
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_TORCH_DTYPES)}")
    run = cfg.run
    torch.set_num_threads(1)
    with GlooParallelContext(run.tp, run.pp, run.dp, timeout_s=300) as ctx:
        device = device_from_env()
        rec = CudaMemoryRecorder(device).start() if device.type == "cuda" else MemoryRecorder().start()
        rec.mark("start")
        model, optimizer, grad_acc = _build(cfg, ctx, block_ranks, dtype, seed)
        rec.mark("built")
        gradients = _mark_the_optimizer_step(optimizer, getattr(model, "module", model), rec)
        stream = random_micro_batches(model, ctx, cfg.model.vocab_size, run.micro_batch_size, run.sequence_length, seed)
        for _ in range(steps):
            rec.mark("step:start")
            train_step(model, ctx, run.engine, stream, run.n_micro_batches, optimizer, grad_accumulator=grad_acc)
            rec.mark("step:end")
        result = _measurements(rec.stop(), ctx, getattr(model, "module", model), optimizer, gradients)
        return {**result, "device": str(device)}


def _build(cfg: PlannerConfig, ctx: Any, block_ranks: Sequence[int], dtype: str, seed: int) -> tuple[Any, Any, Any]:
    """The CPU Llama with ``block_ranks``' split on this rank, its optimizer and gradient accumulator."""
    from nanotron.config import ParallelismArgs

    from nanotron_ext.models.profiled_blocks import llama_config_from_shape
    from nanotron_ext.runtime.cpu_model import build_cpu_llama
    from nanotron_ext.runtime.engine import build_optimizer, make_engine

    run = cfg.run
    parallel_config = ParallelismArgs(
        dp=run.dp,
        pp=run.pp,
        tp=run.tp,
        pp_engine=make_engine(run.engine),
        tp_mode=run.tp_mode,
        tp_linear_async_communication=False,
    )
    torch.manual_seed(seed)
    model = build_cpu_llama(
        llama_config_from_shape(cfg),
        ctx,
        block_ranks=list(block_ranks),
        parallel_config=parallel_config,
        dtype=_TORCH_DTYPES[dtype],
        vocab_shards=cfg.vocab_shards,
        recompute_layer=run.recompute_layer,
    )
    optimizer, grad_acc = build_optimizer(model, ctx, learning_rate=1e-4)
    return model, optimizer, grad_acc


def _mark_the_optimizer_step(optimizer: Any, model: Any, rec: MemoryRecorder) -> dict[str, int]:
    """Wrap ``optimizer.step`` in marks; the returned dict gets the bytes of the gradients it was given."""
    sizes: dict[str, int] = {}
    if optimizer is None:
        return sizes
    inner_step = optimizer.step

    def step_with_marks() -> None:
        # The gradients are complete (and synchronised) here; count them before Adam frees nothing.
        sizes["gradients"] = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        rec.mark("optimizer:start")
        inner_step()
        rec.mark("optimizer:end")

    optimizer.step = step_with_marks
    return sizes


def _measurements(trace: MemoryTrace, ctx: Any, model: Any, optimizer: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """This rank's figures (see :func:`measure_training_memory`) from the trace and the live tensors."""
    from nanotron import distributed as dist

    has_opt = optimizer is not None
    state = optimizer.get_base_optimizer().state if has_opt else {}
    return {
        "pp_rank": dist.get_rank(ctx.pp_pg),
        "tp_rank": dist.get_rank(ctx.tp_pg),
        "params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "peak": trace.peak,
        "weights": _tensor_bytes(model.parameters()),
        "gradients": sizes.get("gradients", 0),
        "optimizer": _tensor_bytes(t for st in state.values() for t in st.values() if isinstance(t, torch.Tensor)),
        "step_start": trace.live_at("step:start"),
        "pipeline_peak": trace.peak_between("step:start", "optimizer:start" if has_opt else "step:end"),
        "optimizer_peak": trace.peak_between("optimizer:start", "optimizer:end") if has_opt else 0,
    }


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
