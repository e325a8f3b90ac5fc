"""What runs inside the ranks of ``replan_cpu.py`` (one process per stage, gloo, one thread each, rank r pinned to
core r): a training run with its re-plan, a CPU hog on rank 0's core until the re-plan decides where the case asks
for one; and the plans a run tried, measured side by side in interleaved turns, apart from the run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: What the hog runs: a busy loop on core 0, the core rank 0 trains on.
HOG = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def pin(rank: int) -> None:
    """This rank on a core of its own (rank r on core r), where the machine has as many."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def train(spec_path: str, out_path: str) -> None:
    """``nanotron-ext train`` of the spec's config for its steps, rank 0 writing the metrics to ``out_path``; with
    ``hog``, a busy loop shares rank 0's core from the start until the re-plan decides."""
    from nanotron_ext.integration.replan_session import ReplanSession
    from nanotron_ext.runtime.train import run_training

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    pin(rank)
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if spec["hog"] and rank == 0 else None
    decide = ReplanSession.decide

    def quiet_from_here(self: Any, *args: Any, **kwargs: Any) -> Any:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        return decide(self, *args, **kwargs)

    ReplanSession.decide = quiet_from_here  # type: ignore[method-assign]
    try:
        run_training(spec["config"], steps=spec["steps"], metrics_out=out_path if rank == 0 else None)
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()


def measure(spec_path: str, out_path: str) -> None:
    """Each of the spec's layouts built once, all alive, then ``rounds`` rounds in which each takes a turn (one
    untimed step, then ``steps`` timed ones; the order rotates every round). A step's time is its slowest rank's;
    rank 0 writes every plan's timed steps to ``out_path``."""
    import torch.distributed as dist

    from nanotron_ext.config import load_config
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan import make_plan
    from nanotron_ext.runtime import GlooParallelContext
    from nanotron_ext.runtime.in_run_calibrate import build_split

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    pin(rank)
    cfg = load_config(spec["config"])
    blocks = inventory_from_config(cfg)
    times: dict[str, list[float]] = {layout: [] for layout in spec["layouts"]}
    with GlooParallelContext(
        tensor_parallel_size=1, pipeline_parallel_size=cfg.run.pp, data_parallel_size=1, timeout_s=1800
    ) as ctx:
        runs = {}
        for layout in spec["layouts"]:
            ranks = make_plan(blocks, cfg.with_overrides(cost_strategy="layout", layout=layout)).block_ranks
            runs[layout] = build_split(cfg, ranks, ctx)
        order = list(spec["layouts"])
        for r in range(spec["rounds"]):
            for layout in order[r % len(order) :] + order[: r % len(order)]:
                for i in range(1 + spec["steps"]):
                    dist.barrier(group=ctx.world_pg)  # every rank starts the step together
                    start = time.perf_counter()
                    runs[layout].step(cfg, ctx)
                    seconds = [0.0] * dist.get_world_size(ctx.world_pg)
                    dist.all_gather_object(seconds, time.perf_counter() - start, group=ctx.world_pg)
                    if i > 0:
                        times[layout].append(max(seconds))
    if rank == 0:
        Path(out_path).write_text(
            json.dumps({"times": times, "medians": {k: statistics.median(v) for k, v in times.items()}})
        )
