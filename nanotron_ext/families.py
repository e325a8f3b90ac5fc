"""Which of Nanotron's model families a ``model_config`` describes, read the way Nanotron's loader reads it.

Nanotron (``nanotron/config/config.py``, ``ModelArgs``) loads ``model_config`` with strict dacite into the first of
``LlamaConfig``, ``Starcoder2Config``, ``Qwen2Config`` that takes every key, so the marker keys
(``is_llama_config``, ``is_qwen2_config``, ...) and any family-only key decide; a dict that none takes becomes a
``Qwen2Config``. LlaMoE is upstream's MoE example (``examples/moe``), marked ``is_llamoe_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from nanotron_ext.errors import ConfigError, check_positive_int

__all__ = ["FAMILIES", "Family", "MoEShape", "model_family", "moe_shape"]

Family = Literal["llama", "qwen2", "starcoder2", "llamoe"]
FAMILIES: tuple[str, ...] = get_args(Family)

_MARKERS: dict[str, str] = {
    "is_llama_config": "llama",
    "is_qwen2_config": "qwen2",
    "is_starcoder2_config": "starcoder2",
    "is_llamoe_config": "llamoe",
    "is_mamba_config": "mamba",
}
# Keys only one family's config class has (a strict loader then picks that class).
_ONLY: dict[str, frozenset[str]] = {
    "mamba": frozenset({"d_model", "ssm_cfg", "fused_add_norm", "residual_in_fp32", "pad_vocab_size_multiple"}),
    "llamoe": frozenset({"moe_num_experts", "num_experts_per_tok", "moe_capacity_factor"}),
    "starcoder2": frozenset(
        {
            "num_kv_heads",
            "multi_query",
            "grouped_query",
            "global_attn_layers",
            "activation_function",
            "layer_norm_epsilon",
            "embd_pdrop",
            "attn_pdrop",
            "resid_pdrop",
        }
    ),
    "qwen2": frozenset(
        {
            "moe_config",
            "sliding_window_size",
            "flex_attention_mask",
            "no_rope_layer",
            "rope_seq_len_interpolation_factor",
            "_fused_rotary_emb",
            "_fused_rms_norm",
            "_use_qkv_packed",
            "_use_doc_masking",
            "log_attn_probs",
            "ring_attn_heads_k_stride",
        }
    ),
}


def model_family(model_config: dict[str, Any], *, source: str = "<dict>") -> Family:
    """The family of a YAML ``model_config``.

    Raises:
        ConfigError: a family nanotron_ext cannot price (Mamba), naming it and what works instead.

    Example:
        >>> model_family({"is_qwen2_config": True, "hidden_size": 8})
        'qwen2'
    """
    family = next((f for key, f in _MARKERS.items() if model_config.get(key) is True), None)
    if family is None:
        family = next((f for f, keys in _ONLY.items() if keys & set(model_config)), "llama")
    if family not in FAMILIES:
        raise ConfigError(
            f"{source}: model family {family!r} cannot be planned from its config: nanotron_ext prices the blocks of "
            f"{', '.join(FAMILIES)} models. For another architecture, plan on the model itself "
            f"(nanotron_ext.integration.build_model / patch_nanotron read its PipelineBlocks) with "
            f"`cost_strategy: uniform`, an explicit `layout:` under `nanotron_ext:`, or a strategy you register "
            f"(`cost_strategy: package.module:MyStrategy`)"
        )
    return family  # type: ignore[return-value]


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a decoder layer.

    Attributes:
        num_experts: experts per MoE layer (all of them hold weights).
        top_k: experts each token runs through (the FLOPs count these).
        expert_intermediate_size: hidden width of one expert.
        layers: indices of the MoE layers; the others are dense.
        shared_expert_intermediate_size: width of the always-on shared expert, 0 for none.
        glu: experts are gated (three matrices, Qwen2) or plain (two, LlaMoE).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0
    glu: bool = True


def moe_shape(family: str, model_config: dict[str, Any], num_layers: int, *, source: str = "<dict>") -> MoEShape | None:
    """The MoE shape of a ``model_config``, or None for a dense model (Nanotron's defaults where a key is absent).

    Raises:
        ConfigError: a non-positive expert count, ``top_k`` above it, or a layer index out of range.
    """
    if family == "llamoe":
        shape = MoEShape(
            num_experts=model_config.get("moe_num_experts", 1),
            top_k=model_config.get("num_experts_per_tok", 1),
            expert_intermediate_size=model_config.get("intermediate_size", 11008),
            layers=tuple(range(num_layers)),
            glu=False,
        )
    elif family == "qwen2" and isinstance(model_config.get("moe_config"), dict):
        moe = model_config["moe_config"]
        layers = list(moe.get("layers", [-1]))
        shape = MoEShape(
            num_experts=moe.get("num_experts", 8),
            top_k=moe.get("top_k", 2),
            expert_intermediate_size=moe.get("moe_intermediate_size", 1408),
            layers=tuple(range(num_layers)) if layers == [-1] else tuple(layers),
            shared_expert_intermediate_size=(
                moe.get("shared_expert_intermediate_size", 5632) if moe.get("enable_shared_expert", False) else 0
            ),
        )
    else:
        return None
    for name in ("num_experts", "top_k", "expert_intermediate_size"):
        check_positive_int(f"MoE {name}", getattr(shape, name), source=source)
    if shape.top_k > shape.num_experts:
        raise ConfigError(f"{source}: MoE top_k={shape.top_k} is above num_experts={shape.num_experts}; lower top_k")
    bad = [i for i in shape.layers if not (isinstance(i, int) and 0 <= i < num_layers)]
    if bad:
        raise ConfigError(
            f"{source}: moe_config.layers {bad} are not layers of a {num_layers}-layer model; use "
            f"indices 0..{num_layers - 1} or [-1] for all"
        )
    return shape
