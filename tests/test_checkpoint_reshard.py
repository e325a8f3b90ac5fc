"""A checkpoint saved under one layout, placed onto another: every element of every weight and optimizer state
lands where the other layout holds it (brute force over pairs of layouts: pp, tp, ZeRO-1 dp, vocabulary shards),
by name, never by position; and every mapping that cannot be exact is refused with what is wrong."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from nanotron_checkpoint import KEYS, Layout, model_tensors, needs_of, rows_of, states_of, write_checkpoint

from nanotron_ext.checkpoint import LM_HEAD, SavedCheckpoint, count_placements, placement_problems
from nanotron_ext.checkpoint.reshard import LiveEntry, LiveOptimizer, fill_weight, optimizer_state_dict
from nanotron_ext.errors import CheckpointError

EMB = "model.token_position_embeddings.pp_block.token_embedding.weight"
QKV0, QKV1 = "model.decoder.0.pp_block.attn.qkv_proj.weight", "model.decoder.1.pp_block.attn.qkv_proj.weight"
NORM = "model.final_layer_norm.pp_block.weight"


def _stages(weights: dict, ranks: list[int], shards: int = 1) -> dict[str, int]:
    """Embedding, decoder.0, decoder.1, final norm, lm_head (or its shards) over the given pp ranks."""
    blocks = [
        "model.token_position_embeddings",
        "model.decoder.0",
        "model.decoder.1",
        "model.final_layer_norm",
        "model.lm_head",
    ]
    out = {n: ranks[next(i for i, b in enumerate(blocks) if n.startswith(b + "."))] for n in weights}
    out.update({f"shard{i}": ranks[-1] for i in range(shards)})
    return out


def _layouts(weights: dict) -> dict[str, Layout]:
    split = {EMB: 0, QKV0: 0, QKV1: 1, LM_HEAD: 0}  # column- and row-parallel splits
    fused = {QKV0: 3}  # q, k and v stacked: each tp rank holds its rows of all three, as Nanotron's qkv_proj
    two = _stages(weights, [0, 0, 1, 1, 1])
    return {
        "pp1": Layout(_stages(weights, [0] * 5)),
        "pp2": Layout(two, pp=2),
        "pp2-other-split": Layout(_stages(weights, [0, 1, 1, 1, 1]), pp=2),
        "pp4": Layout(_stages(weights, [0, 1, 2, 3, 3]), pp=4),
        "tp2": Layout(_stages(weights, [0] * 5), tp=2, split=split, fused=fused),
        "pp2-tp2": Layout(two, pp=2, tp=2, split=split),
        "zero1-dp2": Layout(two, pp=2, dp=2, zero=True),
        "zero1-dp3-tp2": Layout(_stages(weights, [0] * 5), dp=3, zero=True, tp=2, split=split, fused=fused),
        "shards2": Layout({**two, "shard0": 0, "shard1": 1}, pp=2, shards=2),
        "shards3": Layout({**two, "shard0": 1, "shard1": 1, "shard2": 1}, pp=2, shards=3),
    }


@pytest.fixture(scope="module")
def model():
    weights = model_tensors()
    return weights, states_of(weights)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    weights, states = model
    out = {}
    for name, layout in _layouts(weights).items():
        folder = tmp_path_factory.mktemp(name)
        write_checkpoint(folder, weights, states, layout)
        out[name] = folder
    return out


def _region(whole: torch.Tensor, need) -> torch.Tensor:
    """What ``need``'s live tensor holds of the whole tensor, piece by piece."""
    out = torch.empty(need.local_shape, dtype=whole.dtype)
    for piece in need.pieces:
        out[tuple(slice(a, b) for a, b in piece.local)] = whole[tuple(slice(a, b) for a, b in piece.whole)]
    return out


def _live(needs, layout: Layout, rank: int) -> LiveOptimizer:
    """The live optimizer of one rank: an entry per trainable parameter, ZeRO's flat range where it shards."""
    from nanotron_checkpoint import _zero_offsets

    mine = [n for n in needs if n.rank == rank and n.trainable]
    entries = []
    for n in mine:
        span = None
        if layout.zero:
            span = _zero_offsets(int(torch.tensor(n.local_shape).prod()), layout.dp)[n.dp]
            if span[0] == span[1]:
                continue
        entries.append(LiveEntry(len(entries), n.local_name, n, span))
    groups = tuple({"lr": 0.5, "weight_decay": 0.0, "params": [e.index]} for e in entries)
    return LiveOptimizer(tuple(entries), groups, fp32_master=False)


@pytest.mark.parametrize(
    "source, target",
    list(
        itertools.permutations(
            [
                "pp1",
                "pp2",
                "pp2-other-split",
                "pp4",
                "tp2",
                "pp2-tp2",
                "zero1-dp2",
                "zero1-dp3-tp2",
                "shards2",
                "shards3",
            ],
            2,
        )
    ),
)
def test_every_element_of_weights_and_optimizer_state_lands_where_the_new_layout_holds_it(model, saved, source, target):
    weights, states = model
    layout = _layouts(weights)[target]
    needs = needs_of(weights, layout)
    checkpoint = SavedCheckpoint.scan(saved[source])
    assert placement_problems(checkpoint, needs, optimizer=True) == []
    for need in needs:
        out = torch.full(need.local_shape, float("nan"))
        fill_weight(checkpoint, need, out)
        assert torch.equal(out, _region(weights[need.name], need)), (need.local_name, need.rank)
    for rank in sorted({n.rank for n in needs}):
        live = _live(needs, layout, rank)
        sd = optimizer_state_dict(checkpoint, live)
        assert sd["names"] == {e.index: e.name for e in live.entries}
        for entry in live.entries:
            for key in KEYS:
                expected = _region(states[entry.need.name][key], entry.need)
                if entry.flat_range is not None:
                    expected = expected.reshape(-1)[slice(*entry.flat_range)]
                assert torch.equal(sd["state"][entry.index][key], expected), (entry.name, key, rank)
            assert float(sd["state"][entry.index]["step"]) == 4.0
        # Each group takes the hyperparameters its parameter was saved with (lr 0.01), not the live ones (0.5).
        assert all(g["lr"] == 0.01 and g["weight_decay"] == 0.01 for g in sd["param_groups"])


def test_moments_go_to_their_own_layer_when_two_layers_of_one_shape_change_ranks(model, tmp_path):
    # decoder.0 and decoder.1 have the same shape. Saved on ranks 0 and 1; the new plan holds both on rank 1, in
    # the other order of the optimizer's entries. By position, rank 1's first entry (decoder.1's moments when saved)
    # would land on decoder.0: each must get its own.
    weights, states = model
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, weights, states, Layout(_stages(weights, [0, 0, 1, 1, 1]), pp=2))
    assert weights[QKV0].shape == weights[QKV1].shape
    new = Layout(_stages(weights, [0, 1, 1, 1, 1]), pp=2)
    needs = needs_of(weights, new)
    rank1 = sorted((n for n in needs if n.rank == 1), key=lambda n: n.local_name, reverse=True)  # decoder.1 first
    live = LiveOptimizer(
        tuple(LiveEntry(i, n.local_name, n) for i, n in enumerate(rank1)),
        tuple({"lr": 0.5, "weight_decay": 0.0, "params": [i]} for i in range(len(rank1))),
        False,
    )
    checkpoint = SavedCheckpoint.scan(folder)
    sd = optimizer_state_dict(checkpoint, live)
    for entry in live.entries:
        assert torch.equal(sd["state"][entry.index]["exp_avg"], states[entry.need.name]["exp_avg"]), entry.name
    assert not torch.equal(states[QKV0]["exp_avg"], states[QKV1]["exp_avg"])  # a swap would be caught


def test_the_count_names_every_parameter_and_optimizer_entry_once(model, saved):
    weights, _ = model
    layout = _layouts(weights)["pp4"]
    count = count_placements(SavedCheckpoint.scan(saved["zero1-dp2"]), needs_of(weights, layout), optimizer=True)
    assert (count.parameters, count.saved_parameters) == (len(weights), len(weights))
    assert count.entry_keys == ("exp_avg", "exp_avg_sq", "step")
    assert count.entries == count.saved_entries == 3 * len(weights) and count.dropped == 0
    assert f"{len(weights)} of {len(weights)} parameters and {3 * len(weights)} of {3 * len(weights)}" in count.line()


def _problems(folder: Path, needs, optimizer: bool = True) -> str:
    return "\n".join(placement_problems(SavedCheckpoint.scan(folder), needs, optimizer=optimizer))


def test_a_new_plan_with_fewer_layers_is_refused_not_silently_dropped(model, saved):
    # Megatron-Bridge #4992: a layout collapsed to pp=1 silently dropped decoder layers.
    weights, _ = model
    fewer = {k: v for k, v in weights.items() if not k.startswith("model.decoder.1.")}
    text = _problems(saved["pp2"], needs_of(fewer, Layout(_stages(fewer, [0] * 5))))
    assert "the new plan has no place for 2 saved parameter(s): model.decoder.1.pp_block" in text


def test_a_live_parameter_the_checkpoint_lacks_is_missing(model, saved):
    weights, _ = model
    more = {**weights, "model.projector.pp_block.weight": torch.zeros(4, 4)}
    stages = {**_stages(weights, [0] * 5), "model.projector.pp_block.weight": 0}
    text = _problems(saved["pp1"], needs_of(more, Layout(stages)))
    assert "model.projector.pp_block.weight (rank 0) has no saved weight" in text


def test_another_whole_shape_is_refused_naming_both(model, saved):
    weights, _ = model
    padded = {**weights, LM_HEAD: torch.zeros(12, 4)}  # tp=2 pads an odd vocabulary: 11 rows become 12
    text = _problems(saved["pp1"], needs_of(padded, Layout(_stages(weights, [0] * 5))))
    assert f"{LM_HEAD} is (12, 4) in the new plan but (11, 4) in the checkpoint" in text


def test_a_trainable_parameter_without_saved_optimizer_state_is_refused(model, tmp_path):
    weights, states = model
    layout = Layout(_stages(weights, [0] * 5), frozen=frozenset({NORM}))
    write_checkpoint(tmp_path, weights, states, layout)
    text = _problems(tmp_path, needs_of(weights, Layout(_stages(weights, [0] * 5))))
    assert f"{NORM} trains in the new plan but the checkpoint has no optimizer state for it" in text
    assert _problems(tmp_path, needs_of(weights, Layout(_stages(weights, [0] * 5))), optimizer=False) == ""


def test_parts_saved_twice_or_missing_are_named(model, tmp_path):
    weights, states = model
    write_checkpoint(
        tmp_path, weights, states, Layout({**_stages(weights, [0] * 5), "shard0": 0, "shard1": 0}, shards=2)
    )
    head = tmp_path / "model" / "model" / "lm_head" / "pp_block"
    second = head / "model_weight_pp-rank-0-of-1_tp-rank-1-of-2.safetensors"
    needs = needs_of(weights, Layout(_stages(weights, [0] * 5)))
    data = second.read_bytes()
    second.unlink()
    assert f"{LM_HEAD}: 20 of its 44 element(s) are in no file" in _problems(tmp_path, needs, False)
    second.write_bytes(data)
    (head / "model_weight_pp-rank-0-of-1_tp-rank-2-of-2.safetensors").write_bytes(data)  # the same rows again
    assert f"{LM_HEAD}: 20 element(s) saved twice" in _problems(tmp_path, needs, False)
    assert rows_of(11, 2) == [(0, 6), (6, 11)]


def test_an_untied_parameter_placed_twice_in_the_new_plan_is_refused(model, saved):
    weights, _ = model
    needs = needs_of(weights, Layout(_stages(weights, [0] * 5)))
    twice = needs + [n.__class__(**{**n.__dict__, "rank": 1}) for n in needs if n.name == QKV0]
    assert f"{QKV0} is placed twice in the new plan (ranks 0, 1) without being tied" in _problems(saved["pp1"], twice)


def test_an_optimizer_file_without_parameter_names_is_refused(model, saved, tmp_path):
    weights, states = model
    write_checkpoint(tmp_path, weights, states, Layout(_stages(weights, [0] * 5)))
    path = next((tmp_path / "optimizer").glob("*.pt"))
    sd = torch.load(path, weights_only=True)
    del sd["names"]
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match="has no parameter names, so it can be loaded only by position"):
        SavedCheckpoint.scan(tmp_path).optimizer_sources()


def test_state_from_another_optimizer_kind_is_refused(model, saved):
    weights, _ = model
    layout = Layout(_stages(weights, [0] * 5))
    needs = needs_of(weights, layout)
    live = _live(needs, layout, 0)
    sgd = LiveOptimizer(
        live.entries, tuple({"lr": 0.5, "momentum": 0.9, "params": g["params"]} for g in live.param_groups), False
    )
    with pytest.raises(CheckpointError, match=r"the optimizer changed kind: its groups hold \['lr', 'momentum'\]"):
        optimizer_state_dict(SavedCheckpoint.scan(saved["pp1"]), sgd)


def test_a_fused_weights_shape_as_nanotron_0_2_writes_it_under_numpy_2_is_read_as_its_shape(model, saved, tmp_path):
    """Nanotron 0.2 writes a fused qkv's ``unsharded_shape`` from NumPy integers: ``(np.int64(12), 4)`` under NumPy
    2, whose ``64`` is no dimension (the in-process move of ``nanotron-ext train`` saves through 0.2's serializer)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    weights, _ = model
    folder = tmp_path / "tp2"
    shutil.copytree(saved["tp2"], folder)  # the fused qkv in two tp shards: each file's header names its shape
    fused = [p for p in folder.rglob("*.safetensors") if "qkv_proj" in str(p)]
    assert fused
    for path in fused:
        with safe_open(str(path), "pt") as f:
            meta, data = f.metadata(), f.get_tensor("data")
        assert meta["unsharded_shape"] == "(12, 4)"
        save_file({"data": data}, str(path), metadata={**meta, "unsharded_shape": "(np.int64(12), 4)"})
    scanned = SavedCheckpoint.scan(folder)
    name = "model.decoder.0.pp_block.attn.qkv_proj.weight"
    assert scanned.parameters[name].whole_shape == tuple(weights[name].shape) == (12, 4)
