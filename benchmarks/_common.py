"""Shared pieces of the benchmarks: public model shapes, other partitioners' algorithms, timing helpers.

Other partitioners:

* torchgpipe's ``torchgpipe.balance.blockpartition.solve`` (Bárány & Grinberg, "Block partitions of
  sequences", arXiv:1308.2452), imported from the ``torchgpipe`` package when it is installed;
* DeepSpeed's ``deepspeed.runtime.utils.partition_balanced`` (the dynamic programme that minimises the
  *spread* between the heaviest and the lightest stage, DeepSpeed ≥ 0.12 after PR #4312), imported from the
  ``deepspeed`` package when it imports here.

When a package is missing, a transcription written from the algorithm's description is used instead and
the output says so (``source`` below). With both packages installed, ``partition_quality.py`` also checks
that each transcription returns the same split as the library on every random instance.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "nanotron_ext" / "configs"
RESULTS = Path(__file__).resolve().parent / "results"

#: Public model shapes shipped as Nanotron YAMLs: (label, file in nanotron_ext/configs).
SHAPES: tuple[tuple[str, str], ...] = (
    ("SmolLM-135M", "smollm_135m.yaml"),
    ("SmolLM-360M", "smollm_360m.yaml"),
    ("Llama-3.2-1B", "llama_3_2_1b.yaml"),
    ("Gemma-2B", "gemma_2b.yaml"),
    ("Llama-2-7B", "llama_2_7b.yaml"),
    ("Llama-3-8B", "llama_3_8b.yaml"),
    ("Llama-3-70B", "llama_3_70b.yaml"),
)
PPS: tuple[int, ...] = (2, 4, 8)
#: The strategies every benchmark compares (``layout`` needs a hand-written layout, so it is left out).
STRATEGIES: tuple[str, ...] = ("nanotron", "uniform", "flops", "memory", "constrained")


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    """``--machine``, ``--tflops``, ``--p2p-gbps``: the machine the simulated benchmarks plan and simulate on."""
    parser.add_argument("--machine", default=None, help="machine profile (default: the analytic H100 model)")
    parser.add_argument("--tflops", type=float, default=None, help="override: every block at this TFLOP/s")
    parser.add_argument("--p2p-gbps", type=float, default=None, help="override: p2p bandwidth in GB/s")


def machine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config overrides (``PlannerConfig.with_overrides``) that ``add_machine_args``' flags ask for."""
    return {"machine": args.machine, "tflops": args.tflops, "p2p_gbps": args.p2p_gbps}


def print_command(argv: Sequence[str] | None = None) -> None:
    """Print the command that reproduces this run, as the first line of output."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    print(f"Reproduce: `python {shlex.join([str(script), *argv[1:]])}` (from the repository root)\n")


def progress(iterable, **kwargs):
    """A tqdm bar on stderr, so stdout keeps only the tables."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)


# --- partitions as bounds ------------------------------------------------------------------------


def stage_loads(costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Sum of ``costs`` per stage for split points ``bounds`` (``bounds[0] = 0``, ``bounds[-1] = n``)."""
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]


# --- torchgpipe ------------------------------------------------------------------------------------


def blockpartition_transcribed(sequence: Sequence[float], partitions: int) -> list[list[float]]:
    """torchgpipe's block partition (Bárány & Grinberg), written from the paper's steps (1)–(3).

    Costs are scaled to [0, 1] by ``(x − min) / (max − min)``; start from equal block counts; repeatedly take
    a heaviest block ``p`` and a lightest block ``q`` closest to it, and move one element into ``q`` from its
    neighbour ``h`` on ``p``'s side, until heaviest ≤ lightest + 1. A heuristic: not optimal, may leave a
    block empty, and (like the library) may not terminate — callers run it under :func:`time_limit`.
    """
    n = len(sequence)
    if partitions < 1 or n < partitions:
        raise ValueError(f"cannot split {n} items into {partitions} blocks")
    lo, span = min(sequence), max(sequence) - min(sequence)
    scaled = [0.0] * n if span == 0 else [(x - lo) / span for x in sequence]
    cuts = [n // partitions * (i + 1) for i in range(partitions - 1)] + [n]

    def size(i: int) -> float:
        return sum(scaled[(cuts[i - 1] if i else 0) : cuts[i]])

    while True:
        heaviest, p = max((size(i), i) for i in range(partitions))
        while True:
            lightest, q = min((size(i), i) for i in range(partitions))
            if heaviest <= lightest + 1:
                starts = [0, *cuts[:-1]]
                return [list(sequence[a:b]) for a, b in zip(starts, cuts)]
            if p < q:  # take the last element of block q − 1
                h = q - 1
                cuts[h] -= 1
            else:  # take the first element of block q + 1
                h = q + 1
                cuts[q] += 1
            if p == h:
                break


def _torchgpipe_solve() -> tuple[Callable[[list[float], int], list[list[float]]], str]:
    try:
        from torchgpipe.balance.blockpartition import solve
    except ImportError:
        return blockpartition_transcribed, "transcription (torchgpipe not installed)"
    return solve, f"torchgpipe {importlib.metadata.version('torchgpipe')}"


# --- DeepSpeed -------------------------------------------------------------------------------------


def partition_balanced_transcribed(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` (≥ 0.12), written from its description: the linear-partition DP.

    State ``(i, j)``: the first ``i`` items in ``j`` parts. For every last cut ``k`` it extends the kept
    state of ``(k, j − 1)`` — its heaviest and lightest part — by the part ``k:i`` and keeps the ``k`` whose
    heaviest − lightest is smallest (the last such ``k`` on ties). With ``n ≤ num_parts`` items it falls back
    to one item per part (trailing parts empty). It minimises the spread greedily per state, not the slowest
    part, so its heaviest part can exceed the optimum.

    Returns:
        ``num_parts + 1`` split points, DeepSpeed's format.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    best_max = [[inf] * (m + 1) for _ in range(n + 1)]
    best_min = [[inf] * (m + 1) for _ in range(n + 1)]
    best_spread = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    best_max[0][0] = best_spread[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(best_max[k][j - 1], part), min(best_min[k][j - 1], part)
                if best_spread[i][j] >= hi - lo:
                    best_spread[i][j], best_max[i][j], best_min[i][j], cut[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def _deepspeed_partition_balanced() -> tuple[Callable[[list[float], int], list[int]], str]:
    try:
        import logging

        logging.disable(logging.WARNING)  # DeepSpeed logs its accelerator choice on import
        try:
            from deepspeed.runtime.utils import partition_balanced
        finally:
            logging.disable(logging.NOTSET)
    except Exception as exc:  # any import failure (missing deps, no CUDA) means "fall back"
        return (
            partition_balanced_transcribed,
            f"transcription (deepspeed does not import: {type(exc).__name__})",
        )
    return partition_balanced, f"deepspeed {importlib.metadata.version('deepspeed')}"


# --- a uniform interface ---------------------------------------------------------------------------


class Timeout(Exception):
    """An external partitioner ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Timeout` in the main thread after ``seconds`` (Unix ``SIGALRM``)."""

    def expire(signum, frame):
        raise Timeout(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Partitioner:
    """One way to split a cost vector: ``split(costs, pp)`` returns ``pp + 1`` split points."""

    name: str
    source: str
    split: Callable[[Sequence[float], int], list[int]]


def external_partitioners(limit_s: float = 1.0) -> list[Partitioner]:
    """torchgpipe's block partition and DeepSpeed's ``partition_balanced``, library or transcription."""
    solve, tg_source = _torchgpipe_solve()
    balanced, ds_source = _deepspeed_partition_balanced()

    def torchgpipe_split(costs: Sequence[float], pp: int) -> list[int]:
        with time_limit(limit_s):
            blocks = solve(list(map(float, costs)), pp)
        bounds = [0]
        for block in blocks:
            bounds.append(bounds[-1] + len(block))
        return bounds

    def deepspeed_split(costs: Sequence[float], pp: int) -> list[int]:
        return [int(b) for b in balanced(list(map(float, costs)), pp)]

    return [
        Partitioner("torchgpipe", tg_source, torchgpipe_split),
        Partitioner("deepspeed", ds_source, deepspeed_split),
    ]


def transcriptions() -> dict[str, Callable[[Sequence[float], int], list[int]]]:
    """The transcriptions, as ``split(costs, pp) -> bounds``, to check against the libraries."""

    def tg(costs: Sequence[float], pp: int) -> list[int]:
        bounds = [0]
        for block in blockpartition_transcribed(list(map(float, costs)), pp):
            bounds.append(bounds[-1] + len(block))
        return bounds

    return {
        "torchgpipe": tg,
        "deepspeed": lambda c, pp: partition_balanced_transcribed(list(map(float, c)), pp),
    }


def fmt_ratio(x: float) -> str:
    return "-" if x != x else f"{x:.3f}x"  # NaN → "-"


def check_moves(label: str, ratios: Sequence[float], gains: Sequence[float], tolerance: float) -> list[str]:
    """A re-plan benchmark's verdict on its moved runs (issue 42), printed: the median of measured ÷ predicted after
    the move within 1 ± ``tolerance``, and the median step after the move at or under the step before. Returns the
    failed checks."""
    import statistics

    med, gain = statistics.median(ratios), statistics.median(gains)
    print(
        f"{label}: after the move, measured / predicted median {med:.3f} (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}); after / before median {gain:.3f} (range {min(gains):.3f}-{max(gains):.3f})"
    )
    failures = []
    if abs(med - 1) > tolerance:
        failures.append(f"{label}: measured after the move is {med:.3f}x the prediction (tolerance {tolerance})")
    if gain > 1:
        failures.append(f"{label}: the step after the move ({gain:.3f}x) is slower than before it")
    return failures


def finish(out: Path, results: object, failures: Sequence[str]) -> int:
    """Write a benchmark's results and failed checks as JSON to ``out``, print the failures; the exit code."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": results, "failures": list(failures)}, indent=1))
    print(f"\nwrote {out}")
    for line in failures:
        print(f"CHECK FAILED: {line}")
    return 1 if failures else 0
