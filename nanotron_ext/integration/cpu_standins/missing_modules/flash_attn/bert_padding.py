"""Stand-in for `flash_attn.bert_padding`: only has to exist, `models/llama.py:20` imports it by name.

Upstream uses it (pad_input / unpad_input) only on the inference path with a KV cache, never in
training or model building, so nothing tested depends on it.
"""
