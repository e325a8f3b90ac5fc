"""Stand-in for `flash_attn.ops` (package for `flash_attn.ops.triton.layer_norm`); no behaviour of its own."""
