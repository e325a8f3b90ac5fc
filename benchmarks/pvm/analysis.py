"""``predict_vs_measure.py``'s results read back in the launcher: one :class:`Row` per split (measured with an
interval of the median, and predicted), the order checks over a scenario's splits, and one rank's measured step
taken apart (item 3)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.stats import kendall_tau, median_interval

#: Predicted ÷ measured must lie within this on every distinct split.
RATIO_RANGE = (0.95, 1.05)
#: The confidence of the interval of a median; an interval the steps cannot reach shows its own.
CONFIDENCE = 0.95


@dataclass
class Row:
    """One split of one scenario, measured and predicted (seconds)."""

    name: str
    same_as: str | None  # an earlier split with the same model: trained once
    stages: list[str]
    ok: bool
    vocab_shards: int
    steps: list[float]  # every timed step, slowest rank
    median: float
    low: float
    high: float
    coverage: float
    predicted: float
    predicted_planning: float
    predicted_one_p2p: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.median


def step_times(run: dict[str, Any]) -> list[float]:
    """Every timed step of a model: the slowest rank's (its clock stops at the closing barrier)."""
    records = run["records"]
    return [max(rank[i]["step"] for rank in records) for i in range(len(records[0]))]


def run_of(result: dict[str, Any], name: str) -> dict[str, Any]:
    """The trained run of split ``name`` (splits with the same model share one)."""
    return next(r for r in result["runs"].values() if name in r["names"])


def analyse(result: dict[str, Any]) -> list[Row]:
    """One row per split of a scenario's result, in the scenario's order."""
    rows, first = [], {}
    for name, s in result["splits"].items():
        steps = step_times(run_of(result, name))
        low, high, coverage = median_interval(steps)
        same = first.setdefault(s["key"], name)
        rows.append(
            Row(
                name,
                None if same == name else same,
                s["stages"],
                s["ok"],
                s["vocab_shards"],
                steps,
                statistics.median(steps),
                low,
                high,
                coverage,
                s["predicted"],
                s["predicted_planning"],
                s.get("predicted_one_p2p", math.nan),
            )
        )
    return rows


@dataclass
class OrderChecks:
    """Kendall's τ, significant misordered pairs and the default's rank, over a scenario's distinct splits.

    Attributes:
        misordered: pairs (a, b) whose intervals are disjoint with a measured faster, but a predicted slower.
        valid: the distinct splits with a gradient on every stage; ``fastest``: the fastest of them, measured.
        default: the ``default`` split (None: a scenario of hand layouts only, issue 32's).
        default_ok: the default measured fastest or within the fastest one's interval (True without a default).
        bad_ratio: the distinct splits whose predicted ÷ measured lies outside :data:`RATIO_RANGE`.
    """

    tau: float
    distinct: list[Row]
    misordered: list[tuple[Row, Row]]
    valid: list[Row]
    fastest: Row
    default: Row | None
    default_ok: bool
    bad_ratio: list[Row]

    def record(self) -> dict[str, Any]:
        """The checks as the results JSON holds them (split names)."""
        return {
            "tau": self.tau,
            "misordered": [[a.name, b.name] for a, b in self.misordered],
            "default_ok": self.default_ok,
            "fastest": self.fastest.name,
            "bad_ratio": [[r.name, r.ratio] for r in self.bad_ratio],
        }


def order_checks(rows: Sequence[Row]) -> OrderChecks:
    """The order checks over the distinct splits of ``rows``."""
    distinct = [r for r in rows if r.same_as is None]
    tau = kendall_tau([r.median for r in distinct], [r.predicted for r in distinct])
    misordered = [(a, b) for a in distinct for b in distinct if a.high < b.low and a.predicted > b.predicted]
    valid = [r for r in distinct if r.ok]
    fastest = min(valid, key=lambda r: r.median)
    default = next((r for r in rows if r.name == "default"), None)
    bad_ratio = [r for r in distinct if not RATIO_RANGE[0] <= r.ratio <= RATIO_RANGE[1]]
    return OrderChecks(
        tau, distinct, misordered, valid, fastest, default, default is None or default.median <= fastest.high, bad_ratio
    )


def measured_parts(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rank's step taken apart (medians over timed steps): compute inside the pipeline, receive and send
    waits, the wait in collectives after it, the busy time after it (update), and the closing wait."""

    def med(f: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(f(r) for r in records)

    return {
        "step": med(lambda r: r["step"]),
        "compute": med(lambda r: r["pipeline"] - r["pipeline_idle"]),
        "recv": med(lambda r: r["recv_wait"]),
        "send": med(lambda r: r["send_wait"]),
        "after_wait": med(lambda r: r["collective_wait"]),
        "update": med(lambda r: r["busy"] - (r["pipeline"] - r["pipeline_idle"])),
        "end": med(lambda r: r["end_wait"]),
        "cpu": med(lambda r: r["cpu"]),
        "idle": med(lambda r: r["idle"]),
    }
