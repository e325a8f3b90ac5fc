"""``NANOTRON_EXT_DEVICE``: the device choice is validated, ``cpu`` trains exactly as before, and the CUDA path's
host staging, forced on CPU (``NANOTRON_EXT_HOST_STAGING=1``), changes no bit of the training.

What only a GPU can check (``benchmarks/gpu_check.sh``): the copies to and from CUDA memory themselves, and
gloo's own CUDA all-reduce and broadcast.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanotron_ext.errors import ConfigError
from nanotron_ext.runtime.device import (
    DEVICE_ENV,
    STAGING_ENV,
    describe_transport,
    device_from_env,
    host_staging,
)

from . import device_workers
from . import train_workers as tw
from .spawn import run_distributed
from .test_train_cli import assert_every_rank_failed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

NO_CUDA = not torch.cuda.is_available()


def test_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in (None, "", "cpu", " CPU "):
        if value is None:
            monkeypatch.delenv(DEVICE_ENV, raising=False)
        else:
            monkeypatch.setenv(DEVICE_ENV, value)
        assert device_from_env() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(
        ConfigError,
        match=r"NANOTRON_EXT_DEVICE='gpu' is not a device nanotron_ext runs on; use "
        r"NANOTRON_EXT_DEVICE=cpu or NANOTRON_EXT_DEVICE=cuda",
    ):
        device_from_env()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_names_the_value_the_reason_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ConfigError) as info:
        device_from_env()
    message = str(info.value)
    assert message.startswith("NANOTRON_EXT_DEVICE='cuda' asks for CUDA, but torch sees no CUDA device here")
    assert (
        "run on a machine with an NVIDIA GPU and a CUDA build of torch, or unset NANOTRON_EXT_DEVICE to run on the "
        "CPU" in message
    )


def test_host_staging_is_on_for_cuda_and_forced_on_cpu_only_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert (host_staging(cpu), host_staging(cuda)) == (False, True)
    assert (describe_transport(cpu), describe_transport(cuda)) == ("gloo", "gloo, host-staged")
    monkeypatch.setenv(STAGING_ENV, "1")
    assert host_staging(cpu) and describe_transport(cpu) == "gloo, host-staged"
    monkeypatch.setenv(STAGING_ENV, "yes")
    with pytest.raises(ConfigError, match=r"NANOTRON_EXT_HOST_STAGING='yes' must be 1 .* or 0"):
        host_staging(cpu)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_fails_every_rank_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    launch = tw.launch_ranks(["--steps", "1"], 2, timeout=60, outputs=False)
    assert_every_rank_failed(
        launch,
        2,
        "NANOTRON_EXT_DEVICE='cuda' asks for CUDA, but torch sees no CUDA device",
        "or unset NANOTRON_EXT_DEVICE to run on the CPU",
    )
    assert not any("step 1/1" in r.stdout for r in launch.ranks)


def _parameter_hashes(metrics: dict) -> list[dict[str, str]]:
    return [{name: c["sha256_after"] for name, c in r["checksums"].items()} for r in metrics["ranks"]]


def test_cpu_and_host_staged_training_match_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tied embeddings at pp=2, so both staged paths run: the P2P and the tied-gradient sync."""
    config = tw.write_config(tmp_path / "tied.yaml", {"model": {"model_config": {"tie_word_embeddings": True}}})
    runs = {}
    for name, device, staging in (("default", None, None), ("cpu", "cpu", None), ("staged", "cpu", "1")):
        for var, value in ((DEVICE_ENV, device), (STAGING_ENV, staging)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        launch = tw.launch_ranks(["--config-file", str(config), "--steps", "3"], 2, timeout=120)
        assert launch.ok and launch.metrics is not None, f"{name}:\n{launch.describe()}"
        runs[name] = launch.metrics
    assert [runs[n]["p2p"] for n in runs] == ["gloo", "gloo", "gloo, host-staged"]
    assert {runs[n]["device"] for n in runs} == {"cpu"}
    for name in ("cpu", "staged"):
        assert runs[name]["losses"] == runs["default"]["losses"], name
        assert runs[name]["grad_norms"] == runs["default"]["grad_norms"], name
        assert _parameter_hashes(runs[name]) == _parameter_hashes(runs["default"]), name
    # The embedding and the lm_head it is tied to train on different stages: the tied sync ran.
    assert any("token_embedding" in n for n in runs["default"]["ranks"][0]["checksums"])
    assert any("lm_head" in n for n in runs["default"]["ranks"][1]["checksums"])


def test_host_staged_p2p_copies_at_send_and_keeps_autograd() -> None:
    got = run_distributed(device_workers.staged_p2p_round_trip, 2, timeout=60)[1]
    assert got["equal"] == [True, True, True], got  # the in-place change after the send did not travel
    assert got["shapes"] == [(3, 4), (4, 3), (3,)]
    assert got["dtypes"] == ["torch.float32", "torch.float32", "torch.bool"]
    assert got["requires_grad"] == [True, False, False] and all(got["leaf"])


#: On PYTHONPATH, a process sees one CUDA device torch believes in (and none is there): ``fake_cuda/sitecustomize.py``.
FAKE_CUDA = Path(__file__).parent / "fake_cuda"


def test_a_visible_gpu_does_not_move_a_run_that_asks_for_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: calibrate timed blocks on CUDA whenever a GPU was visible while the CPU runtime trained on the CPU.
    With a GPU faked visible and ``NANOTRON_EXT_DEVICE=cpu``, calibrate times the blocks on the CPU, train trains
    there, and a profile timed on the GPU is refused by every rank, naming both devices."""
    import dataclasses
    import subprocess
    import sys

    from nanotron_ext.machine import load_machine

    env = {k: v for k, v in os.environ.items() if k != DEVICE_ENV} | {"PYTHONPATH": str(FAKE_CUDA)}
    rule = subprocess.run(
        [sys.executable, "-c", "from nanotron_ext.devices import device_type; print(device_type())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rule.stdout.strip() == "cuda", rule.stderr  # the fake is seen: unset, the rule would pick the GPU

    monkeypatch.setenv("PYTHONPATH", str(FAKE_CUDA))
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    cpu_profile = tmp_path / "cpu.json"
    calibrate = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanotron_ext.cli",
            "calibrate",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(cpu_profile),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert calibrate.returncode == 0, calibrate.stderr
    profile = load_machine(cpu_profile)
    assert (profile.key.device, profile.name) == ("cpu", "calibrated: cpu (compute only)")

    gpu_profile = tmp_path / "gpu.json"
    dataclasses.replace(profile, key=dataclasses.replace(profile.key, device="cuda:Fake GPU")).save(gpu_profile)
    refused = tw.write_config(tmp_path / "gpu.yaml", {"nanotron_ext": {"machine": str(gpu_profile)}})
    launch = tw.launch_ranks(["--config-file", str(refused), "--steps", "1"], 2, timeout=120, outputs=False)
    assert_every_rank_failed(
        launch,
        2,
        "was measured on another device or backend than this run (device: 'cuda:Fake GPU' vs 'cpu'; profile vs run)",
        "--device cpu --out FILE",
    )

    trained = tw.write_config(tmp_path / "cpu.yaml", {"nanotron_ext": {"machine": str(cpu_profile)}})
    launch = tw.launch_ranks(["--config-file", str(trained), "--steps", "1"], 2, timeout=120)
    assert launch.ok and launch.metrics is not None, launch.describe()
    assert launch.metrics["device"] == "cpu"
