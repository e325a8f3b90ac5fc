"""The estimate of Nanotron's GPU path (issue 30, item 2): a Llama's and a Qwen2's decoder layer and final norm
counted for what upstream's code keeps (fused RMSNorm, flash-attn), by hand on tiny shapes; the other families and
the CPU runtime keep the CPU runtime's count. Measured against upstream's own model in
tests/upstream/test_gpu_path_measured.py."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.block_memory import block_memory
from nanotron_ext.costs.gpu_memory import gpu_path
from nanotron_ext.inventory import inventory_from_config

TINY = load_config(bundled_config())  # hidden 16, 4 heads (head_dim 4), intermediate 64, fp32, seq 32, mb 2


def _block(cfg, role: str):
    return next(b for b in inventory_from_config(cfg) if b.role == role)


def _shape(cfg, **model):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def test_a_multi_head_decoder_on_the_gpu_path_by_hand():
    t, h, w = 2 * 32, 16, 4  # tokens, hidden, fp32
    # norms: the input itself and rstd, twice; the qkv and gate_up linears keep the norms' outputs;
    # attention: the contiguous [3, ...] q|k|v copy (q is a view of it), the rotated k|v tensor, the output, the
    # o_proj copy (2 sequences), fp32 lse per head; MLP 4f.
    norms = 2 * t * (h * w + 4)
    linears = 2 * t * h * w
    attention = t * w * (16 + 2 * 16 + 16 + 16) + t * 4 * 4 + t * w * 2 * 16
    mlp = t * w * 4 * 64
    mem = block_memory(_block(TINY, "decoder"), TINY.model, TINY.run, "gpu")
    assert mem.saved == norms + linears + attention + mlp
    assert mem.input_saved and mem.input == t * h * w + t
    assert mem.forward_temp == t * w * (48 + 2 * 16)  # the qkv output and the concatenated k|v
    assert mem.persistent == 2 * 32 * 2 * w  # flash's cos/sin cache: seq × head_dim/2, model dtype


def test_a_grouped_query_decoder_keeps_k_and_v_at_their_own_width_and_one_sequence_no_o_proj_copy():
    cfg = _shape(TINY, num_key_value_heads=2)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, micro_batch_size=1))
    t, h, w, q, kv = 32, 16, 4, 16, 8
    mem = block_memory(_block(cfg, "decoder"), cfg.model, cfg.run, "gpu")
    attention = t * w * (q + 2 * kv + q) + t * 4 * 4  # q, k|v, output, lse; no o_proj copy for one sequence
    assert mem.saved == 2 * t * (h * w + 4) + 2 * t * h * w + attention + t * w * 4 * 64
    assert mem.forward_temp == t * w * ((q + 2 * kv) + 2 * kv + 2 * kv)  # qkv output, k and v copies, their cat
    bf16 = block_memory(_block(cfg, "decoder"), cfg.model, dataclasses.replace(cfg.run, dtype="bfloat16"), "gpu")
    assert bf16.persistent == 2 * 32 * 2 * 2  # flash's cos/sin cache is in the model dtype (the CPU path's: fp32)
    cpu = block_memory(_block(cfg, "decoder"), cfg.model, cfg.run, "cpu")
    assert cpu.saved > mem.saved  # the CPU path keeps fp32 norms and k, v repeated to every head


def test_the_final_norm_on_the_gpu_path_keeps_its_input_and_rstd():
    t, h, w = 64, 16, 4
    mem = block_memory(_block(TINY, "final_norm"), TINY.model, TINY.run, "gpu")
    assert (mem.saved, mem.input_saved, mem.backward_temp - 16 * w) == (t * (h * w + 4), True, t * h * w)


def test_sequence_parallel_linears_keep_the_shard_unless_upstream_is_told_to_keep_the_gathered_input():
    base = dataclasses.replace(TINY.run, tp=2, tp_mode="REDUCE_SCATTER")
    block = _block(TINY, "decoder")
    shard = block_memory(block, TINY.model, base, "gpu")
    gathered = block_memory(block, TINY.model, dataclasses.replace(base, tp_recompute_allgather=False), "gpu")
    assert gathered.saved - shard.saved == 2 * (64 - 32) * 16 * 4  # two linears' inputs, t vs t / tp tokens


def test_a_qwen2_decoder_on_the_gpu_path_by_hand():
    # Qwen2 (models/qwen.py): the input norm is always the unfused LlamaRMSNorm (fp32 copy, rsqrt, normalised),
    # the post-attention norm the fused one; q and k|v are views of the qkv output, which flash-attn keeps whole
    # beside its output and lse; no o_proj copy ([tokens, q] is contiguous).
    cfg = _shape(TINY, family="qwen2", num_key_value_heads=2)
    t, h, w, q, kv = 64, 16, 4, 16, 8
    unfused, fused = t * (4 * h + 4 + w * h), t * (h * w + 4)
    attention = t * (w * ((q + 2 * kv) + q) + 4 * 4)
    expected = unfused + fused + 2 * t * h * w + attention + t * w * 4 * 64
    mem = block_memory(_block(TINY, "decoder"), cfg.model, cfg.run, "gpu")
    assert (mem.saved, mem.forward_temp, mem.input_saved) == (expected, t * h * 4, True)
    plain = _shape(cfg, fused_rms_norm=False)
    assert block_memory(_block(TINY, "decoder"), plain.model, plain.run, "gpu").saved == expected - fused + unfused
    # Its final norm: the fused one under _fused_rms_norm, else the CPU runtime's count.
    final = _block(TINY, "final_norm")
    assert block_memory(final, cfg.model, cfg.run, "gpu").saved == fused
    assert block_memory(final, plain.model, plain.run, "gpu") == block_memory(final, plain.model, plain.run, "cpu")


def test_fused_rms_norm_is_read_from_a_qwen2_config():
    import yaml

    from nanotron_ext.config import config_from_dict

    raw = yaml.safe_load(bundled_config("smollm3_3b.yaml").read_text())
    assert config_from_dict(raw).model.fused_rms_norm
    raw["model"]["model_config"]["_fused_rms_norm"] = False
    assert not config_from_dict(raw).model.fused_rms_norm


@pytest.mark.parametrize("family", ["starcoder2", "llamoe"])
def test_other_families_and_the_cpu_runtime_keep_the_cpu_count(family):
    assert gpu_path(TINY.model, "gpu") and not gpu_path(TINY.model, "cpu")
    other = dataclasses.replace(TINY.model, family=family)
    assert not gpu_path(other, "gpu")
    block = _block(TINY, "decoder")
    assert block_memory(block, other, TINY.run, "gpu") == block_memory(block, other, TINY.run, "cpu")


def test_tp_recompute_allgather_is_read_from_the_yaml_strictly():
    import yaml

    from nanotron_ext.config import config_from_dict
    from nanotron_ext.errors import ConfigError

    raw = yaml.safe_load(bundled_config().read_text())
    assert config_from_dict(raw).run.tp_recompute_allgather  # upstream's default
    raw["parallelism"]["tp_recompute_allgather"] = False
    assert not config_from_dict(raw).run.tp_recompute_allgather
    raw["parallelism"]["tp_recompute_allgather"] = "no"
    with pytest.raises(ConfigError, match=r"parallelism.tp_recompute_allgather='no' must be true or false"):
        config_from_dict(raw)
