"""The machine profiles ``predict_vs_measure.py`` takes inside its ranks: ``calibrate`` as a user runs it, one profile
for every vocabulary-shard count, the median of a run's profiles, and every block timed with all ranks busy."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.costs.profiled import profile_blocks
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import BlockCost, Collective, EngineOverhead, Link, block_signature
from nanotron_ext.machine.calibrate import calibrate


def calibrate_profile(cfg: Any) -> Any:
    """The machine profile of ``cfg`` measured here, afresh (collective), with ``calibrate``'s own defaults (what
    a user's ``nanotron-ext calibrate`` takes). The one place that names the calibrator."""
    return calibrate(cfg, cache_dir=None, progress=False)


def take_profile(cfgs: dict[int, Any]) -> Any:
    """One profile for every vocabulary-shard count in ``cfgs`` (K → config). With K > 1 among them, ``calibrate``
    of the config under ``vocab_shards: auto``, which measures every K that ``auto`` tries; a K it did not try
    gets its blocks from a ``calibrate`` of its own config (the key leaves ``vocab_shards`` out)."""
    base = cfgs[min(cfgs)]
    profiles = [calibrate_profile(base.with_overrides(vocab_shards="auto") if len(cfgs) > 1 else base)]
    for cfg in cfgs.values():
        if not _covers(profiles[0], cfg):
            profiles.append(calibrate_profile(cfg))
    extra = [b for p in profiles[1:] for b in p.blocks if profiles[0].block(b.signature) is None]
    if not extra:
        return profiles[0]
    return profiles[0].with_blocks(extra, "vocab-shard blocks calibrated from their own configs")


def _covers(profile: Any, cfg: Any) -> bool:
    """Whether ``profile`` measured every block of ``cfg``."""
    blocks = inventory_from_config(cfg)
    return all(
        profile.block(block_signature(b, input_grad=g)) is not None for b, g in zip(blocks, trainable_before(blocks))
    )


def median_profile(profiles: Sequence[Any]) -> Any:
    """Every number of the profiles replaced by its median over them (same blocks, links and syncs)."""
    med, first = statistics.median, profiles[0]
    blocks = tuple(
        BlockCost(
            b.signature,
            *(med(getattr(p.block(b.signature), f) for p in profiles) for f in ("forward", "backward", "update")),
        )
        for b in first.blocks
    )
    links = tuple(
        Link(
            link.src,
            link.dst,
            med(p.links[i].latency for p in profiles),
            med(p.links[i].bytes_per_second for p in profiles),
        )
        for i, link in enumerate(first.links)
    )
    overhead = EngineOverhead(*(med(getattr(p.overhead, f) for p in profiles) for f in ("block_call", "send", "recv")))

    def sync(name: str) -> Any:
        found = [getattr(p, name) for p in profiles]
        if any(c is None for c in found):
            return None
        return Collective(med(c.latency for c in found), med(c.bus_bytes_per_second for c in found))

    rates = tuple((role, med(dict(p.rates).get(role, rate) for p in profiles)) for role, rate in first.rates)
    return dataclasses.replace(
        first,
        blocks=blocks,
        links=links,
        overhead=overhead,
        rates=rates,
        dp_allreduce=sync("dp_allreduce"),
        tied_allreduce=sync("tied_allreduce"),
        source=f"{first.source}; median of {len(profiles)} calibrations in this run",
    )


def busy_block_times(cfgs: dict[int, Any]) -> dict[str, list[float]]:
    """Every block timed on every rank at the same time (each rank its own copy): signature → rank 0's
    [forward, backward, update]. Against the profile (rank 0 alone while the others wait), this shows what ranks
    computing side by side cost each other (shared caches, memory bandwidth, cores)."""
    groups = [dist.new_group(ranks=[r], backend="gloo") for r in range(dist.get_world_size())]
    out: dict[str, list[float]] = {}
    for cfg in cfgs.values():
        blocks = inventory_from_config(cfg)
        with tempfile.TemporaryDirectory(prefix="predict_vs_measure_busy_") as fresh:
            dist.barrier()
            timings = profile_blocks(blocks, cfg, tp_pg=groups[dist.get_rank()], cache_dir=fresh, warmup=2, repeats=5)
        for b, grad, t in zip(blocks, trainable_before(blocks), timings):
            out.setdefault(block_signature(b, input_grad=grad), [t.forward, t.backward, t.optimizer])
    dist.barrier()
    return out
