"""A profile as the ranks of a run share it: built on global rank 0 and broadcast (its error raised on every rank), and
the line that says where it came from."""

from __future__ import annotations

import datetime
import shlex
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import RunFailure
from nanotron_ext.machine.profile import MachineProfile

__all__ = ["profile_source", "share_profile"]


def share_profile(build: Callable[[], MachineProfile], rank: int | None, *, what: str = "calibrate") -> MachineProfile:
    """Global rank 0 builds the profile and broadcasts it; every rank returns it, or raises rank 0's error
    (``rank=None``: no process group, just build it)."""
    if rank is None:
        return build()
    import torch.distributed as dist

    payload: list[Any] = [None]
    error: Exception | None = None
    if rank == 0:
        try:
            payload[0] = {"ok": build().to_json()}
        except Exception as exc:
            error, payload[0] = exc, {"error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    if "error" in payload[0]:
        raise RunFailure(f"{what} failed on global rank 0: {payload[0]['error']}")
    return MachineProfile.from_json(payload[0]["ok"], origin="(broadcast by rank 0)")


def profile_source(cfg: PlannerConfig) -> str:
    """The command line, the config, the date, torch's version and the host."""
    import torch

    argv = list(getattr(sys, "orig_argv", sys.argv)) or ["python"]
    command = shlex.join([Path(argv[0]).name, *argv[1:]])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command}` ({cfg.source}) on {when}, torch {torch.__version__}, host {socket.gethostname()}"
