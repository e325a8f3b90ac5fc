"""``mark_v_stages`` (``nanotron_ext.zero_bubble.v_engine``): each pipeline block's virtual stage of a V, refused
with the value, the reason and the fix where it cannot fold."""

from __future__ import annotations

import pytest
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from torch import nn

from nanotron_ext.zero_bubble.v_engine import mark_v_stages, v_stages_of


def _model(ranks: list[int]) -> nn.Module:
    """Nanotron's own PipelineBlocks, each placed on a PP rank (what ``build_and_set_rank`` records first)."""
    model = nn.Module()
    model.blocks = nn.ModuleList()
    for rank in ranks:
        block = PipelineBlock(
            p2p=None, module_builder=nn.Identity, module_kwargs={}, module_input_keys={"x"}, module_output_keys={"x"}
        )
        block.rank = rank
        model.blocks.append(block)
    return model


def test_each_block_carries_its_stage() -> None:
    model = _model([0, 1, 1, 0, 0])
    assert v_stages_of(model) is None
    mark_v_stages(model, [0, 1, 2, 3, 3], pp=2)
    assert v_stages_of(model) == [0, 1, 2, 3, 3]


@pytest.mark.parametrize(
    ("ranks", "stages", "message"),
    [
        ([0, 1, 1, 0], [0, 1, 2], r"gives 3 virtual stages for 4 pipeline blocks; give one per block"),
        ([0, 1, 0, 0], [0, 1, 3, 3], r"virtual stages \[0, 1, 3, 3\]: a V over pp=2 ranks needs every stage 0\.\.3"),
        ([0, 1, 1, 0], [0, 2, 1, 3], r"virtual stages \[0, 2, 1, 3\].*in order"),
        ([0, 1, 1, 1], [0, 1, 2, 3], r"virtual stage 3 is built on PP rank 1; in a V over pp=2 it runs on rank 0"),
    ],
)
def test_a_layout_that_cannot_fold_is_refused(ranks: list[int], stages: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mark_v_stages(_model(ranks), stages, pp=2)
