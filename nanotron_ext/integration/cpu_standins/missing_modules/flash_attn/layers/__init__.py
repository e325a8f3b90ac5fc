"""Stand-in for `flash_attn.layers` (package for `flash_attn.layers.rotary`); no behaviour of its own."""
