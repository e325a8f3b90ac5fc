"""The CPU Llama's initialisation (:meth:`~nanotron_ext.models.llama.CPULlamaForTraining.init_model_randomly`), the
same whatever the split: each parameter draws from its own RNG stream, seeded from ``torch.initial_seed()`` and the
parameter's full (tied-aware) name; a sharded (TP) parameter is drawn at its full shape and sliced; a vocabulary
shard takes its rows of the unsplit lm_head's draw."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from nanotron.parallel.parameters import NanotronParameter
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
)
from torch import nn

from nanotron_ext.blocks import vocab_slices
from nanotron_ext.models.llama_layers import RMSNorm
from nanotron_ext.models.vocab_chain import VocabShard

__all__ = ["init_randomly"]


def init_randomly(
    model: nn.Module, init_method: Callable[[torch.Tensor], Any], scaled_init_method: Callable[[torch.Tensor], Any]
) -> None:
    """Initialise every local parameter of ``model`` (a ``CPULlamaForTraining``); see the module docstring."""
    base_seed = torch.initial_seed()
    module_id_to_prefix = {id(module): f"{name}." for name, module in model.named_modules()}
    module_id_to_prefix[id(model)] = ""
    initialized: set[str] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(param, NanotronParameter) and param.is_tied:
                full_name = param.get_tied_info().get_full_name_from_module_id_to_prefix(module_id_to_prefix)
            else:
                full_name = f"{module_name}.{param_name}"
            if full_name in initialized:
                continue
            if param_name == "bias":
                param.zero_()
            elif isinstance(module, VocabShard):
                _init_vocab_shard(model, param, module, init_method, base_seed)
            elif isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif isinstance(module, TensorParallelRowLinear):
                _seeded_init(param, full_name, scaled_init_method, base_seed)
            elif isinstance(module, (TensorParallelColumnLinear, TensorParallelEmbedding, nn.Linear)):
                _seeded_init(param, full_name, init_method, base_seed)
            else:
                raise ValueError(
                    f"init_model_randomly does not know how to initialise {full_name} (module {type(module).__name__})."
                )
            initialized.add(full_name)


def _init_vocab_shard(
    model: nn.Module, param: torch.Tensor, shard: VocabShard, init: Callable[[torch.Tensor], Any], base_seed: int
) -> None:
    # The rows the unsplit lm_head would get: same stream, same full draw, so K shards start from exactly
    # the weights of vocab_shards: 1 and the two models can be compared step for step.
    vocab = model.config.vocab_size
    assert (shard.lo, shard.hi) in vocab_slices(vocab, model.model.n_vocab_shards)
    full = torch.empty(vocab, model.config.hidden_size)
    _seeded_init(full, "model.lm_head.pp_block.weight", init, base_seed)
    param.copy_(full[shard.lo : shard.hi].to(dtype=param.dtype))


def _seeded_init(param: torch.Tensor, name: str, init: Callable[[torch.Tensor], Any], base_seed: int) -> None:
    sharded = isinstance(param, NanotronParameter) and param.is_sharded
    shape = tuple(param.get_sharded_info().unsharded_shape) if sharded else tuple(param.shape)
    # fork_rng keeps the caller's global RNG untouched (init methods draw from the global generator).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_name_seed(base_seed, name))
        full = torch.empty(shape, dtype=torch.float32, device="cpu")
        init(full)
    full = full.to(device=param.device, dtype=param.dtype)
    if not sharded:
        param.copy_(full)
        return
    for pair in param.get_sharded_info().local_global_slices_pairs:
        param[pair.local_slices].copy_(full[pair.global_slices])


def _name_seed(base_seed: int, name: str) -> int:
    # crc32 is stable across processes and Python runs (unlike hash()), so every rank and every PP layout
    # derives the same stream for the same parameter name.
    return (base_seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63 - 1)
