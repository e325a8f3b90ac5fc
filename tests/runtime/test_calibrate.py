"""``nanotron-ext calibrate``: a machine profile measured here, under torchrun (2 gloo ranks: links, overheads) and
alone (compute only), read back by ``plan --machine``, and refused for another setup."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_ext.cli import main
from nanotron_ext.cli.calibrate import choose_backend
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import MachineProfile, block_signature, load_machine, machine_for, price_blocks
from nanotron_ext.machine.calibrate import calibrate, calibration_blocks, fit_line
from nanotron_ext.plan import resolve_vocab_shards
from nanotron_ext.procs import rendezvous_env

from . import calibrate_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

CONFIG = str(bundled_config())  # the tiny Llama, pp=2 dp=1 tp=1
FAST = {"warmup": 0, "repeats": 1, "progress": False}
LLAMOE = Path(__file__).resolve().parents[1] / "data" / "nanotron_examples" / "moe" / "config_llamoe.yaml"


def _signatures(blocks) -> list[str]:
    return [block_signature(b, input_grad=g) for b, g in zip(blocks, trainable_before(blocks))]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """Both ranks' results of the CLI and of ``calibrate`` itself, and the file rank 0 wrote."""
    tmp = tmp_path_factory.mktemp("calibrate")
    out = tmp / "machine.json"
    results = run_distributed(
        calibrate_workers.calibrate_world, 2, args=(CONFIG, str(out), str(tmp / "store")), timeout=90
    )
    return results, out


@pytest.fixture(scope="module")
def alone() -> MachineProfile:
    return calibrate(load_config(CONFIG), **FAST)


def test_under_torchrun_the_profile_has_the_links_and_every_block(world: tuple[list[dict], Path]) -> None:
    results, out = world
    assert [r["code"] for r in results] == [0, 0]
    profile = load_machine(out)
    assert profile.name == "calibrated: cpu, gloo, pp=2"
    assert (profile.key.pp, profile.key.dp, profile.key.tp, profile.key.backend, profile.key.device) == (
        2,
        1,
        1,
        "gloo",
        "cpu",
    )
    assert sorted((link.src, link.dst) for link in profile.links) == [(0, 1), (1, 0)]
    for link in profile.links:
        assert link.latency > 0 and link.bytes_per_second > 0
    blocks = inventory_from_config(load_config(CONFIG))
    assert all(profile.block(sig) is not None for sig in _signatures(blocks))
    assert len(profile.blocks) == len(set(_signatures(blocks))) == 6  # both decoder layers share one
    # Nanotron's metadata messages cost real time on gloo; so does the PipelineBlock wrapper.
    assert profile.overhead.send > 0 and profile.overhead.send == profile.overhead.recv
    assert profile.overhead.block_call > 0
    assert profile.dp_allreduce is None and profile.tied_allreduce is None  # dp=1, untied
    assert {role for role, _ in profile.rates} >= {"decoder", "lm_head"}
    # Only rank 0 reports; every rank's calibrate() returned the same profile (rank 0's, broadcast).
    assert profile.describe() in results[0]["stdout"] and results[1]["stdout"] == ""
    assert "p2p stage 0 -> 1" in results[0]["stdout"]
    assert results[0]["profile"] == results[1]["profile"]
    assert MachineProfile.from_json(results[0]["profile"]).links


def test_dp_and_tied_syncs_are_measured_in_nanotrons_layout(tmp_path: Path) -> None:
    """pp=2 × dp=2 with tied embeddings, 4 ranks: both replicas' links, the dp all-reduce of each stage, the
    tied all-reduce of first and last stage; the ranks laid out as Nanotron's ParallelContext lays them."""
    raw = yaml.safe_load(Path(CONFIG).read_text())
    raw["model"]["model_config"]["tie_word_embeddings"] = True
    raw["parallelism"]["dp"] = 2
    (tmp_path / "tied_dp2.yaml").write_text(yaml.safe_dump(raw))
    results = run_distributed(
        calibrate_workers.calibrate_layout, 4, args=(str(tmp_path / "tied_dp2.yaml"),), timeout=90
    )
    assert all(r["layout_is_nanotrons"] for r in results)
    assert len({r["profile"] for r in results}) == 1
    profile = MachineProfile.from_json(results[0]["profile"])
    assert profile.name == "calibrated: cpu, gloo, pp=2, dp=2" and (profile.key.pp, profile.key.dp) == (2, 2)
    assert sorted((link.src, link.dst) for link in profile.links) == [(0, 1), (1, 0)]
    for sync in (profile.dp_allreduce, profile.tied_allreduce):
        assert sync is not None and sync.latency >= 0 and sync.bus_bytes_per_second > 0


def test_plan_reads_the_calibrated_profile(world: tuple[list[dict], Path], capsys: pytest.CaptureFixture) -> None:
    _, out = world
    profile = load_machine(out)
    assert main(["plan", CONFIG, "--machine", str(out)]) == 0
    step = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("simulated step:"))
    assert profile.describe() in step
    # Its links price the sends: the lm_head's logits cross a cut at the measured latency and bandwidth.
    cfg = load_config(CONFIG).with_overrides(machine=str(out))
    blocks = inventory_from_config(cfg)
    prices = price_blocks(machine_for(cfg, blocks), blocks, cfg)
    lm_head = next(i for i, b in enumerate(blocks) if b.role == "lm_head")
    assert prices.send[0][lm_head] > max(link.latency for link in profile.links)


def test_alone_it_measures_the_compute_only(alone: MachineProfile) -> None:
    key = alone.key
    assert (key.pp, key.dp, key.backend) == (None, None, None)
    assert (key.tp, key.device, dict(key.model)["hidden_size"]) == (1, "cpu", 16)
    assert alone.links == () and alone.dp_allreduce is None and alone.tied_allreduce is None
    assert alone.overhead.send == alone.overhead.recv == 0.0 and alone.overhead.block_call > 0
    assert "p2p not measured" in alone.describe() and alone.name == "calibrated: cpu (compute only)"
    blocks = inventory_from_config(load_config(CONFIG))
    assert all(alone.block(sig) is not None for sig in _signatures(blocks))
    assert MachineProfile.from_json(alone.to_json()) == alone


def test_blocks_take_three_rounds_for_each_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanotron_ext.machine import calibrate as calibrate_module

    seen: list[tuple[int, int]] = []
    measured = calibrate_module.measured_blocks

    def counted(blocks, cfg, *, warmup, repeats, **kwargs):
        seen.append((warmup, repeats))
        return measured(blocks, cfg, warmup=warmup, repeats=repeats, **kwargs)

    monkeypatch.setattr(calibrate_module, "measured_blocks", counted)
    calibrate(load_config(CONFIG), warmup=1, repeats=2, progress=False)
    assert seen == [(1, 6)]  # the fastest of a longer window (BLOCK_ROUNDS_PER_REPEAT = 3); warm-ups as asked


def test_the_fitted_rates_price_blocks_that_were_not_measured(alone: MachineProfile) -> None:
    rates = dict(alone.rates)
    lm_head = alone.block(
        next(s for s in _signatures(inventory_from_config(load_config(CONFIG))) if s.startswith("lm_head"))
    )
    assert lm_head is not None
    # The lm_head's rate is its training FLOPs over its measured forward + backward; the overall rate lies
    # between the slowest and the fastest role's.
    blocks = inventory_from_config(load_config(CONFIG))
    work = dict(zip((b.role for b in blocks), training_flops(blocks)))["lm_head"]
    assert rates["lm_head"] == pytest.approx(work / (lm_head.forward + lm_head.backward))
    assert min(rates.values()) <= alone.flops_per_second <= max(rates.values())
    assert alone.rate("vocab_shard") == alone.flops_per_second  # not measured: the overall rate


def test_auto_vocab_shards_measures_every_candidate(tmp_path: Path) -> None:
    cfg = load_config(CONFIG).with_overrides(vocab_shards="auto")
    variants = calibration_blocks(cfg)
    assert [trial.ext.vocab_shards for trial, _ in variants] == [1, 2, 3, 4]  # up to 2·pp
    profile = calibrate(cfg, **FAST)
    wanted = {sig for _, blocks in variants for sig in _signatures(blocks)}
    assert {b.signature for b in profile.blocks} == wanted
    assert "vocab_shard" in dict(profile.rates)
    # auto plans every K on these measurements.
    profile.save(tmp_path / "machine.json")
    _, choice = resolve_vocab_shards(cfg.with_overrides(machine=str(tmp_path / "machine.json")))
    assert choice is not None and sorted(choice.step_times) == [1, 2, 3, 4]


def test_a_profile_is_refused_for_another_shape(
    world: tuple[list[dict], Path], alone: MachineProfile, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = yaml.safe_load(Path(CONFIG).read_text())
    raw["model"]["model_config"]["hidden_size"] = 32
    wider = tmp_path / "wider.yaml"
    wider.write_text(yaml.safe_dump(raw))
    alone.save(tmp_path / "alone.json")
    with pytest.raises(ConfigError, match=r"model\.hidden_size: 16 vs 32"):
        machine_for(load_config(wider).with_overrides(machine=str(tmp_path / "alone.json")))
    # The torchrun profile holds pp=2: planning pp=4 with it is refused, naming the field, exit 2.
    _, out = world
    assert main(["plan", CONFIG, "--pp", "4", "--micro-batches", "4", "--machine", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pp: 2 vs 4" in err and "nanotron-ext calibrate CONFIG --out FILE" in err
    # A compute-only profile leaves pp open: it prices any pp.
    cfg = load_config(CONFIG).with_overrides(machine=str(tmp_path / "alone.json"), pp=1)
    assert machine_for(cfg) == alone


@contextlib.contextmanager
def _one_rank_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_world_that_is_not_the_config_is_refused() -> None:
    with _one_rank_world(), pytest.raises(ConfigError) as info:
        calibrate(load_config(CONFIG), **FAST)
    message = str(info.value)
    assert "world size is 1" in message and "pp*dp*tp = 2*1*1 = 2" in message
    assert "torchrun --nproc_per_node=2" in message


def test_bad_input_is_refused_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["calibrate", CONFIG, "--out", str(blocker / "machine.json")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["calibrate", CONFIG, "--out", str(tmp_path / "m.json"), "--repeats", "0"]) == 2
    assert "repeats=0 must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(ConfigError, match="cannot build its mixture-of-experts decoder layers standalone"):
        calibrate(load_config(LLAMOE), **FAST)


def test_fit_line_recovers_latency_and_bandwidth() -> None:
    sizes = [4096 * 4**i for i in range(6)]
    latency, bandwidth = 50e-6, 2e9
    assert fit_line(sizes, [latency + n / bandwidth for n in sizes]) == pytest.approx((latency, 1 / bandwidth))
    # Relative error: a 10 % outlier at the largest size does not swamp the small sizes' latency.
    noisy = [latency + n / bandwidth for n in sizes]
    noisy[-1] *= 1.1
    assert fit_line(sizes, noisy)[0] == pytest.approx(latency, rel=0.2)
    # Time that does not grow with size: no bandwidth can be read, the largest message's is kept.
    assert fit_line([1.0, 2.0], [3.0, 3.0]) == (3.0, 1.5)


def test_backend_defaults_to_gloo_without_one_gpu_per_rank_and_nccl_is_refused_there(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert choose_backend(None) == choose_backend("gloo") == "gloo"
    with pytest.raises(
        ConfigError,
        match=r"calibrate --backend nccl needs CUDA, but torch sees no CUDA device "
        r"here \(torch .*\); use --backend gloo, the default without a GPU",
    ):
        choose_backend("nccl")
    # Under torchrun's variables the CLI refuses it before any process group exists (no peer to wait for).
    for key, value in rendezvous_env(0, 2, 1).items():
        monkeypatch.setenv(key, value)
    assert main(["calibrate", CONFIG, "--out", str(tmp_path / "m.json"), "--backend", "nccl"]) == 2
    assert "--backend nccl needs CUDA" in capsys.readouterr().err and not (tmp_path / "m.json").exists()


def test_host_staged_links_and_syncs_are_measured_and_named(tmp_path: Path) -> None:
    """The CUDA-under-gloo path (forced on CPU): links and the tied all-reduce through host copies, the profile
    and the summary say host-staged, the key keeps the backend gloo."""
    raw = yaml.safe_load(Path(CONFIG).read_text())
    raw["model"]["model_config"]["tie_word_embeddings"] = True
    (tmp_path / "tied.yaml").write_text(yaml.safe_dump(raw))
    out = tmp_path / "machine.json"
    results = run_distributed(
        calibrate_workers.calibrate_host_staged, 2, args=(str(tmp_path / "tied.yaml"), str(out)), timeout=90
    )
    assert [r["code"] for r in results] == [0, 0]
    profile = load_machine(out)
    assert profile.name == "calibrated: cpu, gloo host-staged, pp=2" and profile.key.backend == "gloo"
    assert sorted((link.src, link.dst) for link in profile.links) == [(0, 1), (1, 0)]
    assert all(link.latency > 0 and link.bytes_per_second > 0 for link in profile.links)
    assert profile.tied_allreduce is not None and profile.tied_allreduce.bus_bytes_per_second > 0
    stdout = results[0]["stdout"]
    assert "p2p stage 0 -> 1 (host-staged)" in stdout
    assert "host-staged: gloo carries host memory only" in stdout and "calibrated there" in stdout
