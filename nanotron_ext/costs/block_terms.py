"""The record of what one block holds (:class:`BlockMemory`) and the counts both runtimes' models share: what an
unfused RMSNorm and a gated MLP keep, and a decoder block's layer index."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron_ext.blocks import BlockInfo
from nanotron_ext.config import ModelShape
from nanotron_ext.inventory.flops import mlp_active

__all__ = ["BlockMemory", "block_layer", "mlp_saved_width", "norm_saved"]


@dataclass(frozen=True)
class BlockMemory:
    """What one block holds, per micro-batch unless said otherwise (bytes).

    Attributes:
        saved: kept from its forward until its backward.
        forward_temp: alive for a moment during its forward, beyond ``saved``, its input and its output.
        backward_temp: alive for a moment during its backward, beyond what is saved and the gradient it
            receives (a weight's gradient is made fresh before it is added to ``.grad``; input gradients).
        persistent: allocated at its first forward and kept (rotary tables).
        input: the tensors it receives; a stage that starts with this block holds them per micro-batch.
        input_saved: ``saved`` already includes the input.
        output: what it hands on; a stage that ends with this block holds it until the backward.
    """

    saved: float
    forward_temp: float
    backward_temp: float
    persistent: float
    input: float
    input_saved: bool
    output: float


def mlp_saved_width(m: ModelShape, layer: int | None = None) -> float:
    """Elements per token a layer's MLP saves for backward: the matmul outputs (gate|up and down's input: 3f;
    Starcoder2's up: 2f), plus the gate's activation in a gated MLP (4f in all)."""
    width = float(mlp_active(m, layer)[1])
    gated = m.moe.glu if m.moe_layer(layer) and m.moe is not None else m.family != "starcoder2"
    return width + width / 3 if gated else width


def norm_saved(tokens: float, h: int, w: int) -> float:
    """RMSNorm's saved tensors: the fp32 input (or upcast), rsqrt, the normalised tensor in the model dtype."""
    return tokens * (4.0 * h + 4.0 + w * h)


def block_layer(block: BlockInfo) -> int | None:
    """A decoder block's layer index from its name (``model.decoder.7`` -> 7)."""
    tail = block.name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None
