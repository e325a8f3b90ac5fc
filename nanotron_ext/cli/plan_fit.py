"""``plan --fit``: the cheapest changes whose every stage fits the memory, as a table or as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from nanotron_ext.cli.common import EXIT_INVALID, EXIT_OK, Notes, titled_table
from nanotron_ext.config import PlannerConfig
from nanotron_ext.report import format_seconds, human_bytes
from nanotron_ext.simulate.fit_search import AS_CONFIGURED, FitRow

__all__ = ["FIT_ROWS", "fit_table", "left_out"]

#: Before a figure that is the least memory any split needs (no split of that row fits; it was not planned).
AT_LEAST = "≥ "
#: Rows ``plan --fit`` prints: the config as it is, then the cheapest that fit, then the nearest that do not.
FIT_ROWS = 8


def left_out(rows: Sequence[FitRow], shown: Sequence[FitRow]) -> str:
    """What ``plan --fit`` did not print: how many candidates, how many of them fit, and how to see them."""
    hidden = [r for r in rows if r not in shown]
    fitting = sum(r.fits for r in hidden)
    return (
        f"{len(hidden)} more candidate{'s' if len(hidden) != 1 else ''} left out ({fitting} of them "
        f"fit{'' if fitting != 1 else 's'}): --all prints every one, --json lists them all"
    )


def fit_table(cfg: PlannerConfig, *, as_json: bool, every: bool = False) -> int:
    """``plan --fit``: the candidates of :func:`~nanotron_ext.simulate.fit_search.fit_search`, the first
    :data:`FIT_ROWS` of them (``every``: all, as ``--json`` gives); exit 0 when one fits."""
    import sys

    from tqdm import tqdm

    from nanotron_ext.simulate.fit_search import fit_search

    with tqdm(desc="fit", unit="candidate", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        limit, rows = fit_search(cfg, progress=advance)
    if as_json:
        print(
            json.dumps(
                {
                    "limit": None if limit is None else dataclasses.asdict(limit),
                    "rows": [{**dataclasses.asdict(r), "gpus": r.gpus} for r in rows],
                },
                indent=2,
            )
        )
        return EXIT_OK if any(r.fits for r in rows) else EXIT_INVALID
    shown = [r for r in rows if r.change == AS_CONFIGURED] + [r for r in rows if r.change != AS_CONFIGURED]
    shown = shown if every else shown[:FIT_ROWS]
    table_rows = [
        [
            r.change,
            r.tp * r.pp,
            f"{AT_LEAST if r.least else ''}{human_bytes(r.peak)}",
            "-" if limit is None else f"{AT_LEAST if r.least else ''}{r.peak / limit.bytes:.0%}",
            "-" if r.step_time is None else format_seconds(r.step_time),
            "yes" if r.fits else "no",
        ]
        for r in shown
    ]
    where = "no memory limit is known (a CPU profile, or memory_runtime: cpu)" if limit is None else f"{limit}"
    print(
        titled_table(
            f"{cfg.source}: changes planned by {cfg.ext.cost_strategy!r} under {where}; "
            f"{len(rows)} candidates, {sum(r.fits for r in rows)} fit",
            ["change", "GPUs per replica", "largest stage", "of limit", "sim. step", "fits"],
            table_rows,
            Notes(),
        )
    )
    if any(r.least for r in shown):
        print(f"\n{AT_LEAST.strip()}: no split of that change fits; the least memory any split's largest stage needs")
    if len(shown) < len(rows):
        print(f"\n{left_out(rows, shown)}")
    if limit is not None and not any(r.fits for r in rows):
        print(
            "\nnothing here fits: what is left is a smaller `tokens.micro_batch_size` or sequence (it changes the "
            "training), or a GPU with more memory"
        )
    return EXIT_OK if any(r.fits for r in rows) else EXIT_INVALID
