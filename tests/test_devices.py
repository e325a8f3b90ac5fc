"""The one device rule (``nanotron_ext.devices``) and the refusal of a profile measured on another device or backend
than the run it prices (``MachineProfile.check_key``, ``simulate_plan``). The same rule inside real processes, with a
GPU faked as visible: ``tests/runtime/test_device.py``."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext import devices
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.devices import DEVICE_ENV, device_type, use_device
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import ANALYTIC_GPU, key_for
from nanotron_ext.plan import make_plan
from nanotron_ext.simulate import simulate_plan


@pytest.fixture
def gpu_visible(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(devices, "_cuda_visible", lambda: True)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    return monkeypatch


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(devices, "_cuda_visible", lambda: False)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    return monkeypatch


def test_unset_it_is_the_gpu_when_one_is_visible_else_the_cpu(gpu_visible: pytest.MonkeyPatch) -> None:
    assert device_type() == "cuda"
    gpu_visible.setattr(devices, "_cuda_visible", lambda: False)
    assert device_type() == "cpu"


def test_the_variable_overrides_a_visible_gpu_and_the_flag_overrides_the_variable(
    gpu_visible: pytest.MonkeyPatch,
) -> None:
    gpu_visible.setenv(DEVICE_ENV, " CPU ")
    assert device_type() == "cpu"
    assert device_type("cuda") == "cuda"
    gpu_visible.setenv(DEVICE_ENV, "cuda")
    assert device_type("cpu") == "cpu"


def test_use_device_carries_the_flag_to_the_rest_of_the_process(gpu_visible: pytest.MonkeyPatch) -> None:
    assert use_device(None) == "cuda" and DEVICE_ENV not in __import__("os").environ  # nothing asked: nothing written
    assert use_device("cpu") == "cpu"
    assert device_type() == "cpu"  # every later reader (the runtime, calibrate, profiled) gets the flag's answer


def test_a_bad_value_names_where_it_came_from_and_the_fix(no_gpu: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^--device='gpu' is not a device nanotron_ext runs on; use --device cpu or "
        r"--device cuda",
    ):
        device_type("gpu")
    no_gpu.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(
        ConfigError,
        match=r"^NANOTRON_EXT_DEVICE='tpu' is not a device nanotron_ext runs on; use "
        r"NANOTRON_EXT_DEVICE=cpu or NANOTRON_EXT_DEVICE=cuda",
    ):
        device_type()


def test_cuda_without_a_gpu_is_refused_with_the_way_back_to_the_cpu(no_gpu: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^--device='cuda' asks for CUDA, but torch sees no CUDA device here .*"
        r"or use --device cpu$",
    ):
        device_type("cuda")
    no_gpu.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ConfigError, match=r"or unset NANOTRON_EXT_DEVICE to run on the CPU$"):
        device_type()


def _seed() -> tuple:
    cfg = load_config(bundled_config())
    blocks = inventory_from_config(cfg)
    return cfg, blocks, make_plan(blocks, cfg)


def _measured_on(cfg, device: str, backend: str | None):
    key = dataclasses.replace(key_for(cfg, device=device, backend=backend))
    return dataclasses.replace(ANALYTIC_GPU, name="calibrated elsewhere", key=key)


def test_simulate_plan_refuses_a_gpu_profile_for_a_cpu_run_naming_both() -> None:
    cfg, blocks, plan = _seed()
    gpu = _measured_on(cfg, "cuda:NVIDIA H200", "gloo")
    with pytest.raises(ConfigError) as info:
        simulate_plan(plan, blocks, cfg, machine=gpu, device="cpu", backend="gloo")
    message = str(info.value)
    assert (
        "was measured on another device or backend than this run (device: 'cuda:NVIDIA H200' vs 'cpu'; "
        "profile vs run)" in message
    )
    assert "nanotron-ext calibrate CONFIG --device cpu --out FILE" in message
    # The same profile prices a run on its own device, and a run whose device is not said (planning ahead).
    on_gpu = simulate_plan(plan, blocks, cfg, machine=gpu, device="cuda", backend="gloo")
    assert on_gpu.step_time == simulate_plan(plan, blocks, cfg, machine=gpu).step_time > 0


def test_simulate_plan_refuses_another_backend() -> None:
    cfg, blocks, plan = _seed()
    gloo = _measured_on(cfg, "cpu", "gloo")
    with pytest.raises(ConfigError, match=r"\(backend: 'gloo' vs 'nccl'; profile vs run\)"):
        simulate_plan(plan, blocks, cfg, machine=gloo, device="cpu", backend="nccl")


def test_a_config_difference_still_reads_profile_vs_config() -> None:
    cfg, blocks, plan = _seed()
    other = _measured_on(cfg.with_overrides(pp=1), "cpu", "gloo")
    with pytest.raises(ConfigError, match=r"measured for another setup \(pp: 1 vs 2; profile vs config\)"):
        simulate_plan(plan, blocks, cfg, machine=other, device="cpu", backend="gloo")
