"""`nanotron-ext plan`: exit codes, tables, JSON."""

from __future__ import annotations

import json
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
    assert "  cannot plan: cost_strategy 'layout' needs `layout:`" in rows["layout"]


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
    out = capsys.readouterr().out
    # Only decoder.0-1 train: constrained must split right after them, doubling the slowest stage.
    assert "constrained                     0-1|2-34" in out
    assert "optimum, frozen stages allowed  0-17|18-34" in out
    assert "1.955x" in out
