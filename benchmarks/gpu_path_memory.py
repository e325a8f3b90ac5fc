"""Upstream Nanotron's own Llama and Qwen2 against the estimate of their GPU path (issue 30, item 2): what it keeps per
decoder layer, one micro-batch's activations, and the peak of a forward and backward, estimated and measured.

One process builds upstream main's ``LlamaForTraining`` or ``Qwen2ForTraining`` (with ``build_model``, at pp = tp =
dp = 1) and runs one micro-batch forward and backward after a warm-up, reading the allocator between marks
(:class:`~nanotron_ext.runtime.memory_measure.CudaMemoryRecorder` on a GPU, the CPU profiler's
:class:`~nanotron_ext.runtime.memory_measure.MemoryRecorder` on CPU). flash-attn is not installed on the lent GPU
machines: the import stand-ins of ``--cpu-debug`` (``nanotron_ext/integration/cpu_standins``) let upstream import,
and ``benchmarks/_flash_memory.py`` replaces its three kernels by ones that keep what flash-attn's keep (SDPA's flash
kernel, in-place rotary, RMSNorm keeping its input and rstd). The estimate is
:func:`nanotron_ext.costs.memory_estimate.stage_memory` with ``runtime="gpu"`` for the same shape, untied (upstream ties
weights in its trainer, not in ``build_model``). The Qwen2 runs have ``log_attn_probs`` off (see ``_model``).

Compared, in bytes above what is allocated just before the micro-batch (weights, inputs, rotary caches):

* ``layer``: what one decoder layer adds to the live bytes in the forward (the median over layers 1..L-2), against
  the block's ``saved − input + output``;
* ``activations``: live bytes after the forward, against the stage's activations of one micro-batch;
* ``peak``: the high-water mark over forward and backward, against the pipeline moment's activations, gradients
  and temporaries.

Usage (upstream Nanotron installed)::

    python benchmarks/gpu_path_memory.py [--device cuda|cpu] [--quick] [--out PATH]

``--device cpu`` runs the same code on this machine (small shapes with ``--quick``): it checks the script, and
on CPU the SDPA flash kernel keeps the same tensors too. Writes JSON to PATH (default
``benchmarks/results/gpu_path_memory_<device>.json``); exit 0 when it ran, whatever the ratios (a finding).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
# flash-attn's import stand-ins, after the installed packages (a GPU machine's own triton comes first).
from nanotron_ext.integration.cpu_standins import MISSING_MODULES  # noqa: E402

sys.path.append(str(MISSING_MODULES))

import _flash_memory  # noqa: E402  (from benchmarks/, put on sys.path above)
import torch  # noqa: E402

from nanotron_ext.config import bundled_config, config_from_dict  # noqa: E402
from nanotron_ext.costs.block_memory import block_memory  # noqa: E402
from nanotron_ext.costs.memory_estimate import stage_memory  # noqa: E402
from nanotron_ext.inventory import inventory_from_config  # noqa: E402
from nanotron_ext.procs import free_port, rendezvous_env  # noqa: E402
from nanotron_ext.runtime.memory_measure import CudaMemoryRecorder, MemoryRecorder  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Shape:
    """A Llama shape and micro-batch to measure."""

    label: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    layers: int
    sequence: int
    micro_batch: int
    recompute: bool = False
    family: str = "llama"
    fused_norms: bool = True  # Qwen2's _fused_rms_norm


def shapes(quick: bool) -> list[Shape]:
    """SmolLM-135M's shape (GQA 9/3, untied) at micro-batch 4 and 1 and recomputed, a multi-head shape, and
    SmolLM-135M's shape as a Qwen2 with fused and unfused norms."""
    # --quick: a vocabulary of 8192, not 49152 and 32000: the bf16 lm_head's matmuls were 72 % of a CPU backward,
    # and every row stays within 0.5 % of the estimate (docs/memory.md, "Upstream's own models").
    layers, seq, vocab = (3, 128, 8192) if quick else (30, 2048, None)
    smol = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=vocab or 49152, layers=layers, sequence=seq)
    mha = dict(
        hidden=1024,
        heads=16,
        kv_heads=16,
        intermediate=2816,
        vocab=vocab or 32000,
        layers=3 if quick else 8,
        sequence=seq,
    )
    every = [
        Shape("smollm-135m mb4", micro_batch=4, **smol),
        Shape("smollm-135m mb1", micro_batch=1, **smol),
        Shape("smollm-135m mb4 recompute", micro_batch=4, recompute=True, **smol),
        Shape("multi-head mb2", micro_batch=2, **mha),
        Shape("qwen2 mb4", micro_batch=4, family="qwen2", **smol),
        Shape("qwen2 mb4 unfused norms", micro_batch=4, family="qwen2", fused_norms=False, **smol),
    ]
    # --quick: one shape per branch of the count (GQA with the o_proj copy, recompute, multi-head, Qwen2 with both
    # norms); one sequence and Qwen2's fused norms only drop terms, which tests/test_gpu_path_memory.py counts.
    return [x for x in every if x.label not in ("smollm-135m mb1", "qwen2 mb4")] if quick else every


def planner_config(shape: Shape) -> Any:
    """The shape as a planner config (the bundled SmolLM-135M YAML, or SmolLM3's for a Qwen2, reshaped; pp = tp =
    dp = 1, one micro-batch)."""
    base = "smollm3_3b.yaml" if shape.family == "qwen2" else "smollm_135m.yaml"
    raw = yaml.safe_load(bundled_config(base).read_text())
    mc = raw["model"]["model_config"]
    if shape.family == "qwen2":
        mc["_fused_rms_norm"] = shape.fused_norms
    mc.update(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        num_hidden_layers=shape.layers,
        tie_word_embeddings=False,
        max_position_embeddings=max(shape.sequence, mc["max_position_embeddings"]),
    )
    raw["model"]["dtype"] = "bfloat16"
    raw["optimizer"]["accumulate_grad_in_fp32"] = False  # build_model alone: gradients in the weights' dtype
    raw["parallelism"].update(dp=1, pp=1, tp=1, pp_engine="1f1b", recompute_layer=shape.recompute)
    raw["tokens"].update(
        sequence_length=shape.sequence, micro_batch_size=shape.micro_batch, batch_accumulation_per_replica=1
    )
    raw.setdefault("nanotron_ext", {})["memory_runtime"] = "gpu"
    return config_from_dict(raw, source=f"{shape.label} (from {base})")


def estimate(shape: Shape) -> dict[str, float]:
    cfg = planner_config(shape)
    blocks = inventory_from_config(cfg)
    mem = stage_memory(blocks, cfg.model, cfg.run, 0, optimizer="fused", runtime="gpu")
    layer = block_memory(next(b for b in blocks if b.role == "decoder"), cfg.model, cfg.run, "gpu")
    return {
        "layer": layer.saved - layer.input + layer.output,
        "activations": mem.activations,
        "peak": mem.pipeline_activations + mem.pipeline_gradients + mem.pipeline_temporaries,
    }


def _context(device: str) -> Any:
    if "MASTER_PORT" not in os.environ:  # not under torchrun: a world of this one process
        os.environ.update(rendezvous_env(0, 1, free_port()))
    if device == "cpu":
        # the CPU stand-ins of upstream's CUDA calls (gloo, "cuda" devices on the CPU), as --cpu-debug installs them
        from nanotron_ext.integration.cpu_standins.trainer import install

        install()
    from nanotron.parallel import ParallelContext

    return ParallelContext(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)


def _model(shape: Shape, ctx: Any, device: str) -> Any:
    from nanotron.config import LlamaConfig, ParallelismArgs, Qwen2Config
    from nanotron.models.base import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.models.qwen import Qwen2ForTraining
    from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode

    common = dict(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        num_hidden_layers=shape.layers,
        tie_word_embeddings=False,
        max_position_embeddings=max(shape.sequence, 2048),
        rms_norm_eps=1e-5,
    )
    if shape.family == "qwen2":
        # log_attn_probs off: with it (upstream's default) each layer's lse is also kept in a log list, by
        # reference, until the trainer clears it; the stand-in kernel does not return it.
        config = Qwen2Config(**common, _fused_rms_norm=shape.fused_norms, _use_qkv_packed=True, log_attn_probs=False)
        model_class = Qwen2ForTraining
    else:
        config, model_class = LlamaConfig(**common), LlamaForTraining
    par = ParallelismArgs(
        dp=1,
        pp=1,
        tp=1,
        pp_engine="1f1b",
        tp_mode=TensorParallelLinearMode.ALL_REDUCE,
        tp_linear_async_communication=False,
        recompute_layer=shape.recompute,
    )
    model = build_model(
        model_builder=lambda: model_class(config=config, parallel_context=ctx, parallel_config=par, random_states=None),
        parallel_context=ctx,
        dtype=torch.bfloat16,
        device=torch.device(device),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)  # norms' weights at 1
    return model


def measure(shape: Shape, ctx: Any, device: str) -> dict[str, float]:
    model = _model(shape, ctx, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (shape.micro_batch, shape.sequence), generator=gen).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = dict(input_ids=ids, label_ids=ids.roll(-1, dims=1), label_mask=mask)
    if shape.family == "qwen2":  # one document per row: positions restart at 0
        batch["position_ids"] = torch.arange(shape.sequence, device=ids.device).expand_as(ids).contiguous()
    else:
        batch["input_mask"] = mask
    model(**batch)["loss"].backward()  # warm-up: rotary caches, kernels' workspaces
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    rec = CudaMemoryRecorder(torch.device(device)) if device == "cuda" else MemoryRecorder()
    requested: dict[str, tuple[int, int]] = {}  # CUDA: bytes asked for (before the allocator's rounding), now and peak

    def mark(name: str) -> None:
        if device == "cuda":  # read before the recorder's mark resets the peaks
            stats = torch.cuda.memory_stats()
            requested[name] = (stats["requested_bytes.all.current"], stats["requested_bytes.all.peak"])
        rec.mark(name)

    layers = list(model.model.decoder)
    hooks = [block.register_forward_hook(lambda *_, i=i: mark(f"layer{i}")) for i, block in enumerate(layers)]
    rec.start()
    mark("start")
    loss = model(**batch)["loss"]
    mark("forward")
    loss.backward()
    mark("backward")
    trace = rec.stop()
    for h in hooks:
        h.remove()
    base = trace.live_at("start")
    steps = [trace.live_at(f"layer{i + 1}") - trace.live_at(f"layer{i}") for i in range(1, len(layers) - 1)]
    out = {
        "layer": float(statistics.median(steps)),
        "activations": float(trace.live_at("forward") - base),
        "peak": float(trace.peak_between("start", "backward") - base),
    }
    if requested:
        now = {k: v[0] for k, v in requested.items()}
        asked = [now[f"layer{i + 1}"] - now[f"layer{i}"] for i in range(1, len(layers) - 1)]
        after_start = [v[1] for k, v in list(requested.items())[1:]]
        out.update(
            requested_layer=float(statistics.median(asked)),
            requested_activations=float(now["forward"] - now["start"]),
            requested_peak=float(max(after_start) - now["start"]),
        )
    del model, loss, batch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="small shapes (3 layers, sequence 128, vocabulary 8192), four of them"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_path_memory: no CUDA device (use --device cpu to check the script here)")
        return 2
    _flash_memory.install()
    ctx = _context(args.device)
    rows = []
    header = f"{'shape':<26} {'what':<12} {'estimated':>12} {'measured':>12} {'est ÷ meas':>10}"
    if args.device == "cuda":  # what the tensors asked for, before the caching allocator rounds blocks up
        header += f" {'requested':>14} {'est ÷ req':>10}"
    print(header)
    print("-" * len(header))
    for shape in shapes(args.quick):
        est, meas = estimate(shape), measure(shape, ctx, args.device)
        for what in ("layer", "activations", "peak"):
            ratio = est[what] / meas[what] if meas[what] else float("nan")
            asked = meas.get(f"requested_{what}")
            tail = "" if asked is None else f" {asked / MIB:>10.1f} MiB {est[what] / asked:>10.3f}"
            print(
                f"{shape.label:<26} {what:<12} {est[what] / MIB:>8.1f} MiB {meas[what] / MIB:>8.1f} MiB "
                f"{ratio:>10.3f}{tail}"
            )
            rows.append(
                {
                    "shape": shape.__dict__,
                    "what": what,
                    "estimated_bytes": est[what],
                    "measured_bytes": meas[what],
                    "ratio": ratio,
                    "requested_bytes": asked,
                }
            )
    kernel = dict(_flash_memory.ATTENTION_KERNEL)
    print(f"attention: {kernel}")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_path_memory_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"device": device_name, "torch": torch.__version__, "quick": args.quick, "attention": kernel, "rows": rows},
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
