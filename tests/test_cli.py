"""`nanotron-ext plan`: exit codes, tables, JSON."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config

FLOPS_ONLY = Path(__file__).parent / "data" / "machine_flops_only.json"


def test_nanotron_rule_exits_1_with_cause_and_fix(capsys):
    assert main(["plan", str(bundled_config()), "--cost-strategy", "nanotron"]) == 1
    out = capsys.readouterr().out
    assert "block -> stage: [0, 0, 0, 0, 0, 1, 1]" in out
    assert "stage 1 holds no parameters (cast, loss)" in out
    assert "vocabulary 50277 × hidden 16 outweighs both decoder layers" in out
    assert "--cost-strategy constrained" in out
    assert out.splitlines()[-1] == "INVALID: this plan cannot train"


def test_constrained_exits_0_and_every_stage_trains(capsys):
    assert main(["plan", "--cost-strategy", "constrained", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ok"] and all(s["trainable"] > 0 for s in plan["stages"])
    # On the analytic H100 the tiny model is latency-bound (10 µs a hop against ~1 µs of compute): the cut goes
    # where only hidden states cross, never after the lm_head. With compute alone, the FLOP-balanced split.
    assert plan["block_ranks"].index(1) <= 4
    assert main(["plan", "--json", "--machine", str(FLOPS_ONLY)]) == 0
    assert json.loads(capsys.readouterr().out)["block_ranks"] == [0, 0, 0, 0, 1, 1, 1]


def test_compare_table_lists_every_strategy(capsys):
    assert main(["plan", "--compare"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["nanotron"].endswith(" INVALID (no-params@1)")
    for name in ("uniform", "flops", "memory", "constrained"):
        assert rows[name].split()[-1] == "OK", rows[name]
    # A message too long for its cell is a tag there and whole under the table, never cut.
    assert rows["layout"].endswith("  cannot plan [1]")
    assert "\n[1] cost_strategy 'layout' needs `layout:` under `nanotron_ext:`, e.g. 'E,t*5|t*6,L'" in out
    assert "…" not in out


def test_stage_table_uses_compact_ranges(capsys):
    assert main(["plan", str(bundled_config("llama_3_8b.yaml")), "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "VALID: every stage has parameters to train"
    assert "embedding, decoder.0-" in out and "lm_head, cast, loss" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--cost-strategy", "bogus"], "known strategies: nanotron, uniform"),
        (["plan", "no/such/file.yaml"], "does not exist"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_infeasible_request_exits_1(capsys):
    assert main(["plan", "--pp", "6", "--cost-strategy", "flops"]) == 1
    assert "largest pp that works is 5" in capsys.readouterr().out


def test_console_script_installed():
    exe = shutil.which("nanotron-ext") or f"{sys.executable} -m nanotron_ext.cli"
    proc = subprocess.run(f"{exe} plan", shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "VALID: every stage has parameters to train"


def test_frozen_setup_shows_the_tradeoff(tmp_path, capsys):
    import yaml

    raw = yaml.safe_load(bundled_config("smollm_135m.yaml").read_text())
    raw["model"]["model_config"]["tie_word_embeddings"] = False
    raw["nanotron_ext"]["freeze"] = {"modules": ["*"], "unfreeze": ["decoder.0", "decoder.1"]}
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path), "--pp", "2"]) == 0
    out = capsys.readouterr().out.split("frozen setup: what a trainable block on every stage costs", 1)[1]
    # Only decoder.0-1 train: constrained must split right after them, doubling the slowest stage.
    every = re.search(r"^trainable on every stage  0-1\|2-34 +(\S+) ms +7\.72T +2 +(\S+)x$", out, re.M)
    free = re.search(r"^frozen stages allowed     0-17\|18-34 +(\S+) ms +3\.95T +1 +1\.000x$", out, re.M)
    assert every and free, out
    # Its speed over the frozen-allowed plan: that plan's step ÷ this one's, below 1 (it is slower).
    assert float(every[2]) == pytest.approx(float(free[1]) / float(every[1]), abs=0.01) and float(every[2]) < 1


def test_version_is_the_installed_package_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"nanotron-ext {metadata.version('nanotron-ext')} (Nanotron ")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["plan", "--engine", "zb1"], "argument --engine: invalid choice: 'zb1'; did you mean 'zb1p'? choose from"),
        (["plna"], "invalid choice: 'plna'; did you mean 'plan'? choose from plan, train, simulate, calibrate"),
        (["simulate", "--times", "flop"], "invalid choice: 'flop'; did you mean 'flops'?"),
    ],
)
def test_flag_choices_and_subcommands_say_did_you_mean(capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_plan_and_simulate_give_the_same_step_and_bubble(tmp_path, capsys):
    config = str(bundled_config("smollm_135m.yaml"))
    shape = ["--pp", "8", "--micro-batches", "16"]
    assert main(["plan", config, *shape, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", config, *shape, "--json", "--out", str(tmp_path / "t.png")]) == 0
    simulated = json.loads(capsys.readouterr().out)["simulation"]
    # plan --json carries the simulated step, as the compare JSON does: the very figures `simulate` gives.
    assert planned["simulated_step_time"] == simulated["step_time"]
    assert planned["bubble_fraction"] == simulated["bubble_fraction"]
    assert main(["plan", config, *shape]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("simulated step: "))
    assert f", bubble {simulated['bubble_fraction']:.1%} (" in line
    assert "estimate" not in line  # the equal-work formula is JSON only, under its own name
    assert main(["simulate", config, *shape, "--out", str(tmp_path / "t.png")]) == 0
    assert f"bubble {simulated['bubble_fraction']:.1%}" in capsys.readouterr().out


def test_compare_ratios_read_as_this_plans_speed(capsys):
    assert main(["plan", "--compare", "--json"]) == 0
    steps = {p["strategy"]: p.get("simulated_step_time") for p in json.loads(capsys.readouterr().out)}
    assert main(["plan", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "ratios (x) are speed: the other plan's time ÷ this one's, so above 1 means this one is faster" in out
    row = next(x for x in out.splitlines() if x.startswith("constrained "))
    vs_optimum, vs_nanotron = re.findall(r" (\d+\.\d{3})x ", row)[:2]
    assert float(vs_nanotron) == pytest.approx(steps["nanotron"] / steps["constrained"], abs=1e-3)
    assert float(vs_nanotron) > 1  # Nanotron's rule is slower here: this plan's speed over it is above 1
    assert float(vs_optimum) <= 1.0  # the optimum's slowest stage ÷ this one's: never faster than the optimum


def test_a_tied_weight_is_counted_once(capsys):
    config = str(bundled_config("smollm_135m.yaml"))  # tie_word_embeddings: true
    assert main(["plan", config, "--pp", "1", "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    # 134.5M: SmolLM-135M, not 163M (the lm_head's 28.3M = 49152 × 576 counted a second time)
    assert stage["params"] == stage["trainable"] == 134_515_008
    assert stage["memory"]["weights"] == 2 * stage["params"]  # bf16: the memory table counts it once too
    assert main(["plan", config, "--pp", "1"]) == 0
    assert re.search(
        r"^    0  embedding, decoder\.0-29, final_norm, lm_head, cast, loss +135M +135M ", capsys.readouterr().out, re.M
    )
    # On two stages each holds its own copy (an all-reduce keeps them equal), so each counts it.
    assert main(["plan", config, "--pp", "2", "--json"]) == 0
    first, last = json.loads(capsys.readouterr().out)["stages"]
    assert first["params"] + last["params"] == 134_515_008 + 49152 * 576


def test_frozen_stages_allowed_get_no_fix_to_set_what_is_set_and_a_verdict_that_says_so(capsys):
    config = str(bundled_config("last_layer_lm_head_pp4.yaml"))  # constrained, allow_frozen_stages: true
    assert main(["plan", config]) == 0
    out = capsys.readouterr().out
    warnings_ = [x for x in out.splitlines() if x.startswith("WARNING [stage")]
    assert len(warnings_) == 3 and all("holds only frozen parameters" in x for x in warnings_)
    fixes = [x for x in out.splitlines() if x.startswith("  fix: ")]
    assert fixes and not any(
        "allow_frozen_stages: true` under" in x or "--cost-strategy constrained" in x for x in fixes
    ), fixes
    assert all(x.startswith("  fix: none needed (`allow_frozen_stages: true` allows it)") for x in fixes)
    verdict = re.search(
        r"^VALID with 3 frozen-only stages \(0, 1, 2\): they compute but hold nothing to train; "
        r"idle \d+%, \d+%, \d+% of the simulated step$",
        out,
        re.M,
    )
    assert verdict, out
    assert "VALID: every stage has parameters to train" not in out


def test_train_ranks_but_0_print_no_warning_every_rank_prints(monkeypatch, tmp_path, capsys):
    import warnings

    from nanotron_ext.config_keys import UnreadKeyWarning

    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # fails on its output path before training; the rank's warning filter is set by then
        assert main(["train", "--metrics-out", str(tmp_path)]) == 2
        warnings.warn("`torch.distributed.all_reduce_coalesced` will be deprecated", FutureWarning, stacklevel=1)
        warnings.warn("'doremi' is read by no Nanotron", UnreadKeyWarning, stacklevel=1)
        warnings.warn("a rank's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a rank's own"]
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--metrics-out", str(tmp_path)]) == 2
        warnings.warn("`torch.distributed.all_reduce_coalesced` will be deprecated", FutureWarning, stacklevel=1)
    assert len(caught) == 1  # rank 0 says it, once
    capsys.readouterr()


def test_planning_never_imports_torch():
    # `plan` is a dry run: importing torch (through the checkpoint reader) cost it 1.3 s of its 1.7 s.
    code = (
        "import sys; from nanotron_ext.cli import main; main(['plan']); "
        "assert 'torch' not in sys.modules, 'plan imported torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_top_level_help_is_written_for_users(capsys):
    from nanotron_ext.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "module" not in out  # not a docstring
    assert out.split("\n\n")[1].startswith("Plan which blocks of a Nanotron model go to which pipeline stage")
    # Every command on one line with its own help, the one its --help starts from.
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub._choices_actions:
        assert re.search(rf"^    {choice.dest} +{re.escape(choice.help.split()[0])} ", out, re.M), choice.dest
    # The first steps are commands that run: each parses, with the bundled example as CONFIG.
    steps = re.findall(r"^  (nanotron-ext [^\n]*?)  +\S", out.split("first steps:")[1], re.M)
    assert len(steps) >= 3
    for line in steps:
        argv = line.split()[1:]
        if "COMMAND" in argv:
            continue
        args = build_parser().parse_args([str(bundled_config()) if a == "CONFIG" else a for a in argv])
        assert callable(args.func), line
    docs = re.search(r"docs: (docs/\S+\.md)", out)
    assert docs and (Path(__file__).parents[1] / docs[1]).is_file()
    assert "141" in out and "exit codes:" in out
