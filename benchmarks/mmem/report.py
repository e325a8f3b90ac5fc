"""What ``measured_memory.py`` prints: estimated against measured bytes per stage and term, and its check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The issue's bound: estimated peak within [1, 1.10] × measured.
BOUND = 1.10


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def table_rows(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = [
        "scenario",
        "stage",
        "tp",
        "weights MiB est/meas",
        "grads",
        "adam",
        "pipeline peak",
        "optimizer peak",
        "peak est",
        "peak meas",
        "est ÷ meas",
    ]
    rows = []
    for res in results:
        for r in res["rows"]:
            e, m = r["estimate"], r["measured"]
            rows.append(
                [
                    r["scenario"],
                    str(r["pp_rank"]),
                    str(r["tp_rank"]),
                    f"{_mib(e['weights'])} / {_mib(m['weights'])}",
                    f"{_mib(e['gradients'])} / {_mib(m['gradients'])}",
                    f"{_mib(e['optimizer'])} / {_mib(m['optimizer'])}",
                    f"{_mib(r['est_pipeline'])} / {_mib(m['pipeline_peak'])}",
                    f"{_mib(r['est_optimizer'])} / {_mib(m['optimizer_peak'])}",
                    _mib(r["est_peak"]),
                    _mib(m["peak"]),
                    f"{r['ratio']:.3f}",
                ]
            )
    return head, rows


def checked(results: Sequence[dict[str, Any]], device: str) -> list[str]:
    """Print the cap lines and the check (on CUDA, the ratios' range: a finding); what fails it."""
    bad = [
        f"{r['scenario']} stage {r['pp_rank']} tp {r['tp_rank']}: {r['ratio']:.4f} "
        f"({r['est_peak'] - r['measured']['peak']:+.0f} B)"
        for res in results
        for r in res["rows"]
        if not 1.0 <= r["ratio"] <= BOUND
    ]
    for res in results:
        if res.get("cap") is not None:
            worst = max(r["measured"]["peak"] for r in res["rows"])
            print(
                f"\n{res['label']}: auto took {res['auto']['engine']} under a cap of {_mib(res['cap'])} MiB "
                f"(faster, not taken: {', '.join(res['auto']['faster_not_taken']) or 'none'}); the largest "
                f"measured peak is {_mib(worst)} MiB, {worst / res['cap']:.3f} of the cap"
            )
            if worst >= res["cap"]:
                bad.append(f"{res['label']}: measured peak {_mib(worst)} MiB over the cap")
    if device == "cuda":
        ratios = [r["ratio"] for res in results for r in res["rows"]]
        print(
            f"\non CUDA (finding, not a check): est ÷ meas from {min(ratios):.3f} to {max(ratios):.3f}; the estimate "
            "is the CPU path's"
        )
        return []
    print(
        f"\ncheck: estimated peak >= measured and <= {BOUND:.2f}x on every row: "
        + ("OK" if not bad else "FAILED: " + "; ".join(bad))
    )
    return bad
