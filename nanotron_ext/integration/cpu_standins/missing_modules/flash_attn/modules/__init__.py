"""Stand-in for `flash_attn.modules` (package for `flash_attn.modules.mha`); no behaviour of its own."""
