"""``calibrate``: measure the machine this runs on into a :class:`~nanotron_ext.machine.profile.MachineProfile`.

What it measures, and how (torch and Nanotron are imported only here, inside the functions):

* **blocks**: every distinct block of the config (and, under ``vocab_shards: auto``, of every K that ``auto``
  tries), built standalone and timed in rounds by :mod:`nanotron_ext.costs.profiled` (the fastest round of each;
  under torchrun rank 0 measures while the others wait).
  ``cache_dir=None`` measures afresh (a temporary cache), so ``--repeats`` is never answered from old files;
  a folder reuses and fills that cache.
* **rates**: per block role, training FLOPs (:func:`~nanotron_ext.costs.analytic.training_flops`) ÷ measured
  forward + backward over the role's measured blocks; ``flops_per_second`` is the same over every measured block,
  so a block that was not measured (another K, another role) is priced at this machine's rate.
* **engine overhead**: ``block_call`` is what Nanotron's ``PipelineBlock`` adds to one forward call: a
  ``Linear(1, 1)`` wrapped in a ``PipelineBlock`` on a one-process group, timed against the bare module (batches
  of 100 calls of each, interleaved; the median difference of their per-call means). ``send`` / ``recv`` are measured,
  not folded into the links: under torchrun, what Nanotron's P2P protocol (two metadata messages before the data; the
  receiver runs Nanotron's own ``P2P.recv_tensors``) adds to a bare transfer of the same small tensor between stages 0
  and 1, split evenly between sender and receiver; 0 alone (one process cannot post a send).
* **links** (under torchrun): for each direction between neighbouring stages, a message of ``n`` bytes answered
  by one byte, timed by the sender, for ``n`` from 4 KiB by fourfold steps to the largest tensor a block sends;
  ``round trip(n) = c + n / B`` fitted by least squares on relative error, ``latency = c / 2`` (each way's
  latency taken equal), ``bytes_per_second = B``. Every replica's pair runs at once, as during training, and
  the slowest replica's median per size is fitted.
* **collectives** (under torchrun): the dp gradient all-reduce (dp > 1, over the ranks of one stage) and the
  tied embedding's all-reduce (first and last stage, tied embeddings, pp > 1), timed after a barrier and fitted
  to :meth:`~nanotron_ext.machine.profile.Collective.time`.
* **host-staged** (CUDA under gloo, e.g. two ranks on one GPU, where NCCL refuses): gloo carries host memory
  only, so links and collectives are timed as the CPU runtime moves CUDA tensors over gloo: the tensors live on
  the GPU, each send copies them to the host first and each receive lands in a host buffer copied to the GPU
  (:func:`host_staged`). Those figures include the device↔host copies: they are the runtime's on this machine,
  not what NCCL over NVLink would give. The P2P protocol overhead is timed on host tensors (the copies are in
  the links).

Alone (no process group) the profile is compute only: its key leaves pp, dp and the backend open, it has no
links, and its ``describe()`` says p2p was not measured. Under torchrun the world size must be the config's
``pp × dp × tp``; Nanotron's layout maps global rank ``(stage · dp + dp_rank) · tp + tp_rank``. Every rank
returns the same profile (rank 0's, broadcast).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import VOCAB_SHARDS_AUTO, PlannerConfig, vocab_shard_candidates
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.costs.profiled import DEFAULT_REPEATS
from nanotron_ext.devices import device_type
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.calibrate_comm import (
    _Comm,
    _extra_per_call,
    _measure_comm,
    _torch_device,
    _World,
    fit_line,
    host_staged,
)
from nanotron_ext.machine.pricing import measured_blocks
from nanotron_ext.machine.profile import (
    BlockCost,
    EngineOverhead,
    MachineProfile,
    block_signature,
    key_for,
)
from nanotron_ext.machine.profile_share import profile_source, share_profile

__all__ = [
    "BLOCK_ROUNDS_PER_REPEAT",
    "calibrate",
    "calibration_blocks",
    "fit_line",
    "fit_rates",
    "host_staged",
]

#: Block rounds per ``repeats``: each block keeps its fastest round, and a longer window lets it escape a slow
#: stretch of the machine. Issue 32's SmolLM shape, calibrations in a row on a noisy day: the fastest of 33 rounds
#: predicted every layout within 1.021-1.025 (max ÷ min), the fastest of the same runs' first 11 within 1.047-1.059
#: (``benchmarks/calibration_statistics.py``); about 31 s here instead of 13.
BLOCK_ROUNDS_PER_REPEAT = 3


def calibrate(
    cfg: PlannerConfig,
    *,
    warmup: int = 2,
    repeats: int = DEFAULT_REPEATS,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> MachineProfile:
    """Measure this machine (and, under torchrun, its links and collectives) for ``cfg``.

    Collective under torch.distributed: every rank calls it and gets the same profile.

    Args:
        cfg: the config whose blocks, links and syncs are measured.
        warmup: untimed runs before each measurement.
        repeats: timed runs of each measurement; blocks take :data:`BLOCK_ROUNDS_PER_REPEAT` times as many rounds
            and keep their fastest, link sizes four times as many and keep their median; blocks and link sizes take
            turns in each round, so a slow stretch of the machine hits them alike.
        cache_dir: block-timing cache to reuse and fill; None measures every block afresh.
        progress: a progress bar on stderr (rank 0 only).

    Raises:
        ConfigError: bad ``warmup``/``repeats``; a world size other than ``pp × dp × tp``; a block that cannot be
            built standalone; torch or Nanotron missing.
        PlanningError, RunFailure: a measurement failed (on every rank, with rank 0's reason).
    """
    _check_counts(warmup, repeats)
    world = _World.current(cfg)
    variants = calibration_blocks(cfg)
    _check_buildable(cfg, variants)
    device, backend = _device_and_backend()
    signatures = {sig for _, blocks in variants for sig in _signatures(blocks)}
    rank0 = world is None or world.rank == 0
    rounds = BLOCK_ROUNDS_PER_REPEAT * repeats
    block_calls = len(signatures) * (warmup + rounds)  # the bar counts each block's call in each round
    with _progress(_steps(cfg, world, block_calls), enabled=progress and rank0) as bar:
        costs = _measure_blocks(variants, warmup, rounds, cache_dir, bar)
        bar.update(max(0, block_calls - bar.n))  # the blocks the cache had
        call = _deferred(world, lambda: _block_call_overhead(world, device, warmup, repeats))
        bar.update()
        comm = _Comm() if world is None else _measure_comm(cfg, variants, world, device, backend, warmup, repeats, bar)

    def build() -> MachineProfile:
        if isinstance(call, BaseException):
            raise call
        rates, overall = fit_rates(variants, costs)
        return MachineProfile(
            name=_name(cfg, world, device, backend),
            source=profile_source(cfg),
            key=key_for(cfg, device=device, backend=backend if world else None, world=world is not None),
            flops_per_second=overall,
            rates=rates,
            blocks=tuple(costs.values()),
            links=comm.links,
            overhead=EngineOverhead(call, comm.send_recv / 2, comm.send_recv / 2),
            dp_allreduce=comm.dp_allreduce,
            tied_allreduce=comm.tied_allreduce,
            device_memory_bytes=_device_memory(device),
        )

    return share_profile(build, None if world is None else world.rank)


def _device_memory(device: str) -> float | None:
    """This rank's GPU memory as CUDA reports its total (what a plan must fit in); None on CPU."""
    import torch

    return (
        float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        if device.startswith("cuda")
        else None
    )


def _check_counts(warmup: int, repeats: int) -> None:
    """Raise a ConfigError unless ``warmup >= 0`` and ``repeats >= 1`` are integers."""
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(
                f"calibrate: --{name}={value!r} must be an integer >= {least} (e.g. --warmup 2 "
                f"--repeats 5: two untimed runs, then five timed ones)"
            )


# --- what is measured ------------------------------------------------------------------------------------


def calibration_blocks(cfg: PlannerConfig) -> list[tuple[PlannerConfig, list[BlockInfo]]]:
    """``(config, its blocks)`` for the config itself, or under ``vocab_shards: auto`` for every K it tries."""
    if cfg.ext.vocab_shards != VOCAB_SHARDS_AUTO:
        return [(cfg, inventory_from_config(cfg))]
    out = []
    for k in vocab_shard_candidates(cfg):
        trial = dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=k))
        out.append((trial, inventory_from_config(trial)))
    return out


def _signatures(blocks: Sequence[BlockInfo]) -> list[str]:
    return [block_signature(b, input_grad=g) for b, g in zip(blocks, trainable_before(blocks))]


def _check_buildable(cfg: PlannerConfig, variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]]) -> None:
    """Refuse, before measuring anything, a block whose standalone module would not be that block."""
    try:
        from nanotron_ext.models.profiled_blocks import MEASURABLE_ROLES
    except ImportError as exc:
        raise ConfigError(
            f"calibrate measures with torch and Nanotron, which cannot be imported here ({exc}); "
            f"install them (pip install 'nanotron-ext[cpu]')"
        ) from exc
    if cfg.model.moe is not None:
        raise ConfigError(
            f"{cfg.source}: calibrate cannot build its mixture-of-experts decoder layers standalone (it measures the "
            f"dense Llama blocks: {', '.join(MEASURABLE_ROLES)}), so their times would not be this model's. Plan "
            f"it with the analytic model (no --machine) or a FLOP rate (--tflops X)"
        )
    for _, blocks in variants:
        for b in blocks:
            if b.role not in MEASURABLE_ROLES:
                raise ConfigError(
                    f"{cfg.source}: calibrate cannot build block {b.name} (role {b.role!r}) standalone; it measures "
                    f"the Llama blocks ({', '.join(MEASURABLE_ROLES)}). Plan this model with the analytic model "
                    f"(no --machine) or a FLOP rate (--tflops X)"
                )


def _device_and_backend() -> tuple[str, str]:
    """Where blocks run (the one device rule, :func:`nanotron_ext.devices.device_type`; a GPU with its name) and the
    process group's backend."""
    import torch
    import torch.distributed as dist

    cuda = device_type() == "cuda"
    device = f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu"
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "gloo"
    return device, "nccl" if cuda and "nccl" in backend else backend  # "cpu:gloo,cuda:nccl" sends CUDA by NCCL


def _steps(cfg: PlannerConfig, world: _World | None, block_calls: int) -> int:
    """Measurements the progress bar counts: every block's call in every round, the block call overhead, then
    links, P2P overhead, collectives."""
    if world is None:
        return block_calls + 1
    tied = cfg.model.tie_word_embeddings and world.pp > 1
    return block_calls + 1 + 2 * (world.pp - 1) + (world.pp > 1) + (world.dp > 1) + tied


@contextlib.contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(
        total=total, desc="calibrate", unit="measurement", file=sys.stderr, disable=not enabled, dynamic_ncols=True
    )
    try:
        yield bar
    finally:
        bar.close()


# --- compute ------------------------------------------------------------------------------------------------


def _measure_blocks(
    variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]],
    warmup: int,
    repeats: int,
    cache_dir: str | Path | None,
    bar: Any,
) -> dict[str, BlockCost]:
    """Every distinct block of every variant, by signature (one cache, so blocks the variants share are
    measured once)."""
    from nanotron_ext.models.profiled_blocks import build_block_module

    def factory(block: BlockInfo, cfg: PlannerConfig, tp_pg: Any) -> Any:
        bar.set_postfix_str(f"building {block.short}")
        return build_block_module(block, cfg, tp_pg)

    def on_round(n_blocks: int) -> None:  # every block once a round: a round is n_blocks timed calls
        bar.set_postfix_str("timing blocks in rounds")
        bar.update(n_blocks)

    out: dict[str, BlockCost] = {}
    with contextlib.ExitStack() as stack:
        folder = (
            cache_dir
            if cache_dir is not None
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="nanotron_ext_calibrate_"))
        )
        for trial, blocks in variants:
            # Rank 0 measures while the others wait, each timed call starting with cold caches. Every rank measuring
            # at once over-predicted the SmolLM shape by 9-23 %: the ranks' cache flushes and timed calls overlap at
            # random and slow each other (benchmarks/predict_vs_measure.py).
            for cost in measured_blocks(
                blocks,
                trial,
                cache_dir=folder,
                warmup=warmup,
                repeats=repeats,
                module_factory=factory,
                on_round=on_round,
            ):
                out.setdefault(cost.signature, cost)
    return out


def fit_rates(
    variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]], costs: dict[str, BlockCost]
) -> tuple[tuple[tuple[str, float], ...], float]:
    """Training FLOP/s per role over its measured blocks (each distinct block once), and over all of them."""
    flops: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    seen: set[str] = set()
    for _, blocks in variants:
        for b, sig, work in zip(blocks, _signatures(blocks), training_flops(blocks)):
            cost = costs.get(sig)
            if sig in seen or cost is None or work <= 0 or cost.forward + cost.backward <= 0:
                continue
            seen.add(sig)
            flops[b.role] += work
            seconds[b.role] += cost.forward + cost.backward
    if not flops:
        raise ConfigError(
            "calibrate: no measured block has training FLOPs and a positive time, so no FLOP rate "
            "can be fitted; check the config's model shape"
        )
    rates = tuple(sorted((role, flops[role] / seconds[role]) for role in flops))
    return rates, sum(flops.values()) / sum(seconds.values())


def _block_call_overhead(world: _World | None, device: str, warmup: int, repeats: int) -> float:
    """Seconds Nanotron's ``PipelineBlock`` adds to one forward call (measured on rank 0; 0 elsewhere)."""
    import torch
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock
    from nanotron.parallel.pipeline_parallel.p2p import P2P

    with _one_process_group(world) as group:
        if group is None:
            return 0.0
        dev = _torch_device(device)
        block = PipelineBlock(
            p2p=P2P(group, dev),
            module_builder=torch.nn.Linear,
            module_kwargs={"in_features": 1, "out_features": 1, "bias": False, "device": dev},
            module_input_keys={"input"},
            module_output_keys={"output"},
        )
        block.build_and_set_rank(0)
        x = torch.ones(1, 1, device=dev)
        return _extra_per_call(lambda: block(input=x), lambda: block.pp_block(input=x), dev, warmup, repeats)


@contextlib.contextmanager
def _one_process_group(world: _World | None) -> Iterator[Any]:
    """A gloo group of global rank 0 alone: yielded on rank 0, None elsewhere (every rank must enter)."""
    import torch.distributed as dist

    if world is not None:
        group = dist.new_group(ranks=[0], backend="gloo")
        yield group if world.rank == 0 else None
        return
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# --- the world, and what only rank 0 does ------------------------------------------------------------------


def _deferred(world: _World | None, fn: Callable[[], float]) -> float | BaseException:
    """``fn()``, or under torch.distributed its error, kept to be raised after the collectives that follow (by
    :func:`share_profile`), so that no peer is left waiting on a rank that stopped."""
    try:
        return fn()
    except Exception as exc:
        if world is None:
            raise
        return exc


def _name(cfg: PlannerConfig, world: _World | None, device: str, backend: str) -> str:
    """``calibrated: cpu, gloo, pp=2`` (``, dp=2`` and ``, tp=2`` where > 1; ``cuda, gloo host-staged`` for CUDA
    over gloo), or ``calibrated: cpu (compute only)``."""
    where = device.split(":")[0]
    if world is None:
        return f"calibrated: {where} (compute only)"
    extra = "".join(f", {k}={v}" for k, v in (("dp", world.dp), ("tp", world.tp)) if v > 1)
    transport = f"{backend} host-staged" if host_staged(device, backend) else backend
    return f"calibrated: {where}, {transport}, pp={world.pp}{extra}"
