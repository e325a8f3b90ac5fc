"""``python -m nanotron_ext.run --cpu-debug``: upstream Nanotron's own trainer on CPU, as docs/checkpoints.md tells a
user to run it on a laptop ("Resume on a laptop"), and nothing of the stand-ins without the flag.

The laptop example (``examples/cpu_debug``) is run with its configs, the training under torchrun as documented: 4
steps at pp=2 on ``E,t|t,L``, then checkpoint 4 resumed for steps 5 and 6 on its own plan (the reference), at pp=1
and on another split. Its config clips gradients (``clip_grad: 1.0``, as upstream's example): with Nanotron's own
clipping a resume under another split or pp drifted by 8.6e-7 once; under the launcher's split-independent clipping it
is bit-identical. Whether the drift shows depends on the run's gradients (it did not in later runs of this example):
the clipping's rule itself is held on gradients chosen to show it, ``tests/runtime/test_clipping.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_ext.integration.cpu_standins import BANNER, STANDIN_PACKAGES
from nanotron_ext.procs import local_env
from upstream.e2e import ROOT, STUBS, TORCHRUN, Run, launch, tiny_config, whole_weights

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

EXAMPLE = ROOT / "examples" / "cpu_debug"
#: The example's runs: config -> ranks (the commands of docs/checkpoints.md).
RUNS = {"train_pp2": 2, "resume_pp2": 2, "resume_pp1": 1, "resume_split": 2}


@pytest.fixture(scope="module")
def laptop(tmp_path_factory) -> tuple[Path, dict[str, Run]]:
    """The example's four runs, in order, in a copy of its folder (its paths are relative to where it runs)."""
    folder = tmp_path_factory.mktemp("laptop")
    for config in RUNS:
        shutil.copy(EXAMPLE / f"{config}.yaml", folder)
    runs = {}
    for config, nproc in RUNS.items():
        # The training run goes through torchrun as the docs say; the resumes start their ranks directly (with
        # torchrun's environment, e2e.launch): what they test is what the checkpoint moves into, and torchrun's
        # agent costs each about 4 s of CPU.
        runs[config] = launch(folder / f"{config}.yaml", nproc=nproc, torchrun=TORCHRUN or config == "train_pp2")
        assert runs[config].rc == 0, runs[config].out[-4000:]
    return folder, runs


def _notes(run: Run) -> list[str]:
    return re.findall(r"^nanotron_ext: (.*)$", run.out, re.M)


def test_the_flag_says_once_that_the_run_is_for_debugging(laptop):
    _, runs = laptop
    for run in runs.values():
        assert _notes(run).count(BANNER) == 1  # rank 0 only
    assert sorted(runs["train_pp2"].losses) == [1, 2, 3, 4]


def test_the_laptop_example_resumes_under_another_pp_and_split_bit_identically(laptop):
    folder, runs = laptop
    assert (folder / "checkpoints" / "train" / "latest.txt").read_text() == "4"
    assert any(
        n.startswith(
            "the config asks pp=1, the checkpoint was trained at pp=2: checkpoint 4 (E,t|t,L) moves "
            "onto the new plan E,t*2,L"
        )
        for n in _notes(runs["resume_pp1"])
    ), _notes(runs["resume_pp1"])
    assert any(
        n.startswith(
            "the config's layout 'E,t*2,N|H,C,X' asks for another split: checkpoint 4 (E,t|t,L) moves "
            "onto the new plan E,t*2,N|H,C,X"
        )
        for n in _notes(runs["resume_split"])
    ), _notes(runs["resume_split"])
    assert any("resuming checkpoint 4 on its recorded split E,t|t,L" in n for n in _notes(runs["resume_pp2"]))
    reference = whole_weights(folder / "checkpoints" / "resume_pp2" / "6")
    start = whole_weights(folder / "checkpoints" / "train" / "4")
    assert all(not torch.equal(reference[k], start[k]) for k in reference)  # steps 5 and 6 moved every weight
    for other in ("resume_pp1", "resume_split"):
        assert {s: runs["resume_pp2"].losses[s] for s in (5, 6)} == runs[other].losses
        moved = whole_weights(folder / "checkpoints" / other / "6")
        assert moved.keys() == reference.keys()
        assert [k for k in reference if not torch.equal(reference[k], moved[k])] == [], other
    # The docs' comparison, as a user runs it: identical, and a checkpoint that differs is told apart.
    compare = [sys.executable, str(EXAMPLE / "compare_weights.py"), "checkpoints/resume_pp2/6"]
    same = subprocess.run(
        [*compare, "checkpoints/resume_pp1/6", "checkpoints/resume_split/6"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert same.returncode == 0 and same.stdout.count("15 weights, bit-identical to checkpoints/resume_pp2/6") == 2, (
        same.stdout + same.stderr
    )
    differs = subprocess.run([*compare, "checkpoints/train/4"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert differs.returncode == 1 and "max |w - w_ref| = " in differs.stdout, differs.stdout + differs.stderr


def test_the_example_configs_differ_only_where_their_comments_say():
    def flat(d: dict, prefix: str = "") -> dict[str, object]:
        out = {}
        for key, value in d.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    configs = {name: flat(yaml.safe_load((EXAMPLE / f"{name}.yaml").read_text())) for name in RUNS}
    paths = {"checkpoints.checkpoints_path", "checkpoints.resume_checkpoint_path", "tokens.train_steps"}
    expected = {
        "resume_pp2": paths,
        "resume_pp1": paths | {"parallelism.pp", "nanotron_ext.layout"},
        "resume_split": paths | {"nanotron_ext.layout"},
    }
    for name, keys in expected.items():
        assert {k for k in configs[name] if configs[name][k] != configs["train_pp2"][k]} == keys, name
    assert configs["train_pp2"]["optimizer.clip_grad"] == 1.0  # the case Nanotron's own clipping broke


_PROBE = textwrap.dedent(
    """
    import importlib.util, sys
    import flash_attn
    import nanotron.parallel.context as context
    print("FOUND", sorted(n for n in sys.argv[1].split(",") if importlib.util.find_spec(n) is not None))
    print("SET_DEVICE", context.ParallelContext.set_device.__module__)
    print("FLASH_ATTN", flash_attn.__version__)
    """
)
_CHILD = textwrap.dedent(
    """
    import sys
    from nanotron_ext.run import main

    code = main(sys.argv[1:])
    print("CODE", code)
    print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("flash_attn", "triton", "grouped_gemm")
                           or m == "nanotron_ext.integration.cpu_standins.trainer"))
    """
)


def _child(args: list[str], *first: Path) -> list[str]:
    """The launcher's ``main(args)`` in a fresh interpreter, one process, with ``first`` and the project on its path and
    not the test pass's shim."""
    env = local_env(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), str(ROOT)])
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True, timeout=180)
    assert STUBS.name not in env["PYTHONPATH"]
    return (out.stdout + out.stderr).splitlines()


def test_without_the_flag_no_standin_is_importable_and_with_it_the_script_runs_on_them(tmp_path):
    config = tiny_config(tmp_path, ext={"cost_strategy": "constrained"})
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    names = ",".join(STANDIN_PACKAGES)
    # Without the flag: Nanotron's trainer cannot be imported here (no flash-attn), the launcher says so and names
    # the flag, and no stand-in package can be found or was loaded.
    plain = _child([str(probe), names, "--config-file", str(config)])
    assert "CODE 3" in plain and "LOADED []" in plain, plain[-20:]
    assert any("importing Nanotron's trainer failed" in line and "--cpu-debug" in line for line in plain), plain[-20:]
    assert not any(line.startswith("FOUND") for line in plain)  # the script never ran
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import importlib.util as u; print([n for n in {names!r}.split(',') if u.find_spec(n)])",
        ],
        env={**local_env(ROOT), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert found.strip() == "[]", found
    # With it, one process (no torchrun): the same script runs, on the stand-ins, which win over an installed
    # flash_attn (whose CUDA kernels could not take the CPU's tensors).
    installed = tmp_path / "site" / "flash_attn"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("__version__ = '2.7.0'\n")
    debug = _child(["--cpu-debug", str(probe), names, "--config-file", str(config)], installed.parent)
    assert "CODE 0" in debug, debug[-20:]
    assert "FLASH_ATTN 2.6.3+cpustub" in debug
    assert f"FOUND {sorted(STANDIN_PACKAGES)}" in debug
    assert "SET_DEVICE nanotron_ext.integration.cpu_standins.trainer" in debug
    assert any(line == f"nanotron_ext: {BANNER}" for line in debug)
