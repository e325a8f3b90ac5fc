"""Zero-bubble pipelining (``pp_engine: zb1p``, ZB-H1) on Nanotron's own pipeline machinery.

``store.py`` holds the weight-gradient store and the linears that defer their weight gradient to it;
``engine.py`` the ``PipelineEngine`` that runs ``engine_program("zb1p", ...)``. Both the CPU runtime and the
launcher (``python -m nanotron_ext.run``) import this part; it never imports either of them.
"""

from nanotron_ext.zero_bubble.engine import ZeroBubblePipelineEngine
from nanotron_ext.zero_bubble.store import (
    STORE_ATTR,
    DeferredLinear,
    WeightGradProduct,
    WeightGradStore,
    ZeroBubbleFallbackWarning,
    install_store,
    linear,
    remove_store,
    store_of,
)

__all__ = [
    "STORE_ATTR",
    "DeferredLinear",
    "WeightGradProduct",
    "WeightGradStore",
    "ZeroBubbleFallbackWarning",
    "ZeroBubblePipelineEngine",
    "install_store",
    "linear",
    "remove_store",
    "store_of",
]

