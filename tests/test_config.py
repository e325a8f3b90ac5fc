"""Loading a Nanotron YAML with our keys."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import yaml
from nanotron.config.config import Config, get_config_from_dict

from nanotron_ext.config import (
    EXT_KEYS,
    bundled_config,
    config_from_dict,
    load_config,
    split_ext_keys,
)
from nanotron_ext.config_keys import UnreadKeyWarning
from nanotron_ext.errors import ConfigError, near_miss


@pytest.fixture
def raw():
    return yaml.safe_load(bundled_config().read_text())


def test_bundled_example_shape():
    cfg = load_config(bundled_config())
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, cfg.model.vocab_size) == (16, 2, 50277)
    assert (cfg.run.pp, cfg.run.dp, cfg.run.engine, cfg.run.n_micro_batches) == (2, 1, "1f1b", 4)
    assert cfg.ext.cost_strategy == "constrained"


@pytest.mark.nanotron02  # 0.2's Config; tests/upstream checks upstream main's loader on its own examples
def test_our_keys_never_reach_nanotrons_strict_loader(raw):
    nanotron, ext = split_ext_keys(raw)
    assert "nanotron_ext" not in nanotron and "cost_strategy" not in nanotron["parallelism"]
    assert ext.cost_strategy == "constrained"
    config = get_config_from_dict(nanotron, config_class=Config)  # strict=True: fails on any unknown key
    assert config.parallelism.pp == 2
    with pytest.raises(Exception, match="nanotron_ext"):
        get_config_from_dict(raw, config_class=Config)


def test_command_line_overrides_yaml():
    cfg = load_config(bundled_config(), cost_strategy="nanotron", pp=1)
    assert cfg.ext.cost_strategy == "nanotron" and cfg.run.pp == 1 and cfg.nanotron["parallelism"]["pp"] == 1


@pytest.mark.parametrize("path", ["model.model_config.hidden_size", "tokens.sequence_length", "parallelism.pp"])
def test_missing_key_is_named(raw, path):
    node = raw
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    del node[leaf]
    with pytest.raises(ConfigError, match=f"required key '{path}' is missing"):
        config_from_dict(raw)


def test_unknown_key_in_our_section(raw):
    raw["nanotron_ext"]["alow_frozen_stages"] = True
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'alow_frozen_stages'.*did you mean 'allow_frozen_stages'"):
        config_from_dict(raw)


def test_conflicting_cost_strategy(raw):
    raw["nanotron_ext"]["cost_strategy"] = "flops"
    with pytest.raises(ConfigError, match=r"'constrained' under 'parallelism:' but 'flops'"):
        config_from_dict(raw)


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallelism:\n  pp: [2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r["model"]["model_config"].update(hidden_size=15), "not divisible by num_attention_heads"),
        (lambda r: r["parallelism"].update(pp=0), r"pp=0 must be a positive integer"),
        (lambda r: r["parallelism"].update(pp_engine="zigzag"), r"pp_engine='zigzag' is not one of 1f1b, afab"),
        (lambda r: r["nanotron_ext"].update(memory_cap_gib=-1), "memory_cap_gib=-1 must be a positive"),
        # one check for every amount of our keys: a number, never true/false, with an example and what null means
        (
            lambda r: r["nanotron_ext"].update(memory_cap_gib=True),
            r"^nanotron_ext.memory_cap_gib=True must be a positive number of GiB, e.g. memory_cap_gib: 70, or null "
            r"for the machine's device memory$",
        ),
        (
            lambda r: r["nanotron_ext"].update(p2p_gbps=0),
            r"p2p_gbps=0 must be a positive number of GB/s, e.g. p2p_gbps: 50",
        ),
        (
            lambda r: r["nanotron_ext"].update(memory_overhead_gib=-0.5),
            r"memory_overhead_gib=-0.5 must be a number of GiB >= 0, e.g. memory_overhead_gib: 1.5, or null for the "
            r"default \(1 GiB on gpu\)",
        ),
    ],
)
def test_bad_values(raw, edit, match):
    raw = copy.deepcopy(raw)
    edit(raw)
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_vocab_padded_like_nanotrons_trainer(raw):
    raw["model"]["make_vocab_size_divisible_by"] = 128
    assert config_from_dict(raw).model.vocab_size == 50304  # ceil(50277 / 128) * 128


# --- one home per rule: our section's keys, near misses, unread keys, the installed Nanotron's keys


def test_our_sections_unknown_key_has_one_message_on_every_path(raw):
    # config_from_dict (plan, train) and split_ext_keys alone (the launcher's strip before Nanotron's loader).
    raw["nanotron_ext"]["memory_cap"] = 1
    messages = []
    for parse in (config_from_dict, split_ext_keys):
        with pytest.raises(ConfigError) as exc:
            parse(copy.deepcopy(raw))
        messages.append(str(exc.value))
    assert messages[0] == messages[1]
    first, listed = messages[0].split("\n")
    assert first == (
        "<dict>: unknown key(s) 'memory_cap' in 'nanotron_ext:': nanotron_ext has no such option; "
        "did you mean 'memory_cap_gib'?"
    )
    assert listed == f"  known keys are {', '.join(sorted(EXT_KEYS))}"


@pytest.mark.parametrize(
    "key, known, close",
    [
        ("cost_stratgy", {"cost_strategy", "pp"}, "cost_strategy"),
        ("costStrategy", {"cost_strategy", "pp"}, "cost_strategy"),
        ("tpLinearAsyncCommunication", {"tp_linear_async_communication", "tp"}, "tp_linear_async_communication"),
        ("ppp", {"pp", "dp", "tp"}, "pp"),
        ("nanotron-ext", {"nanotron_ext", "model"}, "nanotron_ext"),
        ("rms_norm_esp", {"rms_norm_eps"}, "rms_norm_eps"),
        ("doremi", {"model", "data", "general", "tokens"}, None),
        ("moe_layer_recompute", {"recompute_layer", "pp"}, None),
        ("interleaved_rotary", {"rope_interleaved", "rope_theta"}, None),
    ],
)
def test_near_miss(key, known, close):
    assert near_miss(key, known) == close


def test_a_near_miss_is_an_error_and_an_unread_key_a_warning(raw):
    raw["parallelism"]["recompute_layers"] = True  # one letter from upstream's recompute_layer
    with pytest.raises(ConfigError, match=r"'recompute_layers' in 'parallelism:'.*did you mean 'recompute_layer'\?"):
        config_from_dict(copy.deepcopy(raw))
    del raw["parallelism"]["recompute_layers"]
    raw["parallelism"]["moe_layer_recompute"] = True
    with pytest.warns(
        UnreadKeyWarning,
        match=r"'parallelism.moe_layer_recompute' is read by no Nanotron .*the plan "
        r"goes on without it",
    ):
        cfg = config_from_dict(raw)
    assert cfg.nanotron["parallelism"]["moe_layer_recompute"] is True  # Nanotron's loader gets it, and decides


def test_the_installed_nanotrons_keys_have_the_final_word(raw):
    # A fork whose loader reads parallelism.recompute_layers: the launcher and train pass its keys, and then
    # neither refuse nor warn about what it accepts.
    raw["parallelism"]["recompute_layers"] = True
    fork = {"parallelism": {"recompute_layers": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_dict(raw, nanotron_keys=fork).nanotron["parallelism"]["recompute_layers"] is True


@pytest.mark.nanotron02  # the CPU runtime's settings go through 0.2's ParallelismArgs
def test_the_cpu_trainer_takes_tp_mode_from_the_parsed_config():
    from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode

    from nanotron_ext.runtime.train_settings import _nanotron_settings

    cfg = load_config(bundled_config())
    assert "tp_mode" not in cfg.nanotron["parallelism"] or cfg.nanotron["parallelism"]["tp_mode"] != "REDUCE_SCATTER"
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, tp_mode="REDUCE_SCATTER"))
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan

    plan = make_plan(inventory_from_config(cfg), cfg)
    assert _nanotron_settings(cfg, plan)["parallel_config"].tp_mode is TensorParallelLinearMode.REDUCE_SCATTER
