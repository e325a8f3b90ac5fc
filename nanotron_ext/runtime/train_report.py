"""What rank 0 of a CPU training run prints and writes: the header, the summary table, the JSON files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nanotron_ext.blocks import short_name
from nanotron_ext.outputs import atomic_write_text
from nanotron_ext.plan import Plan
from nanotron_ext.plan.v_plan import VPlan
from nanotron_ext.report import compact_names, human_count, table
from nanotron_ext.runtime.train_settings import TrainSettings

__all__ = ["print_header", "summary", "transport", "write_json"]


def write_json(path: str | Path, data: Any) -> None:
    # Temporary file + rename: a reader (or a killed run) never leaves half a JSON file behind.
    atomic_write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def transport(device: str) -> str:
    """``gloo`` or ``gloo, host-staged`` (:func:`nanotron_ext.runtime.device.describe_transport`)."""
    import torch

    from nanotron_ext.runtime.device import describe_transport

    return describe_transport(torch.device(device))


def _device_label(device: str) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else device


def print_header(s: TrainSettings, plan: Plan | VPlan) -> None:
    r = s.cfg.run
    files = ", ".join(f.name for f in s.data_files)
    print(
        f"nanotron-ext train: {s.cfg.source}\n"
        f"  world {s.world_size} = dp {r.dp} × pp {r.pp} × tp {r.tp} | engine {r.engine} | {r.n_micro_batches} "
        f"micro-batches × {r.micro_batch_size} × {r.sequence_length} tokens | strategy {plan.strategy} | "
        f"{s.steps} steps | seed {s.seed}\n"
        f"  data: {files} ({human_count(s.windows.size)} tokens, {len(s.windows)} windows), byte tokenizer\n"
        f"  device: {_device_label(s.device)} | P2P: {transport(s.device)} | attention: torch SDPA\n",
        flush=True,
    )
    print(plan.table())
    if isinstance(plan, VPlan):
        print(f"\nblock -> rank: {plan.block_ranks}; virtual stage: {plan.stages}")
    else:
        print(f"\nblock -> stage: {list(plan.block_ranks)}")
    for finding in plan.findings:
        print(finding)
    for note in s.notes:
        print(f"note: {note}")
    print(flush=True)


def summary(m: dict[str, Any]) -> str:
    losses, times = m["losses"], m["step_times_s"]
    k = min(3, len(losses))
    rows = [
        ["steps", m["steps"]],
        [f"loss, first {k} steps (mean)", f"{sum(losses[:k]) / k:.4f}"],
        [f"loss, last {k} steps (mean)", f"{sum(losses[-k:]) / k:.4f}"],
        ["final loss", f"{losses[-1]:.4f}"],
        ["mean step time (after step 1)", f"{1e3 * sum(times[1:] or times) / len(times[1:] or times):.0f} ms"],
        ["tokens per step", m["tokens_per_step"]],
        ["tokens/s (after step 1)", f"{m['mean_tokens_per_s']:,.0f}"],
    ]
    ranks = [
        [
            r["world_rank"],
            r["pp_rank"],
            r["dp_rank"],
            r["tp_rank"],
            _blocks_label(r["blocks"]),
            human_count(r["params"]),
            human_count(r["trainable"]),
            "yes" if r["has_optimizer"] else "no (frozen)",
            "yes" if r["is_ddp"] else "no",
        ]
        for r in m["ranks"]
    ]
    return (
        "\nsummary\n"
        + table(["metric", "value"], rows)
        + "\n\n"
        + table(["world", "pp", "dp", "tp", "blocks", "params", "trainable", "optimizer", "DDP"], ranks)
    )


def _blocks_label(names: list[str]) -> str:
    return compact_names([short_name(n) for n in names])
