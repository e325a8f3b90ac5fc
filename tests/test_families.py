"""Model families read from the YAML as Nanotron reads them, with hand-counted blocks and parameters.

The same shapes are checked against the models upstream Nanotron actually builds in
``tests/upstream/test_upstream_models.py``; these tests need no Nanotron at all.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, config_from_dict
from nanotron_ext.errors import ConfigError
from nanotron_ext.families import model_family
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan

BASE = yaml.safe_load(bundled_config().read_text())

# h 8, heads 2 (d 4), one kv head, f 16, 3 layers, vocabulary 32; experts: 4 of width 6, top-2, on layer 1
# only, with a shared expert of width 5.
QWEN_MOE = {
    "is_qwen2_config": True,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "num_hidden_layers": 3,
    "vocab_size": 32,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "moe_config": {
        "num_experts": 4,
        "top_k": 2,
        "moe_intermediate_size": 6,
        "layers": [1],
        "enable_shared_expert": True,
        "shared_expert_intermediate_size": 5,
    },
}


def _cfg(model_config: dict, **parallelism):
    raw = copy.deepcopy(BASE)
    raw["model"]["model_config"] = copy.deepcopy(model_config)
    raw["parallelism"].update(parallelism)
    return config_from_dict(raw, source="test")


def _params(block) -> dict[str, int]:
    return {p.name.split(".pp_block.", 1)[1]: p.numel for p in block.parameters}


@pytest.mark.parametrize(
    ("model_config", "family"),
    [
        ({"is_llama_config": True}, "llama"),
        ({"hidden_size": 8, "num_attention_heads": 2}, "llama"),  # only keys LlamaConfig has: dacite picks it first
        ({"is_qwen2_config": True}, "qwen2"),
        ({"moe_config": None, "hidden_size": 8}, "qwen2"),  # a Qwen2-only key
        ({"multi_query": True}, "starcoder2"),
        ({"is_llamoe_config": True, "moe_num_experts": 4}, "llamoe"),
    ],
)
def test_family_is_read_as_nanotron_reads_it(model_config, family):
    assert model_family(model_config) == family


def test_mamba_is_refused_with_what_works_instead():
    with pytest.raises(
        ConfigError,
        match=r"model family 'mamba' cannot be planned from its config.*"
        r"`cost_strategy: uniform`, an explicit `layout:`.*a strategy you register",
    ):
        model_family({"is_mamba_config": True, "d_model": 1536})


def test_qwen2_moe_blocks_hand_counted():
    blocks = inventory_from_config(_cfg(QWEN_MOE))
    # Qwen2 has no cast_to_fp32 block.
    assert [b.name for b in blocks] == [
        "model.token_position_embeddings",
        "model.decoder.0",
        "model.decoder.1",
        "model.decoder.2",
        "model.final_layer_norm",
        "model.lm_head",
        "loss",
    ]
    dense = {
        "input_layernorm.weight": 8,
        "attn.qkv_proj.weight": 128,
        "attn.qkv_proj.bias": 16,
        "attn.o_proj.weight": 64,
        "post_attention_layernorm.weight": 8,
        "mlp.gate_up_proj.weight": 256,
        "mlp.down_proj.weight": 128,
    }
    assert _params(blocks[1]) == _params(blocks[3]) == dense
    moe = {
        **{k: v for k, v in dense.items() if not k.startswith("mlp.")},
        "mlp.router.weight": 32,
        "mlp.shared_expert.gate_up_proj.weight": 80,
        "mlp.shared_expert.down_proj.weight": 40,
        "mlp.shared_expert_gate.weight": 8,
        "mlp.experts.merged_gate_up_proj": 384,
        "mlp.experts.merged_down_proj": 192,
    }
    assert _params(blocks[2]) == moe
    assert [b.params for b in blocks] == [256, 608, 960, 608, 8, 256, 0]
    # Nanotron's class cost ignores kv heads, biases and experts: 4·n·d·h + 3·f·h for every layer.
    assert [b.nanotron_cost for b in blocks] == [0, 640, 640, 640, 0, 256, 0]
    assert [b.builder for b in blocks][1:4] == ["Qwen2DecoderLayer"] * 3


def test_moe_flops_count_the_active_experts_and_memory_counts_all():
    cfg = _cfg(QWEN_MOE)
    blocks = inventory_from_config(cfg)
    t = cfg.run.micro_batch_size * cfg.run.sequence_length
    # Per token, the MoE layer runs router 32 + top-2 × 3 × 6 × 8 = 288 + shared 3 × 5 × 8 + 8 = 128 weights
    # in its MLP (448) where the dense layer runs 3 × 16 × 8 = 384: 64 more, at 2 FLOPs each.
    assert blocks[2].flops_fwd - blocks[1].flops_fwd == 2 * t * 64
    # All four experts hold weights: 960 parameters against 608.
    assert blocks[2].param_bytes - blocks[1].param_bytes == (960 - 608) * 4


def test_tensor_parallel_shards_experts_and_column_biases_not_the_router():
    blocks = inventory_from_config(_cfg({**QWEN_MOE, "num_key_value_heads": 2}, tp=2))
    p = _params(blocks[2])
    assert p["mlp.router.weight"] == 32 and p["input_layernorm.weight"] == 8
    # qkv bias (2 + 2·2) heads × 4 = 24 and the experts' down projection 4 × 6 × 8 = 192, halved.
    assert p["attn.qkv_proj.bias"] == 12 and p["mlp.experts.merged_down_proj"] == 96


def test_starcoder2_multi_query_blocks_hand_counted():
    sc = {
        "multi_query": True,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "intermediate_size": None,
    }
    blocks = inventory_from_config(_cfg(sc))
    assert [b.name for b in blocks] == [
        "model.token_embeddings",
        "model.embeds_dropout",
        "model.decoder.0",
        "model.final_layer_norm",
        "model.lm_head",
        "model.cast_to_fp32",
        "loss",
    ]
    # d 4, one kv head: q 64 + 8, kv 2·4·8 = 64 + 8, o 64 + 8; MLP 4h = 32: c_fc 256 + 32, c_proj 256 + 8.
    assert blocks[2].params == 16 + 72 + 72 + 72 + 16 + 288 + 264
    assert blocks[3].params == 16 and blocks[2].nanotron_cost == 4 * 2 * 4 * 8 + 2 * 32 * 8


def test_llamoe_experts_are_two_plain_matrices():
    lm = {
        "is_llamoe_config": True,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "moe_num_experts": 4,
        "num_experts_per_tok": 1,
    }
    blocks = inventory_from_config(_cfg(lm))
    # norms 16, qkv 3·8·8 = 192, o 64, gate 4·8 = 32, w1 and w2 8·16·4 = 512 each.
    assert blocks[1].params == 16 + 192 + 64 + 32 + 512 + 512
    assert blocks[-2].name == "model.cast_to_fp32"


def test_nanotron_rule_on_qwen2_has_no_cast_block_to_place():
    cfg = _cfg({**QWEN_MOE, "moe_config": None, "vocab_size": 4096}, pp=2)
    plan = make_plan(inventory_from_config(cfg), cfg, "nanotron")
    # lm_head (4096·8) outweighs three layers (3·640): it and everything before it on stage 0, the loss alone.
    assert plan.stage_map() == "0-5|6"
    assert [f.code for f in plan.findings if f.severity == "error"] == ["no-params"]


def test_plan_on_a_mamba_config_exits_2(tmp_path, capsys):
    raw = copy.deepcopy(BASE)
    raw["model"]["model_config"] = {"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 2, "vocab_size": 128}
    path = tmp_path / "mamba.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path)]) == 2
    assert "model family 'mamba' cannot be planned" in capsys.readouterr().err
