"""What the tests against upstream Nanotron main share: where its copy is, and the one device stand-in they need.

Upstream's models hard-code ``device="cuda"`` in places that building a block on ``meta`` reaches (the P2P
buffers, the MoE router's weight, rotary tables); :func:`cuda_to` maps those to another device while blocks are
built. It changes where tensors are allocated, never their shapes, names or which blocks exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from installed_nanotron import NANOTRON  # noqa: F401  (re-exported: the Nanotron under test)
from torch.overrides import TorchFunctionMode

#: The copy of upstream main beside the project (see ../shared/upstream/README.md): the upstream pass installs
#: it, and its run_train.py drives the end-to-end tests. A plain clone has no ../shared; see upstream_tree().
UPSTREAM = Path(__file__).resolve().parents[3] / "shared" / "upstream" / "nanotron"
#: Upstream's example configs: the copies under tests/data, from the same commit as UPSTREAM (tests/data/README.md),
#: so that a test that only reads a config needs nothing beside the clone.
UPSTREAM_EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "nanotron_examples"
#: Set to 1 (CI does) to make a test that needs UPSTREAM fail when it is missing instead of skipping.
REQUIRE_SHARED_ENV = "NANOTRON_EXT_REQUIRE_SHARED"


def upstream_tree() -> Path:
    """UPSTREAM, for a test that needs upstream's source tree (its ``run_train.py``).

    Skips the test when the tree is missing (a plain ``git clone`` has nothing beside it), with a reason naming
    what it needs; fails it instead when ``NANOTRON_EXT_REQUIRE_SHARED=1``.
    """
    if (UPSTREAM / "run_train.py").is_file():
        return UPSTREAM
    reason = (
        f"needs upstream Nanotron's source tree at {UPSTREAM} (../shared/upstream/nanotron beside the "
        f"project: run_train.py); a plain clone has none"
    )
    if os.environ.get(REQUIRE_SHARED_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_SHARED_ENV}=1 requires it", pytrace=False)
    pytest.skip(reason)


class cuda_to(TorchFunctionMode):  # noqa: N801  (used like a function: `with cuda_to("meta"):`)
    """Rewrite ``device="cuda"`` arguments of torch calls to ``device``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def _map(self, value: Any) -> Any:
        if (
            isinstance(value, str)
            and value.startswith("cuda")
            or isinstance(value, torch.device)
            and value.type == "cuda"
        ):
            return self.device
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = {k: self._map(v) for k, v in (kwargs or {}).items()}
        return func(*[self._map(a) for a in args], **kwargs)
