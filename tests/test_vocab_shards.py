"""``nanotron_ext.vocab_shards``: the key, the K shard blocks it makes, their prices, and ``auto``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from nanotron_ext.blocks import vocab_slices
from nanotron_ext.config import ExtConfig, bundled_config, config_from_dict, load_config
from nanotron_ext.costs import block_memory, static_bytes, training_flops
from nanotron_ext.errors import ConfigError, LayoutError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.plan import make_plan, resolve_vocab_shards
from nanotron_ext.report import compact_names

#: Compute only: these tests check the chain's planning logic; on the analytic H100 (p2p at 10 µs a hop) the tiny
#: seed model is latency-bound and one lm_head wins (tests/test_machine_pricing.py covers that).
FLOPS_ONLY = str(Path(__file__).parent / "data" / "machine_flops_only.json")


def _cfg(k, name: str = "tiny_llama_large_vocab.yaml", **run):
    cfg = load_config(bundled_config(name)).with_overrides(machine=FLOPS_ONLY)
    if run:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **run))
    return dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=k))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "four", None])
def test_bad_values_name_the_value_and_the_fix(bad) -> None:
    with pytest.raises(ConfigError, match=rf"vocab_shards={bad!r} is neither a positive integer nor 'auto'.*auto"):
        ExtConfig(vocab_shards=bad)


def test_more_shards_than_rows_and_tied_embeddings_are_refused() -> None:
    with pytest.raises(ConfigError, match="vocab_shards=50278 is more than the vocabulary size 50277"):
        _cfg(50278)
    raw = json.loads(json.dumps(load_config(bundled_config()).nanotron))
    raw["model"]["model_config"]["tie_word_embeddings"] = True
    raw["nanotron_ext"] = {"vocab_shards": 3}
    with pytest.raises(ConfigError, match="tie_word_embeddings: false to untie, or vocab_shards: 1"):
        config_from_dict(raw)
    raw["nanotron_ext"] = {"vocab_shards": "auto"}  # auto on a tied model just keeps one lm_head
    cfg, choice = resolve_vocab_shards(config_from_dict(raw))
    assert (cfg.vocab_shards, list(choice.step_times)) == (1, [1])


def test_unresolved_auto_is_an_error_not_a_guess() -> None:
    with pytest.raises(ConfigError, match="'auto' and was not resolved; call nanotron_ext.plan.resolve_vocab_shards"):
        inventory_from_config(_cfg("auto"))


def test_uneven_slices_cover_the_vocabulary_in_order() -> None:
    assert vocab_slices(11, 3) == [(0, 4), (4, 8), (8, 11)]
    assert vocab_slices(7, 7) == [(i, i + 1) for i in range(7)]
    with pytest.raises(ValueError, match="between 1 and the vocabulary size 5"):
        vocab_slices(5, 6)


def test_shards_replace_lm_head_cast_and_loss_with_the_same_weights_and_work() -> None:
    # 50277 = 4 x 12569 + 1: uneven, the first shard holds one row more.
    one, four = inventory_from_config(_cfg(1)), inventory_from_config(_cfg(4))
    assert [b.short for b in four][-5:] == ["final_norm", "vocab.0", "vocab.1", "vocab.2", "vocab.3"]
    assert {b.role for b in four[-4:]} == {"vocab_shard"}
    tail, shards = one[-3:], four[-4:]
    h = 16
    assert [b.params for b in shards] == [12570 * h] + [12569 * h] * 3
    assert sum(b.params for b in shards) == sum(b.params for b in tail)
    # Weights, gradients and optimizer state are priced per shard by the same function as the lm_head.
    run = _cfg(4).run
    assert sum(static_bytes(b, run) for b in shards) == pytest.approx(sum(static_bytes(b, run) for b in tail))
    # Training FLOPs of the chain equal lm_head + cast + loss; each shard's in proportion to its rows.
    flops4, flops1 = training_flops(four)[-4:], training_flops(one)[-3:]
    assert sum(flops4) == pytest.approx(sum(flops1))
    assert flops4[0] / flops4[1] == pytest.approx(12570 / 12569)
    # Each shard sends the hidden state plus 3 fp32 statistics per token (t = 2 sequences x 32 tokens, fp32
    # model): what the step-time objective and simulate price a cut after it with.
    t = 64
    assert block_memory(shards[1], _cfg(4).model, run).output == 4 * t * h + 12 * t


def test_plan_table_names_shards_compactly() -> None:
    assert compact_names(["final_norm", "vocab.0", "vocab.1", "vocab.2", "decoder.3"]) == (
        "final_norm, vocab.0-2, decoder.3"
    )
    plan = make_plan(inventory_from_config(_cfg(4, pp=2)), _cfg(4, pp=2))
    assert [s.label for s in plan.stages] == ["embedding, decoder.0-1, final_norm, vocab.0-1", "vocab.2-3"]


def test_auto_picks_the_k_with_the_smallest_simulated_step_and_plan_prints_it(capsys, tmp_path) -> None:
    cfg, choice = resolve_vocab_shards(_cfg("auto"))
    # The seed model at pp=2: one lm_head is ~99 % of the work, two shards halve the slowest stage; more
    # shards cannot do better on two stages, so the smallest of the tied best wins.
    best = min(choice.step_times.values())
    assert choice.step_times[1] > 1.4 * best
    assert cfg.vocab_shards == choice.shards == min(k for k, t in choice.step_times.items() if t <= best * 1.01)
    assert choice.shards == 2

    from nanotron_ext.cli import main

    path = tmp_path / "auto.yaml"
    raw = load_config(bundled_config()).nanotron
    raw["nanotron_ext"] = {"vocab_shards": "auto", "machine": FLOPS_ONLY}
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "vocab_shards: auto -> 2 (simulated step K=1:" in out
    assert "vocab.1" in out


@pytest.mark.nanotron02
def test_profiled_times_vocabulary_shards_and_auto_prices_with_them(tmp_path) -> None:
    from nanotron_ext.costs import profiled

    cfg = _cfg(4).with_overrides(profile_cache=str(tmp_path), cost_strategy="profiled")
    blocks = inventory_from_config(cfg)
    timings = profiled.profile_blocks(blocks, cfg, warmup=1, repeats=3)
    # Four shards of (almost) equal rows share one cache key or two; each is timed with a backward.
    assert all(t.forward > 0 and t.backward > 0 for t in timings[-4:])
    chosen, choice = resolve_vocab_shards(
        dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards="auto"))
    )
    # The candidates were planned with profiled: their step times are measured seconds (> 10 µs here), not the
    # FLOP-rate model's microseconds at 400 TFLOP/s.
    assert min(choice.step_times.values()) > 1e-5
    # Which K wins depends on this machine's timings; the rule does not: a larger K must be 1 % faster.
    best = 1
    for k, t in choice.step_times.items():
        best = k if t < choice.step_times[best] * 0.99 else best
    assert chosen.vocab_shards == choice.shards == best


def test_layout_places_vocabulary_shards_with_v() -> None:
    cfg = _cfg(4, pp=2).with_overrides(cost_strategy="layout", layout="E,t*2,N,V|V*3")
    plan = make_plan(inventory_from_config(cfg), cfg)
    assert list(plan.block_ranks) == [0, 0, 0, 0, 0, 1, 1, 1]
    bad = cfg.with_overrides(layout="E,t*2,L|V*3")
    with pytest.raises(LayoutError, match="block 4 of the model is .vocab_shard. but the layout says .lm_head."):
        make_plan(inventory_from_config(bad), bad)


def test_plan_json_says_how_many_shards() -> None:
    assert json.loads(make_plan(inventory_from_config(_cfg(3)), _cfg(3)).to_json())["vocab_shards"] == 3
    assert json.loads(make_plan(inventory_from_config(_cfg(1)), _cfg(1)).to_json())["vocab_shards"] == 1


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _head_and_last(k, **freeze):
    """The example that trains the lm_head and the last decoder layer (4 layers, pp=2), with ``vocab_shards=k``."""
    cfg = load_config(EXAMPLES / "last_layer_lm_head_pp2.yaml").with_overrides(machine=FLOPS_ONLY)
    spec = {**cfg.ext.freeze, **freeze}
    return dataclasses.replace(cfg, ext=dataclasses.replace(cfg.ext, vocab_shards=k, freeze=spec))


def _trainable(cfg) -> dict[str, bool]:
    """Short block name -> whether all of it trains (False: all frozen); a half-frozen block fails here."""
    out = {}
    for b in inventory_from_config(cfg):
        if b.params:
            assert b.trainable in (0, b.params), (b.short, b.trainable, b.params)
            out[b.short] = b.trainable == b.params
    return out


@pytest.mark.parametrize("k", ["auto", 2, 3])
def test_lm_head_in_a_freeze_spec_means_the_chains_shards(k) -> None:
    # `unfreeze: [lm_head]` with a chain: every shard trains, as the one lm_head would; `auto` plans its K > 1
    # candidates with the same spec instead of stopping at "matches no module".
    cfg, choice = resolve_vocab_shards(_head_and_last(k))
    assert cfg.vocab_shards >= 2 and (choice is None or set(choice.step_times) >= {1, 2})
    shards = [f"vocab.{i}" for i in range(cfg.vocab_shards)]
    frozen = ["embedding", "decoder.0", "decoder.1", "decoder.2", "final_norm"]
    assert _trainable(cfg) == {**dict.fromkeys(frozen, False), "decoder.3": True, **dict.fromkeys(shards, True)}
    plan = make_plan(inventory_from_config(cfg), cfg)
    assert all(stage.trainable > 0 for stage in plan.stages)


def test_shards_can_still_be_named_alone() -> None:
    # The role word vocab_shard and a shard's short name pick shards, not the whole chain.
    cfg = _head_and_last(3, unfreeze=["vocab.2"], unfreeze_last_decoder_layers=0)
    assert [s for s, t in _trainable(cfg).items() if t] == ["vocab.2"]
    cfg = _head_and_last(3, modules=["vocab_shard"], unfreeze=[], unfreeze_last_decoder_layers=0)
    assert [s for s, t in _trainable(cfg).items() if not t] == ["vocab.0", "vocab.1", "vocab.2"]
