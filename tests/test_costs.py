"""The cost model, with the numbers written out."""

from __future__ import annotations

import dataclasses

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import in_flight, static_bytes, trainable_before, training_flops
from nanotron_ext.inventory import inventory_from_config


def test_llama2_7b_flops_match_the_standard_count():
    cfg = load_config(bundled_config("llama_2_7b.yaml"))
    assert (cfg.run.sequence_length, cfg.run.micro_batch_size) == (4096, 1)
    blocks = inventory_from_config(cfg)
    # Llama-2-7B has 6,738,415,616 parameters; without the 32000 x 4096 input embedding: 6,607,343,616.
    assert sum(b.params for b in blocks) == 6_738_415_616
    non_embedding = 6_738_415_616 - 32_000 * 4_096
    tokens, layers, hidden, seq = 4_096, 32, 4_096, 4_096
    # 6·N·T for the matmuls (forward + two backward) plus 12·L·h·s per token for attention (PaLM, App. B).
    standard = 6 * non_embedding * tokens + 12 * layers * hidden * seq * tokens
    ours = sum(training_flops(blocks))
    assert abs(ours / standard - 1) < 0.02, ours / standard


def test_frozen_prefix_costs_forward_only_and_frozen_after_trainable_costs_input_gradient():
    cfg = load_config(bundled_config())
    blocks = inventory_from_config(cfg)
    emb, dec0, dec1 = blocks[0], blocks[1], blocks[2]
    frozen = [dataclasses.replace(b, trainable=0) for b in blocks]
    # Everything frozen except decoder.0: the embedding before it costs forward only; decoder.0 costs forward
    # plus weight-gradient (nothing trainable before it, so no input-gradient); the frozen decoder.1 after it
    # costs forward plus input-gradient.
    frozen[1] = dec0
    # 7 blocks: nothing trains before decoder.0, everything after it has decoder.0 before it.
    assert trainable_before(frozen) == [False, False] + [True] * 6
    assert trainable_before(blocks) == [False] + [True] * 7
    costs = training_flops(frozen)
    assert costs[0] == emb.flops_fwd == 64 * 16  # a gather: t·h, t = 2 sequences × 32 tokens
    assert costs[1] == dec0.flops_fwd + dec0.flops_bwd_weight
    assert costs[2] == dec1.flops_fwd + dec1.flops_bwd_input
    t, h, s, lin = 64, 16, 32, 4_096  # tokens, hidden, sequence, linear weights of one layer
    assert dec1.flops_fwd == 2 * t * lin + 4 * t * s * h + 2 * 4 * t * h
    assert dec1.flops_bwd_input == 2 * t * lin + 8 * t * s * h + 2 * 2 * 4 * t * h


def test_memory_model():
    cfg = load_config(bundled_config("llama_3_8b.yaml"))
    lm_head = next(b for b in inventory_from_config(cfg) if b.role == "lm_head")
    # bf16 weights (2) + fp32 grad buffer (4) + the bf16 .grad until it is accumulated (2) + Adam states (8) +
    # fp32 master (4) = 20 bytes per trainable weight.
    assert static_bytes(lm_head, cfg.run) == 128_256 * 4_096 * 20
    frozen = dataclasses.replace(lm_head, trainable=0)
    assert static_bytes(frozen, cfg.run) == 128_256 * 4_096 * 2
    zero1 = dataclasses.replace(cfg.run, zero_stage=1, dp=4)
    # dp=4: DDP's bf16 bucket (+2) too.
    assert static_bytes(lm_head, zero1) == 128_256 * 4_096 * (2 + 4 + 2 + 2 + 12 / 4)
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert in_flight("afab", 4, 8) == [8, 8, 8, 8]
