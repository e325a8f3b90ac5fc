"""Calibration's timing of the process group: links between pipeline neighbours, Nanotron's P2P overhead and the
gradient all-reduces (see :mod:`nanotron_ext.machine.calibrate`); the layout of ranks they are measured in and the fit
of what they time are :mod:`nanotron_ext.machine.comm_fit`'s."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import DTYPE_BYTES, PlannerConfig
from nanotron_ext.costs.block_memory import largest_output
from nanotron_ext.machine.comm_fit import _Comm, _fit_comm, _World, fit_line
from nanotron_ext.machine.pricing import tied_weight_bytes
from nanotron_ext.stats import relative_spread

__all__ = ["fit_line", "host_staged"]

#: The smallest message of the link and collective fits, bytes.
MIN_BYTES = 4096
#: Calls per timed batch of the engine-overhead measurements (one call is microseconds: a batch, then a mean).
CALLS_PER_BATCH = 100
#: Pairs of batches the engine-overhead measurements take at least (a difference of two means, so more than
#: ``repeats`` for one block: a preempted batch must not decide it).
MIN_BATCHES = 9
#: Link rounds per ``repeats`` (see :func:`_measure_comm`).
LINK_ROUNDS_PER_REPEAT = 4
#: The clock every measurement here reads.
clock: Callable[[], float] = time.perf_counter


def host_staged(device: str | None, backend: str | None) -> bool:
    """Whether links measured on ``device`` over ``backend`` go through the host: CUDA tensors over gloo."""
    return bool(device) and str(device).startswith("cuda") and backend == "gloo"


def _torch_device(device: str) -> Any:
    import torch

    return torch.device("cuda" if device.startswith("cuda") else "cpu")


def _extra_per_call(fn: Callable[[], Any], base: Callable[[], Any], device: Any, warmup: int, repeats: int) -> float:
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


# --- links and collectives ---------------------------------------------------------------------------------


def _measure_comm(
    cfg: PlannerConfig,
    variants: Sequence[tuple[PlannerConfig, list[BlockInfo]]],
    world: _World,
    device: str,
    backend: str,
    warmup: int,
    repeats: int,
    bar: Any,
) -> _Comm:
    """Links, P2P overhead and collectives; a collective call: every rank gets the same result."""
    import torch.distributed as dist

    dev = _torch_device(device)  # where the run's tensors live; gloo moves CUDA ones through the host
    staged = host_staged(device, backend)
    blocks = [b for _, bs in variants for b in bs]
    largest = largest_output(blocks, cfg.model, cfg.run)
    grad_bytes = DTYPE_BYTES[cfg.run.dtype]
    mine: dict[tuple[str, int, int], dict[int, float]] = {}
    # Rounds of all sizes are milliseconds where a block's are seconds: take more of them, so that the median spans
    # more of the link's slow and fast stretches (11 rounds: a 25 MB round trip's median moved 5.6-11.2 ms between
    # six back-to-back measurements here; 41 rounds: 5.4-6.8 ms).
    mine.update(_links(world, _sizes(largest), (dev, staged), warmup, LINK_ROUNDS_PER_REPEAT * repeats, bar))
    wire = dev if backend == "nccl" else _torch_device("cpu")  # the protocol's extra messages, without copies
    send_recv = _p2p_overhead(world, wire, warmup, repeats) if world.pp > 1 else 0.0
    bar.update(world.pp > 1)
    if world.dp > 1:
        groups = [[world.rank_of(s, d, t) for d in range(world.dp)] for s in range(world.pp) for t in range(world.tp)]
        mine[("dp", 0, 0)] = _allreduce(
            world, groups, _sizes(max(b.trainable for b in blocks) * grad_bytes), (dev, staged), warmup, repeats
        )
        bar.update()
    tied = cfg.model.tie_word_embeddings and world.pp > 1
    if tied:
        groups = [
            [world.rank_of(0, d, t), world.rank_of(world.pp - 1, d, t)]
            for d in range(world.dp)
            for t in range(world.tp)
        ]
        mine[("tied", 0, 0)] = _allreduce(world, groups, _sizes(tied_weight_bytes(cfg)), (dev, staged), warmup, repeats)
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


def _links(
    world: _World, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int, repeats: int, bar: Any
) -> dict[tuple[str, int, int], dict[int, float]]:
    """Round trips timed by this rank, per direction it sends in: ``("link", src, dst) -> {bytes: seconds}``.
    ``dev``: (where the tensors live, whether they are host-staged)."""
    import torch.distributed as dist

    stage, d, t = world.coords
    out = {}
    for s in range(world.pp - 1):
        for src, dst in ((s, s + 1), (s + 1, s)):
            if stage == src:
                samples = _ping(world.rank_of(dst, d, t), sizes, dev, warmup, repeats)
                out[("link", src, dst)] = {n: statistics.median(x) for n, x in samples.items()}
                # What a transfer of the largest tensor could move by: the figure a plan's step reads most.
                out[("link spread", src, dst)] = {sizes[-1]: relative_spread(samples[sizes[-1]])}
            elif stage == dst:
                _echo(world.rank_of(src, d, t), sizes, dev, warmup, repeats)
            dist.barrier()
            bar.set_postfix_str(f"link {src}->{dst}")
            bar.update()
    return out


def _ping(peer: int, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int, repeats: int) -> dict[int, list[float]]:
    """Seconds of ``n`` bytes to ``peer`` and one byte back, each timed run, per size (host-staged: copies
    included). The sizes take turns in each round, so that a slow stretch hits every size alike."""
    import torch

    where, staged = dev
    ack = torch.zeros(1, dtype=torch.uint8, device=where)
    buffers = {n: torch.zeros(n, dtype=torch.uint8, device=where) for n in sizes}
    out: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(warmup + repeats):
        for n in sizes:
            _sync(where)
            t0 = clock()
            _send(buffers[n], peer, staged)
            _recv(ack, peer, staged)
            _sync(where)
            if i >= warmup:
                out[n].append(clock() - t0)
    return out


def _echo(peer: int, sizes: Sequence[int], dev: tuple[Any, bool], warmup: int, repeats: int) -> None:
    """The other side of :func:`_ping`."""
    import torch

    where, staged = dev
    ack = torch.ones(1, dtype=torch.uint8, device=where)
    buffers = {n: torch.empty(n, dtype=torch.uint8, device=where) for n in sizes}
    for _ in range(warmup + repeats):
        for n in sizes:
            _recv(buffers[n], peer, staged)
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
            send(
                P2PTensorMetaData.to_first_metadata(tensor=x, device=dev),
                P2PTensorMetaData.to_second_metadata(tensor=x, device=dev),
                x,
            )
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


def _allreduce(
    world: _World,
    groups: Sequence[Sequence[int]],
    sizes: Sequence[int],
    dev: tuple[Any, bool],
    warmup: int,
    repeats: int,
) -> dict[int, float]:
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
