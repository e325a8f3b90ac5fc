"""The in-run profile (``nanotron_ext.machine.in_run``): exact hand cases of what a run's clock records becoming the
prices the planner reads. The clock itself, inside Nanotron's engine: ``tests/runtime/test_op_clock.py``."""

from __future__ import annotations

import dataclasses

import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs import trainable_before
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import (
    BlockCost,
    Collective,
    EngineOverhead,
    Link,
    MachineProfile,
    block_signature,
    key_for,
)
from nanotron_ext.machine.in_run import (
    STEP_STATISTIC,
    InRunSplit,
    in_run_profile,
    mean_of_samples,
    median_of_steps,
    position_spread,
    samples_of,
    step_price,
)
from nanotron_ext.machine.in_run_records import BlockOps, RankStep, Receive, Send
from nanotron_ext.machine.pricing import tied_weight_bytes

SEED = load_config(bundled_config())  # embedding, decoder.0, decoder.1, final_norm, lm_head, cast, loss; pp=2
BLOCKS = inventory_from_config(SEED)
SIG = {b.name: block_signature(b, input_grad=g) for b, g in zip(BLOCKS, trainable_before(BLOCKS))}
SPLIT = (0, 0, 0, 1, 1, 1, 1)  # E, t, t | N, H, C, X


def _base(**fields) -> MachineProfile:
    """A standalone profile: every block 1 ms forward, 2 ms backward (0.5 ms of it W where deferred), 0.1 ms update."""
    costs = tuple(
        BlockCost(sig, 1e-3, 2e-3, 1e-4, backward_weight=5e-4 if sig.startswith(("decoder", "lm_head")) else None)
        for sig in dict.fromkeys(SIG.values())
    )
    return MachineProfile(
        **{"name": "calibrated: cpu, gloo, pp=2", "source": "test", "key": key_for(SEED), "blocks": costs, **fields}
    )


def _ops(name: str, fwd: tuple, bwd: tuple = (), w: tuple = ()) -> BlockOps:
    return BlockOps(name, tuple(fwd), tuple(bwd), tuple(w))


def _step(pp_rank: int, blocks: list[BlockOps], **fields) -> RankStep:
    return RankStep(pp_rank=pp_rank, engine=fields.pop("engine", "1f1b"), blocks=tuple(blocks), **fields)


def _run(steps: list[tuple[RankStep, ...]], split: tuple[int, ...] = SPLIT) -> InRunSplit:
    return InRunSplit(split, tuple(steps))


def _two_ranks(**rank0_fields) -> tuple[RankStep, RankStep]:
    rank0 = _step(
        0,
        [
            _ops("model.token_position_embeddings", (1.0, 3.0), (2.0, 2.0)),
            _ops("model.decoder.0", (4.0, 4.0), (8.0, 6.0)),
            _ops("model.decoder.1", (6.0, 6.0), (10.0, 12.0)),
        ],
        **rank0_fields,
    )
    rank1 = _step(
        1,
        [
            _ops("model.final_layer_norm", (0.5, 0.5), (1.0, 1.0)),
            _ops("model.lm_head", (7.0, 9.0), (16.0, 16.0)),
            _ops("model.cast_to_fp32", (0.0, 0.0), (0.0, 0.0)),
            _ops("loss", (2.0, 2.0), (1.0, 1.0)),
        ],
        update=3.0,
    )
    return rank0, rank1


def test_each_signature_is_its_mean_over_steps_micro_batches_and_blocks_sharing_it() -> None:
    profile = in_run_profile(SEED, BLOCKS, [_run([_two_ranks(update=6.0)])], _base(), source="test")
    decoder = profile.block(SIG["model.decoder.0"])
    # decoder.0 and decoder.1 share one signature: forward over 4, 4, 6, 6; backward over 8, 6, 10, 12
    assert (decoder.forward, decoder.backward) == (5.0, 9.0)
    embedding = profile.block(SIG["model.token_position_embeddings"])
    assert (embedding.forward, embedding.backward) == (2.0, 2.0)
    assert profile.method == "in-run" and profile.name == "in-run: cpu, gloo, pp=2"


def test_a_one_f_one_b_run_splits_its_backward_as_the_standalone_calibration_did() -> None:
    profile = in_run_profile(SEED, BLOCKS, [_run([_two_ranks()])], _base(), source="test")
    # standalone: W is 0.5 of 2 ms; in-run the decoder's whole backward is 9: W = 9 · 0.25
    assert profile.block(SIG["model.decoder.0"]).backward_weight == pytest.approx(2.25)
    assert profile.block(SIG["model.token_position_embeddings"]).backward_weight is None  # the embedding defers none


def test_a_zero_bubble_run_prices_b_plus_w_and_its_measured_w() -> None:
    rank0 = _step(
        0,
        [
            _ops("model.token_position_embeddings", (1.0,), (2.0,)),
            _ops("model.decoder.0", (4.0,), (5.0,), (3.0,)),
            _ops("model.decoder.1", (4.0,), (7.0,), (5.0,)),
        ],
        engine="zb1p",
    )
    rank1 = _step(
        1,
        [
            _ops("model.final_layer_norm", (1.0,), (1.0,)),
            _ops("model.lm_head", (8.0,), (6.0,), (10.0,)),
            _ops("model.cast_to_fp32", (0.0,), (0.0,)),
            _ops("loss", (2.0,), (1.0,)),
        ],
        engine="zb1p",
    )
    profile = in_run_profile(SEED, BLOCKS, [_run([(rank0, rank1)])], _base(), source="test")
    decoder = profile.block(SIG["model.decoder.0"])
    assert (decoder.backward, decoder.backward_weight) == (10.0, 4.0)  # B 5, 7 and W 3, 5
    lm_head = profile.block(SIG["model.lm_head"])
    assert (lm_head.backward, lm_head.backward_weight) == (16.0, 10.0)


def test_a_ranks_update_is_shared_by_trainable_parameters() -> None:
    profile = in_run_profile(SEED, BLOCKS, [_run([_two_ranks(update=6.0)])], _base(), source="test")
    embedding, layer = BLOCKS[0], BLOCKS[1]
    total = embedding.trainable + 2 * layer.trainable
    assert profile.block(SIG[embedding.name]).update == pytest.approx(6.0 * embedding.trainable / total)
    assert profile.block(SIG[layer.name]).update == pytest.approx(6.0 * layer.trainable / total)
    norm, head = BLOCKS[3], BLOCKS[4]
    assert profile.block(SIG[head.name]).update == pytest.approx(
        3.0 * head.trainable / (norm.trainable + head.trainable)
    )
    assert profile.block(SIG["loss"]).update == 0.0  # nothing to step


def test_a_tied_lm_head_beside_its_embedding_holds_no_share_of_the_update() -> None:
    cfg = SEED.with_overrides(pp=1)
    tied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_word_embeddings=True))
    blocks = inventory_from_config(tied)
    sig = {b.name: block_signature(b, input_grad=g) for b, g in zip(blocks, trainable_before(blocks))}
    rank0, rank1 = _two_ranks(update=4.0)
    one = _step(0, [*rank0.blocks, *rank1.blocks], update=4.0)
    profile = in_run_profile(tied, blocks, [_run([(one,)], split=(0,) * 7)], _base(key=key_for(tied)), source="t")
    assert profile.block(sig["model.lm_head"]).update == 0.0
    # the embedding's share counts the one tensor once: the decoders and the norm take the rest by their weights
    counted = blocks[0].trainable + 2 * blocks[1].trainable + blocks[3].trainable
    assert profile.block(sig["model.token_position_embeddings"]).update == pytest.approx(
        4.0 * blocks[0].trainable / counted
    )


def test_a_block_no_run_timed_is_its_standalone_figure_times_its_roles_in_run_ratio() -> None:
    rank0, rank1 = _two_ranks()
    without_head = dataclasses.replace(rank1, blocks=tuple(b for b in rank1.blocks if b.block != "model.lm_head"))
    profile = in_run_profile(SEED, BLOCKS, [_run([(rank0, without_head)])], _base(), source="test")
    head = profile.block(SIG["model.lm_head"])
    # no lm_head ran: the ratio of every block that ran (in-run ÷ standalone sums over the signatures both have)
    forward = (2.0 + 5.0 + 0.5 + 0.0 + 2.0) / (5 * 1e-3)
    backward = (2.0 + 9.0 + 1.0 + 0.0 + 1.0) / (5 * 2e-3)
    assert head.forward == pytest.approx(1e-3 * forward)
    assert head.backward == pytest.approx(2e-3 * backward)
    assert head.backward_weight == pytest.approx(5e-4 * backward)


def test_the_engines_overhead_is_its_ops_own_time_per_block_they_ran() -> None:
    rank0, rank1 = _two_ranks(calls=((0.3, 3), (0.5, 2)))
    profile = in_run_profile(
        SEED,
        BLOCKS,
        [_run([(rank0, dataclasses.replace(rank1, calls=((0.2, 5),)))])],
        _base(overhead=EngineOverhead(1e-6, 2e-6, 3e-6)),
        source="test",
    )
    assert profile.overhead == EngineOverhead(pytest.approx(1.0 / 10), 2e-6, 3e-6)


def test_a_link_takes_the_latency_of_its_whole_transfers_in_the_run() -> None:
    link = Link(0, 1, 1e-4, 1e9)
    base = _base(links=(link, Link(1, 0, 1e-4, 1e9)), overhead=EngineOverhead(0.0, 1e-5, 1e-5))
    n_bytes = 4_000_000
    whole = 3e-3 + n_bytes / link.bytes_per_second + 2e-5  # a transfer whose latency in the run is 3 ms
    rank0, rank1 = _two_ranks()
    sender = dataclasses.replace(rank0, sends=(Send(0, 1, n_bytes, 1, posted=10.0), Send(0, 1, n_bytes, 1, 20.0)))
    # the first receive was waiting before its send was posted: a whole transfer; the second came late: left out
    receiver = dataclasses.replace(
        rank1,
        receives=(
            Receive(0, 1, n_bytes, 1, started=9.0, ended=10.0 + whole),
            Receive(0, 1, n_bytes, 1, started=21.0, ended=21.001),
        ),
    )
    profile = in_run_profile(SEED, BLOCKS, [_run([(sender, receiver)])], base, source="test")
    forward, backward = profile.links
    assert (forward.latency, forward.bytes_per_second) == (pytest.approx(3e-3), 1e9)  # the bandwidth as calibrated
    assert profile.p2p_time(n_bytes, 1, cut=0) == pytest.approx(whole)
    assert backward == base.links[1]  # nothing crossed back whole: as calibrated


def test_the_tied_all_reduce_is_the_later_ends_time_inside_it() -> None:
    tied = dataclasses.replace(SEED, model=dataclasses.replace(SEED.model, tie_word_embeddings=True))
    blocks = inventory_from_config(tied)
    base = _base(key=key_for(tied), tied_allreduce=Collective(1e-4, 1e9))
    rank0, rank1 = _two_ranks()
    steps = [
        (dataclasses.replace(rank0, tied_sync=(1.0, 1.5)), dataclasses.replace(rank1, tied_sync=(1.2, 1.5))),
        (dataclasses.replace(rank0, tied_sync=(2.0, 2.7)), dataclasses.replace(rank1, tied_sync=(2.1, 2.7))),
    ]
    profile = in_run_profile(tied, blocks, [_run(steps)], base, source="test")
    # later ends: rank 1 in both steps, 0.3 s and 0.6 s inside: the median, 0.45 s, for the tied gradient's bytes
    assert profile.tied_allreduce.time(tied_weight_bytes(tied), 2) == pytest.approx(0.45)


def test_position_spread_compares_one_blocks_stages() -> None:
    first = _run([_two_ranks()])
    later = _run([_two_ranks()], split=(0, 0, 1, 1, 1, 1, 1))  # decoder.1 on the last stage in the second run
    samples = samples_of(BLOCKS, SEED, [first, later])
    spread = position_spread(samples)
    # the decoder signature: first stage 4, 4, 6, 6, 4, 4 forwards + backwards 8, 6, 10, 12, 8, 6; last: 6+10, 6+12
    first_mean = (12 + 10 + 16 + 18 + 12 + 10) / 6
    assert spread[SIG["model.decoder.0"]] == pytest.approx(17 / first_mean - 1)
    assert SIG["loss"] not in spread  # only ever on the last stage


def test_a_run_of_another_model_or_of_nothing_is_refused() -> None:
    alien = _step(0, [_ops("model.decoder.9", (1.0,))])
    with pytest.raises(ConfigError, match=r"timed block 'model.decoder.9', which this config's model does not have"):
        in_run_profile(SEED, BLOCKS, [_run([(alien,)])], _base(), source="test")
    with pytest.raises(ConfigError, match=r"the in-run steps timed no block"):
        in_run_profile(SEED, BLOCKS, [_run([])], _base(), source="test")


def test_kendall_tau_counts_concordant_and_discordant_pairs() -> None:
    from nanotron_ext.stats import kendall_tau

    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx((5 - 1) / 6)


def test_each_signature_keeps_its_means_by_stage_position() -> None:
    first = _run([_two_ranks()])
    later = _run([_two_ranks()], split=(0, 0, 1, 1, 1, 1, 1))  # decoder.1 on the last stage in the second run
    profile = in_run_profile(SEED, BLOCKS, [first, later], _base(), source="test", statistic=mean_of_samples)
    decoder = profile.block(SIG["model.decoder.0"])
    # first stage: decoder.0 twice (4, 4 | 8, 6) and decoder.1 in the first run (6, 6 | 10, 12); last: decoder.1
    assert [p.position for p in decoder.positions] == ["first", "last"]
    assert decoder.at("first")[:2] == (pytest.approx(28 / 6), pytest.approx(50 / 6))
    assert decoder.at("last")[:2] == (6.0, 11.0)
    assert decoder.at("middle") == (decoder.forward, decoder.backward, decoder.backward_weight)  # not run there: mean
    # a 1F1B run: each position's W is its backward split as the standalone calibration split it (a quarter)
    assert decoder.at("last")[2] == pytest.approx(11.0 / 4)


def test_a_profile_by_position_prices_each_stage_at_its_position(tmp_path) -> None:
    from nanotron_ext.machine import PositionCost, load_machine
    from nanotron_ext.plan import plan_with_ranks
    from nanotron_ext.simulate import plan_stage_times

    sig = SIG["model.decoder.0"]
    costs = tuple(
        c
        if c.signature != sig
        else dataclasses.replace(
            c, positions=(PositionCost("first", 4e-3, 6e-3, 1e-3), PositionCost("last", 1e-3, 1e-3, None))
        )
        for c in _base().blocks
    )
    machine = _base(blocks=costs)
    machine.save(tmp_path / "m.json")
    assert load_machine(tmp_path / "m.json") == machine  # positions survive the JSON round trip
    split = plan_with_ranks(BLOCKS, SEED, (0, 0, 1, 1, 1, 1, 1), "layout", suggest_fixes=False)
    stages = plan_stage_times(split, BLOCKS, SEED, machine=machine).stages
    # stage 0: the embedding (1 ms) and decoder.0 at the first stage's 4 ms; stage 1: decoder.1 at the last's 1 ms
    assert stages[0].forward == pytest.approx(1e-3 + 4e-3)
    assert stages[1].forward == pytest.approx(1e-3 + 4 * 1e-3)  # decoder.1, norm, lm_head, cast, loss
    assert stages[0].backward == pytest.approx(2e-3 + 6e-3)


def test_a_bad_position_figure_is_refused_naming_it() -> None:
    from nanotron_ext.machine import PositionCost

    sig = SIG["model.decoder.0"]
    for bad, why in (
        (PositionCost("top", 1.0, 1.0), "a position is one of first, middle, last"),
        (PositionCost("first", 1.0, 1.0, 2.0), r"backward_weight=2.0 exceeds its backward=1.0"),
        (PositionCost("last", -1.0, 1.0), r"forward=-1.0 must be a finite number >= 0"),
    ):
        costs = tuple(dataclasses.replace(c, positions=(bad,)) if c.signature == sig else c for c in _base().blocks)
        with pytest.raises(ConfigError, match=why):
            _base(blocks=costs)


def test_a_figure_is_the_median_over_steps_of_each_steps_mean_so_one_slow_step_moves_it_no_more_than_another() -> None:
    """Steps 1-3 of one figure: 10 and 12 (mean 11), 11, then a slow step 30 and 31 (mean 30.5). The median of the
    steps' means is 11; the mean of every sample, 18.8, prices the slow step into every step."""
    values, steps = [10.0, 12.0, 11.0, 30.0, 31.0], [1, 1, 2, 3, 3]
    assert STEP_STATISTIC is median_of_steps
    assert step_price(values, steps) == 11.0
    assert step_price(values, steps, mean_of_samples) == pytest.approx(94 / 5)
    assert step_price([], []) == 0.0


def test_the_profile_prices_each_block_by_the_median_of_its_steps() -> None:
    """Three steps of the seed model's two ranks, the last one twice as slow: the profile keeps the typical step's
    prices (a mean would land between)."""
    quick, slow = _two_ranks(), _two_ranks()
    slow = tuple(
        dataclasses.replace(
            r, blocks=tuple(dataclasses.replace(b, forward=tuple(2 * x for x in b.forward)) for b in r.blocks)
        )
        for r in slow
    )
    profile = in_run_profile(SEED, BLOCKS, [_run([quick, quick, slow])], _base(), source="test")
    typical = in_run_profile(SEED, BLOCKS, [_run([quick])], _base(), source="test")
    for name in ("model.decoder.0", "model.lm_head"):
        assert profile.block(SIG[name]).forward == typical.block(SIG[name]).forward > 0


def test_a_backward_the_standalone_profile_deferred_whole_stays_whole_in_run_not_one_rounding_over() -> None:
    """Standalone, the lm_head's W was its whole backward: in-run it is the whole in-run backward, where
    ``backward × W ÷ B`` rounds one ulp above it for these figures (CI's run refused its own profile)."""
    whole = 0.0033302507526366703
    base = _base()
    head = dataclasses.replace(base.block(SIG["model.lm_head"]), backward=whole, backward_weight=whole)
    base = dataclasses.replace(base, blocks=tuple(head if b.signature == head.signature else b for b in base.blocks))
    rank0, rank1 = _two_ranks()
    x = 0.004785144227477606
    assert x * whole / whole > x  # the rounding the rule must not let through
    ops = [o if o.block != "model.lm_head" else _ops("model.lm_head", (7.0, 9.0), (x, x)) for o in rank1.blocks]
    rank1 = dataclasses.replace(rank1, blocks=tuple(ops))
    lm_head = in_run_profile(SEED, BLOCKS, [_run([(rank0, rank1)])], base, source="test").block(SIG["model.lm_head"])
    assert lm_head.backward_weight == lm_head.backward == x
