"""CPU stand-in (``--cpu-debug`` only) for `grouped_gemm` (github.com/fanshiqing/grouped_gemm, a CUDA extension).

`nanotron/nn/moe.py:19` imports `grouped_gemm.ops` at module level and raises RuntimeError (not ImportError)
without it; `scaling/parametrization.py:9` imports `nn/moe.py`, so Llama and the trainer need it too.
The ops are re-implemented in plain torch in `ops.py`; see there.
"""
