"""Stand-in for `flash_attn.modules.mha`: `models/qwen.py:4` imports `flash_attn_varlen_kvpacked_func` from here.

It is the torch re-implementation from `flash_attn.flash_attn_interface`; it has no parameters, so the
model structure and everything built from it are upstream's.
"""

from flash_attn.flash_attn_interface import flash_attn_varlen_kvpacked_func  # noqa: F401
