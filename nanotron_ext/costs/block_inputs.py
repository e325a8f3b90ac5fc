"""What a timed block call starts from, as inside a pipeline: hot inputs of one micro-batch's shape, and cold
caches (see :mod:`nanotron_ext.costs.profiled`).

Each timed forward, backward and optimizer step starts with cold caches (:func:`flush_caches`, as Triton's
``do_bench`` clears the GPU's L2) and hot inputs: inside a pipeline the other blocks, micro-batches and ranks run
between two calls of a block and evict its weights and saved activations, while its input (or output gradient) was
just made by its neighbour. On the seed model's first stage (memory-bound blocks of a few hundred microseconds)
warm-cache timings were half of what the blocks took in Nanotron's engine (2.2 against 4.4 ms per micro-batch);
timed this way, 4.1 ms.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["FLUSH_BYTES_MIN", "FLUSH_MIB_VARIABLE", "flush_bytes", "flush_caches"]


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
        stats = {
            "running_max": act(s, b, float_dtype=torch.float32).detach(),
            "running_sumexp": act(s, b, float_dtype=torch.float32).abs(),
            "target_logit": act(s, b, float_dtype=torch.float32),
        }
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
        _flush_buffers[key] = torch.zeros(flush_bytes(device.type) // 4, dtype=torch.float32, device=device)
    _flush_buffers[key].add_(1.0)
    _sync(device)


#: Overrides the flush's size, in MiB: a host whose last-level cache is shared and huge (this project's CI VM reports
#: 480 MiB, so every timed call would first write 960 MiB) calibrates faster with less, at the price of a block's
#: weights perhaps still partly cached when it is timed.
FLUSH_MIB_VARIABLE = "NANOTRON_EXT_FLUSH_MIB"


def flush_bytes(device_type: str) -> int:
    """Bytes :func:`flush_caches` writes on ``device_type``: ``NANOTRON_EXT_FLUSH_MIB`` where set, else twice the
    last-level cache on CPU, at least :data:`FLUSH_BYTES_MIN`.

    Raises:
        ConfigError: the variable is not a whole number of MiB >= 1.
    """
    value = os.environ.get(FLUSH_MIB_VARIABLE, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"{FLUSH_MIB_VARIABLE}={value!r} must be a whole number of MiB >= 1 (the bytes written "
                f"between timed calls to evict the caches); unset it for twice the last-level cache"
            )
        return int(value) * 2**20
    return max(
        FLUSH_BYTES_MIN.get(device_type, FLUSH_BYTES_MIN["cpu"]),
        2 * _last_level_cache_bytes() if device_type == "cpu" else 0,
    )


def _last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for CPU 0 (0 where it reports none)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = entry.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)
