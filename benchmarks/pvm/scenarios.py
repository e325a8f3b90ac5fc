"""The scenarios of ``predict_vs_measure.py`` (a model, a batch shape, a pipeline and the splits trained on it),
and :class:`RankSpec`, what one scenario's rank processes read."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "nanotron_ext" / "configs"
RESULTS = ROOT / "benchmarks" / "results"
ENGINE = "1f1b"
#: The splits of the seed model at pp=2 (the chain at K = 2, 3, 4, planned under the profile). The default comes
#: first, so that a split equal to it is shown as ``(= default)``.
SEED_SPLITS = ("default", "nanotron", "uniform", "flop-optimal", "chain K=2", "chain K=3", "chain K=4")
#: The splits of the SmolLM shape; ``shift ±2``: two decoder layers more (fewer) on PP0 than the default has, a
#: deliberately shifted split (``layout`` strategy).
SMOL_SPLITS = ("default", "flop-optimal", "uniform", "nanotron", "shift +2", "shift -2")
#: Issue 32's hand layouts of the 8-layer SmolLM shape at pp=2 (no other scenario trains them).
LAYOUTS = (
    ("front-heavy", "E,t*6|t*2,N,H,C,X"),
    ("even", "E,t*4|t*4,N,H,C,X"),
    ("back-heavy", "E,t*2|t*6,N,H,C,X"),
    # The 25 MB of fp32 logits across the cut (PP1 holds only the cast and the loss: its optimizer skipped).
    ("logits across the cut", "E,t*8,N,H|C,X"),
)


@dataclass(frozen=True)
class Scenario:
    """A model, batch shape and pipeline size, and the splits trained on it."""

    label: str
    yaml_name: str
    pp: int
    n_micro_batches: int
    splits: tuple[str, ...]
    notes: str
    sequence_length: int | None = None  # None: as in the YAML
    micro_batch_size: int | None = None
    num_hidden_layers: int | None = None
    #: Each split's turn in a round: ``rewarm`` untimed steps, then ``steps_per_turn`` timed ones.
    rounds: int = 8
    steps_per_turn: int = 1
    rewarm: int = 0
    #: ``calibrate`` again after every this many rounds (0: only at the start).
    calibrate_every: int = 4
    #: Print what ``vocab_shards: auto`` picks under the profile (untied models only).
    auto: bool = False
    #: Item 3: the splits whose step is taken apart per stage, measured and predicted.
    decompose: tuple[str, ...] = ()
    #: Splits trained a second time, in the same rounds, with every queued send posted at once (the runtime's
    #: ``sends="eager"``) instead of Nanotron's one tensor of a cut per communication call: that fix's measured effect.
    eager_sends: tuple[str, ...] = ()
    #: Calibrations back to back at the start (issue 32: how far apart their predictions land).
    calibrations_first: int = 1
    #: Named hand layouts (``layout`` strategy) trained as splits of those names.
    layouts: tuple[tuple[str, str], ...] = ()
    tied: bool | None = None  # None: as in the YAML
    #: The splits whose calibrations must agree within 3 % (issue 32's three layouts; the others' spread is printed).
    repeatable: tuple[str, ...] = ()

    def raw_config(self) -> dict[str, Any]:
        """The YAML as a dict with this scenario's overrides (pp, 1F1B, fp32, batch shape)."""
        raw = copy.deepcopy(yaml.safe_load((CONFIGS / self.yaml_name).read_text()))
        raw["parallelism"].update(dp=1, tp=1, pp=self.pp, pp_engine=ENGINE)
        raw["tokens"]["batch_accumulation_per_replica"] = self.n_micro_batches
        for key, value in (("sequence_length", self.sequence_length), ("micro_batch_size", self.micro_batch_size)):
            if value is not None:
                raw["tokens"][key] = value
        raw["model"]["dtype"] = "float32"
        raw.setdefault("optimizer", {})["accumulate_grad_in_fp32"] = False
        if self.num_hidden_layers is not None:
            raw["model"]["model_config"]["num_hidden_layers"] = self.num_hidden_layers
        if self.tied is not None:
            raw["model"]["model_config"]["tie_word_embeddings"] = self.tied
        raw.pop("nanotron_ext", None)
        return raw


def scenarios(quick: bool) -> list[Scenario]:
    """The scenarios; ``quick``: smaller models and fewer rounds (a minute or two on a busy 2-core machine)."""
    return [_seed_pp2(quick), *_smol_scenarios(quick), _seed_pp4(quick)]


def _seed_pp2(quick: bool) -> Scenario:
    # Millisecond, memory-bound blocks: a turn starts with an untimed step that re-warms the caches.
    return Scenario(
        "seed-pp2",
        "tiny_llama_large_vocab.yaml",
        2,
        4,
        SEED_SPLITS,
        "seed model as shipped, pp=2, m=4",
        rounds=3 if quick else 10,
        steps_per_turn=2 if quick else 3,
        rewarm=1,
        # Its calibration takes ~3 s: every 2 rounds, 6 in all (a single one wanders by tens of % here).
        calibrate_every=0 if quick else 2,
        auto=True,
        decompose=("default", "chain K=2"),
        eager_sends=("default", "chain K=2", "chain K=4"),
    )


def _smol_scenarios(quick: bool) -> list[Scenario]:
    """The SmolLM shape at m = 2 and 4, at pp=3, and issue 32's hand layouts."""
    layers, seq = (4, 32) if quick else (8, 128)
    smol = dict(
        yaml_name="smollm_135m.yaml",
        pp=2,
        splits=SMOL_SPLITS,
        sequence_length=seq,
        micro_batch_size=1,
        num_hidden_layers=layers,
        rounds=3 if quick else 8,
        steps_per_turn=1 if quick else 2,
        # Its calibration takes ~10 s (the tied embedding's 113 MB all-reduce): once more at the end only.
        calibrate_every=0 if quick else 8,
    )
    shape = f"SmolLM-135M shape, {layers} layers, seq {seq}, micro-batch 1"
    return [
        Scenario("smollm-m2", n_micro_batches=2, notes=f"{shape}, m=2", **smol),
        Scenario(
            "smollm-m4",
            n_micro_batches=4,
            notes=f"{shape}, m=4",
            decompose=("default",),
            eager_sends=("default",),
            **smol,
        ),
        # Issue 29: Nanotron's rule ships the logits across one cut (lm_head | cast, loss), hidden states across the
        # other; each cut is priced by what crosses it.
        Scenario(
            "smollm-pp3",
            n_micro_batches=4,
            notes=f"{shape}, pp=3, m=4 (logits across a cut)",
            **{**smol, "pp": 3, "splits": ("default", "nanotron", "flop-optimal")},
        ),
        # Issue 32: three layouts no other scenario trains, untied; three calibrations back to back, each predicting
        # every layout (repeatability), then training (accuracy of each calibration).
        # The layouts name 8 decoder layers, so --quick keeps 8 here (and its shorter sequence).
        Scenario(
            "smollm-layouts",
            n_micro_batches=4,
            notes=f"SmolLM-135M shape, 8 layers, seq {seq}, micro-batch 1, untied, m=4, hand layouts",
            **{
                **smol,
                "splits": tuple(name for name, _ in LAYOUTS),
                "calibrate_every": 0,
                "rounds": 3 if quick else 6,
                "num_hidden_layers": 8,
            },
            calibrations_first=3,
            layouts=LAYOUTS,
            tied=False,
            repeatable=tuple(name for name, _ in LAYOUTS[:3]),
        ),
    ]


def _seed_pp4(quick: bool) -> Scenario:
    return Scenario(
        "seed-pp4",
        "tiny_llama_large_vocab.yaml",
        4,
        4,
        ("default", "flop-optimal", "uniform", "nanotron"),
        "seed model, 6 layers, pp=4, m=4",
        num_hidden_layers=6,
        rounds=2 if quick else 6,
        steps_per_turn=2 if quick else 3,
        rewarm=1,
        calibrate_every=0 if quick else 2,
    )


@dataclass(frozen=True)
class RankSpec:
    """What the ranks of one scenario read, as JSON: its config and splits, the rounds, where to save the profiles.

    Attributes:
        raw: the scenario's config as a dict (:meth:`Scenario.raw_config`).
        warmup: untimed steps of each split before its first turn.
        planning_profile, median_profile: where rank 0 saves the first calibration (the splits are planned under
            it) and the median of every calibration of the run (the predictions use it).
        progress: the file rank 0 rewrites with its turns done (the launcher's progress bar reads it).
    """

    label: str
    raw: dict[str, Any]
    pp: int
    splits: tuple[str, ...]
    rounds: int
    steps_per_turn: int
    rewarm: int
    calibrate_every: int
    auto: bool
    decompose: tuple[str, ...]
    eager_sends: tuple[str, ...]
    calibrations_first: int
    layouts: tuple[tuple[str, str], ...]
    planning_profile: str
    median_profile: str
    warmup: int = 1
    progress: str = ""

    @classmethod
    def of(cls, sc: Scenario, planning_profile: str, median_profile: str) -> RankSpec:
        """The spec of scenario ``sc``, its profiles saved at those paths."""
        return cls(
            sc.label,
            sc.raw_config(),
            sc.pp,
            sc.splits,
            sc.rounds,
            sc.steps_per_turn,
            sc.rewarm,
            sc.calibrate_every,
            sc.auto,
            sc.decompose,
            sc.eager_sends,
            sc.calibrations_first,
            sc.layouts,
            planning_profile,
            median_profile,
        )

    @property
    def n_calibrations(self) -> int:
        """The calibrations of the run: those back to back first, then one after every ``calibrate_every`` rounds."""
        every = self.calibrate_every
        return self.calibrations_first + (self.rounds // every if every else 0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        """The spec :meth:`to_json` wrote (JSON's lists back to tuples)."""
        data = json.loads(text)
        for key in ("splits", "decompose", "eager_sends"):
            data[key] = tuple(data[key])
        data["layouts"] = tuple((name, layout) for name, layout in data["layouts"])
        return cls(**data)
