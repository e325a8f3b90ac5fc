"""The scenarios of ``measured_memory.py``: a model, dtype, engine and parallelism each, measured on the CPU
runtime (or, with ``--device cuda``, SmolLM-135M as shipped on one GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "nanotron_ext" / "configs"
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Scenario:
    """A model, dtype, engine and parallelism to measure."""

    label: str
    yaml_name: str
    dtype: str
    engine: str
    tp: int = 1
    pp: int = 2
    num_hidden_layers: int | None = None
    sequence_length: int | None = None
    micro_batch_size: int | None = None
    n_micro_batches: int | None = None
    device: str = "cpu"
    recompute: bool = False  # parallelism.recompute_layer
    #: ``pp_engine: auto`` under ``memory_cap_gib`` halfway between these two engines' estimated peaks under
    #: ``flops``'s split; the check adds that every measured peak stays under the cap (issue 31).
    cap_between: tuple[str, str] | None = None
    #: With ``cap_between``: keep ``flops``'s uncapped split for every engine (``layout``), so that only the engine
    #: can change; else ``flops`` plans under the cap and may move the split.
    fixed_split: bool = False

    def raw_config(self) -> dict[str, Any]:
        raw = yaml.safe_load((CONFIGS / self.yaml_name).read_text())
        raw["model"]["dtype"] = self.dtype
        raw["parallelism"].update(
            pp=self.pp,
            tp=self.tp,
            dp=1,
            pp_engine=self.engine,
            tp_mode="ALL_REDUCE",
            tp_linear_async_communication=False,
        )
        raw["optimizer"]["accumulate_grad_in_fp32"] = False
        raw["parallelism"]["recompute_layer"] = self.recompute
        raw["optimizer"]["zero_stage"] = 0
        if self.num_hidden_layers is not None:
            raw["model"]["model_config"]["num_hidden_layers"] = self.num_hidden_layers
        for key, value in (
            ("sequence_length", self.sequence_length),
            ("micro_batch_size", self.micro_batch_size),
            ("batch_accumulation_per_replica", self.n_micro_batches),
        ):
            if value is not None:
                raw["tokens"][key] = value
        raw.setdefault("nanotron_ext", {})
        raw["nanotron_ext"] = {**(raw["nanotron_ext"] or {}), "memory_runtime": "cpu"}
        return raw


def scenarios(device: str = "cpu") -> list[Scenario]:
    if device == "cuda":
        return [
            Scenario(f"SmolLM-135M {dtype} {engine} (CUDA)", "smollm_135m.yaml", dtype, engine, device="cuda")
            for dtype in ("bfloat16", "float32")
            for engine in ("1f1b", "zb1p", "zb2p")
        ]
    out = []
    for dtype in ("float32", "bfloat16"):
        for engine in ("1f1b", "afab"):
            out.append(Scenario(f"tiny {dtype} {engine}", "tiny_llama_large_vocab.yaml", dtype, engine))
    out.append(Scenario("tiny float32 1f1b tp=2", "tiny_llama_large_vocab.yaml", "float32", "1f1b", tp=2))
    # zb1p, zb2p (nanotron_ext.zero_bubble): 1F1B's activations (zb2p: more micro-batches in flight) plus the
    # deferred weight-gradient products.
    for engine in ("zb1p", "zb2p"):
        out.append(Scenario(f"tiny float32 {engine}", "tiny_llama_large_vocab.yaml", "float32", engine))
    for dtype in ("float32", "bfloat16"):
        for engine in ("1f1b", "afab", "zb1p", "zb2p"):
            out.append(
                Scenario(
                    f"SmolLM-135M-shaped {dtype} {engine}",
                    "smollm_135m.yaml",
                    dtype,
                    engine,
                    num_hidden_layers=6,
                    sequence_length=128,
                    micro_batch_size=2,
                    n_micro_batches=4,
                )
            )
    # pp_engine: auto under a cap between zb1p's and zb2p's estimated peaks, issue 31's shape: zb2p is faster and
    # does not fit, auto takes zb1p, whose measured peak must stay under the cap.
    # With the split free, flops plans zb2p under the cap too and may find a split of it that fits.
    for fixed in (True, False):
        out.append(
            Scenario(
                f"SmolLM-135M-shaped 8 layers float32 auto, cap between zb1p and zb2p, split "
                f"{'fixed' if fixed else 'free'}",
                "smollm_135m.yaml",
                "float32",
                "auto",
                num_hidden_layers=8,
                sequence_length=128,
                micro_batch_size=1,
                n_micro_batches=4,
                cap_between=("zb1p", "zb2p"),
                fixed_split=fixed,
            )
        )
    # parallelism.recompute_layer: each decoder layer keeps its input; its backward runs the forward again.
    for dtype in ("float32", "bfloat16"):
        for engine in ("1f1b", "afab"):
            # A longer sequence than above, so that the activations, not the optimizer step, set the peak.
            out.append(
                Scenario(
                    f"SmolLM-135M-shaped {dtype} {engine} recompute",
                    "smollm_135m.yaml",
                    dtype,
                    engine,
                    num_hidden_layers=6,
                    sequence_length=512,
                    micro_batch_size=2,
                    n_micro_batches=4,
                    recompute=True,
                )
            )
    return out
