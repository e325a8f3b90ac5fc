"""Loading a Nanotron YAML with our keys."""

from __future__ import annotations

import copy

import pytest
import yaml
from nanotron.config.config import Config, get_config_from_dict

from nanotron_ext.config import bundled_config, config_from_dict, load_config, split_ext_keys
from nanotron_ext.errors import ConfigError


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
