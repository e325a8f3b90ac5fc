"""The shape records a config is read into: the model (:class:`ModelShape`, with its family) and one training step's
parallelism and batch (:class:`RunShape`), each checking its own fields; :mod:`nanotron_ext.config` reads them from
the YAML and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nanotron_ext.config_ext import check_choice
from nanotron_ext.errors import ConfigError, check_positive_int
from nanotron_ext.families import Family, MoEShape
from nanotron_ext.schedule import EngineSetting

__all__ = ["DTYPE_BYTES", "DType", "ModelShape", "RunShape", "TPMode"]

DType = Literal["float32", "bfloat16", "float16"]
TPMode = Literal["ALL_REDUCE", "REDUCE_SCATTER"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The shape fields the planner prices (Nanotron's ``LlamaConfig`` names), and the model family.

    Attributes:
        family: ``llama``, ``qwen2``, ``starcoder2`` or ``llamoe`` (:mod:`nanotron_ext.families`).
        attention_bias: Qwen2's qkv projection has a bias.
        fused_rms_norm: Qwen2's ``_fused_rms_norm`` (its post-attention and final norms are Triton's fused one).
        moe: the mixture-of-experts layers, None for a dense model.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    family: Family = "llama"
    attention_bias: bool = False
    moe: MoEShape | None = None
    fused_rms_norm: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            check_positive_int(f"model_config.{name}", getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        check_positive_int("model_config.num_key_value_heads", self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model_config.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model_config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs an integer group size"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def moe_layer(self, layer: int | None) -> bool:
        """Whether decoder layer ``layer`` is a mixture of experts."""
        return self.moe is not None and layer is not None and layer in self.moe.layers


@dataclass(frozen=True)
class RunShape:
    """Parallelism and batch shape of one training step."""

    dp: int
    pp: int
    tp: int
    sequence_length: int
    micro_batch_size: int
    n_micro_batches: int  # Nanotron's tokens.batch_accumulation_per_replica
    engine: EngineSetting = "afab"  # Nanotron's default pp_engine; "auto": the planner chooses (plan.engine_choice)
    dtype: DType = "bfloat16"
    zero_stage: int = 0
    accumulate_grad_in_fp32: bool = False
    tp_mode: TPMode = "ALL_REDUCE"  # Nanotron's parallelism.tp_mode (REDUCE_SCATTER: sequence parallel)
    tp_async: bool = False  # parallelism.tp_linear_async_communication
    torch_adam_is_fused: bool = False  # optimizer.torch_adam_is_fused
    recompute_layer: bool = False  # parallelism.recompute_layer (upstream main): each decoder layer recomputed
    tp_recompute_allgather: bool = True  # parallelism.tp_recompute_allgather (upstream main): SP linears keep the shard

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "sequence_length", "micro_batch_size", "n_micro_batches"):
            check_positive_int(name, getattr(self, name))
        check_choice("parallelism.pp_engine", self.engine, EngineSetting)
        check_choice("model.dtype", self.dtype, DType)
        check_choice("parallelism.tp_mode", self.tp_mode, TPMode)
        if self.zero_stage not in (0, 1):
            raise ConfigError(f"optimizer.zero_stage={self.zero_stage!r}: Nanotron supports 0 or 1")
        for name in ("recompute_layer", "tp_recompute_allgather"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"parallelism.{name}={getattr(self, name)!r} must be true or false")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.sequence_length * self.micro_batch_size
