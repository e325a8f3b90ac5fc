"""CPU stand-in for the `flash_attn` package (flash-attention 2.x), for running upstream Nanotron on CPU: on the
import path only under the launcher's ``--cpu-debug`` (and in the upstream test pass).

Upstream imports flash_attn at module level (nn/ring_attention.py, nn/rotary.py, nn/layer_norm.py,
models/llama.py, models/qwen.py) although flash-attn only builds against CUDA. The submodules of this
package re-implement, in plain torch, only the functions the training forward uses (attention,
rotary embedding, RMS/LayerNorm); everything else raises NotImplementedError. None of it creates
parameters or touches PipelineBlocks, so block split, build, freezing, DDP/optimizer construction and
the pipeline engine schedule are exactly upstream's.

The version is declared >= 2.1 so that `nanotron.nn.attention` imports `flash_attn_func` (its test is
`version >= 2.1.0`), which keeps the default `flash_attention_2` implementation usable.
"""

__version__ = "2.6.3+cpustub"
