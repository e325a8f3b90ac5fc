"""CPU stand-in for `triton`, for importing upstream Nanotron on CPU (``--cpu-debug`` only).

`nanotron/nn/ring_attention.py:293` and `nn/llama3_ring_attention.py:511` (imported by `nanotron.config`
through `nn/attention.py`) do `import triton`, `import triton.language as tl` and decorate two helper
kernels with `@triton.jit` at module level. Those kernels only run for the `ring` / `llama3_ring_attention`
context-parallel attention, never here; `jit` returns the function unchanged. Nothing about models, blocks,
build, freezing, DDP/optimizer construction or the engine schedule goes through Triton.

torch must not mistake this for a real Triton: it probes with `import triton` (has_triton_package,
`_inductor/runtime/triton_compat.py`) and then uses Triton's API, e.g. `torch._dynamo`, which
`Optimizer.zero_grad` imports lazily, reads `triton.language.dtype`. So this stand-in refuses imports that
do not come from a `nanotron` module, and `jit` (which those modules call right after importing
`triton.language`) takes it out of `sys.modules` again, so later probes by torch find no Triton.
"""

import sys


def _importer():
    f = sys._getframe(2)  # skip this function and the module body
    while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        f = f.f_back
    return f.f_globals.get("__name__", "") if f is not None else ""


if not _importer().startswith("nanotron"):
    raise ImportError("triton stand-in (nanotron_ext --cpu-debug): only serves nanotron's ring-attention modules")


def jit(fn=None, **kwargs):
    sys.modules.pop("triton.language", None)
    sys.modules.pop("triton", None)
    return fn if fn is not None else (lambda f: f)
