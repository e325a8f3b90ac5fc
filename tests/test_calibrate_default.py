"""Which profile ``nanotron-ext calibrate`` takes (no process): the in-run profile by default under torchrun at
pp >= 2 where the CPU runtime can train the config, the standalone one elsewhere, each time saying why. The
calibrations themselves run in ``tests/runtime/test_calibrate.py`` and ``test_calibrate_in_run.py``."""

from __future__ import annotations

import argparse

import pytest

from nanotron_ext.cli import calibrate as cli_calibrate
from nanotron_ext.cli.calibrate import IN_RUN_TAKEN, STANDALONE_TAKEN, profile_method
from nanotron_ext.config import bundled_config, load_config

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _args(**flags: object) -> argparse.Namespace:
    return argparse.Namespace(**{"in_run": False, "standalone": False, "backend": None, **flags})


@pytest.fixture
def under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli_calibrate, "_installed_nanotron", lambda: "0.2")


def test_under_torchrun_at_pp_2_the_default_is_the_in_run_profile(under_torchrun):
    in_run, why = profile_method(load_config(bundled_config()), _args())
    assert in_run and why == f"{IN_RUN_TAKEN} (the default under torchrun at pp >= 2; --standalone times blocks alone)"
    assert profile_method(load_config(bundled_config()), _args(standalone=True)) == (
        False,
        f"{STANDALONE_TAKEN} (--standalone)",
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pp": 1}, "pp = 1: there is no pipeline to price from its steps"),
        ({"engine": "zbv"}, "pp_engine: zbv: the CPU runtime's in-run steps train contiguous splits"),
    ],
)
def test_where_the_in_run_profile_cannot_be_taken_calibrate_says_why(under_torchrun, change, reason):
    in_run, why = profile_method(load_config(bundled_config()).with_overrides(**change), _args())
    assert not in_run and why.startswith(f"{STANDALONE_TAKEN}: {reason}; blocks alone price a step a few to 15 % fast")


def test_beside_upstream_main_it_says_the_cpu_runtime_needs_nanotron_0_2_and_names_the_launchers_way(
    under_torchrun, monkeypatch
):
    monkeypatch.setattr(cli_calibrate, "_installed_nanotron", lambda: "upstream")
    in_run, why = profile_method(load_config(bundled_config()), _args())
    assert not in_run and "runs Nanotron 0.2's engines, and the Nanotron installed here is upstream main" in why
    assert "the launcher's --replan-after K" in why


def test_alone_or_over_nccl_it_takes_the_standalone_profile(under_torchrun, monkeypatch):
    cfg = load_config(bundled_config())
    assert profile_method(cfg, _args(backend="nccl"))[1].startswith(
        f"{STANDALONE_TAKEN}: --backend nccl: the in-run steps run over gloo"
    )
    for name in TORCHRUN:
        monkeypatch.delenv(name)
    in_run, why = profile_method(cfg, _args())
    assert not in_run and "not under torchrun" in why
    assert profile_method(cfg, _args(in_run=True)) == (True, f"{IN_RUN_TAKEN} (--in-run)")


def test_the_installed_nanotron_is_read_from_its_files():
    from installed_nanotron import NANOTRON

    assert cli_calibrate._installed_nanotron() == NANOTRON
