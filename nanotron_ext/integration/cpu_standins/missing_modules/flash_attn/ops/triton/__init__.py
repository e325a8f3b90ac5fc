"""Stand-in for `flash_attn.ops.triton` (package for `layer_norm`); no behaviour of its own, no Triton needed."""
