"""The plan a checkpoint was trained with, as plain data saved beside Nanotron's files.

The launcher writes ``nanotron_ext_plan.json`` into every checkpoint folder twice: first with ``complete: false``,
before Nanotron writes a file there, then with ``complete: true`` once every rank has written all of its files. A
folder whose record says ``false`` was cut off while it was being written; one without a record was written by
Nanotron alone. The record names the split (block → stage), the vocabulary shards, the engine and the strategy,
pp/tp/dp and ZeRO, the model's shape and a digest of the machine model that priced the split, so a resume can
keep the split or say exactly what moves. The complete record also lists every file the save wrote, with its size and
checksum (:mod:`nanotron_ext.checkpoint.digest`), so a resume can prove the files before anything loads
(:mod:`nanotron_ext.checkpoint.verify`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from nanotron_ext import __version__
from nanotron_ext.blocks import vocab_slices
from nanotron_ext.checkpoint.digest import SavedFile
from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import CheckpointError
from nanotron_ext.machine import MachineProfile
from nanotron_ext.outputs import atomic_write_text
from nanotron_ext.partition.layout_string import split_text
from nanotron_ext.plan import Plan
from nanotron_ext.plan.v_plan import VPlan
from nanotron_ext.report import table

__all__ = [
    "RECORD_FILE",
    "RECORD_FORMAT",
    "Difference",
    "ModelKey",
    "PlanRecord",
    "read_record",
    "record_for",
    "side_by_side",
]

RECORD_FILE = "nanotron_ext_plan.json"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class ModelKey:
    """The model's shape as far as its saved state depends on it."""

    family: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    tie_word_embeddings: bool

    def __str__(self) -> str:
        tied = ", tied" if self.tie_word_embeddings else ""
        return (
            f"{self.family}: {self.num_hidden_layers} layers, hidden {self.hidden_size}, vocab {self.vocab_size}{tied}"
        )


@dataclass(frozen=True)
class Difference:
    """One way two plans differ: ``what`` and its value in each, as the user would write it."""

    what: str
    recorded: str
    now: str

    def __str__(self) -> str:
        return f"{self.what}: {self.recorded} -> {self.now}"


@dataclass(frozen=True)
class PlanRecord:
    """The plan of one checkpoint.

    Attributes:
        step: the training step the checkpoint holds (None for a plan not tied to a checkpoint).
        complete: False while the checkpoint is being written.
        strategy: the strategy that chose the split (kept across resumes that keep the split).
        engine: the pipeline engine (``1f1b``, ``afab``, ``zb1p``).
        pp, tp, dp, zero_stage: Nanotron's parallelism and ZeRO stage.
        blocks: the pipeline blocks' module paths, in forward order.
        stages: the PP rank of each block.
        v_stages: under ``pp_engine: zbv``, the virtual stage of each block (its chunk of the V; empty otherwise).
        vocab_bounds: rows ``[lo, hi)`` of the lm_head each vocabulary shard holds (empty: Nanotron's lm_head).
        machine: the name of the machine model that priced the split.
        machine_digest: SHA-256 of that machine model's JSON, to tell a re-measured profile from the same one.
        model: the model's shape.
        written_by: the nanotron_ext version that wrote the record.
        format: the record's own format version.
        files: every file the save wrote into the folder (this record aside), with its size and checksum; None
            in a record written before checkpoints listed their files (its files cannot be verified).
    """

    step: int | None
    complete: bool
    strategy: str
    engine: str
    pp: int
    tp: int
    dp: int
    zero_stage: int
    blocks: tuple[str, ...]
    stages: tuple[int, ...]
    vocab_bounds: tuple[tuple[int, int], ...] = ()
    machine: str = ""
    machine_digest: str = ""
    model: ModelKey | None = None
    written_by: str = ""
    format: int = RECORD_FORMAT
    files: tuple[SavedFile, ...] | None = None
    v_stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.stages) or self.v_stages and len(self.v_stages) != len(self.blocks):
            raise CheckpointError(
                f"a plan record names {len(self.blocks)} blocks but {len(self.stages)} stages "
                f"({len(self.v_stages)} virtual stages)"
            )

    @property
    def vocab_shards(self) -> int:
        """Vocabulary-shard blocks (1: Nanotron's lm_head)."""
        return max(1, len(self.vocab_bounds))

    @property
    def layout(self) -> str:
        """The split as a layout string (``E,t|t,L``; a V's ``2 pp`` chunks), or as stage labels where a block has no
        layout symbol."""
        if self.v_stages:
            return split_text(self.blocks, self.v_stages, 2 * self.pp)
        return split_text(self.blocks, self.stages, self.pp)

    def differences(self, now: PlanRecord) -> list[Difference]:
        """What differs between this (recorded) plan and ``now``, in the order a user would check it."""
        out = []

        def differ(what: str, a: Any, b: Any) -> None:
            if a != b:
                out.append(Difference(what, str(a), str(b)))

        differ("model", self.model or "unknown", now.model or "unknown")
        differ("pp", self.pp, now.pp)
        differ("tp", self.tp, now.tp)
        differ("dp", self.dp, now.dp)
        differ("ZeRO stage", self.zero_stage, now.zero_stage)
        differ("vocabulary shards", self.vocab_shards, now.vocab_shards)
        differ("split", self.layout, now.layout)
        differ("engine", self.engine, now.engine)
        differ("strategy", self.strategy, now.strategy)
        differ("machine", f"{self.machine} ({self.machine_digest[:12]})", f"{now.machine} ({now.machine_digest[:12]})")
        return out

    def same_state_layout(self, now: PlanRecord) -> bool:
        """Whether every parameter and optimizer shard sits where it sat when this was saved (so Nanotron's own
        loader, which reads the files of its own ranks by position, reads the right ones)."""
        return (
            (self.blocks, self.stages, self.pp, self.tp, self.vocab_bounds, self.zero_stage)
            == (now.blocks, now.stages, now.pp, now.tp, now.vocab_bounds, now.zero_stage)
            and (self.zero_stage == 0 or self.dp == now.dp)
            and not self.vocab_bounds
        )

    def side_by_side(self, now: PlanRecord, *, now_title: str = "now") -> str:
        """The two plans in one table, one row per field, with a mark where they differ."""
        return side_by_side(self, now, now_title=now_title)

    def fields_shown(self) -> list[tuple[str, str]]:
        """``(field, value)`` as a person reads the plan: its split, parallelism, engine, strategy and machine."""
        return [
            ("step", "-" if self.step is None else str(self.step)),
            ("split", self.layout),
            ("pp / tp / dp", f"{self.pp} / {self.tp} / {self.dp}"),
            ("ZeRO stage", str(self.zero_stage)),
            ("vocabulary shards", str(self.vocab_shards)),
            ("engine", self.engine),
            ("strategy", self.strategy),
            ("machine", f"{self.machine} ({self.machine_digest[:12]})"),
        ]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.v_stages:  # a contiguous split's record reads as before, in versions without V records too
            del out["v_stages"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, origin: str = "<record>") -> PlanRecord:
        """The record of a dict as :meth:`to_dict` writes it.

        Raises:
            CheckpointError: not a record this version reads (names the origin and what is wrong).
        """
        if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(
                f"{origin}: not a nanotron_ext plan record of format {RECORD_FORMAT} (format {got!r}); "
                f"it was written by another nanotron_ext version: resume with that version, or with "
                f"`nanotron_ext: {{resume_plan: replan}}`"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CheckpointError(
                f"{origin}: unknown plan-record field(s) {unknown}; it was written by a newer "
                f"nanotron_ext: upgrade to read it"
            )
        try:
            values = dict(d)
            values["blocks"] = tuple(values["blocks"])
            values["stages"] = tuple(int(s) for s in values["stages"])
            values["v_stages"] = tuple(int(s) for s in values.get("v_stages", ()))
            values["vocab_bounds"] = tuple((int(a), int(b)) for a, b in values.get("vocab_bounds", ()))
            if values.get("model") is not None:
                values["model"] = ModelKey(**values["model"])
            if values.get("files") is not None:
                values["files"] = tuple(SavedFile(**f) for f in values["files"])
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{origin}: the plan record is malformed ({type(exc).__name__}: {exc}); the "
                f"checkpoint's {RECORD_FILE} was edited or damaged"
            ) from None

    def write(self, folder: Path) -> Path:
        """Write (atomically) into a checkpoint folder; returns the file."""
        return atomic_write_text(Path(folder) / RECORD_FILE, self.to_json() + "\n")


def side_by_side(recorded: PlanRecord | None, now: PlanRecord, *, now_title: str = "now") -> str:
    """A checkpoint's recorded plan beside ``now`` in one table, one row per field, marked where they differ; a
    checkpoint without a record (Nanotron saved it alone) shows ``not recorded``."""
    shown = recorded.fields_shown() if recorded is not None else [(w, "not recorded") for w, _ in now.fields_shown()]
    rows = []
    for (what, a), (_, b) in zip(shown, now.fields_shown()):
        if what == "step":
            b = "-"
        mark = "" if what == "step" or recorded is None or a == b else "differs"
        rows.append([what, a, b, mark])
    return table(["", "checkpoint", now_title, ""], rows)


def record_for(
    plan: Plan | VPlan,
    cfg: PlannerConfig,
    machine: MachineProfile,
    *,
    step: int | None = None,
    complete: bool = False,
    tp: int | None = None,
    dp: int | None = None,
    vocab_bounds: tuple[tuple[int, int], ...] | None = None,
) -> PlanRecord:
    """The record of ``plan``, made under ``cfg`` and priced on ``machine``.

    ``tp`` and ``dp`` default to the config's, ``vocab_bounds`` to the shards of the config's vocabulary (a built
    model's own bounds differ when Nanotron padded its vocabulary).
    """
    v = isinstance(plan, VPlan)
    shards = cfg.vocab_shards if v else plan.vocab_shards
    if vocab_bounds is None:
        vocab_bounds = tuple(vocab_slices(cfg.model.vocab_size, shards)) if shards > 1 else ()
    return PlanRecord(
        step=step,
        complete=complete,
        strategy=plan.strategy,
        engine=plan.engine,
        pp=plan.pp,
        tp=cfg.run.tp if tp is None else tp,
        dp=cfg.run.dp if dp is None else dp,
        zero_stage=cfg.run.zero_stage,
        blocks=plan.blocks if v else plan.block_names,
        stages=tuple(plan.block_ranks),
        v_stages=tuple(plan.stages) if v else (),
        vocab_bounds=tuple(vocab_bounds),
        machine=machine.name,
        machine_digest=hashlib.sha256(machine.to_json().encode()).hexdigest(),
        model=ModelKey(
            cfg.model.family,
            cfg.model.hidden_size,
            cfg.model.num_hidden_layers,
            cfg.model.vocab_size,
            cfg.model.tie_word_embeddings,
        ),
        written_by=__version__,
    )


def read_record(folder: Path) -> PlanRecord | None:
    """The record of a checkpoint folder, None when it has none (written by Nanotron alone).

    Raises:
        CheckpointError: the record exists but cannot be read.
    """
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: unreadable plan record ({exc}); the checkpoint was damaged while it was being "
            f"written: resume from an earlier checkpoint"
        ) from None
    return PlanRecord.from_dict(data, origin=str(path))
