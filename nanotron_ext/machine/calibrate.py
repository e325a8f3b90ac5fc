"""``calibrate``: measure the machine this runs on into a :class:`~nanotron_ext.machine.profile.MachineProfile`.

What it measures, and how (torch and Nanotron are imported only here, inside the functions):

* **blocks**: every distinct block of the config (and, under ``vocab_shards: auto``, of every K that ``auto``
  tries), built standalone and timed by :mod:`nanotron_ext.costs.profiled` (under torchrun every rank measures at once; the median over the ranks).
  ``cache_dir=None`` measures afresh (a temporary cache), so ``--repeats`` is never answered from old files;
  a folder reuses and fills that cache.
* **rates**: per block role, training FLOPs (:func:`~nanotron_ext.costs.analytic.training_flops`) ÷ measured
  forward + backward over the role's measured blocks; ``flops_per_second`` is the same over every measured block,
  so a block that was not measured (another K, another role) is priced at this machine's rate.
* **engine overhead**: ``block_call`` is what Nanotron's ``PipelineBlock`` adds to one forward call: a
  ``Linear(1, 1)`` wrapped in a ``PipelineBlock`` on a one-process group, timed against the bare module (batches
  of 100 calls of each, interleaved; the median difference of their per-call means). ``send`` / ``recv`` are measured, not folded into the links: under torchrun, what
  Nanotron's P2P protocol (two metadata messages before the data; the receiver runs Nanotron's own
  ``P2P.recv_tensors``) adds to a bare transfer of the same small tensor between stages 0 and 1, split evenly
  between sender and receiver; 0 alone (one process cannot post a send).
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
import datetime
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import DTYPE_BYTES, VOCAB_SHARDS_AUTO, PlannerConfig, vocab_shard_candidates
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.costs.block_memory import block_memory
from nanotron_ext.errors import ConfigError, RunFailure
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine.pricing import measured_blocks, tied_weight_bytes
from nanotron_ext.machine.profile import (
    BlockCost,
    Collective,
    EngineOverhead,
    Link,
    MachineProfile,
    block_signature,
    key_for,
)

__all__ = ["calibrate", "calibration_blocks", "fit_line", "host_staged"]

#: The smallest message of the link and collective fits, bytes.
MIN_BYTES = 4096
#: Calls per timed batch of the engine-overhead measurements (one call is microseconds: a batch, then a mean).
CALLS_PER_BATCH = 100
#: Pairs of batches the engine-overhead measurements take at least (a difference of two means, so more than
#: ``repeats`` for one block: a preempted batch must not decide it).
MIN_BATCHES = 9
#: The clock every measurement here reads.
clock: Callable[[], float] = time.perf_counter


def calibrate(cfg: PlannerConfig, *, warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
              progress: bool = True) -> MachineProfile:
    """Measure this machine (and, under torchrun, its links and collectives) for ``cfg``.

    Collective under torch.distributed: every rank calls it and gets the same profile.

    Args:
        cfg: the config whose blocks, links and syncs are measured.
        warmup: untimed runs before each measurement.
        repeats: timed runs of each measurement (the median is kept).
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
    with _progress(_steps(cfg, world, len(signatures)), enabled=progress and rank0) as bar:
        costs = _measure_blocks(variants, warmup, repeats, cache_dir, bar)
        bar.update(max(0, len(signatures) - bar.n))  # the last block measured, and those the cache had
        call = _deferred(world, lambda: _block_call_overhead(world, device, warmup, repeats))
        bar.update()
        comm = _Comm() if world is None else _measure_comm(cfg, variants, world, device, backend, warmup, repeats,
                                                                  bar)

    def build() -> MachineProfile:
        if isinstance(call, BaseException):
            raise call
        rates, overall = _fit_rates(variants, costs)
        return MachineProfile(
            name=_name(cfg, world, device, backend), source=_source(cfg),
            key=key_for(cfg, device=device, backend=backend if world else None, world=world is not None),
            flops_per_second=overall, rates=rates, blocks=tuple(costs.values()), links=comm.links,
            overhead=EngineOverhead(call, comm.send_recv / 2, comm.send_recv / 2),
            dp_allreduce=comm.dp_allreduce, tied_allreduce=comm.tied_allreduce,
        )

    return _share(build, world)


def _check_counts(warmup: int, repeats: int) -> None:
    """Raise a ConfigError unless ``warmup >= 0`` and ``repeats >= 1`` are integers."""
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"calibrate: {name}={value!r} must be an integer >= {least} (e.g. --warmup 2 "
                              f"--repeats 5: two untimed runs, then the median of five)")


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
        raise ConfigError(f"calibrate measures with torch and Nanotron, which cannot be imported here ({exc}); "
                          f"install them (pip install 'nanotron-ext[cpu]')") from exc
    if cfg.model.moe is not None:
        raise ConfigError(
            f"{cfg.source}: calibrate cannot build its mixture-of-experts decoder layers standalone (it measures the "
            f"dense Llama blocks: {', '.join(MEASURABLE_ROLES)}), so their times would not be this model's. Plan "
            f"it with the analytic model (no --machine) or a FLOP rate (--tflops X)")
    for _, blocks in variants:
        for b in blocks:
            if b.role not in MEASURABLE_ROLES:
                raise ConfigError(
                    f"{cfg.source}: calibrate cannot build block {b.name} (role {b.role!r}) standalone; it measures "
                    f"the Llama blocks ({', '.join(MEASURABLE_ROLES)}). Plan this model with the analytic model "
                    f"(no --machine) or a FLOP rate (--tflops X)")


def _device_and_backend() -> tuple[str, str]:
    """Where blocks run (as :mod:`~nanotron_ext.costs.profiled` picks) and the process group's backend."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu"
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "gloo"
    return device, "nccl" if cuda and "nccl" in backend else backend  # "cpu:gloo,cuda:nccl" sends CUDA by NCCL


def host_staged(device: str | None, backend: str | None) -> bool:
    """Whether links measured on ``device`` over ``backend`` go through the host: CUDA tensors over gloo."""
    return bool(device) and str(device).startswith("cuda") and backend == "gloo"


def _torch_device(device: str) -> Any:
    import torch

    return torch.device("cuda" if device.startswith("cuda") else "cpu")


def _steps(cfg: PlannerConfig, world: _World | None, n_blocks: int) -> int:
    """Measurements the progress bar counts: blocks, the block call, then links, P2P overhead, collectives."""
    if world is None:
        return n_blocks + 1
    tied = cfg.model.tie_word_embeddings and world.pp > 1
    return n_blocks + 1 + 2 * (world.pp - 1) + (world.pp > 1) + (world.dp > 1) + tied


@contextlib.contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="calibrate", unit="measurement", file=sys.stderr, disable=not enabled,
               dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


# --- compute ------------------------------------------------------------------------------------------------


def _measure_blocks(variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]], warmup: int, repeats: int,
                    cache_dir: str | Path | None, bar: Any) -> dict[str, BlockCost]:
    """Every distinct block of every variant, by signature (one cache, so blocks the variants share are
    measured once)."""
    from nanotron_ext.models.profiled_blocks import build_block_module

    built = [0]

    def factory(block: BlockInfo, cfg: PlannerConfig, tp_pg: Any) -> Any:
        bar.update(built[0] > 0)  # the block built before this one is measured by now
        built[0] += 1
        bar.set_postfix_str(block.short)
        return build_block_module(block, cfg, tp_pg)

    out: dict[str, BlockCost] = {}
    with contextlib.ExitStack() as stack:
        folder = cache_dir if cache_dir is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="nanotron_ext_calibrate_"))
        for trial, blocks in variants:
            # Rank 0 measures while the others wait, each timed call starting with cold caches. Every rank measuring
            # at once over-predicted the SmolLM shape by 9-23 %: the ranks' cache flushes and timed calls overlap at
            # random and slow each other (benchmarks/predict_vs_measure.py).
            for cost in measured_blocks(blocks, trial, cache_dir=folder, warmup=warmup, repeats=repeats,
                                        module_factory=factory):
                out.setdefault(cost.signature, cost)
    return out


def _fit_rates(variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]],
               costs: dict[str, BlockCost]) -> tuple[tuple[tuple[str, float], ...], float]:
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
        raise ConfigError("calibrate: no measured block has training FLOPs and a positive time, so no FLOP rate "
                          "can be fitted; check the config's model shape")
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
        block = PipelineBlock(p2p=P2P(group, dev), module_builder=torch.nn.Linear,
                              module_kwargs={"in_features": 1, "out_features": 1, "bias": False, "device": dev},
                              module_input_keys={"input"}, module_output_keys={"output"})
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


def _extra_per_call(fn: Callable[[], Any], base: Callable[[], Any], device: Any, warmup: int,
                    repeats: int) -> float:
    """Seconds one call of ``fn`` takes beyond one of ``base``: batches of each, interleaved so that both see
    the same load, and the median difference of their per-call means over at least :data:`MIN_BATCHES` pairs
    (after ``warmup``); never below 0."""
    extra = []
    for i in range(warmup + max(repeats, MIN_BATCHES)):
        mean_fn, mean_base = _per_call(fn, device), _per_call(base, device)
        if i >= warmup:
            extra.append(mean_fn - mean_base)
    return max(0.0, statistics.median(extra))


def _per_call(fn: Callable[[], Any], device: Any) -> float:
    """Mean seconds of one call of ``fn`` over a batch of :data:`CALLS_PER_BATCH`."""
    _sync(device)
    t0 = clock()
    for _ in range(CALLS_PER_BATCH):
        fn()
    _sync(device)
    return (clock() - t0) / CALLS_PER_BATCH


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the world, and what only rank 0 does ------------------------------------------------------------------


@dataclass(frozen=True)
class _World:
    """This rank in Nanotron's layout: global rank ``(stage · dp + dp_rank) · tp + tp_rank``."""

    rank: int
    pp: int
    dp: int
    tp: int

    @classmethod
    def current(cls, cfg: PlannerConfig) -> _World | None:
        """The initialised process group as a layout of ``cfg``, or None without one.

        Raises:
            ConfigError: the world size is not ``pp × dp × tp``.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        r, size = cfg.run, dist.get_world_size()
        need = r.pp * r.dp * r.tp
        if size != need:
            raise ConfigError(
                f"calibrate: torch.distributed's world size is {size}, but {cfg.source} needs pp*dp*tp = "
                f"{r.pp}*{r.dp}*{r.tp} = {need} ranks, so that every link and gradient sync is the run's own. "
                f"Launch {need} ranks (torchrun --nproc_per_node={need}), or run calibrate without torchrun to "
                f"measure the compute alone")
        return cls(dist.get_rank(), r.pp, r.dp, r.tp)

    def rank_of(self, stage: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def coords(self) -> tuple[int, int, int]:
        """(stage, dp rank, tp rank) of this rank."""
        stage, rest = divmod(self.rank, self.dp * self.tp)
        return (stage, *divmod(rest, self.tp))


def _deferred(world: _World | None, fn: Callable[[], float]) -> float | BaseException:
    """``fn()``, or under torch.distributed its error, kept to be raised after the collectives that follow (by
    :func:`_share`), so that no peer is left waiting on a rank that stopped."""
    try:
        return fn()
    except Exception as exc:
        if world is None:
            raise
        return exc


def _share(build: Callable[[], MachineProfile], world: _World | None) -> MachineProfile:
    """Rank 0 builds the profile and broadcasts it; every rank returns it (or raises rank 0's error)."""
    if world is None:
        return build()
    import torch.distributed as dist

    payload: list[Any] = [None]
    error: Exception | None = None
    if world.rank == 0:
        try:
            payload[0] = {"ok": build().to_json()}
        except Exception as exc:
            error, payload[0] = exc, {"error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    if "error" in payload[0]:
        raise RunFailure(f"calibrate failed on global rank 0: {payload[0]['error']}")
    return MachineProfile.from_json(payload[0]["ok"], origin="(broadcast by rank 0)")


def _name(cfg: PlannerConfig, world: _World | None, device: str, backend: str) -> str:
    """``calibrated: cpu, gloo, pp=2`` (``, dp=2`` and ``, tp=2`` where > 1; ``cuda, gloo host-staged`` for CUDA
    over gloo), or ``calibrated: cpu (compute only)``."""
    where = device.split(":")[0]
    if world is None:
        return f"calibrated: {where} (compute only)"
    extra = "".join(f", {k}={v}" for k, v in (("dp", world.dp), ("tp", world.tp)) if v > 1)
    transport = f"{backend} host-staged" if host_staged(device, backend) else backend
    return f"calibrated: {where}, {transport}, pp={world.pp}{extra}"


def _source(cfg: PlannerConfig) -> str:
    """The command line, the config, the date, torch's version and the host."""
    import torch

    argv = list(getattr(sys, "orig_argv", sys.argv)) or ["python"]
    command = shlex.join([Path(argv[0]).name, *argv[1:]])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command}` ({cfg.source}) on {when}, torch {torch.__version__}, host {socket.gethostname()}"


# --- links and collectives ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Comm:
    """What the process group measured: links, the P2P protocol's extra seconds per transfer, the syncs."""

    links: tuple[Link, ...] = ()
    send_recv: float = 0.0
    dp_allreduce: Collective | None = None
    tied_allreduce: Collective | None = None


def _measure_comm(cfg: PlannerConfig, variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]], world: _World,
                  device: str, backend: str, warmup: int, repeats: int, bar: Any) -> _Comm:
    """Links, P2P overhead and collectives; a collective call: every rank gets the same result."""
    import torch.distributed as dist

    dev = _torch_device(device)  # where the run's tensors live; gloo moves CUDA ones through the host
    staged = host_staged(device, backend)
    blocks = [b for _, bs in variants for b in bs]
    largest = max(block_memory(b, cfg.model, cfg.run).output for b in blocks)
    grad_bytes = DTYPE_BYTES[cfg.run.dtype]
    mine: dict[tuple[str, int, int], dict[int, float]] = {}
    mine.update(_links(world, _sizes(largest), (dev, staged), warmup, repeats, bar))
    wire = dev if backend == "nccl" else _torch_device("cpu")  # the protocol's extra messages, without copies
    send_recv = _p2p_overhead(world, wire, warmup, repeats) if world.pp > 1 else 0.0
    bar.update(world.pp > 1)
    if world.dp > 1:
        groups = [[world.rank_of(s, d, t) for d in range(world.dp)] for s in range(world.pp) for t in range(world.tp)]
        mine[("dp", 0, 0)] = _allreduce(world, groups, _sizes(max(b.trainable for b in blocks) * grad_bytes),
                                        (dev, staged), warmup, repeats)
        bar.update()
    tied = cfg.model.tie_word_embeddings and world.pp > 1
    if tied:
        groups = [[world.rank_of(0, d, t), world.rank_of(world.pp - 1, d, t)]
                  for d in range(world.dp) for t in range(world.tp)]
        mine[("tied", 0, 0)] = _allreduce(world, groups, _sizes(tied_weight_bytes(cfg)), (dev, staged), warmup,
                                          repeats)
        bar.update()
    gathered: list[Any] = [None] * (world.pp * world.dp * world.tp)
    dist.all_gather_object(gathered, (mine, send_recv))
    return _fit_comm(gathered, world, tied)


def _sizes(largest: float) -> list[int]:
    """Message sizes in bytes: 4 KiB by fourfold steps up to ``largest`` (at least 64 KiB), a multiple of 4."""
    top = max(16 * MIN_BYTES, -(-int(largest) // 4) * 4)
    out, n = [], MIN_BYTES
    while n < top:
        out.append(n)
        n *= 4
    return [*out, top]


def _links(world: _World, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int,
           repeats: int, bar: Any) -> dict[tuple[str, int, int], dict[int, float]]:
    """Round trips timed by this rank, per direction it sends in: ``("link", src, dst) -> {bytes: seconds}``.
    ``dev``: (where the tensors live, whether they are host-staged)."""
    import torch.distributed as dist

    stage, d, t = world.coords
    out = {}
    for s in range(world.pp - 1):
        for src, dst in ((s, s + 1), (s + 1, s)):
            if stage == src:
                out[("link", src, dst)] = _ping(world.rank_of(dst, d, t), sizes, dev, warmup, repeats)
            elif stage == dst:
                _echo(world.rank_of(src, d, t), sizes, dev, warmup, repeats)
            dist.barrier()
            bar.set_postfix_str(f"link {src}->{dst}")
            bar.update()
    return out


def _ping(peer: int, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int, repeats: int) -> dict[int, float]:
    """Median seconds of ``n`` bytes to ``peer`` and one byte back, per size (host-staged: copies included)."""
    import torch

    where, staged = dev
    ack = torch.zeros(1, dtype=torch.uint8, device=where)
    out = {}
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8, device=where)
        times = []
        for i in range(warmup + repeats):
            _sync(where)
            t0 = clock()
            _send(buf, peer, staged)
            _recv(ack, peer, staged)
            _sync(where)
            if i >= warmup:
                times.append(clock() - t0)
        out[n] = statistics.median(times)
    return out


def _echo(peer: int, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int, repeats: int) -> None:
    """The other side of :func:`_ping`."""
    import torch

    where, staged = dev
    ack = torch.ones(1, dtype=torch.uint8, device=where)
    for n in sizes:
        buf = torch.empty(n, dtype=torch.uint8, device=where)
        for _ in range(warmup + repeats):
            _recv(buf, peer, staged)
            _send(ack, peer, staged)


def _send(tensor: Any, peer: int, staged: bool) -> None:
    """``dist.send``; host-staged: a host copy of ``tensor`` is sent, as the CPU runtime's P2P does on CUDA."""
    import torch.distributed as dist

    dist.send(tensor.detach().to("cpu", copy=True) if staged else tensor, peer)


def _recv(tensor: Any, peer: int, staged: bool) -> None:
    """``dist.recv`` into ``tensor``; host-staged: into a fresh host buffer, then copied to ``tensor``'s device."""
    import torch
    import torch.distributed as dist

    if not staged:
        dist.recv(tensor, peer)
        return
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    dist.recv(host, peer)
    tensor.copy_(host)


def _p2p_overhead(world: _World, dev: Any, warmup: int, repeats: int) -> float:
    """Seconds Nanotron's P2P protocol adds to one small transfer over a bare one, between stages 0 and 1 of
    the first replica (timed on stage 0; 0 elsewhere).

    The protocol is two metadata messages before the data, and a receiver that reads them before it can post
    the data's receive and reshape it: the receiver runs Nanotron's own ``P2P.recv_tensors``; the sender posts
    the three messages with ``isend``, as NCCL does for Nanotron's ``P2P`` and the CPU runtime's P2P does on
    gloo (a send never blocks the host there), then waits for a one-byte reply.
    """
    import torch
    import torch.distributed as dist
    from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData

    group = dist.new_group(ranks=[world.rank_of(s) for s in range(world.pp)])  # the first replica's pp group
    if world.rank not in (world.rank_of(0), world.rank_of(1)):
        return 0.0
    p2p, peer, first = P2P(group, dev), world.rank_of(1 - world.coords[0]), world.coords[0] == 0
    x = torch.zeros(16, 16, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)

    def send(*tensors: Any) -> None:
        works = [dist.isend(t, dst=peer, group=group) for t in tensors]
        dist.recv(ack, peer)
        for work in works:
            work.wait()

    def nanotron() -> None:
        if first:
            send(P2PTensorMetaData.to_first_metadata(tensor=x, device=dev),
                 P2PTensorMetaData.to_second_metadata(tensor=x, device=dev), x)
        else:
            p2p.recv_tensors(1, from_rank=0)
            dist.send(ack, peer)

    def bare() -> None:
        if first:
            send(x)
        else:
            dist.recv(x, peer, group=group)
            dist.send(ack, peer)

    extra = _extra_per_call(nanotron, bare, dev, warmup, repeats)  # both sides run the same loops
    return extra if first else 0.0


def _allreduce(world: _World, groups: Sequence[Sequence[int]], sizes: Sequence[int], dev: tuple[Any, bool],
               warmup: int, repeats: int) -> dict[int, float]:
    """Median seconds of an all-reduce of each size over this rank's group (every replica's group at once);
    host-staged: the buffer lives on the device and is reduced through a host copy, copied back."""
    import torch
    import torch.distributed as dist

    mine = None
    for ranks in groups:  # every rank creates every group, in the same order (torch requires it)
        group = dist.new_group(ranks=list(ranks))
        mine = group if world.rank in ranks else mine
    out: dict[int, float] = {}
    if mine is None:
        dist.barrier()
        return out
    where, staged = dev
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32, device=where)
        times = []
        for i in range(warmup + repeats):
            dist.barrier(group=mine)
            _sync(where)
            t0 = clock()
            if staged:
                host = buf.to("cpu", copy=True)
                dist.all_reduce(host, group=mine)
                buf.copy_(host)
            else:
                dist.all_reduce(buf, group=mine)
            _sync(where)
            if i >= warmup:
                times.append(clock() - t0)
        out[n] = statistics.median(times)
    dist.barrier()
    return out


def _slowest(gathered: Sequence[Any], key: tuple[str, int, int]) -> dict[int, float]:
    """Per size, the largest median any rank timed for ``key``."""
    out: dict[int, float] = {}
    for mine, _ in gathered:
        for n, seconds in mine.get(key, {}).items():
            out[n] = max(out.get(n, 0.0), seconds)
    return out


def _fit_comm(gathered: Sequence[Any], world: _World, tied: bool) -> _Comm:
    """Every rank's ``(timings, P2P extra)`` fitted into links and collectives (the slowest rank per size)."""
    links = []
    for s in range(world.pp - 1):
        for src, dst in ((s, s + 1), (s + 1, s)):
            rtt = _slowest(gathered, ("link", src, dst))
            c, slope = fit_line(list(rtt), list(rtt.values()))
            links.append(Link(src, dst, c / 2, 1.0 / slope))

    def collective(name: str, n: int) -> Collective:
        t = _slowest(gathered, (name, 0, 0))
        c, slope = fit_line([2.0 * (n - 1) / n * b for b in t], list(t.values()))
        return Collective(c, 1.0 / slope)

    return _Comm(
        links=tuple(links), send_recv=max(extra for _, extra in gathered),
        dp_allreduce=collective("dp", world.dp) if world.dp > 1 else None,
        tied_allreduce=collective("tied", 2) if tied else None,
    )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y = a + b·x`` by least squares on relative error (each point weighted
    ``1 / y²``, so small messages fit their latency as well as large ones their bandwidth).

    The intercept is kept within ``[0, min(y)]``. Where time did not grow with size (no positive slope) the
    data shows no bandwidth: then ``(min(y), max(y) / max(x))``, a bandwidth no better than the largest message
    alone proves.
    """
    ys = [max(y, 1e-12) for y in ys]
    w = [1.0 / y**2 for y in ys]
    s, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = s * sxx - sx * sx
    slope = (s * sxy - sx * sy) / det if det > 0 else 0.0
    intercept = (sy - slope * sx) / s
    if not slope > 0:
        return min(ys), max(ys) / max(xs)
    return min(max(intercept, 0.0), min(ys)), slope
