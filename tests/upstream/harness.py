"""What the tests against upstream Nanotron main share: where its copy is, and the one device stand-in they need.

Upstream's models hard-code ``device="cuda"`` in places that building a block on ``meta`` reaches (the P2P
buffers, the MoE router's weight, rotary tables); :func:`cuda_to` maps those to another device while blocks are
built. It changes where tensors are allocated, never their shapes, names or which blocks exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from installed_nanotron import NANOTRON  # noqa: F401  (re-exported: the Nanotron under test)
from torch.overrides import TorchFunctionMode

#: The copy of upstream main beside the project (see ../shared/upstream/README.md).
UPSTREAM = Path(__file__).resolve().parents[3] / "shared" / "upstream" / "nanotron"
UPSTREAM_EXAMPLES = UPSTREAM / "examples"


class cuda_to(TorchFunctionMode):  # noqa: N801  (used like a function: `with cuda_to("meta"):`)
    """Rewrite ``device="cuda"`` arguments of torch calls to ``device``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def _map(self, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("cuda") or isinstance(value, torch.device) and value.type == "cuda":
            return self.device
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = {k: self._map(v) for k, v in (kwargs or {}).items()}
        return func(*[self._map(a) for a in args], **kwargs)
