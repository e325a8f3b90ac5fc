"""The scenarios of ``in_run_accuracy.py``: a model shape, a pipeline, the splits and engines trained on it.

Each scenario's profile is taken as a user takes it: ``calibrate`` (standalone) first, then the in-run steps of the
config's own split (the split ``calibrate --in-run`` trains); every other split is *held out*: the profile never
saw it train. The SmolLM-135M shape is shrunk to fit the time (8 layers, sequence 128, micro-batch 1), fp32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "nanotron_ext" / "configs"


@dataclass(frozen=True)
class Split:
    """A split trained in a scenario: its name and layout string (``plan``: the config's own split, ``pick``: the
    planner's pick under the in-run profile)."""

    name: str
    layout: str


@dataclass(frozen=True)
class Scenario:
    """A model, a pipeline and what is trained on it, in interleaved rounds.

    Attributes:
        label: the name on the command line and in the tables.
        yaml_name: the config in ``nanotron_ext/configs``.
        pp, micro_batches: the pipeline and the micro-batches per step of the profile's run.
        splits: the splits trained (each under every engine of ``engines``).
        engines: the engines each split is trained under; ``micro_batches_also``: more micro-batch counts trained.
        tolerance: predicted ÷ measured must lie within 1 ± this on every held-out row.
        layers, sequence, micro_batch, tied: the shape (None: as in the YAML).
        rounds, steps_per_turn, rewarm: each run's turn in a round: ``rewarm`` untimed steps, then timed ones.
        engine: the config's engine: the one the profile's run trains under.
    """

    label: str
    yaml_name: str
    pp: int
    micro_batches: int
    splits: tuple[Split, ...]
    notes: str
    engines: tuple[str, ...] = ("1f1b",)
    micro_batches_also: tuple[int, ...] = ()
    tolerance: float = 0.05
    layers: int | None = None
    sequence: int | None = None
    micro_batch: int | None = None
    tied: bool | None = None
    rounds: int = 8
    steps_per_turn: int = 2
    rewarm: int = 0
    engine: str = "1f1b"

    def raw_config(self) -> dict[str, Any]:
        """The YAML as a dict with this scenario's overrides."""
        raw = copy.deepcopy(yaml.safe_load((CONFIGS / self.yaml_name).read_text()))
        raw["parallelism"].update(dp=1, tp=1, pp=self.pp, pp_engine=self.engine)
        raw["tokens"]["batch_accumulation_per_replica"] = self.micro_batches
        for key, value in (("sequence_length", self.sequence), ("micro_batch_size", self.micro_batch)):
            if value is not None:
                raw["tokens"][key] = value
        raw["model"]["dtype"] = "float32"
        raw.setdefault("optimizer", {})["accumulate_grad_in_fp32"] = False
        shape = raw["model"]["model_config"]
        if self.layers is not None:
            shape["num_hidden_layers"] = self.layers
        if self.tied is not None:
            shape["tie_word_embeddings"] = self.tied
        raw.pop("nanotron_ext", None)
        return raw

    def quick(self) -> Scenario:
        """Fewer rounds (a rehearsal: its figures are not checked against the tolerance's claim)."""
        return type(self)(**{**self.__dict__, "rounds": 2, "steps_per_turn": 1})


_SMOL = dict(yaml_name="smollm_135m.yaml", layers=8, sequence=128, micro_batch=1)
_SHAPE = "SmolLM-135M shape, 8 layers, seq 128, micro-batch 1"

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "smollm-pp2",
        pp=2,
        micro_batches=4,
        notes=f"{_SHAPE}, pp=2, m=4, 1F1B",
        splits=(
            Split("plan", "plan"),
            Split("pick", "pick"),
            Split("front-heavy", "E,t*6|t*2,N,H,C,X"),
            Split("t*5|t*3", "E,t*5|t*3,N,H,C,X"),
            Split("t*3|t*5", "E,t*3|t*5,N,H,C,X"),
            Split("back-heavy", "E,t*2|t*6,N,H,C,X"),
            Split("logits across the cut", "E,t*8,N,H|C,X"),
        ),
        **_SMOL,
    ),
    Scenario(
        "smollm-pp3",
        pp=3,
        micro_batches=4,
        notes=f"{_SHAPE}, pp=3, m=4, 1F1B (3 ranks)",
        splits=(
            Split("plan", "plan"),
            Split("pick", "pick"),
            Split("even", "E,t*3|t*3|t*2,N,H,C,X"),
            Split("front-heavy", "E,t*4|t*3|t,N,H,C,X"),
            Split("back-heavy", "E,t*2|t*2|t*4,N,H,C,X"),
            Split("logits across a cut", "E,t*4|t*4,N,H|C,X"),
        ),
        rounds=6,
        **_SMOL,
    ),
    Scenario(
        "smollm-engines",
        pp=2,
        micro_batches=4,
        notes=f"{_SHAPE}, pp=2, 1F1B/zb1p/zb2p at m=4 and 8",
        splits=(Split("plan", "plan"),),
        engines=("1f1b", "zb1p", "zb2p"),
        micro_batches_also=(8,),
        engine="zb2p",
        **_SMOL,
    ),
    Scenario(
        "seed-pp2",
        yaml_name="tiny_llama_large_vocab.yaml",
        pp=2,
        micro_batches=4,
        notes="seed model as shipped, pp=2, m=4 (millisecond blocks)",
        tolerance=0.10,
        rounds=10,
        steps_per_turn=3,
        rewarm=1,
        splits=(
            Split("plan", "plan"),
            Split("pick", "pick"),
            Split("E,t|t,N,H,C,X", "E,t|t,N,H,C,X"),
            Split("E|t*2,N,H,C,X", "E|t*2,N,H,C,X"),
            Split("E,t*2,N|H,C,X", "E,t*2,N|H,C,X"),
        ),
    ),
)
