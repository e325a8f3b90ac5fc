"""Every published config we could find plans: upstream Nanotron's ``examples/`` (and its sub-projects: DoReMi,
muP, MoE, Mamba...) and SmolLM1/2/3's pretraining configs, copied under ``tests/data`` (see its README).

``nanotron-ext plan FILE`` exits 0 (the plan can train) or 1 (it cannot), never 2 or 3: keys that no Nanotron we
know reads (SmolLM3's ``parallelism.moe_layer_recompute``, DoReMi's ``doremi:``) are a warning, not a refusal.
Only a family the planner cannot price (Mamba) exits 2, and says so.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from nanotron_ext.cli import main
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from nanotron_ext.config_keys import UnreadKeyWarning

DATA = Path(__file__).resolve().parent / "data"
CONFIGS = sorted([*DATA.glob("nanotron_examples/**/*.yaml"), *DATA.glob("smollm/**/*.yaml")])
#: Families the planner cannot price from a config: ``plan`` exits 2 naming the family.
UNPRICED = {"mamba/config_mamba.yaml": "model family 'mamba' cannot be planned from its config"}
#: The keys no Nanotron we know reads, per file (the warning must name each).
UNREAD = {
    "doremi/configs/config_2.8b_llama.yaml": ["'doremi'"],
    "doremi/configs/config_2.8b_llama_with_tuned_weights.yaml": ["'doremi'"],
    "doremi/configs/config_280m_llama.yaml": ["'doremi'"],
    "doremi/configs/config_280m_llama_proxy.yaml": ["'doremi'"],
    "config_resume_training.yaml": ["'model.model_config.interleaved_rotary'", "'parallelism.moe_layer_recompute'"],
    **{
        f"smollm3/{name}": ["'parallelism.moe_layer_recompute'"]
        for name in (
            "stage1_8T.yaml",
            "stage2_8T_9T.yaml",
            "stage3_9T_11T.yaml",
            "long_context_4k_to_32k.yaml",
            "long_context_32k_to_64.yaml",
        )
    },
}


def _key(path: Path) -> str:
    return str(path.relative_to(DATA)).split("/", 1)[1]


def test_the_copies_are_all_there() -> None:
    # 16 YAMLs under upstream's examples/ at the README's commit, 3 + 3 + 5 SmolLM pretraining configs.
    assert len([p for p in CONFIGS if "nanotron_examples" in p.parts]) == 16
    assert len([p for p in CONFIGS if "smollm" in p.parts]) == 11
    assert set(UNPRICED) | set(UNREAD) <= {_key(p) for p in CONFIGS}


@pytest.mark.parametrize("pp", [None, 2], ids=["pp-of-the-file", "pp2"])
@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(DATA)) for p in CONFIGS])
def test_a_real_config_plans(path: Path, pp: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", str(path)] + ([] if pp is None else ["--pp", str(pp)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    out, err = capsys.readouterr()
    shown = f"exit {code}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-2000:]}"
    assert "Traceback" not in out + err, shown
    if _key(path) in UNPRICED:
        assert code == EXIT_USAGE and UNPRICED[_key(path)] in err, shown
        return
    assert code in (EXIT_OK, EXIT_INVALID), shown
    verdict = "VALID: every stage has parameters to train" if code == EXIT_OK else "INVALID: this plan cannot train"
    assert verdict in out.splitlines() or code == EXIT_INVALID and "cannot train" in out + err, shown
    unread = [str(w.message) for w in caught if issubclass(w.category, UnreadKeyWarning)]
    expected = UNREAD.get(_key(path), [])
    assert len(unread) == (1 if expected else 0), unread
    for key in expected:
        assert key in unread[0] and "the plan goes on" in unread[0] and "Nanotron 0.2 and upstream main" in unread[0]


# --- a plain clone: upstream's examples come from tests/data; its source tree is skipped without, required in CI


def test_upstream_examples_are_read_from_the_copies() -> None:
    from upstream.harness import UPSTREAM_EXAMPLES

    assert UPSTREAM_EXAMPLES == DATA / "nanotron_examples"


@pytest.mark.parametrize("required", ["", "1"])
def test_a_missing_upstream_tree_skips_or_fails_when_required(
    required: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from upstream import harness

    monkeypatch.setattr(harness, "UPSTREAM", tmp_path / "shared" / "upstream" / "nanotron")
    monkeypatch.setenv(harness.REQUIRE_SHARED_ENV, required)
    with pytest.raises(
        (pytest.fail.Exception, pytest.skip.Exception), match="needs upstream Nanotron's source tree at .*run_train.py"
    ) as outcome:
        harness.upstream_tree()
    assert outcome.type is (pytest.fail.Exception if required else pytest.skip.Exception)
