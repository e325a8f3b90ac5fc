"""``replace_lm_head_with_vocab_chain`` on upstream Nanotron main's own ``LlamaForTraining`` and ``Qwen2ForTraining``.

Small untied variants of upstream's example configs are built with upstream's ``ParallelContext`` over a
one-process gloo group. Checked: after the replacement the model's blocks are exactly what the planner's
inventory says for ``vocab_shards: 3`` (paths, parameter names and counts), upstream's own ``build_model``
places them, and on CPU (pp = 1, the flash-attn stand-ins) the chain's loss and every gradient equal the
unsplit upstream model's on the same weights, masked labels included.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from nanotron.config import get_config_from_dict  # noqa: E402  (upstream main only: see conftest.py)
from nanotron.models.base import build_model  # noqa: E402
from nanotron.models.llama import LlamaForTraining  # noqa: E402
from nanotron.models.qwen import Qwen2ForTraining  # noqa: E402
from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402

from nanotron_ext.blocks import vocab_slices
from nanotron_ext.config import config_from_dict
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.models.vocab_chain import label_pp_ranks, replace_lm_head_with_vocab_chain
from upstream.harness import UPSTREAM_EXAMPLES, cuda_to

K, VOCAB = 3, 1009  # a prime vocabulary: uneven shards
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
CASES = {"llama": ("config_tiny_llama", LlamaForTraining), "qwen2": ("config_qwen", Qwen2ForTraining)}


def _raw(case: str) -> dict:
    raw = yaml.safe_load((UPSTREAM_EXAMPLES / f"{CASES[case][0]}.yaml").read_text())
    raw["parallelism"].update(tp=1, dp=1, pp=1)
    raw["model"]["model_config"].update(SMALL)
    for stage in raw.get("data_stages") or []:  # config_qwen's Nanoset stage checks its vocabulary against ours
        dataset = stage.get("data", {}).get("dataset") or {}
        if "vocab_size" in dataset:
            dataset["vocab_size"] = VOCAB
    return raw


def _build(case: str, parallel_context, shards: int, device: str):
    config = get_config_from_dict(copy.deepcopy(_raw(case)))

    def builder():
        with cuda_to(device):
            model = CASES[case][1](
                config=config.model.model_config,
                parallel_context=parallel_context,
                parallel_config=config.parallelism,
                random_states=None,
            )
        return replace_lm_head_with_vocab_chain(model, shards) if shards > 1 else model

    with cuda_to(device):
        return build_model(
            builder, parallel_context, dtype=torch.float32, target_pp_ranks=[0], device=torch.device(device)
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_replaced_model_has_the_blocks_the_planner_prices(case, parallel_context):
    model = _build(case, parallel_context, K, "meta")
    blocks = [name for name, m in model.named_modules() if isinstance(m, PipelineBlock)]
    raw = {**_raw(case), "nanotron_ext": {"vocab_shards": K}}
    ours = inventory_from_config(config_from_dict(raw, source=case))
    assert blocks == [b.name for b in ours]
    assert blocks[-K:] == [f"model.vocab_shards.{i}" for i in range(K)]
    params = {n: p.numel() for n, p in model.named_parameters()}
    assert params == {p.name: p.numel for b in ours for p in b.parameters}
    assert label_pp_ranks(model) == [0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_chain_loss_and_gradients_equal_upstreams_unsplit_model(case, parallel_context):
    torch.manual_seed(0)
    whole = _build(case, parallel_context, 1, "cpu")
    chain = _build(case, parallel_context, K, "cpu")
    with torch.no_grad():
        for p in whole.parameters():  # norms at 1, matrices random (upstream's init needs its full Config)
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
            else:
                p.fill_(1.0)
        chained = dict(chain.named_parameters())
        head = whole.model.lm_head.pp_block.weight * 150.0  # large logits: a loss well above exp's fp32 range
        whole.model.lm_head.pp_block.weight.copy_(head)
        for name, p in whole.named_parameters():
            if "lm_head" not in name:
                chained[name].copy_(p)
        for i, (lo, hi) in enumerate(vocab_slices(VOCAB, K)):
            chained[f"model.vocab_shards.{i}.pp_block.weight"].copy_(head[lo:hi])
    gen = torch.Generator().manual_seed(1)
    batch, seq = 2, 16
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
    labels = tokens[:, 1:]
    labels[0, :6] = torch.tensor([0, 336, 337, 672, 673, VOCAB - 1])  # every slice boundary
    mask = torch.rand(batch, seq, generator=gen) > 0.3
    inputs = {"input_ids": tokens[:, :-1].contiguous(), "label_ids": labels.contiguous(), "label_mask": mask}
    if case == "llama":
        inputs["input_mask"] = torch.ones(batch, seq, dtype=torch.bool)
    else:
        inputs["position_ids"] = torch.arange(seq).repeat(batch, 1)
    with cuda_to("cpu"):
        losses = [m(**inputs)["loss"] for m in (whole, chain)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() > 88.0  # exp of the largest logit alone would overflow fp32
    assert abs(losses[1].item() - losses[0].item()) / losses[0].item() < 1e-5
    grads = {n: p.grad for n, p in chain.named_parameters()}
    grads["model.lm_head.pp_block.weight"] = torch.cat(
        [grads.pop(f"model.vocab_shards.{i}.pp_block.weight") for i in range(K)]
    )
    for name, p in whole.named_parameters():
        assert float((grads[name] - p.grad).norm() / p.grad.norm()) < 1e-5, name


def test_refused_with_tied_embeddings(parallel_context):
    raw = _raw("llama")
    raw["model"]["model_config"]["tie_word_embeddings"] = True
    config = get_config_from_dict(raw)
    with cuda_to("meta"):
        model = LlamaForTraining(
            config=config.model.model_config,
            parallel_context=parallel_context,
            parallel_config=config.parallelism,
            random_states=None,
        )
    with pytest.raises(ValueError, match="tie_word_embeddings: false to untie, or vocab_shards: 1"):
        replace_lm_head_with_vocab_chain(model, K)
