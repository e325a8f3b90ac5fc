"""The in-run profile: a :class:`~nanotron_ext.machine.profile.MachineProfile` priced from the engine's own clock.

``calibrate`` times each block alone and keeps its fastest round; inside the engine the same block runs beside the
other stages' work, and a step adds up its ops, slow ones included: the standalone profile priced the SmolLM shape's
steps 2.5-15 % fast, the seed model's 13-35 %. This module turns what :mod:`nanotron_ext.integration.op_clock` records
during training steps (:mod:`~nanotron_ext.machine.in_run_records`) into the same profile, marked ``in-run``:

* **blocks**: each signature's mean forward, backward (``B + W`` under zb1p and zb2p, where its ``W`` is measured too)
  over every step, micro-batch and rank it ran on, with each figure's split-half spread, and the same means per stage
  position it ran at (first, middle, last stage): inside a pipeline a block's time depends on where it sits, what
  runs beside it and how long its activations wait for their backward (the SmolLM shape at pp=2: a decoder layer's
  forward + backward 52.4 ms on the first stage, 41.2 on the last, in one run). A block is priced at each position by
  its mean there, and at a position it did not run at by its mean over the positions it ran at; a split whose blocks
  never ran together, by the sum of those prices. :func:`position_spread` says how far apart the positions put one
  block.
* **update**: each rank's busy time after the pipeline (the optimizer step and gradient finishing, waits left out),
  shared among its blocks by trainable parameters (a tied lm_head beside its embedding holds no tensor of its own).
* **blocks that never ran** (another vocabulary-shard count, a frozen variant): the standalone figure times the
  in-run ÷ standalone ratio of the blocks of their role that did run (of all blocks, where none of the role ran).
  A run under AFAB or 1F1B measures no ``W``: its backward is split as the standalone calibration split it.
* **the engine's overhead**: the forward and backward ops less their blocks and waits, per block they ran.
* **links**: each send matched with its receive (in order, per direction); where the receiver was already waiting
  when the send was posted, post → arrival is the whole transfer. A link keeps its calibrated bandwidth (the
  transport's, measured over every size; a run sees one or two) and takes the latency those transfers show.
* **tied all-reduce**: the later of the two ends' time inside it (the earlier one waits for the other), and the
  calibrated collective scaled to it the same way. The dp all-reduce stays as calibrated: DDP reduces inside the
  backward, where the clock does not separate it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo, tied_pair
from nanotron_ext.config import PlannerConfig
from nanotron_ext.costs.analytic import trainable_before
from nanotron_ext.errors import ConfigError
from nanotron_ext.machine.calibrate import fit_rates
from nanotron_ext.machine.in_run_records import BlockOps, RankStep
from nanotron_ext.machine.pricing import tied_weight_bytes
from nanotron_ext.machine.profile import (
    POSITIONS,
    BlockCost,
    Collective,
    EngineOverhead,
    Link,
    MachineProfile,
    PositionCost,
    block_signature,
    stage_position,
)
from nanotron_ext.stats import mean_spread

__all__ = [
    "IN_RUN_STEPS",
    "IN_RUN_WARMUP_STEPS",
    "InRunSplit",
    "Ops",
    "Samples",
    "in_run_profile",
    "position_spread",
    "samples_of",
]

#: Timed training steps per split of ``calibrate --in-run``: each gives every block one figure per micro-batch.
IN_RUN_STEPS = 5
#: Untimed steps first (allocations, the optimizer's first states, the first P2P handshakes).
IN_RUN_WARMUP_STEPS = 2


@dataclass(frozen=True)
class InRunSplit:
    """One split's timed steps: the stage of every block, and per step every global rank's :class:`RankStep`."""

    block_ranks: tuple[int, ...]
    steps: tuple[tuple[RankStep, ...], ...]


@dataclass
class Ops:
    """One signature's figures per micro-batch: forward, backward (``B + W`` where W is measured) and W, each with
    the step it was taken in (``*_step``), so that a price is a statistic over steps."""

    forward: list[float] = dataclasses.field(default_factory=list)
    backward: list[float] = dataclasses.field(default_factory=list)
    weight: list[float] = dataclasses.field(default_factory=list)
    forward_step: list[int] = dataclasses.field(default_factory=list)
    backward_step: list[int] = dataclasses.field(default_factory=list)
    weight_step: list[int] = dataclasses.field(default_factory=list)

    def add(self, ops: BlockOps, step: int) -> None:
        w = ops.weight if len(ops.weight) == len(ops.backward) else (0.0,) * len(ops.backward)
        self.forward += ops.forward
        self.backward += [b + x for b, x in zip(ops.backward, w)]
        self.weight += ops.weight
        self.forward_step += [step] * len(ops.forward)
        self.backward_step += [step] * len(ops.backward)
        self.weight_step += [step] * len(ops.weight)


@dataclass
class Samples(Ops):
    """Every figure one signature got, its share of its ranks' updates, and its figures by stage position."""

    update: list[float] = dataclasses.field(default_factory=list)
    update_step: list[int] = dataclasses.field(default_factory=list)
    positions: dict[str, Ops] = dataclasses.field(default_factory=lambda: defaultdict(Ops))


def samples_of(blocks: Sequence[BlockInfo], cfg: PlannerConfig, runs: Sequence[InRunSplit]) -> dict[str, Samples]:
    """Each signature's figures over ``runs`` (``blocks``: the config's inventory, whose names the runs' blocks
    carry).

    Raises:
        ConfigError: a run timed a block the inventory does not have (another config's run).
    """
    index = {b.name: i for i, b in enumerate(blocks)}
    signature = [block_signature(b, input_grad=g) for b, g in zip(blocks, trainable_before(blocks))]
    tie = tied_pair(blocks, cfg.model.tie_word_embeddings)
    out: dict[str, Samples] = defaultdict(Samples)
    n = 0  # every step of every run, numbered
    for run in runs:
        pp = max(run.block_ranks) + 1
        for step in run.steps:
            n += 1
            for rank in step:
                held = []
                for ops in rank.blocks:
                    if ops.block not in index:
                        raise ConfigError(
                            f"an in-run step timed block {ops.block!r}, which this config's model does "
                            f"not have; price a config with the runs of its own model"
                        )
                    i = index[ops.block]
                    s = out[signature[i]]
                    s.add(ops, n)
                    position = stage_position(run.block_ranks[i], pp)
                    if position is not None:
                        s.positions[position].add(ops, n)
                    held.append(i)
                for i, share in _update_shares(blocks, held, tie, rank.update):
                    out[signature[i]].update.append(share)
                    out[signature[i]].update_step.append(n)
    return dict(out)


def _update_shares(
    blocks: Sequence[BlockInfo], held: list[int], tie: tuple[int, int] | None, update: float
) -> list[tuple[int, float]]:
    """A rank's update shared among its trainable blocks by trainable parameters (a tied lm_head beside its
    embedding holds one tensor with it, counted once, with the embedding)."""
    together = tie is not None and tie[0] in held and tie[1] in held
    weights = {i: 0 if together and i == tie[1] else blocks[i].trainable for i in held}
    total = sum(weights.values())
    return [(i, update * w / total) for i, w in weights.items() if w > 0] if total > 0 else []


#: How a figure's samples, grouped by the step they were taken in, make its price.
Statistic = Callable[[Sequence[Sequence[float]]], float]


def mean_of_samples(by_step: Sequence[Sequence[float]]) -> float:
    """The mean of every sample, whatever its step."""
    return statistics.fmean(x for step in by_step for x in step)


def median_of_steps(by_step: Sequence[Sequence[float]]) -> float:
    """The median over steps of each step's mean: a step the machine slowed moves it no more than any other."""
    return statistics.median(statistics.fmean(step) for step in by_step)


#: The in-run profile's statistic: a step adds its ops up, slow ones included, so the mean of every sample prices the
#: mean step; a few slow steps pull it above the median step that is measured (the profile's own split priced
#: 1.057x its median step in one quiet run on the SmolLM shape, 1.009x by the median of steps: docs/in-run.md).
STEP_STATISTIC: Statistic = median_of_steps


def step_price(values: Sequence[float], steps: Sequence[int], statistic: Statistic = STEP_STATISTIC) -> float:
    """One figure's price from its samples (``steps[i]``: the step ``values[i]`` was taken in); 0 without samples."""
    if not values:
        return 0.0
    by_step: dict[int, list[float]] = defaultdict(list)
    for value, step in zip(values, steps):
        by_step[step].append(value)
    return statistic(list(by_step.values()))


def _weight(ops: Ops, backward: float, base: BlockCost | None, statistic: Statistic) -> float | None:
    """W as measured (zb1p, zb2p); from a run under AFAB or 1F1B, which measure none, the backward split as the
    standalone calibration split it; None where neither says (then the FLOPs split it)."""
    if ops.weight:
        return min(step_price(ops.weight, ops.weight_step, statistic), backward)
    if base is not None and base.backward_weight is not None and base.backward > 0:
        # the share first: at most 1, so the product never rounds above the backward (x·w/b can, by one ulp)
        return backward * (base.backward_weight / base.backward)
    return None


def _block_cost(sig: str, s: Samples, base: BlockCost | None, statistic: Statistic) -> BlockCost:
    def forward(ops: Ops) -> float:
        return step_price(ops.forward, ops.forward_step, statistic)

    def backward(ops: Ops) -> float:
        return step_price(ops.backward, ops.backward_step, statistic)

    positions = tuple(
        PositionCost(p, forward(ops), backward(ops), _weight(ops, backward(ops), base, statistic))
        for p, ops in sorted(s.positions.items(), key=lambda item: POSITIONS.index(item[0]))
        if ops.forward
    )
    return BlockCost(
        sig,
        forward(s),
        backward(s),
        step_price(s.update, s.update_step, statistic),
        backward_weight=_weight(s, backward(s), base, statistic),
        spread=(mean_spread(s.forward), mean_spread(s.backward), mean_spread(s.update)),
        positions=positions,
    )


def _ratios(measured: dict[str, BlockCost], base: MachineProfile, role: dict[str, str]) -> dict[str, tuple]:
    """Per role (and ``*``: all), in-run ÷ standalone of forward, backward and update over the signatures both have."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * 6)
    for sig, cost in measured.items():
        old = base.block(sig)
        if old is None:
            continue
        for key in (role[sig], "*"):
            for k, (new, was) in enumerate(
                ((cost.forward, old.forward), (cost.backward, old.backward), (cost.update, old.update))
            ):
                sums[key][k] += new
                sums[key][k + 3] += was
    return {key: tuple(v[k] / v[k + 3] if v[k + 3] > 0 else 1.0 for k in range(3)) for key, v in sums.items()}


def _unseen(base: MachineProfile, measured: dict[str, BlockCost], role: dict[str, str]) -> list[BlockCost]:
    """The standalone blocks no run timed, scaled by their role's in-run ÷ standalone ratios."""
    ratios = _ratios(measured, base, role)
    out = []
    for old in base.blocks:
        if old.signature in measured:
            continue
        name = old.signature.split(":", 1)[0]
        f, b, u = ratios.get(name, ratios.get("*", (1.0, 1.0, 1.0)))
        w = None if old.backward_weight is None else old.backward_weight * b
        out.append(
            dataclasses.replace(
                old, forward=old.forward * f, backward=old.backward * b, update=old.update * u, backward_weight=w
            )
        )
    return out


def position_spread(samples: dict[str, Samples]) -> dict[str, float]:
    """Per signature that ran on more than one stage position: (slowest ÷ fastest position's mean) − 1, its forward
    and backward per micro-batch together."""
    out = {}
    for sig, s in samples.items():
        means = [
            statistics.fmean(ops.forward) + (statistics.fmean(ops.backward) if ops.backward else 0.0)
            for ops in s.positions.values()
            if ops.forward
        ]
        if len(means) > 1 and min(means) > 0:
            out[sig] = max(means) / min(means) - 1
    return out


def _overhead(runs: Sequence[InRunSplit], base: EngineOverhead) -> EngineOverhead:
    """The engine's bookkeeping per block call: the ops' own time less their blocks', per block they ran."""
    own = calls = 0.0
    for run in runs:
        for step in run.steps:
            for rank in step:
                for seconds, n in rank.calls:
                    own += seconds
                    calls += n
    return dataclasses.replace(base, block_call=max(own / calls, 0.0)) if calls > 0 else base


def _transfers(runs: Sequence[InRunSplit]) -> dict[tuple[int, int], list[tuple[int, int, float]]]:
    """Per direction ``(src, dst)``, ``(bytes, tensors, seconds)`` of every whole transfer: a send matched with its
    receive (the k-th of each, within a step), kept where the receiver was waiting before the send was posted."""
    out: dict[tuple[int, int], list[tuple[int, int, float]]] = defaultdict(list)
    for run in runs:
        for step in run.steps:
            sends, receives = defaultdict(list), defaultdict(list)
            for rank in step:
                for s in rank.sends:
                    sends[(s.src, s.dst)].append(s)
                for r in rank.receives:
                    receives[(r.src, r.dst)].append(r)
            for pair, posted in sends.items():
                for s, r in zip(posted, receives.get(pair, [])):
                    if r.started <= s.posted and r.n_bytes == s.n_bytes:
                        out[pair].append((s.n_bytes, s.n_tensors, r.ended - s.posted))
    return out


def _in_run_links(base: MachineProfile, runs: Sequence[InRunSplit]) -> tuple[Link, ...]:
    """Each calibrated link with the latency its whole transfers in the run show: per tensor, the median of the
    transfer less Nanotron's posting and the bytes at the calibrated bandwidth. The bandwidth stays as calibrated:
    it is the transport's, measured over every size between idle ranks, where a run sees one or two sizes; what a
    run adds per transfer (waking a rank blocked in its receive, the transport's loop under load) is latency."""
    transfers = _transfers(runs)
    call = base.overhead.send + base.overhead.recv  # Nanotron's per-tensor posting, priced apart from the link
    links = []
    for link in base.links:
        samples = transfers.get((link.src, link.dst), [])
        latencies = [(t - n_bytes / link.bytes_per_second) / n - call for n_bytes, n, t in samples]
        if not latencies:
            links.append(link)
            continue
        latency = max(statistics.median(latencies), 0.0)
        links.append(
            Link(
                link.src,
                link.dst,
                latency,
                link.bytes_per_second,
                mean_spread(latencies) if len(latencies) > 1 else link.spread,
            )
        )
    return tuple(links)


def _tied(
    base: MachineProfile, cfg: PlannerConfig, blocks: Sequence[BlockInfo], runs: Sequence[InRunSplit]
) -> Collective | None:
    """The tied all-reduce scaled to its in-run time: per step, the later end's time inside it."""
    tie = tied_pair(blocks, cfg.model.tie_word_embeddings)
    if tie is None:
        return base.tied_allreduce
    ends = {blocks[tie[0]].name, blocks[tie[1]].name}
    times = []
    for run in runs:
        if run.block_ranks[tie[0]] == run.block_ranks[tie[1]]:
            continue  # both ends on one stage: one tensor, no all-reduce
        for step in run.steps:
            spans = [r.tied_sync for r in step if r.tied_sync is not None and ends & {o.block for o in r.blocks}]
            if len(spans) >= 2:
                later = max(spans, key=lambda span: span[0])
                times.append(later[1] - later[0])
    if not times:
        return base.tied_allreduce
    n_bytes, seconds = tied_weight_bytes(cfg), statistics.median(times)
    if base.tied_allreduce is None:
        return Collective(0.0, n_bytes / seconds)
    k = seconds / base.tied_allreduce.time(n_bytes, 2)
    return Collective(base.tied_allreduce.latency * k, base.tied_allreduce.bus_bytes_per_second / k)


def in_run_profile(
    cfg: PlannerConfig,
    blocks: Sequence[BlockInfo],
    runs: Sequence[InRunSplit],
    base: MachineProfile,
    *,
    source: str,
    statistic: Statistic = STEP_STATISTIC,
) -> MachineProfile:
    """The profile ``runs`` make, on top of ``base`` (the standalone calibration of the same processes), for
    ``cfg``'s blocks (see the module docstring); ``statistic``: how a figure's per-step means make its price.

    Raises:
        ConfigError: no run timed any block, or a run timed a block of another model.
    """
    samples = samples_of(blocks, cfg, runs)
    if not any(s.forward for s in samples.values()):
        raise ConfigError("the in-run steps timed no block; run at least one recorded step of a built model")
    role = {sig: sig.split(":", 1)[0] for sig in samples}
    measured = {sig: _block_cost(sig, s, base.block(sig), statistic) for sig, s in samples.items() if s.forward}
    costs = {c.signature: c for c in (*measured.values(), *_unseen(base, measured, role))}
    rates, overall = fit_rates([(cfg, list(blocks))], costs)
    return dataclasses.replace(
        base,
        name=base.name.replace("calibrated:", "in-run:", 1),
        source=source,
        flops_per_second=overall,
        rates=rates,
        blocks=tuple(costs.values()),
        links=_in_run_links(base, runs),
        overhead=_overhead(runs, base.overhead),
        tied_allreduce=_tied(base, cfg, blocks, runs),
        method="in-run",
    )
