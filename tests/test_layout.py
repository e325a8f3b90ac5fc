"""Explicit layout strings."""

from __future__ import annotations

import pytest

from nanotron_ext.errors import LayoutError
from nanotron_ext.partition.layout_string import layout_ranks, parse_layout

TINY = ["embedding", "decoder", "decoder", "final_norm", "lm_head", "cast", "loss"]


def test_parse_and_expand():
    assert parse_layout("E,t|t,L") == [["embedding", "decoder"], ["decoder", "final_norm", "lm_head", "cast", "loss"]]
    assert layout_ranks("E, t*2 | N,H,C,X", TINY) == [0, 0, 0, 1, 1, 1, 1]
    assert layout_ranks("E,t*2,N|H,C,X", TINY) == [0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    "text, column, why",
    [
        ("E,t*5|t*6,Q", 11, "unknown symbol 'Q'"),
        ("E,t*|L", 5, r"a repeat count after '\*' must be >= 1"),
        ("E,t*0|L", 5, r"a repeat count after '\*' must be >= 1"),
        ("E,,t|L", 3, "empty item or stage"),
        ("E,t||L", 5, "empty item or stage"),
        ("E,t#|L", 4, "expected a symbol"),
    ],
)
def test_malformed_layout_points_at_the_character(text, column, why):
    with pytest.raises(LayoutError, match=f"character {column}: {why}") as info:
        parse_layout(text)
    caret_line = str(info.value).splitlines()[-1]
    assert caret_line.index("^") - 2 == column - 1


def test_layout_must_match_the_model():
    with pytest.raises(LayoutError, match="has 3 decoder layers but the model has 2"):
        layout_ranks("E,t*3|L", TINY)
    with pytest.raises(LayoutError, match="block 0 of the model is 'embedding' but the layout says 'decoder'"):
        layout_ranks("t,E,t|L", TINY)
    with pytest.raises(LayoutError, match="stops before block 3"):
        layout_ranks("E,t*2", TINY)


def test_block_lists_by_role_are_compressed_to_ranges():
    from nanotron_ext.blocks import compact_roles

    roles = ["embedding"] + ["decoder"] * 30 + ["final_norm", "lm_head", "cast", "loss"]
    assert compact_roles(roles) == "embedding, decoder.0-29, final_norm, lm_head, cast, loss"
    assert compact_roles(["decoder", "vocab_shard", "vocab_shard", "vocab_shard"]) == "decoder.0, vocab.0-2"
