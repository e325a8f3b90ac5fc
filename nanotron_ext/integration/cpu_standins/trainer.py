"""The stand-ins that let upstream Nanotron's own trainer run on CPU over gloo (the launcher's ``--cpu-debug``).

Each replaces only a call that needs CUDA (device selection, the NCCL init, devices written as ``"cuda"``, CUDA timers
and memory stats, NCCL's non-blocking sends), plus one log line (torch's environment report). None of them touches
what a debugging run is for: which block is built on which rank, freezing, whether DDP and the optimizer are built
and with which parameters, the pipeline engine's schedule, and checkpoints and resumes. The list, with the reason
each is safe, is in docs/stand-ins.md ("Upstream's trainer on CPU").
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install"]

_CPU = torch.device("cpu")


def _is_cuda(value: Any) -> bool:
    return (isinstance(value, str) and value.startswith("cuda")) or (
        isinstance(value, torch.device) and value.type == "cuda"
    )


class _CudaToCpu(TorchFunctionMode):
    """Allocations that upstream writes as ``device="cuda"`` (buffers, counters, data) land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = {k: _CPU if _is_cuda(v) else v for k, v in (kwargs or {}).items()}
        args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _torch_with_cpu_generator() -> types.ModuleType:
    # The dummy-data generator asks for torch.Generator(device="cuda"); a class constructor is not seen by a
    # TorchFunctionMode, so this one module gets a torch whose Generator is made on the CPU.
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    proxy.Generator = lambda device="cpu": torch.Generator(device=_CPU if _is_cuda(device) else device)
    return proxy


def _waiting_for_sends(train_batch_iter: Any, wait: Any) -> Any:
    def run(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = train_batch_iter(self, model, *args, **kwargs)
        wait(model)
        return outputs

    return run


_installed = False


def install() -> None:
    """Apply every stand-in in this process (a rank, before the launcher runs the script); a second call does
    nothing. Nothing is undone: the process is a ``--cpu-debug`` run to its end."""
    global _installed
    if _installed:
        return
    _installed = True
    _gloo_process_groups()
    _cpu_devices()
    _gloo_p2p()
    _gloo_all_reduce()
    _cpu_bookkeeping()


def _gloo_process_groups() -> None:
    import nanotron.distributed as ndist
    from nanotron.parallel import context

    # 1. No GPU to select; the process groups stay upstream's own, made over gloo.
    context.ParallelContext.set_device = lambda self: None

    # 2. Upstream's init refuses to start without CUDA; start the same env:// process group over gloo.
    def init_gloo() -> bool:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend="gloo")
        return True

    ndist.initialize_torch_distributed = init_gloo


def _cpu_devices() -> None:
    from nanotron.data import dataloader

    # 3. "cuda" written into upstream's code becomes "cpu" (a mode for the whole process; it does not see
    # class constructors, hence the generator of the dummy data).
    _CudaToCpu().__enter__()
    dataloader.torch = _torch_with_cpu_generator()


def _gloo_p2p() -> None:
    # 4. Pipeline P2P: NCCL sends never block the host; gloo's do until the peer receives, and 1F1B then
    # deadlocks (stage 0 sends micro-batch k+1 while stage 1 sends micro-batch k's gradient) as soon as a cut
    # carries two tensors. The models get GlooP2P: Nanotron's wire format, sends posted with isend and waited for
    # after each train_batch_iter (of every engine the trainer may run, zero-bubble's included); it also keeps its
    # buffers on the CPU.
    from nanotron.models import llama, qwen
    from nanotron.parallel.pipeline_parallel import engine

    from nanotron_ext.integration.gloo_p2p import GlooP2P, wait_pending_sends
    from nanotron_ext.zero_bubble import ZeroBubblePipelineEngine

    for module in (llama, qwen):
        module.P2P = lambda pg, device: GlooP2P(pg, _CPU)
    engines = (
        engine.AllForwardAllBackwardPipelineEngine,
        engine.OneForwardOneBackwardPipelineEngine,
        ZeroBubblePipelineEngine,
    )
    for cls in engines:
        cls.train_batch_iter = _waiting_for_sends(cls.train_batch_iter, wait_pending_sends)


def _gloo_all_reduce() -> None:
    import nanotron.distributed as ndist

    # 5. gloo runs AVG as a sum and an in-place divide, which autograd refuses on a leaf that needs a gradient
    # (NCCL reduces in place outside autograd); the values are the same.
    original_all_reduce = ndist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        guard = torch.no_grad() if tensor.requires_grad and tensor.is_leaf else contextlib.nullcontext()
        with guard:
            return original_all_reduce(tensor, *args, **kwargs)

    ndist.all_reduce = all_reduce


def _cpu_bookkeeping() -> None:
    import nanotron.logging.timers as timers

    # 6. CUDA-only bookkeeping: the peak-memory reset, and CUDA timers (which turn into CPU timers on first use
    # and then fail the next lookup by type).
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    original_timer = timers.Timers.__call__

    def timer(self: Any, name: Any = None, timer_type: Any = timers.TimerType.CPU, *args: Any, **kwargs: Any) -> Any:
        return original_timer(self, name, timers.TimerType.CPU, *args, **kwargs)

    timers.Timers.__call__ = timer

    # 7. After a resume the trainer moves the loaded optimizer state to "cuda" and asserts it got there; here
    # the CPU is the device, so the state stays where it was loaded.
    import nanotron.trainer

    nanotron.trainer.state_dict_to_device = lambda state_dict, device: None
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))

    # 8. Not a CUDA call, and only a log line: torch's environment report (it runs pip and lscpu), which upstream's
    # trainer prints at start-up on rank 0 and which took 3.3 s of every ~8.5 s test run here.
    from torch.utils import collect_env

    collect_env.main = lambda: "(skipped by the CPU stand-ins)"
