"""Every ratio a table or a line prints against another plan: measured against a plan that can train, or saying in
the same line why the other plan cannot (issue 44: Llama-3-8B's plan compared itself with Nanotron's split, which
does not fit the GPU, without a word; "vs optimum" was a FLOP optimum that could not train)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import plan_with_ranks
from nanotron_ext.report import format_seconds

LLAMA_8B = str(bundled_config("llama_3_8b.yaml"))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


def _pictures(tmp_path) -> list[str]:
    return ["--out", str(tmp_path / "t.png"), "--loads-out", str(tmp_path / "l.png")]


def _line(text: str, start: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(start))


def _over_memory(plan_text: str) -> str:
    """``stage K needs X, over LIMIT``, as the plan's own first memory error says it (``needs about X``)."""
    error = re.search(r"^ERROR \[stage \d+\] (stage \d+ needs) about (\S+ \S+, over .*) by \S+ \S+$", plan_text, re.M)
    assert error, plan_text
    return f"{error[1]} {error[2]}"


def test_the_nanotron_line_says_that_nanotrons_split_does_not_fit(tmp_path, capsys):
    rule = json.loads(_run(capsys, "plan", LLAMA_8B, "--cost-strategy", "nanotron", "--json"))
    assert [f["code"] for f in rule["findings"]] == ["memory"] and not rule["ok"]
    why = _over_memory(_run(capsys, "plan", LLAMA_8B, "--cost-strategy", "nanotron"))
    ours = json.loads(_run(capsys, "plan", LLAMA_8B, "--json"))
    line = _line(_run(capsys, "plan", LLAMA_8B), "Nanotron's rule: ")
    speed = f"{rule['simulated_step_time'] / ours['simulated_step_time']:.3f}x"
    assert line == (
        f"Nanotron's rule: {format_seconds(rule['simulated_step_time'])}, this split is {speed} as "
        f"fast; Nanotron's split does not fit: {why}"
    )
    # simulate --compare's line says the same of the same split.
    compare = _run(capsys, "simulate", LLAMA_8B, "--compare", *_pictures(tmp_path))
    assert _line(compare, "constrained vs Nanotron's rule: ").endswith(
        f" as fast; Nanotron's split does not fit: {why}"
    )
    # plan --compare: the vs nanotron column's line under the table.
    assert f"\nvs nanotron: Nanotron's split does not fit: {why}\n" in _run(capsys, "plan", LLAMA_8B, "--compare")


def test_the_nanotron_line_says_that_nanotrons_split_cannot_train(tmp_path, capsys):
    rule = json.loads(_run(capsys, "plan", "--cost-strategy", "nanotron", "--json"))
    assert [(f["code"], f["stage"]) for f in rule["findings"]] == [("no-params", 1)]
    assert _line(_run(capsys, "plan"), "Nanotron's rule: ").endswith(
        " as fast; Nanotron's split cannot train: no parameters on stage 1"
    )
    text = _run(capsys, "simulate", "--compare", *_pictures(tmp_path))
    assert _line(text, "constrained vs Nanotron's rule: ").endswith(
        "; Nanotron's split cannot train: no parameters on stage 1"
    )


def test_a_comparison_with_a_plan_that_can_train_adds_nothing(capsys):
    config = str(bundled_config("smollm_135m.yaml"))
    rule = json.loads(_run(capsys, "plan", config, "--pp", "2", "--cost-strategy", "nanotron", "--json"))
    assert rule["ok"]
    text = _run(capsys, "plan", config, "--pp", "2")
    assert re.search(r"^Nanotron's rule: \S+ \S+, this split is \d\.\d{3}x as fast$", text, re.M), text
    assert "vs nanotron:" not in _run(capsys, "plan", config, "--pp", "2", "--compare")


def test_compare_engines_says_when_the_1f1b_plan_it_compares_with_does_not_fit(capsys, monkeypatch):
    # The contiguous engines only: the V's row plays no part in this line, and its search on Llama-3-8B takes 28 s.
    from nanotron_ext.cli import plan_compare
    from nanotron_ext.plan import CONTIGUOUS_AUTO_ENGINES

    every = plan_compare.engine_rows
    monkeypatch.setattr(plan_compare, "engine_rows", lambda cfg: every(cfg, CONTIGUOUS_AUTO_ENGINES))
    argv = ["plan", LLAMA_8B, "--pp", "2", "--micro-batches", "2", "--compare-engines"]
    text = _run(capsys, *argv)
    row = _line(text, "1f1b ")
    assert row.endswith("INVALID (memory@0-1)")
    first_peak = re.search(r"  (\S+ GiB) / \S+ GiB  ", row)[1]
    assert _line(text, "vs 1f1b: ") == (
        f"vs 1f1b: 1F1B's split does not fit: stage 0 needs {first_peak}, over "
        f"79.18 GiB per GPU (H100 SXM (analytic)) (2 stages over)"
    )


def test_the_frozen_tradeoff_says_when_the_plan_with_frozen_stages_does_not_fit(tmp_path, capsys):
    raw = yaml.safe_load(bundled_config("llama_3_70b.yaml").read_text())
    raw["model"]["model_config"]["tie_word_embeddings"] = False
    raw.setdefault("nanotron_ext", {})["freeze"] = {"modules": ["*"], "unfreeze": ["decoder.0", "decoder.1"]}
    path = tmp_path / "frozen.yaml"
    path.write_text(yaml.safe_dump(raw))
    free = _run(capsys, "plan", str(path), "--pp", "2", "--micro-batches", "2", "--cost-strategy", "constrained")
    text = free.split("frozen setup: what a trainable block on every stage costs", 1)[1]
    assert re.search(r"^frozen stages allowed .* 1\.000x$", text, re.M)
    line = _line(text, "vs frozen allowed: ")
    assert line.startswith("vs frozen allowed: the plan with frozen stages allowed does not fit: stage ")


# --- vs best valid: the best split that can train, found by trying every split ---------------------------------


def _capped_smollm(tmp_path, cap_gib: float) -> str:
    raw = yaml.safe_load(bundled_config("smollm_135m.yaml").read_text())
    raw["parallelism"]["pp"] = 2
    raw.setdefault("nanotron_ext", {})["memory_cap_gib"] = cap_gib
    path = tmp_path / "capped.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_vs_best_valid_is_the_lightest_slowest_stage_of_any_split_that_can_train(tmp_path, capsys):
    # SmolLM-135M at pp=2 under an 8 GiB cap: the FLOP-balanced cut needs 8.24 GiB on stage 0, so the best valid
    # split is a lighter-on-memory one with a heavier slowest stage; two cuts leave the last stage without weights.
    config = _capped_smollm(tmp_path, 8.0)
    cfg = load_config(config)
    blocks = inventory_from_config(cfg)
    n = len(blocks)
    every = [
        plan_with_ranks(blocks, cfg, [0] * cut + [1] * (n - cut), "tried", suggest_fixes=False) for cut in range(1, n)
    ]
    valid = [p.slowest_flops for p in every if p.ok]
    assert len(valid) < len(every) and min(valid) > min(p.slowest_flops for p in every)  # the cap decides
    best = min(valid)
    assert json.loads(_run(capsys, "plan", config, "--json"))["best_valid_flops"] == best
    plans = {p["strategy"]: p for p in json.loads(_run(capsys, "plan", config, "--compare", "--json"))}
    text = _run(capsys, "plan", config, "--compare")
    for name, plan in plans.items():
        if "slowest_flops" in plan:
            cell = re.search(rf"^{name} +\S+ +(\S+) ", text, re.M)[1]
            assert cell == f"{best / plan['slowest_flops']:.3f}x", (name, cell)
            assert plan["ok"] is False or best / plan["slowest_flops"] <= 1.0 + 1e-12
    line = _line(_run(capsys, "plan", config, "--cost-strategy", "flops"), "slowest stage vs best valid split: ")
    assert line.startswith(f"slowest stage vs best valid split: {best / plans['flops']['slowest_flops']:.3f}x")


@pytest.mark.parametrize(
    "argv",
    [
        ["--pp", "6", "--cost-strategy", "nanotron"],  # the tiny model's five blocks with weights: a stage without
        [LLAMA_8B, "--pp", "2", "--micro-batches", "2"],  # Llama-3-8B on two H100s: no split fits
    ],
    ids=["no-params", "memory"],
)
def test_vs_best_valid_is_a_dash_when_no_split_can_train(capsys, argv):
    text = _run(capsys, "plan", *argv)
    assert _line(text, "slowest stage vs best valid split: ") == (
        "slowest stage vs best valid split: - (no split can train and fit under this config)"
    )


def test_simulate_vs_best_is_the_fastest_plan_that_can_train(tmp_path, capsys):
    entries = json.loads(_run(capsys, "simulate", LLAMA_8B, "--compare", "--json", *_pictures(tmp_path)))["compare"]
    steps = {e["strategy"]: (e["step_time"], e["ok"]) for e in entries if "step_time" in e}
    fastest_ok = min(t for t, ok in steps.values() if ok)
    assert min(t for t, _ in steps.values()) < fastest_ok  # Nanotron's split is faster and does not fit
    text = _run(capsys, "simulate", LLAMA_8B, "--compare", *_pictures(tmp_path))
    for name, (step, ok) in steps.items():
        cell = re.search(rf"^{name} +\S+ +\S+ \S+ +\S+ \S+ +(\S+) ", text, re.M)[1]  # times: value and unit
        assert cell == f"{fastest_ok / step:.3f}x", (name, cell)
        assert not ok or fastest_ok / step <= 1.0
    assert not steps["nanotron"][1] and fastest_ok / steps["nanotron"][0] > 1.0  # faster, and it cannot train
