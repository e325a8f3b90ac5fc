"""Zero-bubble pipelining (``pp_engine: zb1p``, ZB-H1; ``zb2p``, ZB-H2) on Nanotron's own pipeline machinery.

``store.py`` holds the weight-gradient store and the linears that defer their weight gradient to it;
``engine.py`` the ``PipelineEngine``s that run ``engine_program("zb1p", ...)`` and ``("zb2p", ...)``. Both the CPU
runtime and the launcher (``python -m nanotron_ext.run``) import this part; it never imports either of them.
"""

from nanotron_ext.zero_bubble.engine import (
    ZERO_BUBBLE_ENGINES,
    ZeroBubbleH2PipelineEngine,
    ZeroBubblePipelineEngine,
)
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
    "ZERO_BUBBLE_ENGINES",
    "DeferredLinear",
    "WeightGradProduct",
    "WeightGradStore",
    "ZeroBubbleFallbackWarning",
    "ZeroBubbleH2PipelineEngine",
    "ZeroBubblePipelineEngine",
    "install_store",
    "linear",
    "remove_store",
    "store_of",
]
