"""Functions run inside spawned ranks by ``test_calibrate.py`` (see ``runtime/spawn.py``).

Free of pytest imports: each rank loads this file by path and calls one function. Return values are plain
dicts and strings so they unpickle in the test process without this module.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any


def calibrate_world(config: str, out: str, store: str, repeats: int = 2) -> dict[str, Any]:
    """``nanotron-ext calibrate CONFIG --out OUT`` on this rank (the CLI makes the gloo group from torchrun's
    variables and tears it down), then :func:`calibrate` itself on a second group over a file store.

    Returns:
        The CLI's exit code and output, and the profile the API returned on this rank (JSON).
    """
    import torch.distributed as dist

    from nanotron_ext.cli import main
    from nanotron_ext.config import load_config
    from nanotron_ext.machine.calibrate import calibrate

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["calibrate", config, "--standalone", "--out", out, "--repeats", str(repeats), "--warmup", "1"])
    assert not dist.is_initialized(), "the CLI tears down the group it made"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        profile = calibrate(load_config(config), warmup=0, repeats=1, progress=False)
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "code": code, "stdout": text.getvalue(), "profile": profile.to_json()}


def calibrate_layout(config: str) -> dict[str, Any]:
    """:func:`calibrate` of ``config`` inside Nanotron's own ``ParallelContext`` (gloo) for its layout.

    Returns:
        The profile as JSON, and whether calibrate's rank layout is the context's (every stage, dp and tp rank).
    """
    from nanotron_ext.config import load_config
    from nanotron_ext.machine.calibrate import _World, calibrate
    from nanotron_ext.runtime import GlooParallelContext

    cfg = load_config(config)
    r = cfg.run
    with GlooParallelContext(tensor_parallel_size=r.tp, pipeline_parallel_size=r.pp, data_parallel_size=r.dp) as ctx:
        world = _World.current(cfg)
        same = all(
            int(ctx.world_rank_matrix[0, s, d, t]) == world.rank_of(s, d, t)
            for s in range(r.pp)
            for d in range(r.dp)
            for t in range(r.tp)
        )
        profile = calibrate(cfg, warmup=0, repeats=1, progress=False)
    return {"profile": profile.to_json(), "layout_is_nanotrons": same}


def calibrate_host_staged(config: str, out: str) -> dict[str, Any]:
    """``nanotron-ext calibrate CONFIG --out OUT --backend gloo`` with host staging forced on CPU (as on CUDA
    under gloo: every link and sync timed through host copies), so that its code runs here.

    Returns:
        The CLI's exit code and output on this rank.
    """
    from nanotron_ext.cli import calibrate as cli_calibrate
    from nanotron_ext.cli import main
    from nanotron_ext.machine import calibrate as machine_calibrate
    from nanotron_ext.machine import calibrate_comm

    def staged(device: Any, backend: Any) -> bool:
        return backend == "gloo"

    machine_calibrate.host_staged = staged
    calibrate_comm.host_staged = staged
    cli_calibrate.host_staged = staged
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(
            ["calibrate", config, "--standalone", "--out", out, "--backend", "gloo", "--repeats", "1", "--warmup", "0"]
        )
    return {"code": code, "stdout": text.getvalue()}


def calibrate_cli(argv: list[str]) -> dict[str, Any]:
    """``nanotron-ext calibrate *argv`` on this rank. Returns its exit code and what it printed."""
    from nanotron_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["calibrate", *argv])
    return {"rank": int(os.environ["RANK"]), "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
