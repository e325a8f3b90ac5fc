"""The machine model: the profile as data (JSON, key, errors) and the one pricing that planning and simulation share."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import block_memory, trainable_before
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import (
    ANALYTIC_GPU,
    BlockCost,
    Collective,
    EngineOverhead,
    Link,
    MachineProfile,
    block_signature,
    key_for,
    load_machine,
    machine_for,
    price_blocks,
)
from nanotron_ext.partition import ranks_from_bounds
from nanotron_ext.plan import Plan, make_plan
from nanotron_ext.simulate import simulate_plan
from nanotron_ext.strategies.step_time import schedule_problem

SEED = load_config(bundled_config())  # embedding, decoder.0, decoder.1, final_norm, lm_head, cast, loss; pp=2
BLOCKS = inventory_from_config(SEED)
#: Measured seconds (forward, backward, update) that invert the FLOP model: the decoder layers are slow here and
#: the lm_head cheap, so the best split puts one layer on each stage, where FLOPs put both on stage 0.
SLOW_LAYERS = {
    "embedding": (1e-4, 1e-4, 1e-5),
    "decoder": (10e-3, 20e-3, 1e-3),
    "final_norm": (1e-4, 2e-4, 0.0),
    "lm_head": (1e-3, 2e-3, 1e-3),
    "cast": (1e-4, 1e-4, 0.0),
    "loss": (2e-4, 2e-4, 0.0),
}


def _measured(times: dict[str, tuple[float, float, float]] = SLOW_LAYERS, **fields) -> MachineProfile:
    costs = {
        block_signature(b, input_grad=g): BlockCost(block_signature(b, input_grad=g), *times[b.role])
        for b, g in zip(BLOCKS, trainable_before(BLOCKS))
    }
    base = dict(
        name="hand-measured",
        source="test",
        key=key_for(SEED),
        blocks=tuple(costs.values()),
        links=(Link(0, 1, 1e-4, 1e9), Link(1, 0, 2e-4, 1e9)),
    )
    return MachineProfile(**{**base, **fields})


def _saved(tmp_path: Path, machine: MachineProfile) -> str:
    path = tmp_path / "machine.json"
    machine.save(path)
    return str(path)


def _all_splits(n: int, pp: int) -> list[tuple[int, ...]]:
    return [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]


def test_a_profile_survives_a_json_round_trip_with_every_field(tmp_path):
    full = _measured(
        overhead=EngineOverhead(1e-5, 2e-5, 3e-5),
        dp_allreduce=Collective(1e-5, 1e9),
        tied_allreduce=Collective(2e-5, 2e9),
        rates=(("decoder", 1e9),),
        notes=("n",),
        device_memory_bytes=85e9,
    )
    assert load_machine(_saved(tmp_path, full)) == full
    assert MachineProfile.from_json(ANALYTIC_GPU.to_json()) == ANALYTIC_GPU


def test_another_key_is_refused_naming_what_differs(tmp_path):
    path = _saved(tmp_path, _measured())
    wider = load_config(bundled_config()).with_overrides(machine=path, pp=1)
    with pytest.raises(ConfigError, match=r"measured for another setup \(pp: 2 vs 1; profile vs config\).*calibrate"):
        machine_for(wider)
    other = dataclasses.replace(SEED, model=dataclasses.replace(SEED.model, hidden_size=32)).with_overrides(
        machine=path
    )
    with pytest.raises(ConfigError, match=r"model.hidden_size: 16 vs 32"):
        make_plan(inventory_from_config(other), other)
    # Another layer count is the same key: a decoder layer's time does not depend on how many there are.
    deeper = dataclasses.replace(SEED, model=dataclasses.replace(SEED.model, num_hidden_layers=4))
    assert machine_for(deeper.with_overrides(machine=path)).name == "hand-measured"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "is not JSON"),
        ('{"version": 99}', "format version 99, this nanotron_ext reads 1"),
        ('{"version": 1, "name": "x"}', "is malformed .*KeyError"),
    ],
)
def test_bad_profile_files_say_what_is_wrong_and_how_to_remake_them(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_machine(path)
    with pytest.raises(ConfigError, match="cannot be read .*nanotron-ext calibrate"):
        load_machine(tmp_path / "missing.json")


def test_measured_blocks_links_syncs_and_overheads_are_priced_by_hand():
    machine = _measured(
        overhead=EngineOverhead(block_call=1e-6, send=3e-6, recv=5e-6), dp_allreduce=Collective(1e-3, 1e9)
    )
    cfg = dataclasses.replace(SEED, run=dataclasses.replace(SEED.run, dp=4))
    prices = price_blocks(machine, BLOCKS, cfg)
    # decoder.0: measured times plus one PipelineBlock call each way; its update pays the dp all-reduce of its
    # fp32 gradients over 4 ranks: 1 ms + 2·3/4 × bytes / 1 GB/s.
    layer = BLOCKS[1]
    assert (prices.forward[1], prices.backward[1]) == (10e-3 + 1e-6, 20e-3 + 1e-6)
    assert prices.update[1] == pytest.approx(1e-3 + 1e-3 + 1.5 * layer.trainable * 4 / 1e9)
    # embedding: nothing trains before it, but it trains itself, so autograd reaches it.
    assert prices.backward[0] == 1e-4 + 1e-6
    # A send: the slowest link (200 µs latency) for what the block hands on, plus posting it and receiving it;
    # a decoder layer hands on two tensors (hidden states, sequence mask), each paying latency and posting.
    out = block_memory(BLOCKS[4], SEED.model, SEED.run).output
    assert prices.send[0][4] == pytest.approx(2e-4 + out / 1e9 + 3e-6 + 5e-6)
    out = block_memory(BLOCKS[1], SEED.model, SEED.run).output
    assert prices.send[0][1] == pytest.approx(2 * (2e-4 + 3e-6 + 5e-6) + out / 1e9)


def test_a_send_takes_the_link_of_its_own_cut():
    # pp=3 with a slow second link: a block's send across cut 1 pays that link, across cut 0 the first one (each
    # cut the slower of its two directions); a link naming no stage stands in for a cut that has none.
    links = (Link(0, 1, 1e-4, 1e9), Link(1, 0, 2e-4, 1e9), Link(1, 2, 1e-3, 1e8), Link(2, 1, 1e-3, 1e8))
    cfg = dataclasses.replace(SEED, run=dataclasses.replace(SEED.run, pp=3))
    prices = price_blocks(_measured(links=links), BLOCKS, cfg)
    out = block_memory(BLOCKS[4], SEED.model, SEED.run).output
    assert len(prices.send) == 2
    assert prices.send[0][4] == pytest.approx(2e-4 + out / 1e9)
    assert prices.send[1][4] == pytest.approx(1e-3 + out / 1e8)
    spare = _measured(links=(Link(0, 1, 1e-4, 1e9), Link(-1, -1, 5e-4, 2e9)))
    assert spare.p2p_time(out, cut=0) == pytest.approx(1e-4 + out / 1e9)
    assert spare.p2p_time(out, cut=1) == pytest.approx(5e-4 + out / 2e9)


@pytest.mark.parametrize(
    "dtype, fp32_acc, zero, dp, per_param",
    [
        ("float32", False, 0, 1, 28.0),  # fused AdamW: weight, gradient, 2 moments read; weight, 2 moments written
        ("bfloat16", True, 0, 1, 34.0),  # ... on the fp32 masters, then the master copied into the bf16 weight
        ("bfloat16", False, 0, 1, 14.0),  # ... on the bf16 weights themselves
        ("bfloat16", True, 1, 4, 8.5),  # ZeRO-1: each of 4 dp ranks steps a quarter
    ],
)
def test_the_analytic_machine_prices_the_optimizer_step_by_the_bytes_it_moves(dtype, fp32_acc, zero, dp, per_param):
    run = dataclasses.replace(SEED.run, dtype=dtype, accumulate_grad_in_fp32=fp32_acc, zero_stage=zero, dp=dp)
    cfg = dataclasses.replace(SEED, run=run)
    blocks = inventory_from_config(cfg)
    machine = dataclasses.replace(ANALYTIC_GPU, dp_allreduce=None)  # the step alone
    prices = price_blocks(machine, blocks, cfg)
    assert ANALYTIC_GPU.memory_bytes_per_second == 3.0e12
    assert prices.update[1] == pytest.approx(blocks[1].trainable * per_param / 3.0e12, rel=1e-12)
    assert prices.update[1] > 0 and prices.update[5] == 0.0  # a decoder layer steps; cast holds nothing


def test_a_tied_weight_is_stepped_once_where_one_stage_holds_both_ends_and_on_each_rank_otherwise():
    tied = dataclasses.replace(SEED, model=dataclasses.replace(SEED.model, tie_word_embeddings=True))
    blocks = inventory_from_config(tied)  # embedding, decoder.0, decoder.1, final_norm, lm_head, cast, loss
    machine = MachineProfile(name="hbm", source="test", memory_bytes_per_second=1e12)
    prices = price_blocks(machine, blocks, tied)
    step = [b.trainable * 28 / 1e12 for b in blocks]
    assert prices.update == pytest.approx(step) and prices.update[4] > 0
    apart = schedule_problem(blocks, tied, machine).stage_times((0, 4, 7))[2]
    assert apart == pytest.approx([sum(step[:4]), sum(step[4:])])
    together = schedule_problem(blocks, tied, machine).stage_times((0, 5, 7))[2]  # Nanotron's rule's shape
    assert together == pytest.approx([sum(step[:4]), 0.0])
    alone = dataclasses.replace(tied, run=dataclasses.replace(tied.run, pp=1))
    assert schedule_problem(blocks, alone, machine).stage_times((0, 7))[2] == pytest.approx([sum(step[:4])])


def test_both_ends_of_a_tied_embedding_wait_in_its_all_reduce_unless_one_stage_holds_both():
    tied = dataclasses.replace(SEED, model=dataclasses.replace(SEED.model, tie_word_embeddings=True))
    blocks = inventory_from_config(tied)
    machine = MachineProfile(name="tied", source="test", tied_allreduce=Collective(1e-3, 1e9))
    prices = price_blocks(machine, blocks, tied)
    table = 50277 * 16 * 4  # vocab × hidden fp32 bytes, over 2 ranks: 1 ms + 2·1/2 × bytes / 1 GB/s
    assert [prices.update[i] for i in (0, 4)] == pytest.approx([1e-3 + table / 1e9] * 2)
    assert prices.update[1] == prices.update[5] == 0.0
    problem = schedule_problem(blocks, tied, machine)
    assert problem.stage_times((0, 4, 7))[2] == pytest.approx([1e-3 + table / 1e9] * 2)
    assert problem.stage_times((0, 5, 7))[2] == [0.0, 0.0]  # one stage holds the tensor: nothing to sync
    alone = dataclasses.replace(tied, run=dataclasses.replace(tied.run, pp=1))
    assert schedule_problem(blocks, alone, machine).stage_times((0, 7))[2] == [0.0]  # one stage: no all-reduce


def test_an_unmeasured_block_is_priced_by_its_roles_rate():
    machine = _measured(rates=(("decoder", 1e9),), blocks=())
    prices = price_blocks(machine, BLOCKS, SEED)
    layer = BLOCKS[1]
    assert prices.forward[1] == pytest.approx(layer.flops_fwd / 1e9)
    assert prices.forward[4] == pytest.approx(BLOCKS[4].flops_fwd / machine.flops_per_second)


def test_the_planner_and_the_simulator_price_through_the_one_machine(tmp_path):
    # A profile that inverts the FLOP model. If the planner bypassed it, it would pick the FLOP split (both layers
    # on stage 0); if `simulate` bypassed it, its stage times would not be the profile's sums.
    cfg = SEED.with_overrides(machine=_saved(tmp_path, _measured()))
    plan = make_plan(BLOCKS, cfg)
    flop_only = SEED.with_overrides(machine=str(Path(__file__).parent / "data" / "machine_flops_only.json"))
    assert make_plan(BLOCKS, flop_only).block_ranks == (0, 0, 0, 0, 1, 1, 1)
    assert plan.block_ranks == (0, 0, 1, 1, 1, 1, 1)
    result = simulate_plan(plan, BLOCKS, cfg)
    assert [s.forward for s in result.stages] == pytest.approx([1e-4 + 10e-3, 10e-3 + 1e-4 + 1e-3 + 1e-4 + 2e-4])
    # ... and the planner's split is the simulator's fastest of every split.
    steps = {
        b: simulate_plan(Plan(**{**plan.__dict__, "block_ranks": tuple(ranks_from_bounds(b))}), BLOCKS, cfg).step_time
        for b in _all_splits(len(BLOCKS), 2)
    }
    assert result.step_time == pytest.approx(min(steps.values()), rel=1e-12)


def test_simulate_compare_never_ranks_the_default_behind_a_valid_strategy(tmp_path, capsys):
    path = _saved(tmp_path, _measured())
    argv = [
        "simulate",
        "--compare",
        "--json",
        "--machine",
        path,
        "--out",
        str(tmp_path / "a.png"),
        "--loads-out",
        str(tmp_path / "b.png"),
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["machine"].startswith("hand-measured: 6 measured blocks, p2p 1 GB/s + 200 µs")
    valid = {e["strategy"]: e["step_time"] for e in data["compare"] if e.get("ok")}
    assert valid["constrained"] <= min(valid.values()) * (1 + 1e-12)
    assert valid["flops"] > valid["constrained"] * 1.05  # the FLOP split really is slower on this machine


def test_overrides_are_named_and_flops_drops_measured_blocks(tmp_path):
    path = _saved(tmp_path, _measured())
    flops = machine_for(SEED.with_overrides(machine=path, tflops=2.0))
    assert not flops.blocks and flops.flops_per_second == 2e12 and flops.links == _measured().links
    fast = machine_for(SEED.with_overrides(machine=path, p2p_gbps=100.0))
    assert fast.links == (Link(-1, -1, 2e-4, 100e9),) and fast.blocks == _measured().blocks
    assert fast.describe() == "hand-measured: 6 measured blocks, p2p 100 GB/s + 200 µs [p2p overridden: 100 GB/s]"
    assert machine_for(SEED).describe() == (
        "H100 SXM (analytic): bf16 at 400 TFLOP/s, optimizer step at 3 TB/s, p2p 50 GB/s + 10 µs, 79.18 GiB per GPU"
    )
    with pytest.raises(ConfigError, match="times=profiled measures block times; tflops would replace them"):
        SEED.with_overrides(times="profiled", tflops=1.0)
    with pytest.raises(ConfigError, match="nanotron_ext.tflops=-1.0 must be a positive number of TFLOP/s"):
        SEED.with_overrides(tflops=-1.0)
    with pytest.raises(ConfigError, match="nanotron_ext.times='fast' is not one of machine, flops, profiled"):
        SEED.with_overrides(times="fast")


def test_the_plan_header_names_the_machine(tmp_path, capsys):
    assert main(["plan", "--compare"]) == 0
    assert "simulated step time on H100 SXM (analytic): bf16 at 400 TFLOP/s, optimizer step at 3 TB/s, p2p 50 GB/s" in (
        capsys.readouterr().out
    )
    assert main(["plan", "--machine", _saved(tmp_path, _measured())]) == 0
    assert "hand-measured: 6 measured blocks, p2p 1 GB/s + 200 µs" in capsys.readouterr().out


def test_a_recomputed_layer_pays_its_forward_again_in_its_backward():
    machine = _measured()
    plain = price_blocks(machine, BLOCKS, SEED)
    again = dataclasses.replace(SEED, run=dataclasses.replace(SEED.run, recompute_layer=True))
    recomputed = price_blocks(machine, BLOCKS, again)
    call = machine.overhead.block_call
    for i, b in enumerate(BLOCKS):
        extra = plain.forward[i] - call if b.role == "decoder" else 0.0  # the forward, without its call overhead
        assert recomputed.backward[i] == pytest.approx(plain.backward[i] + extra), b.role
        assert recomputed.weight[i] == plain.weight[i]  # zb1p's W is the same weight-gradient work


def test_the_dp_all_reduce_of_a_partly_frozen_block_reduces_only_its_trainable_gradients():
    """DDP reduces the gradients that exist: a block with a third of its weights training all-reduces that third."""
    sync = Collective(1e-3, 1e9)
    machine = _measured(dp_allreduce=sync)
    layer = BLOCKS[1]
    part = dataclasses.replace(layer, trainable=layer.params // 3)
    blocks = [*BLOCKS[:1], part, *BLOCKS[2:]]
    alone, four = (
        price_blocks(machine, blocks, dataclasses.replace(SEED, run=dataclasses.replace(SEED.run, dp=dp)))
        for dp in (1, 4)
    )
    assert four.update[1] - alone.update[1] == pytest.approx(sync.time(part.trainable * 4, 4))  # fp32 gradients
    assert four.update[1] - alone.update[1] < sync.time(layer.params * 4, 4)


def test_no_backward_call_is_priced_for_a_block_autograd_never_reaches():
    """A frozen embedding with nothing trainable before it: no gradient reaches it, so its backward is no call at
    all, not even the PipelineBlock's overhead; the first decoder layer after it runs its backward (its weights
    train) and pays the call."""
    cfg = SEED.with_overrides(freeze={"modules": ["embedding"]})
    blocks = inventory_from_config(cfg)
    assert blocks[0].trainable == 0 and not trainable_before(blocks)[0]
    prices = price_blocks(_measured(overhead=EngineOverhead(block_call=1e-6)), blocks, cfg)
    assert prices.backward[0] == 0.0
    assert prices.backward[1] > 1e-6


def test_a_links_one_way_latency_is_half_its_fitted_round_trip():
    """calibrate times a message of n bytes answered by one byte (a round trip) and fits c + n / B: the link's
    latency is one way, c / 2; its bandwidth the slope's (the answer's one byte costs nothing)."""
    from nanotron_ext.machine.calibrate_comm import _fit_comm, _World

    c, bandwidth = 400e-6, 2e9
    rtt = {n: c + n / bandwidth for n in (4096, 65536, 1 << 20, 1 << 24)}
    timings = {
        ("link", 0, 1): rtt,
        ("link", 1, 0): rtt,
        ("link spread", 0, 1): {0: 0.0},
        ("link spread", 1, 0): {0: 0.0},
    }
    comm = _fit_comm([(timings, 0.0)], _World(rank=0, pp=2, dp=1, tp=1), tied=False)
    assert [link.latency for link in comm.links] == pytest.approx([c / 2, c / 2])
    assert [link.bytes_per_second for link in comm.links] == pytest.approx([bandwidth, bandwidth])
