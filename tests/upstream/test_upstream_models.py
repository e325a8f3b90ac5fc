"""The planner's inventory, made from the YAML alone, against the models upstream Nanotron main builds.

For upstream's own example configs (and variants: qkv bias, a partial MoE without shared expert, untied
embeddings), upstream's ``LlamaForTraining`` / ``Qwen2ForTraining`` are constructed with upstream's own
``ParallelContext`` over a one-process gloo group, and every block's module is built on ``meta``. Compared:
block paths, builder classes, parameter names and counts, Nanotron's class costs, and the ``nanotron``
strategy's block → rank against upstream's own ``build_model`` at pp 1, 2 and 4.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from nanotron.config import get_config_from_dict  # noqa: E402  (upstream main only: see conftest.py)
from nanotron.models.base import build_model  # noqa: E402
from nanotron.models.llama import LlamaForTraining  # noqa: E402
from nanotron.models.qwen import Qwen2ForTraining  # noqa: E402
from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402

from nanotron_ext.config import config_from_dict, split_ext_keys
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan
from upstream.harness import UPSTREAM_EXAMPLES, cuda_to

MODEL_CLASSES = {"LlamaConfig": LlamaForTraining, "Qwen2Config": Qwen2ForTraining}


def _raw(name: str) -> dict:
    """An upstream example at tp = dp = 1: one process builds every block whole, as the inventory counts them."""
    raw = yaml.safe_load((UPSTREAM_EXAMPLES / f"{name}.yaml").read_text())
    raw["parallelism"].update(tp=1, dp=1)
    return raw


def _variant(name: str, **model_config) -> dict:
    raw = copy.deepcopy(_raw(name))
    raw["model"]["model_config"].update(model_config)
    return raw


CASES = {
    "config_tiny_llama": _raw("config_tiny_llama"),
    "config_qwen": _raw("config_qwen"),
    "config_qwen_with_moe": _raw("config_qwen_with_moe"),
    "qwen_qkv_bias_untied": _variant(
        "config_qwen", attention_bias=True, tie_word_embeddings=False, num_hidden_layers=4
    ),
    "qwen_partial_moe_no_shared": _variant(
        "config_qwen_with_moe",
        num_hidden_layers=4,
        moe_config={
            "num_experts": 4,
            "top_k": 2,
            "moe_intermediate_size": 96,
            "layers": [1, 3],
            "enable_shared_expert": False,
        },
    ),
    "llama_plain_dict_no_marker": _variant("config_tiny_llama", num_hidden_layers=3),
}
del CASES["llama_plain_dict_no_marker"]["model"]["model_config"]["is_llama_config"]


def _upstream_model(raw: dict, parallel_context):
    config = get_config_from_dict(copy.deepcopy(raw))
    model_config = config.model.model_config
    cls = MODEL_CLASSES[type(model_config).__name__]

    def builder():
        with cuda_to("meta"):  # its P2P buffers are allocated on "cuda"
            return cls(
                config=model_config,
                parallel_context=parallel_context,
                parallel_config=config.parallelism,
                random_states=None,
            )

    return builder


def _upstream_blocks(model) -> list[tuple[str, str, dict[str, int], float]]:
    costs = model.get_block_compute_costs()
    out = []
    for name, block in model.named_modules():
        if not isinstance(block, PipelineBlock):
            continue
        with torch.device("meta"), cuda_to("meta"):
            module = block.module_builder(**block.module_kwargs)
        params = dict(module.named_parameters()) if isinstance(module, torch.nn.Module) else {}
        out.append(
            (
                name,
                block.module_builder.__name__,
                {n: p.numel() for n, p in params.items()},
                float(costs.get(block.module_builder, 0)),
            )
        )
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_inventory_from_yaml_equals_what_upstream_builds(case, parallel_context):
    raw = CASES[case]
    ours = inventory_from_config(config_from_dict(raw, source=case))
    theirs = _upstream_blocks(_upstream_model(raw, parallel_context)())
    assert [b.name for b in ours] == [name for name, *_ in theirs]
    for block, (name, builder, params, cost) in zip(ours, theirs):
        local = {p.name.split(".pp_block.", 1)[1]: p.numel for p in block.parameters}
        assert local == params, name
        assert block.nanotron_cost == cost, name
        if cost:  # the classes Nanotron's rule prices are looked up by name
            assert block.builder == builder, name


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_nanotron_strategy_is_upstreams_build_model(case, pp, parallel_context, monkeypatch):
    raw = CASES[case]
    cfg = config_from_dict(raw, source=case).with_overrides(pp=pp)
    blocks = inventory_from_config(cfg)
    if pp > len(blocks):
        pytest.skip("more stages than blocks")
    ranks: dict[str, int] = {}

    def record(self, pp_rank):  # the rank upstream's rule picks; nothing is built
        ranks[id(self)] = pp_rank
        self.rank = pp_rank

    monkeypatch.setattr(PipelineBlock, "build_and_set_rank", record)
    model = build_model(
        _upstream_model(raw, parallel_context),
        parallel_context,
        dtype=torch.float32,
        target_pp_ranks=list(range(pp)),
        device=torch.device("meta"),
    )
    upstream = [ranks[id(b)] for _, b in model.named_modules() if isinstance(b, PipelineBlock)]
    assert list(make_plan(blocks, cfg, "nanotron").block_ranks) == upstream


def test_seed_case_is_refused_by_the_plan_but_not_by_upstreams_rule(parallel_context, monkeypatch):
    """Qwen2-MoE at pp=2: upstream's rule leaves rank 1 with the loss alone; our validator says so."""
    cfg = config_from_dict(CASES["config_qwen_with_moe"], source="moe").with_overrides(pp=2)
    plan = make_plan(inventory_from_config(cfg), cfg, "nanotron")
    assert plan.stage_map() == "0-14|15"
    assert [f.code for f in plan.findings if f.severity == "error"][0] == "no-params"
    assert make_plan(inventory_from_config(cfg), cfg, "constrained").ok


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_keys_never_reach_upstreams_strict_loader(case):
    raw = copy.deepcopy(CASES[case])
    raw["parallelism"]["cost_strategy"] = "constrained"
    raw["nanotron_ext"] = {"allow_frozen_stages": True, "objective": "step_time"}
    with pytest.raises(Exception, match="nanotron_ext|cost_strategy"):
        get_config_from_dict(copy.deepcopy(raw))  # strict: our keys would stop it
    nanotron, ext = split_ext_keys(raw)
    assert ext.allow_frozen_stages and get_config_from_dict(nanotron).parallelism.pp == raw["parallelism"]["pp"]


def test_upstream_examples_are_where_the_harness_says():
    assert Path(UPSTREAM_EXAMPLES, "config_qwen_with_moe.yaml").is_file()
