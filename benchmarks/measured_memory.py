"""Estimated vs measured peak memory per stage and per term, on the CPU runtime (Nanotron 0.2's engines, gloo).

For each scenario, ``dp × pp × tp`` fresh processes build the planned split with the CPU runtime
(``nanotron_ext.runtime``), train 2 steps (the second with Adam's state alive) and record every allocation of
torch's CPU allocator (:class:`nanotron_ext.runtime.memory_measure.MemoryRecorder`, from before the model is built). The
estimate is the plan's (``nanotron_ext.costs.memory_estimate``) with ``memory_runtime: cpu`` (single-tensor AdamW, no
overhead allowance: the measured quantity is live tensor bytes, which has no CUDA context or NCCL buffers).

Per rank it prints weights, gradients and Adam state (estimated / measured tensor bytes), the peak of the
pipeline part (``train_batch_iter``), of the optimizer step, and of the whole run, with ``est ÷ meas``. The check
at the end: on every row the estimated peak is at least the measured peak and at most 1.10× it.

Scenarios: the bundled tiny example (``tiny_llama_large_vocab.yaml``: 2 layers, hidden 16, vocabulary 50277,
sequence 32, micro-batch 2, 4 micro-batches) and a SmolLM-135M-shaped model shrunk to CPU (hidden 576, 9/3 heads,
intermediate 1536, vocabulary 49152, tied embeddings; 6 layers, sequence 128, micro-batch 2, 4 micro-batches),
each in fp32 and bf16, 1F1B, AFAB, zb1p and zb2p (``nanotron_ext.zero_bubble``; the tiny example in fp32), at pp=2;
the tiny example also at tp=2 (``ALL_REDUCE``; gloo has no
reduce-scatter, so ``REDUCE_SCATTER`` cannot run here). bf16 runs AdamW on the bf16 parameters
(``accumulate_grad_in_fp32`` needs Nanotron's CUDA-only fp32 accumulator).

With ``--device cuda`` (a GPU; both ranks on one GPU, gloo between them, host-staged) the scenarios are
SmolLM-135M as shipped (30 layers, sequence 2048, micro-batch 4, 8 micro-batches) at pp=2 in bf16 and fp32,
1F1B, zb1p and zb2p, measured with CUDA's caching allocator (``torch.cuda.max_memory_allocated`` between marks). The
estimate is still the CPU runtime's (the same Llama, torch SDPA), so ``est ÷ meas`` there is a finding, not a
check: on CUDA, SDPA's fused kernels save less than the CPU path.

Usage: ``python benchmarks/measured_memory.py [--scenario LABEL] [--device cuda] [--out PATH]``. Writes
``benchmarks/results/measured_memory.json`` (``measured_memory_cuda.json`` on CUDA) or PATH; exit status 1
when the check fails (on CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mmem.measure import run_scenario, worker  # noqa: E402
from mmem.report import checked, table_rows  # noqa: E402
from mmem.scenarios import RESULTS, scenarios  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", help="run only this scenario (its label)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: SmolLM-135M on one GPU, measured with CUDA's allocator (a finding, no check)",
    )
    parser.add_argument("--out", type=Path, help="where the JSON goes (default benchmarks/results/...)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from nanotron_ext.report import table

    known = scenarios(args.device)
    chosen = [s for s in known if args.scenario in (None, s.label)]
    if not chosen:
        parser.error(f"no scenario {args.scenario!r}; scenarios: {', '.join(s.label for s in known)}")
    results, failed = [], []
    for sc in chosen:
        t0 = time.perf_counter()
        try:
            results.append(run_scenario(sc))
        except RuntimeError as exc:  # one scenario's failure must not hide the others' figures
            print(exc, file=sys.stderr, flush=True)
            failed.append(sc.label)
        print(f"{sc.label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if not results:
        print(f"every scenario failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    head, rows = table_rows(results)
    print(table(head, rows))
    print()
    print(table(head, rows, markdown=True))
    bad = checked(results, args.device)
    out = args.out or (
        RESULTS / ("measured_memory_cuda.json" if args.device == "cuda" else "measured_memory.json")
        if args.scenario is None
        else None
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    if failed:
        print(f"FAILED to run: {', '.join(failed)}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
