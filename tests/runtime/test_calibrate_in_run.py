"""``nanotron-ext calibrate --in-run``: a profile priced from real training steps of Nanotron's engine, under two
gloo ranks, marked in-run, read by ``plan --machine``; and its flags refused where they do not apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import block_signature, load_machine

from . import calibrate_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

CONFIG = str(bundled_config())  # the tiny Llama, pp=2 dp=1 tp=1
QUICK = ["--repeats", "1", "--warmup", "0", "--steps", "2", "--warmup-steps", "1"]


def test_in_run_writes_an_in_run_profile_that_plan_reads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "in_run.json"
    results = run_distributed(
        calibrate_workers.calibrate_cli,
        2,
        args=([CONFIG, "--in-run", "--probes", *QUICK, "--out", str(out)],),
        timeout=240,
    )
    assert [r["code"] for r in results] == [0, 0], results
    assert "in-run: cpu, gloo, pp=2" in results[0]["stdout"]
    profile = load_machine(out)
    assert profile.method == "in-run" and profile.name == "in-run: cpu, gloo, pp=2"
    assert (profile.key.pp, profile.key.device, profile.key.backend) == (2, "cpu", "gloo")
    blocks = inventory_from_config(load_config(CONFIG))
    for b, grad in zip(blocks, trainable_before(blocks)):
        cost = profile.block(block_signature(b, input_grad=grad))
        assert cost is not None and cost.forward >= 0 and cost.spread is not None, b.name
    assert profile.block(block_signature(blocks[1], input_grad=True)).forward > 0  # a decoder layer's own work
    assert sorted((link.src, link.dst) for link in profile.links) == [(0, 1), (1, 0)]
    assert main(["plan", CONFIG, "--machine", str(out)]) in (0, 1)
    assert "in-run: cpu, gloo, pp=2: 6 measured blocks (in-run)" in capsys.readouterr().out


def test_in_run_flags_need_in_run_and_in_run_needs_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "m.json")
    assert main(["calibrate", CONFIG, "--out", out, "--steps", "3", "--probes"]) == 2
    assert "calibrate: --probes, --steps only apply to the in-run profile" in capsys.readouterr().err
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["calibrate", CONFIG, "--out", out, "--in-run"]) == 2
    assert "run it under torchrun with pp*dp*tp = 2 ranks" in capsys.readouterr().err
    assert main(["calibrate", CONFIG, "--out", out, "--in-run", "--steps", "0"]) == 2
    assert "--steps=0 must be an integer >= 1" in capsys.readouterr().err
    assert not Path(out).exists()
