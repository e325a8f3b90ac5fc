"""The per-stage peak-memory estimate (``nanotron_ext.costs.memory_estimate``): exact tiny cases, term by term.

What it must match on the real runtime is checked with real processes in ``tests/runtime/test_memory_cap.py`` and
measured in ``benchmarks/measured_memory.py``; here each rule is pinned by a hand count.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from nanotron_ext.config import bundled_config, config_from_dict, load_config
from nanotron_ext.costs import block_memory, param_bytes, stage_memory
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.costs.memory_estimate import RUNTIME_TENSORS_BYTES
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from nanotron_ext.report import human_bytes


@pytest.fixture
def tiny():
    cfg = load_config(bundled_config())
    return cfg, inventory_from_config(cfg)


def _run(cfg, **kw):
    return dataclasses.replace(cfg.run, **kw)


def test_bytes_per_parameter_follow_nanotrons_optimizer(tiny):
    cfg, _ = tiny
    per = lambda **kw: dataclasses.astuple(param_bytes(_run(cfg, **kw)))  # noqa: E731
    # (weights, gradients, optimizer, Adam state element, gradients allocated before training)
    assert per(dtype="float32") == (4, 4, 8, 4, 0)
    # bf16 without fp32 accumulation: AdamW on the bf16 parameters themselves, 8 B in all.
    assert per(dtype="bfloat16") == (2, 2, 4, 2, 0)
    # fp32 accumulation: fp32 buffer + the bf16 .grad until it is added; fp32 master + Adam.
    assert per(dtype="bfloat16", accumulate_grad_in_fp32=True) == (2, 6, 12, 4, 4)
    # dp > 1: DDP's bucket holds one more gradient in the model dtype; ZeRO-1 shards master + Adam.
    assert per(dtype="bfloat16", accumulate_grad_in_fp32=True, dp=4) == (2, 8, 12, 4, 6)
    assert per(dtype="bfloat16", accumulate_grad_in_fp32=True, dp=4, zero_stage=1) == (2, 8, 3, 4, 6)


def test_decoder_saves_what_the_cpu_runtime_saves(tiny):
    cfg, blocks = tiny
    dec = next(b for b in blocks if b.role == "decoder")
    t, h, f, heads = 64, 16, 64, 4  # tokens (2 × 32), hidden, intermediate, heads; MHA, head dim 4
    # fp32, micro-batch 2: per norm input + rsqrt + normalised (4h + 4 + 4h), the linear's input (4h); attention:
    # rotated q, rotated k, the qkv output v keeps alive (3h), the output, o_proj's 2D copy, the log-sum-exp;
    # MLP 4f.
    norms = 2 * t * (4 * h + 4 + 4 * h) + 2 * t * 4 * h
    attention = t * 4 * (h + h + 3 * h + h + h) + t * 4 * heads
    assert block_memory(dec, cfg.model, cfg.run).saved == norms + attention + t * 4 * 4 * f
    # One sequence per micro-batch: o_proj's input is contiguous, no copy.
    one = block_memory(dec, cfg.model, _run(cfg, micro_batch_size=1, sequence_length=64))
    assert one.saved == norms + attention - t * 4 * h + t * 4 * 4 * f
    # bf16: the norms save an fp32 upcast, not the bf16 input; everything else at 2 bytes.
    bf16 = block_memory(dec, cfg.model, _run(cfg, dtype="bfloat16"))
    assert bf16.saved == (
        2 * t * (4 * h + 4 + 2 * h) + 2 * t * 2 * h + t * 2 * (h + h + 3 * h + h + h) + t * 4 * heads + t * 2 * 4 * f
    )
    assert not bf16.input_saved and block_memory(dec, cfg.model, cfg.run).input_saved


def test_gqa_saves_k_and_v_after_the_repeat():
    cfg = load_config(bundled_config("smollm_135m.yaml"))  # 9 heads, 3 kv heads, head dim 64
    dec = next(b for b in inventory_from_config(cfg) if b.role == "decoder")
    run = dataclasses.replace(cfg.run, micro_batch_size=1, sequence_length=128, dtype="float32")
    t, h, f = 128, 576, 1536
    attention = t * 4 * (h + 2 * h + h) + t * 4 * 9  # q, k and v repeated to 9 heads, output, lse
    assert block_memory(dec, cfg.model, run).saved == 2 * t * (8 * h + 4) + 2 * t * 4 * h + attention + t * 16 * f


def test_tp_shards_heads_mlp_and_vocabulary_and_reduce_scatter_the_sequence(tiny):
    cfg, blocks = tiny
    dec, loss = next(b for b in blocks if b.role == "decoder"), blocks[-1]
    t, h, f, heads = 64, 16, 64, 4
    one = block_memory(dec, cfg.model, cfg.run).saved
    all_reduce = block_memory(dec, cfg.model, _run(cfg, tp=2)).saved
    attention, mlp = t * 4 * 7 * h + t * 4 * heads, t * 4 * 4 * f
    assert one - all_reduce == (attention + mlp) / 2  # norms and the linears' inputs stay whole
    seq = block_memory(dec, cfg.model, _run(cfg, tp=2, tp_mode="REDUCE_SCATTER")).saved
    assert all_reduce - seq == t * (4 * h + 4 + 4 * h)  # both norms on half the tokens; the linears gather
    seq_async = block_memory(dec, cfg.model, _run(cfg, tp=2, tp_mode="REDUCE_SCATTER", tp_async=True)).saved
    assert seq - seq_async == t * 4 * h  # the async column linear saves its shard and gathers again in backward
    assert block_memory(loss, cfg.model, _run(cfg, tp=2)).saved == t * 4 * cfg.model.vocab_size / 2 + 13 * t


def test_loss_stage_holds_the_logits_next_to_their_shifted_copy(tiny):
    cfg, blocks = tiny
    t, v, h = 64, 50277, 16
    mem = stage_memory(blocks[4:], cfg.model, cfg.run, stage=1)  # lm_head, cast, loss
    # Peak: the loss's forward, with the softmax saved and the fp32 logits it came from (8·t·V), plus every
    # gradient (1F1B, 4 micro-batches: a backward came before).
    assert mem.pipeline_gradients == mem.gradients == 804_432 * 4
    assert mem.pipeline_activations == t * 4 * h + t * 4 * v + 13 * t
    assert mem.pipeline_temporaries == t * 4 * v
    assert mem.peak_at == "pipeline"


def test_afab_and_1f1b_hold_their_micro_batches_and_gradients_when_they_exist(tiny):
    cfg, blocks = tiny
    first = blocks[:4]
    ofob = stage_memory(first, cfg.model, cfg.run, stage=0)
    afab = stage_memory(first, cfg.model, _run(cfg, engine="afab"), stage=0)
    assert (ofob.in_flight, afab.in_flight) == (2, 4)
    assert ofob.activations == afab.activations
    # 1F1B with 4 micro-batches on 2 stages runs a backward before its third forward: every gradient exists.
    assert ofob.pipeline_gradients == ofob.gradients
    # 2 micro-batches: both forwards come first, as under AFAB; the same moments, the same peak.
    two = stage_memory(first, cfg.model, _run(cfg, n_micro_batches=2), stage=0)
    assert two == stage_memory(first, cfg.model, _run(cfg, n_micro_batches=2, engine="afab"), stage=0)
    # Under AFAB the loss stage peaks in its last forward, before any gradient exists.
    assert stage_memory(blocks[4:], cfg.model, _run(cfg, engine="afab"), stage=1).pipeline_gradients == 0


def test_two_micro_batches_peak_in_the_second_backward_with_every_gradient_alive(tiny):
    cfg, blocks = tiny
    t, h = 64, 16
    # AFAB, 2 micro-batches, stage 0 (embedding, 2 decoders, final norm): the first backward made every .grad;
    # in the second, the other micro-batch is gone, and the embedding makes its table's gradient fresh (50277 × 16
    # fp32) before adding it to .grad. That moment is the pipeline's peak.
    mem = stage_memory(blocks[:4], cfg.model, _run(cfg, engine="afab", n_micro_batches=2), stage=0)
    trainable = 50277 * 16 + 2 * 4128 + 16
    # Held: the input ids (int64) and their mask (1 B) of this micro-batch, the ids the embedding saved, the
    # final norm's output kept until the backward reaches it.
    assert mem.pipeline_activations == t * (8 + 1) + t * 8 + t * h * 4
    assert mem.pipeline_gradients == trainable * 4
    # The embedding's output (hidden states + mask), its fresh table gradient, the contiguous gradient copy.
    assert mem.pipeline_temporaries == (t * h * 4 + t) + 50277 * 16 * 4 + t * h * 4


@pytest.mark.parametrize("sequence, moment", [(512, "start"), (1, "end")])
def test_a_recomputed_layers_first_backward_holds_what_it_recomputed_or_its_gradients_never_both(
    tiny, sequence, moment
):
    # One recomputed decoder layer alone on a stage, AFAB, one micro-batch (fp32: no fresh copy of a gradient on a
    # first backward). The start of its backward holds what it recomputed and none of its gradients; its end, its
    # gradients and none of that (measured on upstream's Llama: docs/memory.md, "Nanotron's GPU path").
    cfg, blocks = tiny
    run = _run(cfg, engine="afab", n_micro_batches=1, recompute_layer=True, sequence_length=sequence)
    decoder = blocks[1]
    plain = block_memory(decoder, cfg.model, dataclasses.replace(run, recompute_layer=False))
    again = block_memory(decoder, cfg.model, run)
    recomputed = plain.saved + plain.output
    assert again.backward_temp == recomputed + plain.backward_temp
    fresh = 2 * 64 * 16 * 4  # the largest weight's gradient (the merged gate|up), made in place of .grad
    mem = stage_memory([decoder], cfg.model, run, stage=1)
    assert mem.pipeline_activations == again.saved + again.output  # its input, and its output held to its backward
    if moment == "start":  # a long sequence: what it recomputed outweighs its gradients
        assert recomputed > decoder.trainable * 4
        assert (mem.pipeline_gradients, mem.pipeline_temporaries) == (0, again.output + again.backward_temp - fresh)
    else:  # one token: its gradients outweigh what it recomputed
        assert recomputed < decoder.trainable * 4
        assert mem.pipeline_gradients == decoder.trainable * 4
        assert mem.pipeline_temporaries == again.output + again.backward_temp - fresh - recomputed


def test_the_overhead_allowance_counts_at_both_moments():
    # Gemma-2B's first stage (the 256k x 2048 embedding) peaks in the optimizer step; the allowance belongs there
    # as much as in the pipeline.
    flops_only = Path(__file__).parent / "data" / "machine_flops_only.json"  # the embedding alone on stage 0
    cfg = load_config(bundled_config("gemma_2b.yaml")).with_overrides(machine=str(flops_only))
    blocks = inventory_from_config(cfg)
    first = make_plan(blocks, cfg).stages[0]
    assert first.memory.peak_at == "optimizer" and cfg.ext.overhead_gib == 1.0
    assert first.memory_bytes / GIB == pytest.approx(14.672, abs=5e-4)
    members = [b for b in blocks if b.name in first.blocks]
    for overhead in (0.0, 0.25):
        mem = stage_memory(members, cfg.model, cfg.run, 0, overhead_gib=overhead)
        bare = stage_memory(members, cfg.model, cfg.run, 0)
        assert mem.optimizer_peak - bare.optimizer_peak == overhead * GIB
        assert mem.pipeline_peak - bare.pipeline_peak == overhead * GIB


def test_tied_embedding_counted_once_on_the_rank_that_holds_both():
    cfg = load_config(bundled_config("smollm_135m.yaml"), pp=1)
    blocks = inventory_from_config(cfg)
    per = param_bytes(cfg.run)
    tied = 49_152 * 576
    total = sum(b.params for b in blocks)
    one = stage_memory(blocks, cfg.model, cfg.run, stage=0)
    assert one.weights == (total - tied) * per.weights  # 134.5M held, not 163M
    assert one.gradients == (total - tied) * per.gradients
    # Split across two stages, each rank holds its own copy.
    two = [
        stage_memory(blocks[:10], cfg.model, cfg.run, 0, pp=2),
        stage_memory(blocks[10:], cfg.model, cfg.run, 1, pp=2),
    ]
    assert sum(s.weights for s in two) == total * per.weights


def test_optimizer_temporaries_by_implementation(tiny):
    cfg, blocks = tiny
    head = blocks[4:5]
    largest = 50277 * 16
    assert stage_memory(head, cfg.model, cfg.run, 1, optimizer="for_loop").optimizer_temporaries == 2 * largest * 4
    assert stage_memory(head, cfg.model, cfg.run, 1, optimizer="foreach").optimizer_temporaries == 2 * largest * 4
    assert stage_memory(blocks[:4], cfg.model, cfg.run, 0, optimizer="fused").optimizer_temporaries == 0
    with pytest.raises(ValueError, match=r"optimizer='adam' is not one of foreach, for_loop, fused"):
        stage_memory(head, cfg.model, cfg.run, 1, optimizer="adam")


def test_cpu_runtime_keeps_sent_tensors_until_the_step_ends(tiny):
    cfg, blocks = tiny
    kept = stage_memory(blocks[4:], cfg.model, cfg.run, 1, retain_sends=True)
    sent_back = 4 * 64 * 16 * 4  # the input gradient of every micro-batch
    assert kept.pipeline_temporaries - stage_memory(blocks[4:], cfg.model, cfg.run, 1).pipeline_temporaries == sent_back


def test_overhead_and_runtime_from_the_config():
    raw = yaml.safe_load(bundled_config().read_text())
    gpu = config_from_dict(raw)
    assert gpu.ext.overhead_gib == 1.0
    raw["nanotron_ext"]["memory_runtime"] = "cpu"
    cpu = config_from_dict(raw)
    assert cpu.ext.overhead_gib == 0.0
    blocks = inventory_from_config(gpu)
    a, b = make_plan(blocks, gpu).stages[0].memory, make_plan(blocks, cpu).stages[0].memory
    assert a.overhead == GIB and b.overhead == 0 and b.buffers >= RUNTIME_TENSORS_BYTES
    raw["nanotron_ext"]["memory_overhead_gib"] = 0.5
    assert config_from_dict(raw).ext.overhead_gib == 0.5


@pytest.mark.parametrize(
    "key,value,says",
    [
        (
            "memory_overhead_gib",
            -1,
            r"memory_overhead_gib=-1 must be a number of GiB >= 0, e.g. memory_overhead_gib: 1.5, or null for the "
            r"default",
        ),
        ("memory_overhead_gib", "lots", r"memory_overhead_gib='lots' must be a number of GiB"),
        ("memory_runtime", "gpus", r"memory_runtime='gpus' is unknown; did you mean 'gpu'\? use gpu .* or cpu"),
    ],
)
def test_bad_memory_keys(key, value, says):
    raw = yaml.safe_load(bundled_config().read_text())
    raw["nanotron_ext"][key] = value
    with pytest.raises(ConfigError, match=says):
        config_from_dict(raw)


def test_plan_shows_the_breakdown_per_stage_and_in_json(tiny):
    cfg, blocks = tiny
    plan = make_plan(blocks, cfg)
    lines = plan.memory_table().splitlines()
    assert lines[0].split() == [
        "stage",
        "weights",
        "gradients",
        "optimizer",
        "buffers",
        "activations/mb",
        "in",
        "flight",
        "temporaries",
        "overhead",
        "peak",
        "peak",
        "at",
        "of",
        "limit",
        "margin",
    ]
    assert len(lines) == 2 + plan.pp
    # Each peak against the analytic H100's memory (the config names no other): its share and the room left.
    assert plan.memory_limit is not None and plan.memory_limit.bytes == 81_082 * 2**20
    share, number, unit = lines[2].split()[-3:]
    assert share == f"{plan.stages[0].memory_bytes / plan.memory_limit.bytes:.0%}"
    assert f"{number} {unit}" == "+" + human_bytes(plan.memory_limit.bytes - plan.stages[0].memory_bytes)
    # Right-aligned numbers end in the same column as their header.
    end = lines[0].index("peak ") + len("peak")
    assert all(line[:end].rstrip().endswith(("MiB", "GiB", "peak")) for line in lines[2:] + lines[:1])
    stages = json.loads(plan.to_json())["stages"]
    for s, d in zip(plan.stages, stages):
        assert d["memory"]["peak"] == s.memory_bytes == s.memory.peak
        assert set(d["memory"]) >= {"weights", "gradients", "optimizer", "activations", "in_flight", "overhead"}


def test_fp32_accumulation_buffer_and_ddp_buckets_exist_before_any_backward(tiny):
    cfg, blocks = tiny
    # One micro-batch: the forward peak comes before any backward, so no .grad exists yet; the fp32 buffer
    # (4 B/param) and DDP's bf16 bucket (2 B/param) were allocated when the accumulator and DDP were built.
    run = _run(cfg, dtype="bfloat16", accumulate_grad_in_fp32=True, dp=2, n_micro_batches=1)
    mem = stage_memory(blocks[4:], cfg.model, run, stage=1)
    assert mem.gradients == 804_432 * (4 + 2 + 2)
    assert mem.pipeline_gradients == 804_432 * (4 + 2)
    assert stage_memory(blocks[4:], cfg.model, _run(cfg, n_micro_batches=1), stage=1).pipeline_gradients == 0


def test_without_a_cast_block_the_loss_copies_the_16_bit_logits_to_fp32():
    cfg = load_config(bundled_config("smollm3_3b.yaml"))  # Qwen2: lm_head -> loss, bf16, tp=2
    blocks = inventory_from_config(cfg)
    assert [b.role for b in blocks[-2:]] == ["lm_head", "loss"]
    t, v = 3 * 4096, 128_256 // 2
    loss = block_memory(blocks[-1], cfg.model, cfg.run)
    assert (loss.input, loss.forward_temp) == (t * v * 2, t * v * 4)
    # The loss's forward: bf16 logits, their fp32 copy and the shifted softmax it saves, 10·t·V/tp bytes.
    mem = stage_memory(blocks[-2:], cfg.model, cfg.run, stage=1)
    assert mem.pipeline_temporaries == t * v * (2 + 4)
