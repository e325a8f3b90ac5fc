"""User-facing errors that no other test triggered (issue 14): each one raised for real, its message matched.

The distributed ones live with their real-process tests: rank 0's profiling failing
(``runtime/test_profiled.py::test_rank0_profiling_failure_raises_on_every_rank``), a stage holding only frozen weights
in the collective check (``runtime/test_integration.py::test_collective_check_names_a_frozen_only_stage``) and a NaN
loss (``runtime/test_train_cli.py::test_nan_loss_stops_with_its_step``).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import yaml

from nanotron_ext import make_plan
from nanotron_ext.config import bundled_config, config_from_dict, load_config
from nanotron_ext.errors import ConfigError, LayoutError, PlanningError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.layout_string import layout_ranks, parse_layout
from nanotron_ext.strategies import Assignment, get_strategy, register_strategy


@pytest.fixture
def raw():
    return yaml.safe_load(bundled_config().read_text())


@pytest.fixture
def tiny():
    cfg = load_config(bundled_config())
    return cfg, inventory_from_config(cfg)


# --- config.py -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda r: r["model"]["model_config"].update(num_key_value_heads=3),
            r"^model_config\.num_attention_heads=4 is not a multiple of num_key_value_heads=3; GQA needs an integer "
            r"group size$",
        ),
        (lambda r: r["optimizer"].update(zero_stage=2), r"^optimizer\.zero_stage=2: Nanotron supports 0 or 1$"),
        (
            lambda r: r["nanotron_ext"].update(base_strategy="constrained"),
            r"^nanotron_ext\.base_strategy='constrained' would recurse; use flops, memory or uniform$",
        ),
        (
            lambda r: r["nanotron_ext"].update(allow_frozen_stages="yes"),
            r"^nanotron_ext\.allow_frozen_stages='yes' must be true or false$",
        ),
        (lambda r: r["nanotron_ext"].update(projector=1), r"^nanotron_ext\.projector=1 must be true or false$"),
    ],
    ids=["gqa-heads", "zero-stage", "base-constrained", "allow-frozen-not-bool", "projector-not-bool"],
)
def test_bad_config_values(raw, edit, match):
    raw = copy.deepcopy(raw)
    raw.setdefault("nanotron_ext", {})
    edit(raw)
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


#: Every number a config holds, set wrong: its error gives an example of a good value (issue 55).
BAD_NUMBERS = [
    ("nanotron_ext", "memory_cap_gib", -1),
    ("nanotron_ext", "memory_cap_gib", "lots"),
    ("nanotron_ext", "memory_overhead_gib", -1),
    ("nanotron_ext", "tflops", 0),
    ("nanotron_ext", "p2p_gbps", -5),
    ("nanotron_ext", "vocab_shards", 0),
    ("nanotron_ext.replan", "min_gain", 2),
    ("model.model_config", "num_hidden_layers", 0),
    ("model.model_config", "hidden_size", -16),
    ("model.model_config", "vocab_size", 0),
    ("model.model_config", "rms_norm_eps", -1),
    ("parallelism", "pp", 0),
    ("parallelism", "dp", -1),
    ("tokens", "batch_accumulation_per_replica", 0),
    ("tokens", "micro_batch_size", 0),
]


@pytest.mark.parametrize("section, key, value", BAD_NUMBERS, ids=[f"{k}={v}" for _, k, v in BAD_NUMBERS])
def test_every_number_error_gives_an_example_value(raw, section, key, value):
    raw = copy.deepcopy(raw)
    node = raw
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    message = str(exc.value)
    assert f"{key}={value!r}" in message and re.search(rf"e\.g\. (?:{key}: )?[\d.]+(?:e-?\d+)?\b", message), message


# --- strategies --------------------------------------------------------------------------------------------


def test_import_path_that_is_not_a_strategy():
    # A function, not a class with `name` and `assign`.
    with pytest.raises(
        ConfigError,
        match=r"^cost_strategy 'nanotron_ext\.config:load_config' is a function, not a "
        r"strategy \(it has no `name` and `assign\(blocks, cfg\)`\); give "
        r"'package\.module:ClassName'",
    ):
        get_strategy("nanotron_ext.config:load_config")


def test_base_strategy_that_cannot_be_constrained(tiny):
    cfg, blocks = tiny
    with pytest.raises(
        ConfigError,
        match=r"^nanotron_ext\.base_strategy='nanotron' cannot be constrained; use one "
        r"of uniform, flops, memory$",
    ):
        make_plan(blocks, cfg.with_overrides(base_strategy="nanotron"), "constrained")


# --- plan/make.py: a custom strategy's ranks are checked -----------------------------------------------------


@register_strategy("test-user-errors-rank-out-of-range")
class _RankOutOfRange:
    name = "test-user-errors-rank-out-of-range"

    def assign(self, blocks, cfg):
        return Assignment([0] * (len(blocks) - 1) + [2], [1.0] * len(blocks), "blocks")


@register_strategy("test-user-errors-too-few-ranks")
class _TooFewRanks:
    name = "test-user-errors-too-few-ranks"

    def assign(self, blocks, cfg):
        return Assignment([0, 1], [1.0] * len(blocks), "blocks")


@register_strategy("test-user-errors-not-contiguous")
class _NotContiguous:
    name = "test-user-errors-not-contiguous"

    def assign(self, blocks, cfg):
        return Assignment([0, 1, 0, 0, 1, 1, 1], [1.0] * len(blocks), "blocks")


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "test-user-errors-rank-out-of-range",
            r"^strategy 'test-user-errors-rank-out-of-range' returned ranks \[0, 0, 0, 0, 0, 0, 2\] for 7 blocks and "
            r"pp=2$",
        ),
        (
            "test-user-errors-too-few-ranks",
            r"^strategy 'test-user-errors-too-few-ranks' returned ranks \[0, 1\] for 7 blocks and pp=2$",
        ),
        (
            "test-user-errors-not-contiguous",
            r"^strategy 'test-user-errors-not-contiguous' returned non-contiguous stages \[0, 1, 0, 0, 1, 1, 1\]$",
        ),
    ],
)
def test_custom_strategy_with_bad_ranks(tiny, name, match):
    cfg, blocks = tiny
    with pytest.raises(PlanningError, match=match):
        make_plan(blocks, cfg, name)


# --- partition/layout_string.py -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_layout(text):
    expected = rf"^layout={text!r} is empty; write one stage per '\|', e.g\. 'E,t\*5\|t\*6,L'$"
    with pytest.raises(LayoutError, match=expected):
        parse_layout(text)
    with pytest.raises(LayoutError, match=expected):
        layout_ranks(text, ["embedding", "decoder", "final_norm", "lm_head", "cast", "loss"])


# --- runtime/data.py: too little data ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["ten bytes\n", ""], ids=["10-tokens", "empty"])  # 9 bytes + eos < 33
def test_text_shorter_than_one_window(tmp_path, text):
    from nanotron_ext.runtime.data import load_packed_windows

    short = tmp_path / "short.txt"
    short.write_text(text)
    with pytest.raises(
        ConfigError,
        match=rf"^the data files \({short}\) hold fewer than 33 tokens "
        r"\(sequence_length \+ 1\); give more text$",
    ):
        load_packed_windows([short], 32)


def test_fewer_windows_than_a_micro_batch_per_replica():
    from nanotron_ext.runtime.data import PackedTextData

    windows = np.zeros((3, 33), dtype=np.int64)
    PackedTextData(windows, 3)  # exactly one micro-batch: fine
    with pytest.raises(
        ConfigError,
        match=r"^the data has 3 windows of 33 tokens: fewer than micro_batch_size=2 "
        r"per DP replica \(dp=2\); give more text or shrink the batch$",
    ):
        PackedTextData(windows, 2, dp_rank=0, dp_size=2)


# --- command-line flags: each message names the flag or the YAML key, never an internal name -----------------

#: Python-side names of what a flag sets, which no user types (the flag's own spelling is in the message instead).
INTERNAL_NAMES = ("n_micro_batches", "micro_batches", "p2p_gbps", "cost_strategy", "config_file")
#: The subcommands checked here; calibrate's --repeats and --warmup are checked by machine/calibrate.py.
OWN_COMMANDS = ("plan", "simulate", "train")


def _numeric_flags() -> list[tuple[str, str, object]]:
    import argparse

    from nanotron_ext.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (command, action.option_strings[-1], action.type)
        for command in OWN_COMMANDS
        for action in sub.choices[command]._actions
        if action.option_strings and action.type is not None
    ]


def test_every_numeric_flag_is_checked_where_it_is_parsed():
    from nanotron_ext.cli.common import non_negative_int, positive_int, positive_number

    flags = _numeric_flags()
    assert {f for _, f, _ in flags} >= {"--pp", "--micro-batches", "--tflops", "--p2p-gbps", "--steps", "--seed"}
    # A bare int or float lets -3 through to a check that names the config's field (n_micro_batches=-3).
    loose = [(c, f) for c, f, t in flags if t not in (positive_int, non_negative_int, positive_number)]
    assert not loose, f"numeric flags parsed without a range: {loose}"


@pytest.mark.parametrize(
    "command, flag, bad",
    [
        (command, flag, bad)
        for command, flag, kind in _numeric_flags()
        for bad in (
            "-3",
            "x",
            *(("0",) if kind.__name__.startswith("positive") else ()),
            *(("nan", "inf") if kind.__name__ == "positive_number" else ()),
        )
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(capsys, command, flag, bad):
    from nanotron_ext.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, flag, bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"nanotron-ext {command}: error: argument {flag}: {bad!r} is not a ")
    assert "; give e.g. " in err  # an example of a good value
    assert f"`nanotron-ext {command} --help` lists every flag" in err
    assert not any(name in err for name in INTERNAL_NAMES), err


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_flags_the_config_refuses_are_named_before_its_message(capsys, command):
    # The config's own check names the YAML key it guards; the flags that set it come first.
    from nanotron_ext.cli import main

    says = "nanotron-ext: error: --pp 2 --times profiled --tflops 3.5: nanotron_ext.times=profiled measures block times"
    assert main([command, "--tflops", "3.5", "--times", "profiled", "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1, err
    assert not any(name in err for name in INTERNAL_NAMES), err


def test_usage_errors_are_one_line_with_where_the_flags_are(capsys):
    from nanotron_ext.cli import main

    for argv, says in (
        (
            ["plan", "--bogus"],
            "nanotron-ext: error: unrecognized arguments: --bogus (`nanotron-ext "
            "--help` lists the commands, `nanotron-ext COMMAND --help` their flags)",
        ),
        (["plan", "--pp"], "nanotron-ext plan: error: argument --pp: expected one argument"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith(says) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--repeats", "0"], "--repeats"),
        (["--warmup", "-1"], "--warmup"),
        (["--in-run", "--steps", "0"], "--steps"),
        (["--in-run", "--warmup-steps", "-1"], "--warmup-steps"),
    ],
)
def test_calibrates_counts_name_their_flag(tmp_path, capsys, argv, flag):
    # calibrate checks its counts before it measures anything; the message names the flag as typed.
    from nanotron_ext.cli import main

    assert main(["calibrate", *argv, "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert f"{flag}={argv[-1]} must be an integer >= " in err and err.count("\n") == 1, err
