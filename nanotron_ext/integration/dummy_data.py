"""Nanotron's dummy data (``dataset: null``), made the same at any split and continuing on resume.

Upstream's ``dummy_infinite_data_generator`` seeds each pipeline rank's stream with ``seed × (1 + dp rank) × (1 +
pp rank)`` and draws the inputs on the input rank, the labels on the output rank: at pp=1 both come from one stream,
at pp=2 from two others, so one seed gives other data under another split; and a resumed run starts its stream
again. The launcher's generator draws sample ``g`` of a data stage from its own generator seeded by ``(seed, g)``;
dp rank ``d`` of ``D`` takes samples ``C + d, C + d + D, ...`` where ``C`` is the samples the stage has consumed
(0 on a fresh run, the checkpoint's count on a resume), the order a ``DistributedSampler`` deals them. Every rank
that needs a sample draws the same one, so the data depends on the seed and the sample index alone: the same at
any pp, tp, split or number of vocabulary shards, and continued, not restarted, on a resume. Keys, shapes, dtypes
and the ranks that get tensors (``TensorPointer`` elsewhere) are upstream's.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from nanotron_ext.integration.upstream_fixes import Patches

__all__ = ["install_dummy_data", "sample_indices"]

_UPSTREAM_ARGS = (
    "micro_batch_size",
    "sequence_length",
    "input_pp_rank",
    "output_pp_rank",
    "vocab_size",
    "seed",
    "parallel_context",
    "use_position_ids",
    "cp_pg",
)


def sample_indices(consumed: int, dp_rank: int, dp_size: int, micro_batch: int, micro_batch_size: int) -> list[int]:
    """The stage's sample indices in micro-batch ``micro_batch`` (counted from this run's start) of a dp rank.

    Example:
        >>> sample_indices(16, 1, 2, 0, 4)
        [17, 19, 21, 23]
    """
    first = micro_batch * micro_batch_size
    return [consumed + dp_rank + k * dp_size for k in range(first, first + micro_batch_size)]


def _sample(seed: int, index: int, vocab_size: int, sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * 2_654_435_761 + index) % 2**63)
    tokens = torch.randint(0, vocab_size, (2, sequence_length), dtype=torch.long, generator=generator)
    return tokens[0], tokens[1]


def _consumed(trainer: Any) -> int:
    metadata = getattr(trainer, "metadata", None)
    stages = getattr(metadata, "data_stages", None)
    if stages:
        return int(metadata.current_stage.consumed_train_samples)
    return int(getattr(metadata, "consumed_train_samples", 0) or 0)


def install_dummy_data(patches: Patches, trainer_module: Any) -> bool:
    """Replace upstream's dummy-data generator with the layout-free one; returns False (nothing installed) when the
    installed Nanotron's generator has another signature than the one this was written against, or lives elsewhere
    (Nanotron 0.2 has ``nanotron.dataloader``, whose generator keeps its own data)."""
    try:
        from nanotron.data import dataloader
    except ImportError:
        return False
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    original = getattr(dataloader, "dummy_infinite_data_generator", None)
    if original is None or tuple(inspect.signature(original).parameters) != _UPSTREAM_ARGS:
        return False
    current: list[Any] = []
    init = trainer_module.DistributedTrainer.__init__

    def remember_trainer(self: Any, *args: Any, **kwargs: Any) -> None:
        current.append(self)  # the generator is made after the trainer has loaded its checkpoint's metadata
        init(self, *args, **kwargs)

    patches.set(trainer_module.DistributedTrainer, "__init__", remember_trainer)

    def dummy_infinite_data_generator(
        micro_batch_size: int,
        sequence_length: int,
        input_pp_rank: int,
        output_pp_rank: int,
        vocab_size: int,
        seed: int,
        parallel_context: Any,
        use_position_ids: bool = False,
        cp_pg: Any = None,
    ) -> Any:
        import torch.distributed as dist

        cp_pg = cp_pg if cp_pg is not None else parallel_context.cp_pg
        cp_rank, cp_size = dist.get_rank(cp_pg), cp_pg.size()
        if sequence_length % cp_size:
            raise ValueError(f"sequence_length {sequence_length} must be divisible by cp_size {cp_size}")
        local = slice(cp_rank * sequence_length // cp_size, (cp_rank + 1) * sequence_length // cp_size)
        consumed = _consumed(current[-1]) if current else 0
        dp_rank, dp_size = dist.get_rank(parallel_context.dp_pg), parallel_context.dp_pg.size()
        pp_rank = dist.get_rank(parallel_context.pp_pg)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

        def data_generator() -> Iterator[dict[str, Any]]:
            micro_batch = 0
            while True:
                rows = [
                    _sample(seed, g, vocab_size, sequence_length)
                    for g in sample_indices(consumed, dp_rank, dp_size, micro_batch, micro_batch_size)
                ]
                micro_batch += 1
                inputs = torch.stack([r[0] for r in rows]).to(device)[:, local]
                labels = torch.stack([r[1] for r in rows]).to(device)[:, local]
                ones = torch.ones(micro_batch_size, sequence_length, dtype=torch.bool, device=device)[:, local]
                here_in, here_out = pp_rank == input_pp_rank, pp_rank == output_pp_rank
                batch: dict[str, Any] = {"input_ids": inputs if here_in else TensorPointer(group_rank=input_pp_rank)}
                if use_position_ids:
                    batch["position_ids"] = (
                        _position_ids(micro_batch_size, sequence_length, device)[:, local]
                        if here_in
                        else TensorPointer(group_rank=input_pp_rank)
                    )
                else:
                    batch["input_mask"] = ones if here_in else TensorPointer(group_rank=input_pp_rank)
                batch["label_ids"] = labels if here_out else TensorPointer(group_rank=output_pp_rank)
                batch["label_mask"] = ones if here_out else TensorPointer(group_rank=output_pp_rank)
                yield batch

        return data_generator

    patches.set(dataloader, "dummy_infinite_data_generator", dummy_infinite_data_generator)
    return True


def _position_ids(micro_batch_size: int, sequence_length: int, device: torch.device) -> torch.Tensor:
    """Upstream's packed-sequence positions: documents of 4, 6 and the rest in the first sample, one in the others."""
    lengths = [[4, 6, sequence_length - 10]] + [[sequence_length]] * (micro_batch_size - 1)
    out = torch.full((micro_batch_size, sequence_length), -1, dtype=torch.long)
    for i, docs in enumerate(lengths):
        start = 0
        for n in docs:
            out[i, start : start + n] = torch.arange(n)
            start += n
    return out.to(device)
