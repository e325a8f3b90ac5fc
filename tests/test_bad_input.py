"""Bad input through the real command line: one row per case of issue 13.

Every row runs ``nanotron-ext plan|simulate`` in-process (``nanotron_ext.cli.main``) or, for the rows named
"train ...", ``nanotron-ext train`` as a real process (``tests/runtime/test_bad_train_input.py`` runs those), and
checks three things: the documented exit code (0 OK, 1 the plan cannot train, 2 bad usage or config, 3 a
runtime failure), that one line of the output names the value and carries the fix, and that nothing printed a
traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from upstream.harness import NANOTRON, UPSTREAM_EXAMPLES

from nanotron_ext import config_keys
from nanotron_ext.cli import main
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from nanotron_ext.config import bundled_config
from nanotron_ext.costs import profiled

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = bundled_config()
TINY_TEXT = TINY.read_text()


def _yaml(tmp: Path, text: str, name: str = "c.yaml") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _edit(tmp: Path, change: Callable[[dict], None]) -> str:
    raw = yaml.safe_load(TINY_TEXT)
    change(raw)
    return _yaml(tmp, yaml.safe_dump(raw, sort_keys=False))


def _replace(tmp: Path, old: str, new: str) -> str:
    assert old in TINY_TEXT
    return _yaml(tmp, TINY_TEXT.replace(old, new, 1))


def _set(dotted: str, value: object) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        node = raw
        *path, last = dotted.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value

    return change


def _not_utf8(tmp: Path) -> str:
    path = tmp / "latin1.yaml"
    path.write_bytes(TINY_TEXT.replace("# Nanotron's", "# Nanotron\xe9s").encode("latin-1"))
    return str(path)


def _under_a_file(tmp: Path, name: str) -> str:
    (tmp / "a_file").write_text("x")
    return str(tmp / "a_file" / name)


def _data_config(tmp: Path, data: bytes) -> str:
    (tmp / "corpus.txt").write_bytes(data)
    return _edit(tmp, _set("data.dataset", {"hf_dataset_or_datasets": str(tmp / "corpus.txt")}))


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: the command (built in a temporary folder), the exit code, and what one line must say."""

    id: str
    argv: Callable[[Path], list[str]]
    code: int
    says: tuple[str, ...]  # all on one line: the value, the reason, the fix


CASES = [
    # --- the config file itself
    Case(
        "config-is-a-directory",
        lambda t: ["plan", str(t)],
        EXIT_USAGE,
        ("is a directory", "pass the path of a Nanotron YAML file"),
    ),
    Case(
        "config-missing",
        lambda t: ["plan", str(t / "nope.yaml")],
        EXIT_USAGE,
        ("nope.yaml' does not exist", "pass the path"),
    ),
    Case("config-not-utf8", lambda t: ["plan", _not_utf8(t)], EXIT_USAGE, ("is not UTF-8 text", "save it as UTF-8")),
    Case(
        "config-unreadable",
        lambda t: ["plan", "/proc/self/mem"],
        EXIT_USAGE,
        ("'/proc/self/mem' cannot be read", "check its permissions"),
    ),
    Case(
        "config-empty",
        lambda t: ["plan", _yaml(t, "# only a comment\n")],
        EXIT_USAGE,
        ("c.yaml is empty (no YAML in it)", "start from a Nanotron YAML such as"),
    ),
    Case(
        "config-a-list",
        lambda t: ["plan", _yaml(t, "- model\n")],
        EXIT_USAGE,
        ("the top level is a list (['model']), but it must be a mapping", "write it like `model: {...}"),
    ),
    # --- unknown and misspelt keys
    Case(
        "hyphen-section",
        lambda t: ["plan", _edit(t, _set("nanotron-ext", {"memory_cap_gib": 0.001}))],
        EXIT_USAGE,
        ("unknown key(s) 'nanotron-ext' in the top level", "did you mean 'nanotron_ext'?"),
    ),
    Case(
        "misspelt-ext-key",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.memory_cap", 1))],
        EXIT_USAGE,
        ("unknown key(s) 'memory_cap' in 'nanotron_ext:'", "did you mean 'memory_cap_gib'?"),
    ),
    Case(
        "misspelt-freeze-key",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.freeze", {"module": ["*"]}))],
        EXIT_USAGE,
        ("unknown key(s) 'module' in 'nanotron_ext.freeze:'", "did you mean 'modules'?"),
    ),
    Case(
        "parallelism.cost_stratgy",
        lambda t: ["plan", _edit(t, _set("parallelism.cost_stratgy", "nanotron"))],
        EXIT_USAGE,
        ("unknown key(s) 'cost_stratgy' in 'parallelism:'", "did you mean 'cost_strategy'?"),
    ),
    Case(
        "parallelism.costStrategy",
        lambda t: ["plan", _edit(t, _set("parallelism.costStrategy", "nanotron"))],
        EXIT_USAGE,
        ("unknown key(s) 'costStrategy' in 'parallelism:'", "did you mean 'cost_strategy'?"),
    ),
    Case(
        "unknown key in our section, no near miss",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.doremi", 1))],
        EXIT_USAGE,
        ("unknown key(s) 'doremi' in 'nanotron_ext:'", "nanotron_ext has no such option"),
    ),
    Case(
        "parallelism.ppp (Nanotron rejects it)",
        lambda t: ["plan", _edit(t, _set("parallelism.ppp", 4))],
        EXIT_USAGE,
        ("unknown key(s) 'ppp' in 'parallelism:'", "Nanotron's config loader rejects it", "did you mean 'pp'?"),
    ),
    Case(
        "nanotron-nested-key",
        lambda t: ["plan", _edit(t, _set("model.model_config.rms_norm_esp", 1e-5))],
        EXIT_USAGE,
        ("unknown key(s) 'rms_norm_esp' in 'model.model_config:'", "did you mean 'rms_norm_eps'?"),
    ),
    # --- a value of the wrong type gets an example of the right form
    Case(
        "freeze: decoder",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.freeze", "decoder"))],
        EXIT_USAGE,
        (
            "nanotron_ext.freeze is text ('decoder'), but it must be a mapping",
            "write it like `freeze: {modules: [decoder], unfreeze: [lm_head]}`",
            "docs/freezing.md",
        ),
    ),
    Case(
        "freeze.modules: [1]",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.freeze", {"modules": [1]}))],
        EXIT_USAGE,
        ("freeze.modules=[1] must be a list of non-empty patterns", "`modules: [decoder, lm_head]`"),
    ),
    Case(
        "nanotron_ext: [a]",
        lambda t: ["plan", _edit(t, _set("nanotron_ext", ["a"]))],
        EXIT_USAGE,
        ("nanotron_ext is a list (['a']), but it must be a mapping", "`nanotron_ext: {allow_frozen_stages: true}`"),
    ),
    Case(
        "parallelism: 2",
        lambda t: ["plan", _edit(t, _set("parallelism", 2))],
        EXIT_USAGE,
        ("c.yaml: parallelism is a number (2), but it must be a mapping", "write it like `parallelism: {"),
    ),
    Case(
        "model_config: x",
        lambda t: ["plan", _edit(t, _set("model.model_config", "x"))],
        EXIT_USAGE,
        ("model.model_config is text ('x'), but it must be a mapping", "write it like `model_config: {"),
    ),
    # --- every name a user types gets "did you mean"
    Case(
        "--cost-strategy constraned",
        lambda t: ["plan", "--cost-strategy", "constraned"],
        EXIT_USAGE,
        ("unknown cost strategy 'constraned'", "did you mean 'constrained'?", "known strategies: nanotron"),
    ),
    Case(
        "pp_engine: 1fb1",
        lambda t: ["plan", _edit(t, _set("parallelism.pp_engine", "1fb1"))],
        EXIT_USAGE,
        ("parallelism.pp_engine='1fb1' is not one of", "did you mean '1f1b'?"),
    ),
    Case(
        "base_strategy: flop",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.base_strategy", "flop"))],
        EXIT_USAGE,
        ("base_strategy='flop' cannot be constrained", "did you mean 'flops'?", "use one of"),
    ),
    Case(
        "objective: step",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.objective", "step"))],
        EXIT_USAGE,
        ("objective='step' is not one of step_time, slowest_stage", "did you mean 'step_time'?"),
    ),
    Case(
        "freeze.modules: [decodr]",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.freeze", {"modules": ["decodr"]}))],
        EXIT_USAGE,
        ("freeze pattern 'decodr' matches no module", "did you mean 'decoder'?", "modules are: embedding"),
    ),
    Case(
        "freeze.unfreeze: [lm_haed]",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.freeze", {"modules": ["*"], "unfreeze": ["lm_haed"]}))],
        EXIT_USAGE,
        ("unfreeze pattern 'lm_haed' matches no module", "did you mean 'lm_head'?"),
    ),
    Case(
        "vocab_shards: atuo",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.vocab_shards", "atuo"))],
        EXIT_USAGE,
        ("vocab_shards='atuo' is neither a positive integer nor 'auto'", "did you mean 'auto'?"),
    ),
    Case(
        "times: flop",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.times", "flop"))],
        EXIT_USAGE,
        ("times='flop' is not one of", "did you mean 'flops'?"),
    ),
    # --- values
    Case(
        "make_vocab_size_divisible_by: abc",
        lambda t: ["plan", _edit(t, _set("model.make_vocab_size_divisible_by", "abc"))],
        EXIT_USAGE,
        ("model.make_vocab_size_divisible_by='abc' must be a positive integer", "make_vocab_size_divisible_by: 1"),
    ),
    Case(
        "rms_norm_eps: abc",
        lambda t: ["plan", _edit(t, _set("model.model_config.rms_norm_eps", "abc"))],
        EXIT_USAGE,
        ("rms_norm_eps='abc' must be a positive number", "e.g. 1.0e-5"),
    ),
    Case(
        "batch_accumulation_per_replica: 0",
        lambda t: ["plan", _edit(t, _set("tokens.batch_accumulation_per_replica", 0))],
        EXIT_USAGE,
        ("tokens.batch_accumulation_per_replica=0 must be a positive integer",),
    ),
    Case(
        "layout: 5",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.layout", 5))],
        EXIT_USAGE,
        ("nanotron_ext.layout=5 must be a non-empty string", "E,t*5|t*6,L"),
    ),
    Case(
        "profile_cache: 5",
        lambda t: ["plan", _edit(t, _set("nanotron_ext.profile_cache", 5))],
        EXIT_USAGE,
        ("nanotron_ext.profile_cache=5 must be a non-empty string", "a folder path"),
    ),
    Case(
        "tp: 3 with 4 heads",
        lambda t: ["plan", _edit(t, _set("parallelism.tp", 3))],
        EXIT_USAGE,
        ("parallelism.tp=3 does not divide model_config.num_attention_heads=4", "Use tp in {1, 2, 4}"),
    ),
    # 4 heads divide by tp=4, the 2 KV heads do not: each rank would hold half a KV head.
    Case(
        "tp: 4 with 2 KV heads",
        lambda t: [
            "plan",
            _edit(
                t, lambda raw: (_set("parallelism.tp", 4)(raw), _set("model.model_config.num_key_value_heads", 2)(raw))
            ),
        ],
        EXIT_USAGE,
        ("parallelism.tp=4 does not divide model_config.num_key_value_heads=2", "Use tp in {1, 2}"),
    ),
    # --- strategies
    Case(
        "--cost-strategy :",
        lambda t: ["plan", "--cost-strategy", ":"],
        EXIT_USAGE,
        ("cost_strategy ':' is not an import path", "give 'package.module:ClassName'"),
    ),
    Case(
        "--cost-strategy :system",
        lambda t: ["plan", "--cost-strategy", ":system"],
        EXIT_USAGE,
        ("cost_strategy ':system' is not an import path", "give 'package.module:ClassName'"),
    ),
    Case(
        "--cost-strategy .strategies:X",
        lambda t: ["plan", "--cost-strategy", ".strategies:X"],
        EXIT_USAGE,
        ("cost_strategy '.strategies:X' is not an import path", "give 'package.module:ClassName'"),
    ),
    Case(
        "--cost-strategy subprocess:Popen",
        lambda t: ["plan", "--cost-strategy", "subprocess:Popen"],
        EXIT_USAGE,
        (
            "is the class subprocess.Popen, which is not a strategy",
            "so it was not constructed",
            "give 'package.module:ClassName'",
        ),
    ),
    Case(
        "malformed layout",
        lambda t: ["plan", "--cost-strategy", "layout", _edit(t, _set("nanotron_ext.layout", "E,t*2,|L"))],
        EXIT_USAGE,
        (
            "c.yaml: nanotron_ext.layout: malformed layout at character 7: empty item or stage",  # its source
            "separate items with ','",
            "'E,t*5|t*6,L'",
        ),
    ),
    Case(
        "layout with the wrong stage count",
        lambda t: ["plan", "--cost-strategy", "layout", _edit(t, _set("nanotron_ext.layout", "E,t*2,L"))],
        EXIT_USAGE,
        (
            "c.yaml: nanotron_ext.layout: layout 'E,t*2,L' has 1 stages but pp=2",
            "give one '|'-separated stage per pipeline rank",
            "set pp to 1",
        ),
    ),
    Case(
        "layout short of the model's blocks",
        lambda t: ["plan", "--cost-strategy", "layout", _edit(t, _set("nanotron_ext.layout", "E,t|t"))],
        EXIT_USAGE,
        ("c.yaml: nanotron_ext.layout: layout 'E,t|t' stops before block 3 (final_norm)", "add the remaining"),
    ),
    Case(
        "zbv layout of too few chunks",
        lambda t: [
            "plan",
            "--engine",
            "zbv",
            "--cost-strategy",
            "layout",
            _edit(t, _set("nanotron_ext.layout", "E,t|t,L")),
        ],
        EXIT_USAGE,
        ("c.yaml: nanotron_ext.layout: layout 'E,t|t,L' writes 2 stages; a V over pp=2 ranks takes 4", "write 4"),
    ),
    # --- plans that cannot train, and misleading messages
    Case(
        "pp above the blocks with parameters (nothing frozen)",
        lambda t: ["plan", "--pp", "6"],
        EXIT_INVALID,
        (
            "pp=6 but only 5 blocks have parameters (embedding, decoder.0-1, final_norm, lm_head)",
            "cast, loss have none",
            "Lower pp to 5",
        ),
    ),
    Case(
        "--pp 100 --compare",
        lambda t: ["plan", "--pp", "100", "--compare"],
        EXIT_INVALID,
        ("nanotron", "-×96", "INVALID (few-micro-batches, no-params@2-3, empty-stage@4-99)"),
    ),
    Case(
        "plan needing 3.7e5 TiB per stage",
        lambda t: ["plan", _edit(t, _set("model.model_config.vocab_size", 10**12))],
        EXIT_INVALID,
        ("warning: stage", "TiB, more than any accelerator holds", "check model_config's sizes"),
    ),
    Case(
        "plan over the GPU's memory",
        lambda t: ["plan", _edit(t, _set("model.model_config.vocab_size", 10**12))],
        EXIT_INVALID,
        ("ERROR [stage 0] stage 0 needs about", "TiB, over 79.18 GiB per GPU (H100 SXM (analytic))"),
    ),
    # --- output paths (checked before any work)
    Case(
        "simulate --out is a directory",
        lambda t: ["simulate", "--out", str(t)],
        EXIT_USAGE,
        ("--out", "is a directory", "give a file path"),
    ),
    Case(
        "simulate --out under a file",
        lambda t: ["simulate", "--out", _under_a_file(t, "t.png")],
        EXIT_USAGE,
        ("--out", "cannot be written", "a_file' is a file, not a folder", "choose a path in a folder you can write"),
    ),
    Case(
        "simulate --loads-out under a file",
        lambda t: ["simulate", "--compare", "--out", str(t / "t.png"), "--loads-out", _under_a_file(t, "l.png")],
        EXIT_USAGE,
        ("--loads-out", "cannot be written", "choose a path"),
    ),
    Case(
        "simulate --out into a missing folder",
        lambda t: ["simulate", "--out", str(t / "nope" / "deeper" / "t.png")],
        EXIT_USAGE,
        ("--out", "its folder", "nope/deeper' does not exist", "create it first (mkdir -p"),
    ),
    Case(
        "simulate --loads-out into a missing folder",
        lambda t: ["simulate", "--compare", "--out", str(t / "t.png"), "--loads-out", str(t / "nope" / "l.png")],
        EXIT_USAGE,
        ("--loads-out", "its folder", "nope' does not exist", "create it first"),
    ),
    Case(
        "simulate --out x.bmp",
        lambda t: ["simulate", "--out", str(t / "x.bmp")],
        EXIT_USAGE,
        ("cannot write a .bmp file", "name it with one of .png, .pdf, .svg"),
    ),
    # --- train: checked before any process group, every rank the same message
    Case(
        "train --metrics-out is a directory",
        lambda t: ["train", "--metrics-out", str(t)],
        EXIT_USAGE,
        ("error on rank 0: --metrics-out", "is a directory", "give a file path"),
    ),
    Case(
        "train --metrics-out into a missing folder",
        lambda t: ["train", "--metrics-out", str(t / "nope" / "m.json")],
        EXIT_USAGE,
        ("error on rank 0: --metrics-out", "its folder", "nope' does not exist", "create it first"),
    ),
    Case(
        "train --plan-out under a file",
        lambda t: ["train", "--plan-out", _under_a_file(t, "p.json")],
        EXIT_USAGE,
        ("error on rank 0: --plan-out", "cannot be written", "choose a path"),
    ),
    Case(
        "train hyphen section",
        lambda t: ["train", "--config-file", _edit(t, _set("nanotron-ext", {"memory_cap_gib": 0.001}))],
        EXIT_USAGE,
        ("'nanotron-ext'", "did you mean 'nanotron_ext'?"),
    ),
    Case(
        "train parallelism.ppp",
        lambda t: ["train", "--config-file", _edit(t, _set("parallelism.ppp", 4))],
        EXIT_USAGE,
        ("unknown key(s) 'ppp' in 'parallelism:'", "did you mean 'pp'?"),
    ),
    Case(
        "train binary data file",
        lambda t: ["train", "--config-file", _data_config(t, b"\x00\x01\x02" * 500)],
        EXIT_USAGE,
        ("corpus.txt' is binary", "point data.dataset.hf_dataset_or_datasets at UTF-8 .txt files"),
    ),
    Case(
        "train non-UTF-8 data file",
        lambda t: ["train", "--config-file", _data_config(t, b"caf\xe9 " * 500)],
        EXIT_USAGE,
        ("corpus.txt' is not UTF-8 text", "convert it to UTF-8"),
    ),
    Case(
        "train empty data file", lambda t: ["train", "--config-file", _data_config(t, b"")], EXIT_USAGE, ("corpus.txt",)
    ),
    Case(
        "train data shorter than one sequence",
        lambda t: ["train", "--config-file", _data_config(t, b"hi\n")],
        EXIT_USAGE,
        ("corpus.txt",),
    ),
    Case(
        "train NANOTRON_EXT_TIMEOUT_S=abc",
        lambda t: ["train", "env:NANOTRON_EXT_TIMEOUT_S=abc"],
        EXIT_USAGE,
        ("NANOTRON_EXT_TIMEOUT_S='abc' must be a positive number of seconds", "NANOTRON_EXT_TIMEOUT_S=60"),
    ),
]


#: The cases that start a ``nanotron-ext train`` process (named "train ..."): tests/runtime/test_bad_train_input.py
#: runs them, in the Nanotron 0.2 pass, so that the planner's tests stay quick and start no process.
TRAIN_CASES = [c for c in CASES if c.id.startswith("train ")]
PLAN_CASES = [c for c in CASES if c not in TRAIN_CASES]


def run_case(case: Case, tmp: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    argv = case.argv(tmp)
    assert argv[0] != "train", f"case {case.id!r} runs `train`: name it 'train ...' (see TRAIN_CASES)"
    cwd = os.getcwd()
    os.chdir(tmp)  # simulate's default outputs land here
    try:
        code = main(argv)
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("case", PLAN_CASES, ids=[c.id for c in PLAN_CASES])
def test_bad_input(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_case(case, tmp_path, capsys)
    check_reply(case, code, out, err)


def check_reply(case: Case, code: int, out: str, err: str) -> None:
    """The documented exit code, one line with the value and the fix, no traceback, no endless line."""
    shown = f"exit {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    assert code == case.code, shown
    assert "Traceback" not in err and "Traceback" not in out, shown
    lines = (out + "\n" + err).splitlines()
    assert any(all(s in line for s in case.says) for line in lines), f"no line says {case.says}:\n{shown}"
    assert "nanx" not in out
    # (a bound well above one message with its config path, which the test runner chooses, well below thousands)
    assert max(map(len, lines), default=0) < 1000, "a line thousands of characters wide"


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--out", "{missing}/t.png"],
        ["simulate", "--compare", "--out", "{tmp}/t.png", "--loads-out", "{missing}/l.png"],
        ["calibrate", "--out", "{missing}/m.json"],
    ],
    ids=["simulate --out", "simulate --loads-out", "calibrate --out"],
)
def test_an_output_into_a_missing_folder_is_refused_and_no_folder_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # One rule for every output flag (train's --metrics-out and --plan-out: TRAIN_CASES): the folder must exist; a
    # typo in its name would otherwise put the output where nobody looks.
    missing = tmp_path / "typo" / "deeper"
    code = main([a.format(missing=missing, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"its folder {str(missing)!r} does not exist; create it first" in err, err
    assert not (tmp_path / "typo").exists() and err.count("\n") == 1


def test_simulate_pdf_is_a_pdf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--out", str(tmp_path / "t.pdf")]) == EXIT_OK
    assert (tmp_path / "t.pdf").read_bytes().startswith(b"%PDF")
    assert main(["simulate", "--out", str(tmp_path / "t.svg")]) == EXIT_OK
    assert b"<svg" in (tmp_path / "t.svg").read_bytes()[:2000]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_strategy_class_is_checked_before_it_is_constructed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "constructed"
    (tmp_path / "side_effect_mod.py").write_text(
        f"class Writer:\n    def __init__(self):\n        open({str(marker)!r}, 'w').close()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--cost-strategy", "side_effect_mod:Writer"]) == EXIT_USAGE
    assert "not a strategy" in capsys.readouterr().err
    assert not marker.exists()


def test_unexpected_errors_are_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nanotron_ext.cli.plan as plan_cli

    def boom(*_: object, **__: object) -> None:
        raise KeyError("surprise")

    monkeypatch.setattr(plan_cli, "inventory_from_config", boom)
    assert main(["plan"]) == EXIT_RUNTIME
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpected KeyError" in err and "NANOTRON_EXT_TRACEBACK=1" in err


# --- the profiled cache ------------------------------------------------------------------------------------


@pytest.fixture
def fake_measure(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """measure_blocks without measuring: a fixed time, and the names of the blocks it was asked for."""
    calls: list[str] = []

    def measure(blocks, cfg, **_):
        calls.extend(block.short for block, _ in blocks)
        return [profiled.BlockTiming(1e-3, 2e-3, 1e-4) for _ in blocks]

    monkeypatch.setattr(profiled, "measure_blocks", measure)
    return calls


def _cache_config(tmp: Path) -> str:
    return _edit(tmp, _set("nanotron_ext.profile_cache", str(tmp / "cache")))


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "1e308", "-1", '"fast"', "0"])
def test_profiled_cache_bad_entry_is_measured_again(
    bad: str, tmp_path: Path, fake_measure: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = _cache_config(tmp_path)
    argv = ["simulate", config, "--times", "profiled", "--out", str(tmp_path / "t.png")]
    assert main(argv) == EXIT_OK
    entries = sorted((tmp_path / "cache").glob("*.json"))
    assert entries and fake_measure
    victim = entries[0]
    victim.write_text(victim.read_text().replace('"forward": 0.001', f'"forward": {bad}', 1))
    fake_measure.clear()
    capsys.readouterr()
    with pytest.warns(profiled.CacheWarning, match=f"cache entry {victim} is unusable .*measuring that block again"):
        assert main(argv) == EXIT_OK
    assert "Traceback" not in capsys.readouterr().err
    assert len(fake_measure) == 1, "exactly the bad entry is measured again"
    assert '"forward": 0.001' in victim.read_text(), "the bad entry is replaced"


def test_profiled_cache_entry_replaced_by_a_directory_leaves_no_temporary_file(
    tmp_path: Path, fake_measure: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = _cache_config(tmp_path)
    argv = ["simulate", config, "--times", "profiled", "--out", str(tmp_path / "t.png")]
    assert main(argv) == EXIT_OK
    victim = sorted((tmp_path / "cache").glob("*.json"))[0]
    victim.unlink()
    victim.mkdir()
    for _ in range(2):
        with pytest.warns(profiled.CacheWarning, match=str(victim)):
            assert main(argv) == EXIT_OK
    assert "Traceback" not in capsys.readouterr().err
    assert not list((tmp_path / "cache").glob(".tmp-*")), "temporary files left behind"


# --- the key tables stay in step with the code they mirror -------------------------------------------------


def test_nanotron_schema_matches_the_installed_nanotron() -> None:
    pytest.importorskip("nanotron.config")
    installed = "upstream main" if NANOTRON == "upstream" else "0.2"
    assert config_keys.NANOTRON_SCHEMAS[installed] == config_keys.installed_nanotron_keys()


def _plan_json(path: str | Path) -> subprocess.CompletedProcess:
    """``nanotron-ext plan PATH --json`` in a fresh interpreter: its warnings on stderr, the plan on stdout."""
    return subprocess.run(
        [sys.executable, "-m", "nanotron_ext.cli", "plan", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_key_no_nanotron_reads_is_one_warning_and_the_plan_goes_on(tmp_path: Path) -> None:
    # SmolLM3's configs carry parallelism.moe_layer_recompute (the Nanotron branch that trained it reads it);
    # upstream's DoReMi example a top-level doremi: section (its own config class reads it). No near miss.
    path = _edit(
        tmp_path,
        lambda raw: (raw["parallelism"].update(moe_layer_recompute=False), raw.update(doremi={"domain_names": "a, b"})),
    )
    proc = _plan_json(path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stderr.splitlines() == [
        f"nanotron-ext: warning: {path}: 'parallelism.moe_layer_recompute', 'doremi' are read by no Nanotron "
        f"nanotron_ext knows: the loaders of Nanotron 0.2 and upstream main reject them (a fork or the example's "
        f"own config class may read them); the plan goes on without them"
    ]
    assert json.loads(proc.stdout)["pp"] == 2


def test_duplicate_yaml_key_is_a_one_line_warning_and_the_last_one_wins(tmp_path: Path) -> None:
    # A warning, not an error: upstream's own examples/config_qwen_with_moe.yaml gives moe_config twice, and
    # Nanotron's loader keeps the last one too.
    path = _replace(tmp_path, "  pp: 2\n", "  pp: 2\n  pp: 4\n")
    proc = _plan_json(path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stderr.splitlines() == [
        f"nanotron-ext: warning: {path}: key 'pp' appears twice in one mapping (line 17 and line 18); YAML keeps "
        f"the last one, and so does Nanotron. Delete one of them"
    ]
    assert json.loads(proc.stdout)["pp"] == 4


def test_a_current_upstream_config_passes_the_key_check() -> None:
    # data_stages, metrics_logging, s3_upload, context_parallel_size: keys 0.2 does not know. The copy under
    # tests/data (UPSTREAM_EXAMPLES), so that a plain clone runs it.
    assert main(["plan", str(UPSTREAM_EXAMPLES / "config_qwen.yaml"), "--json"]) in (EXIT_OK, EXIT_INVALID)


def test_every_bundled_config_passes_the_key_check() -> None:
    for path in sorted(TINY.parent.glob("*.yaml")):
        assert main(["plan", str(path), "--json"]) in (EXIT_OK, EXIT_INVALID), path
