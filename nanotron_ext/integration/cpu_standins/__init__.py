"""``python -m nanotron_ext.run --cpu-debug``: upstream Nanotron's own trainer on CPU over gloo, to debug a split, a
checkpoint or a resume under another plan on a laptop. For debugging, never for speed; a run without the flag uses
none of this.

Two kinds of stand-in, both put in place only by :func:`enable` (the flag):

* packages for modules that only build with CUDA (``missing_modules/``: ``flash_attn``, ``triton``,
  ``grouped_gemm``), which upstream imports at module level; :func:`enable` puts their folder first on
  ``sys.path``, so nothing of them is importable without the flag;
* the trainer's CUDA calls (:mod:`nanotron_ext.integration.cpu_standins.trainer`: gloo instead of NCCL, ``"cuda"``
  devices on the CPU, non-blocking P2P, CPU timers).

What each one replaces and why it changes nothing a debugging run looks at: docs/stand-ins.md. Importing this module
loads nothing that imports flash_attn, triton or grouped_gemm, so the launcher can put the folder on the path first.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from nanotron_ext.errors import ConfigError
from nanotron_ext.procs import RENDEZVOUS_VARIABLES, free_port, rendezvous_env

__all__ = ["BANNER", "FLAG", "MISSING_MODULES", "STANDIN_PACKAGES", "enable", "put_missing_modules_on_path"]

#: The launcher's flag that enables everything here.
FLAG = "--cpu-debug"
#: The folder holding the stand-in packages for modules that need CUDA; on ``sys.path`` only under :data:`FLAG`.
MISSING_MODULES = Path(__file__).resolve().parent / "missing_modules"
#: The packages in :data:`MISSING_MODULES`, each standing in for the package of that name.
STANDIN_PACKAGES = ("flash_attn", "triton", "grouped_gemm")
#: What rank 0 prints when the flag is given: what runs, and that it is for debugging.
BANNER = (
    f"{FLAG}: upstream Nanotron's own trainer on CPU over gloo, with CPU stand-ins for flash-attn, Triton, "
    f"grouped_gemm and the trainer's CUDA calls (docs/stand-ins.md). For debugging a split, a checkpoint or a "
    f"resume, not for speed (plain-torch kernels on the CPU); a run without {FLAG} uses none of them"
)


def put_missing_modules_on_path() -> None:
    """Put :data:`MISSING_MODULES` first on ``sys.path`` (once): the stand-ins win over a real package, whose CUDA
    kernels could not run on the CPU tensors of a ``--cpu-debug`` run."""
    folder = str(MISSING_MODULES)
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _installed_nanotron_is_upstream() -> bool:
    # Upstream main ships Qwen2 (nanotron/models/qwen.py); 0.2 does not. Found without importing nanotron.
    spec = importlib.util.find_spec("nanotron")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return any((Path(p) / "models" / "qwen.py").is_file() for p in locations)


def enable(say: Callable[[str], None] | None = None) -> None:
    """Everything ``--cpu-debug`` changes in this process, before the training script imports Nanotron.

    Outside torchrun (no ``RANK``), the process is a world of one on a free local port. Upstream's tensor-parallel
    linears refuse to start without ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which is set unless already set.

    Args:
        say: where the banner goes (rank 0 passes ``print``); None prints nothing.

    Raises:
        ConfigError: the installed Nanotron is not upstream main (the stand-ins are written against its code).
    """
    if not _installed_nanotron_is_upstream():
        raise ConfigError(
            f"{FLAG} runs upstream Nanotron main's own trainer on CPU, but the installed nanotron is not upstream main "
            f"(no nanotron/models/qwen.py; nanotron==0.2?); install Nanotron from its repository "
            f"(pip install git+https://github.com/huggingface/nanotron), or use `nanotron-ext train`, the CPU runtime "
            f"on Nanotron 0.2's engines"
        )
    if not any(name in os.environ for name in RENDEZVOUS_VARIABLES):
        os.environ.update(rendezvous_env(0, 1, free_port()))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    put_missing_modules_on_path()
    from nanotron_ext.integration.cpu_standins.trainer import install

    install()
    if say is not None:
        say(BANNER)
