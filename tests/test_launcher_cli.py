"""``python -m nanotron_ext.run``: arguments, bad input, and what it installs into the Nanotron at hand (0.2 or
upstream main; the trainer module is imported with the test stand-ins for flash-attn, in a child process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from launcher_scripts import ONE_RANK, ROOT, STUBS, script_env

from nanotron_ext.config import bundled_config
from nanotron_ext.integration.trainer_patches import strip_ext_keys
from nanotron_ext.run import config_file_of, main


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config-file", "a.yaml"], "a.yaml"),
        (["--config-file=b.yaml", "--x", "1"], "b.yaml"),
        (["--sanity", "2", "--config_file", "c.yaml"], "c.yaml"),
        (["--config", "d.yaml"], "d.yaml"),
        (["--config-file"], None),
        ([], None),
    ],
)
def test_config_file_is_read_from_the_scripts_own_arguments(args, expected):
    assert config_file_of(args) == expected


def test_strip_removes_only_our_keys():
    raw = yaml.safe_load(bundled_config().read_text())
    raw["parallelism"]["cost_strategy"] = "constrained"
    stripped = strip_ext_keys(raw)
    assert "nanotron_ext" in raw and "nanotron_ext" not in stripped
    assert "cost_strategy" not in stripped["parallelism"] and raw["parallelism"]["cost_strategy"] == "constrained"
    assert {k: v for k, v in raw.items() if k != "nanotron_ext"}.keys() == stripped.keys()
    plain = {"model": {"dtype": "float32"}}
    assert strip_ext_keys(plain) is plain


def test_missing_script_is_a_usage_error(tmp_path, capsys):
    assert main([str(tmp_path / "run_train.py"), "--config-file", str(bundled_config())]) == 2
    assert "training script" in capsys.readouterr().err


def test_missing_config_file_argument_says_how_to_pass_it(tmp_path, capsys):
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main([str(script), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "no config file" in err and "--config-file" in err


def test_unknown_cost_strategy_names_the_known_ones(tmp_path, capsys):
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main(["--cost-strategy", "bogus", str(script), "--config-file", str(bundled_config())]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "constrained" in err


_CHILD = textwrap.dedent(
    """
    import sys
    import nanotron.trainer as trainer
    from nanotron.config import get_config_from_file
    from nanotron_ext import load_config
    from nanotron_ext.integration.trainer_patches import install_launcher

    path = sys.argv[1]
    try:
        get_config_from_file(path)
        print("LOADED-BEFORE")
    except Exception as exc:
        print("REFUSED-BEFORE", type(exc).__name__)
    names = ("build_model", "mark_tied_parameters", "check_model_has_grad", "DistributedDataParallel",
             "init_optimizer_and_grad_accumulator", "sync_gradients_across_dp", "load_optimizer", "clip_grad_norm")
    before = {n: getattr(trainer, n) for n in names}
    undo = install_launcher(load_config(path), say=lambda s: None)
    cfg = get_config_from_file(path)
    print("LOADED-AFTER", cfg.parallelism.pp)
    print("SWAPPED", sorted(n for n in names if getattr(trainer, n) is not before[n]))
    undo()
    print("RESTORED", all(getattr(trainer, n) is before[n] for n in names))
    # A re-plan's move re-launches on its new engine whatever the YAML's pp_engine says.
    for moved in (False, True):
        undo = install_launcher(load_config(path).with_overrides(engine="zb1p"), say=lambda s: None, moved=moved)
        print("MOVED" if moved else "YAML", type(get_config_from_file(path).parallelism.pp_engine).__name__)
        undo()
    """
)


def test_launcher_installs_into_nanotrons_own_trainer_and_loader(tmp_path):
    # The bundled example is written for Nanotron 0.2's loader; upstream's strict loader wants its own
    # sections, so under upstream use its example shrunk by the end-to-end helper.
    try:
        from upstream.e2e import tiny_config
        from upstream.harness import NANOTRON
    except ImportError:  # pragma: no cover
        NANOTRON = "0.2"
    path = tiny_config(tmp_path, ext={"cost_strategy": "constrained"}) if NANOTRON == "upstream" else bundled_config()
    env = script_env()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("REFUSED-BEFORE") for line in lines), out.stdout  # strict: our keys are unknown
    assert "LOADED-AFTER 2" in lines
    assert (
        "SWAPPED ['DistributedDataParallel', 'build_model', 'check_model_has_grad', 'clip_grad_norm', "
        "'init_optimizer_and_grad_accumulator', 'load_optimizer', 'mark_tied_parameters', "
        "'sync_gradients_across_dp']" in lines
    )
    assert "RESTORED True" in lines
    assert "YAML OneForwardOneBackwardPipelineEngine" in lines and "MOVED ZeroBubblePipelineEngine" in lines, lines


_OPTIMIZER_CHILD = ONE_RANK + textwrap.dedent(
    """
    import nanotron.trainer as trainer
    from nanotron.config import get_config_from_file
    from nanotron_ext import load_config
    from nanotron_ext.integration.trainer_patches import install_launcher
    from nanotron_ext.runtime import GlooParallelContext, build_cpu_llama

    path = sys.argv[1]
    build_optimizer = trainer.init_optimizer_and_grad_accumulator  # Nanotron's own, before the launcher wraps it
    ctx = GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)

    def optimized(model, optimizer_args):
        optimizer, _ = build_optimizer(model=model, optimizer_args=optimizer_args, parallel_context=ctx)
        return {id(p) for group in optimizer.param_groups for p in group["params"]}

    undo = install_launcher(load_config(path), say=lambda s: None)
    nanotron_cfg = get_config_from_file(path)
    model = build_cpu_llama(nanotron_cfg.model.model_config, ctx, ddp=False,
                            freeze=lambda name, param: "token_position_embeddings" in name or "decoder.0." in name)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    print("COUNTS", len(trainable), len(frozen))
    print("INSTALLED", optimized(model, nanotron_cfg.optimizer) == trainable)
    undo()
    print("NANOTRON-ALONE", optimized(model, nanotron_cfg.optimizer) == trainable | frozen)
    """
)


@pytest.mark.nanotron02
def test_the_optimizer_nanotron_builds_under_the_launcher_gets_only_trainable_parameters():
    # Nanotron hands every parameter to AdamW, frozen or not, and weight decay moves a frozen weight even with a
    # zero gradient; the launcher filters the named parameters Nanotron's optimizer builder reads. Here Nanotron's
    # own init_optimizer_and_grad_accumulator builds the optimizer of a model with a frozen embedding and first
    # decoder layer (0.2's trainer imported with the flash-attn stand-in, one gloo process).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _OPTIMIZER_CHILD, str(bundled_config())],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    counts = next(line for line in lines if line.startswith("COUNTS")).split()[1:]
    assert int(counts[0]) > 0 and int(counts[1]) > 0, out.stdout
    assert "INSTALLED True" in lines, out.stdout
    assert "NANOTRON-ALONE True" in lines, out.stdout  # without the launcher the frozen weights go in too


@pytest.mark.nanotron02
def test_a_trainer_that_cannot_be_imported_is_one_line_with_the_fix(tmp_path, capsys):
    # In the 0.2 pass flash-attn is missing, as on any CPU machine: Nanotron's trainer cannot be imported.
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main([str(script), "--config-file", str(bundled_config())]) == 3
    err = capsys.readouterr().err
    assert "flash-attn" in err and "nanotron-ext train" in err and "Traceback" not in err


def _refused(tmp_path, capsys, old: str, new: str, *flags: str, text: str | None = None) -> str:
    """The launcher's stderr on the bundled config (or ``text``) with ``old`` replaced by ``new``, run with the
    launcher's ``flags``, refused (exit 2) before the script (which would exit 0) runs."""
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    config = tmp_path / "config.yaml"
    config.write_text((text or bundled_config_text()).replace(old, new))
    assert main([*flags, str(script), "--config-file", str(config)]) == 2
    return capsys.readouterr().err


def test_a_replan_of_a_v_or_after_one_step_is_refused_by_the_launcher_before_the_script_runs(tmp_path, capsys):
    """The launcher re-plans contiguous splits after K >= 2 steps (its YAML key or --replan-after): a V, or K = 1,
    stops every rank before anything is built, saying what to do."""
    text = bundled_config_text().replace("pp_engine: 1f1b", "pp_engine: zbv")
    err = _refused(tmp_path, capsys, "\nnanotron_ext:\n", "\nnanotron_ext:\n  replan: {after_steps: 5}\n", text=text)
    assert "nanotron_ext.replan re-plans contiguous splits, not a V yet" in err and "1f1b, zb1p, zb2p or auto" in err
    for typed in ("1", "0"):  # one rule for the flag and the key; the error names the flag, no usage block
        err = _refused(tmp_path, capsys, "\nnanotron_ext:\n", "\nnanotron_ext:\n", "--replan-after", typed)
        assert err == (
            f"nanotron_ext.run [rank 0]: error: --replan-after {typed} must be a whole number of at least 2 (step 1 "
            f"pays one-off costs and is not timed; the steps after it price the run), e.g. --replan-after 20\n"
        )
    err = _refused(tmp_path, capsys, "\nnanotron_ext:\n", "\nnanotron_ext:\n  replan: {after_steps: 1}\n")
    assert "nanotron_ext.replan.after_steps=1 must be a whole number of at least 2" in err


def bundled_config_text() -> str:
    from pathlib import Path

    text = Path(bundled_config()).read_text()
    assert "pp_engine: 1f1b" in text
    return text


def test_the_launchers_auto_prices_the_v_with_its_sends_held_and_a_replan_starts_contiguous(tmp_path, capsys):
    """Nanotron's trainer holds a V's sends to one order (a GPU's send waits for its receive): the launcher's auto
    prices the V so and says it on the V's line; under --replan-after it chooses among the contiguous engines."""
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    config = tmp_path / "config.yaml"
    config.write_text(bundled_config_text().replace("pp_engine: 1f1b", "pp_engine: auto"))
    main([str(script), "--config-file", str(config)])  # the trainer may not import here (0.2 without flash-attn)
    out = capsys.readouterr().out
    assert "nanotron_ext: pp_engine: auto -> " in out
    assert re.search(r"zbv: step \S+ \S+ \(its sends held as Nanotron's trainer runs them\), peak ", out), out
    main(["--replan-after", "4", str(script), "--config-file", str(config)])
    out = capsys.readouterr().out
    assert "nanotron_ext: pp_engine: auto -> " in out and "zbv" not in out, out
