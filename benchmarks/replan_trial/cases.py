"""The cases of ``replan_cpu.py``: where a run starts, whether a transient load is on, and what must hold.

Every case trains the SmolLM-135M shape of ``in_run_accuracy.py`` (8 layers, sequence 128, micro-batch 1, fp32,
untied) at pp = 2, m = 4, 1F1B, with ``--replan-after K``, each rank on a core of its own, beside its *twin*: the same
run with ``min_gain: 0.99``, which re-plans at the same step (its profile, its pause) and stays. The memory cap is
100 GiB, so no split is ruled out by memory.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

#: The ``in_run_accuracy.py`` scenario whose shape every case trains.
SHAPE_SCENARIO = "smollm-pp2"
#: ``memory_cap_gib`` of every case: far above any split, so that the trial chooses on time alone.
MEMORY_CAP_GIB = 100.0


class Check(enum.Enum):
    """What a case must show in every round."""

    NO_SLOWER = "the run ends no slower than its twin, which stayed (within the twin's noise)"
    MOVES_FASTER = "the run moves and ends faster than its twin, which stayed on the bad start"
    KEEPS_FASTEST = "the plan the run keeps measured fastest of those it tried, or inside the fastest one's interval"


@dataclass(frozen=True)
class Case:
    """One case: its label, the split it starts on, whether a CPU hog shares rank 0's core until the re-plan
    decides, and its check."""

    label: str
    start: str
    hog: bool
    check: Check
    notes: str
    min_gain: float | None = None  # the run's (the twin's is 0.99); None: the default

    def config(self, folder: Path, *, twin: bool, after: int) -> Path:
        """The case's YAML (the twin's: ``min_gain: 0.99``)."""
        from in_run.scenarios import SCENARIOS

        shape = next(s for s in SCENARIOS if s.label == SHAPE_SCENARIO)
        raw: dict[str, Any] = copy.deepcopy(shape.raw_config())
        raw["parallelism"]["cost_strategy"] = "layout"
        min_gain = 0.99 if twin else self.min_gain
        replan: dict[str, Any] = {"after_steps": after, **({} if min_gain is None else {"min_gain": min_gain})}
        raw["nanotron_ext"] = {"layout": self.start, "memory_cap_gib": MEMORY_CAP_GIB, "replan": replan}
        path = folder / f"{self.label.split()[0]}{'_twin' if twin else ''}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path


CASES: tuple[Case, ...] = (
    Case(
        "transient load",
        "E,t*8,N|H,C,X",
        True,
        Check.NO_SLOWER,
        "started on the split measured fastest (docs/replan.md); a hog on rank 0's core during steps 1..K only",
    ),
    Case(
        "bad start",
        "E,t*2|t*6,L",
        False,
        Check.MOVES_FASTER,
        "most decoder layers on the last stage, a quiet machine",
    ),
    Case(
        "close call",
        "E,t*7|t,L",
        False,
        Check.KEEPS_FASTEST,
        "one of the two splits measured fastest in turn (docs/in-run.md), the other within the profile's error of it; "
        "min_gain 0, so that every plan within that error is tried whichever the profile prices faster",
        min_gain=0.0,
    ),
)
