"""One job, one message: our errors under real torchrun processes (two ranks, ``--standalone``). Each is printed once,
by the first rank that has it, with no traceback of ours; every rank writes it to torchelastic's error file, so
torchrun's summary names it as the root cause (not ``error_file: <N/A>``); each rank exits with the documented code
and torchrun itself with 1. Cases: a half-written checkpoint refused by the launcher, a config error found on the
ranks of ``nanotron-ext train``, a re-plan setting the launcher refuses, and a message of several lines."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from launcher_scripts import script_env
from torchrun_summary import exit_code, no_traceback_of_ours, root_cause

from nanotron_ext.checkpoint import record_for
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import make_plan
from nanotron_ext.procs import run_local_ranks

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@dataclass
class Job:
    rc: int | None
    out: str  # torchrun's and the ranks' stdout, then their stderr


def _torchrun(tmp: Path, *argv: str) -> Job:
    """``torchrun --standalone --nproc_per_node=2 ARGV`` in its own session (its ranks die with it at the deadline)."""
    run = run_local_ranks(
        [*TORCHRUN, *argv], 1, timeout=240, env=script_env(), rendezvous=False, merge_output=False, cwd=tmp
    )
    return Job(run.ranks[0].returncode, run.ranks[0].stdout + run.ranks[0].stderr)


def _config(tmp: Path, **sections: dict) -> Path:
    raw = yaml.safe_load(bundled_config().read_text())
    for name, values in sections.items():
        raw[name] = {**(raw.get(name) or {}), **values}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _script(tmp: Path, source: str = "raise SystemExit(0)\n") -> str:
    script = tmp / "run_train.py"
    script.write_text(source)
    return str(script)


def _one_message(job: Job, prefix: str, text: str, code: int) -> str:
    """The job printed ``prefix`` + ``text`` once (by one rank), every failed rank's error file holds it with the
    rank's exit code ``code``, torchrun's summary names it as the root cause, and no traceback is ours; returns the
    printed line."""
    printed = [line for line in job.out.splitlines() if re.match(prefix, line) and text in line]
    assert len(printed) == 1, job.out[-4000:]
    assert job.rc == 1, job.out[-4000:]  # torchrun's own code when a rank failed
    root = root_cause(job.out, code)
    assert re.search(rf"traceback : {prefix}.*{re.escape(text)}", root), root
    # Every rank wrote its own file before any exited (torchrun may end one that was still exiting: SIGTERM).
    failures = re.findall(r"\[\d\]:\n(?:  .*\n?)+", job.out)
    assert len(failures) == 2 and all(re.search(r"error_file: \S+error\.json", f) for f in failures), failures
    assert all(re.search(exit_code(code), f) for f in failures), failures
    no_traceback_of_ours(job.out)  # torchrun's traceback is not ours
    return printed[0]


def test_a_half_written_checkpoint_is_one_message_named_as_torchruns_root_cause(tmp_path):
    cfg = load_config(bundled_config())
    blocks = inventory_from_config(cfg)
    record = record_for(make_plan(blocks, cfg), cfg, machine_for(cfg), complete=True)
    root = tmp_path / "checkpoints"
    for step, complete in ((2, True), (4, False)):  # step 4 was cut off while it was being written
        (root / str(step) / "model").mkdir(parents=True)
        (root / str(step) / "model_config.json").write_text("{}")
        replace(record, step=step, complete=complete).write(root / str(step))
    (root / "latest.txt").write_text("4")
    config = _config(tmp_path, checkpoints={"resume_checkpoint_path": str(root)})
    job = _torchrun(tmp_path, "-m", "nanotron_ext.run", _script(tmp_path), "--config-file", str(config))
    line = _one_message(job, r"nanotron_ext\.run \[rank \d\]: error: ", "its nanotron_ext_plan.json says", 2)
    assert f"resume from the last complete one instead: checkpoints.resume_checkpoint_path: {root / '2'}" in line


def test_a_config_error_on_the_ranks_of_train_is_one_message_named_as_torchruns_root_cause(tmp_path):
    config = _config(tmp_path, nanotron_ext={"memory_cap_gib": -1})
    job = _torchrun(tmp_path, "-m", "nanotron_ext.cli", "train", "--config-file", str(config), "--steps", "1")
    line = _one_message(job, r"nanotron-ext train: error on rank \d: ", "nanotron_ext.memory_cap_gib=-1", 2)
    assert "e.g." in line  # a number's error gives an example


def test_a_replan_setting_the_launcher_refuses_is_one_message_named_as_torchruns_root_cause(tmp_path):
    config = _config(tmp_path, nanotron_ext={"replan": {"after_steps": 1}})
    job = _torchrun(tmp_path, "-m", "nanotron_ext.run", _script(tmp_path), "--config-file", str(config))
    line = _one_message(job, r"nanotron_ext\.run \[rank \d\]: error: ", "after_steps", 2)
    assert "replan" in line


def test_a_message_of_several_lines_prints_its_first_and_torchruns_summary_holds_the_rest(tmp_path):
    source = (
        "from nanotron_ext.errors import CheckpointError\n"
        "raise CheckpointError('checkpoint 4 is damaged:\\n  model/a.safetensors: missing\\n  resume from 2')\n"
    )
    config = _config(tmp_path)
    job = _torchrun(tmp_path, "-m", "nanotron_ext.run", _script(tmp_path, source), "--config-file", str(config))
    line = _one_message(job, r"nanotron_ext\.run \[rank \d\]: error: ", "checkpoint 4 is damaged:", 2)
    assert line.endswith("checkpoint 4 is damaged: [2 more lines: torchrun's summary below]"), line
    root = root_cause(job.out, 2)
    assert "\n    model/a.safetensors: missing\n    resume from 2" in root, root  # torchrun indents them by 2
    assert job.out.count("model/a.safetensors: missing") == 2  # in each rank's failure, never printed by a rank


def test_a_flag_error_on_every_rank_is_one_message_named_as_torchruns_root_cause(tmp_path):
    job = _torchrun(tmp_path, "-m", "nanotron_ext.cli", "train", "--steps", "0")
    line = _one_message(job, r"nanotron-ext train: error: ", "argument --steps: '0' is not a whole number", 2)
    assert line.endswith("(`nanotron-ext train --help` lists every flag)"), line  # one line, no usage block
