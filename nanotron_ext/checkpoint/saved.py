"""What a saved checkpoint holds, by parameter name: each parameter's whole shape and the saved parts that tile it
(weights), and where each part's optimizer state, fp32 master copy, parameter group and learning rate are.

Everything is keyed by *canonical* name: a tied parameter by its tied name (as Nanotron saves it), a vocabulary
shard ``model.vocab_shards.{i}.pp_block.weight`` as rows of ``model.lm_head.pp_block.weight``. Two plans of one
model therefore name the same state alike, however they split it across pp, tp, dp or vocabulary shards.
Nothing here loads a tensor until asked; optimizer files are memory-mapped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanotron_ext.blocks import VOCAB_SHARDS_PATH
from nanotron_ext.checkpoint.boxes import Box, Piece, full_box, parse_slices_pairs, tiling_gaps
from nanotron_ext.checkpoint.files import RankFile, WeightFile, parse_rank_file, parse_weight_file
from nanotron_ext.errors import CheckpointError

__all__ = [
    "LM_HEAD",
    "OptimizerSource",
    "SavedCheckpoint",
    "SavedParameter",
    "Slot",
    "canonical_name",
    "vocab_shard_index",
]

#: The canonical name of the output projection that vocabulary shards are rows of.
LM_HEAD = "model.lm_head.pp_block.weight"
_SHARD = re.compile(rf"^{re.escape(VOCAB_SHARDS_PATH)}\.(\d+)\.pp_block\.weight$")


def vocab_shard_index(name: str) -> int | None:
    """``i`` for ``model.vocab_shards.{i}.pp_block.weight``, else None."""
    match = _SHARD.match(name)
    return int(match.group(1)) if match else None


def canonical_name(name: str) -> str:
    """The name a parameter's state is saved under whatever the plan: a vocabulary shard's is the lm_head's."""
    return LM_HEAD if vocab_shard_index(name) is not None else name


@dataclass(frozen=True)
class Slot:
    """One saved part of a parameter: its weight file and the pieces of the whole parameter it covers.

    ``key`` names the part across files: the tp rank of a tensor-parallel shard, the shard index of a vocabulary
    shard, None for an unsharded parameter.
    """

    key: int | None
    file: WeightFile
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class SavedParameter:
    """One parameter of the checkpoint: its canonical name, whole shape and saved parts."""

    name: str
    whole_shape: tuple[int, ...]
    slots: tuple[Slot, ...]

    def slot(self, key: int | None) -> Slot | None:
        return next((s for s in self.slots if s.key == key), None)


@dataclass(frozen=True)
class OptimizerSource:
    """Where one part (``key``, as in :class:`Slot`) of a parameter's optimizer state is: the files of the chosen
    copy, in dp order (several under ZeRO-1, each a flat slice), and how many other copies hold the same part
    (tied or tp-replicated parameters: every rank that holds one saves its state)."""

    name: str
    key: int | None
    parts: tuple[tuple[RankFile, int], ...]
    replicas: int = 0


@dataclass
class SavedCheckpoint:
    """The index of one checkpoint folder (see :meth:`scan`)."""

    folder: Path
    parameters: dict[str, SavedParameter]
    optimizer_files: tuple[RankFile, ...]
    scheduler_files: tuple[RankFile, ...]
    zero: bool
    _states: dict[Path, dict[str, Any]] = field(default_factory=dict, repr=False)
    _optimizer: dict[tuple[str, int | None], OptimizerSource] | None = field(default=None, repr=False)

    @classmethod
    def scan(cls, folder: Path) -> SavedCheckpoint:
        """Index a checkpoint folder from its file names and headers.

        Raises:
            CheckpointError: a weight file's header cannot be read, or the folder holds expert-parallel shards.
        """
        folder = Path(folder)
        model_root = folder / "model"
        weights = [w for p in sorted(model_root.rglob("*.safetensors")) if (w := parse_weight_file(p, model_root))]
        if any(w.exp_size > 1 for w in weights):
            raise CheckpointError(
                f"{folder}: expert-parallel shards (expert_parallel_size > 1) are resumed only under the "
                f"plan they were saved with; keep the recorded split (nanotron_ext.resume_plan: keep)"
            )
        rank_files = [r for p in sorted(folder.glob("*/*.pt")) if (r := parse_rank_file(p))]
        optimizer = tuple(sorted((r for r in rank_files if r.kind == "optimizer"), key=lambda r: r.rank))
        scheduler = tuple(sorted((r for r in rank_files if r.kind == "lr_scheduler"), key=lambda r: r.rank))
        return cls(folder, _parameters(weights), optimizer, scheduler, zero=any(r.dp is not None for r in optimizer))

    # --- weights --------------------------------------------------------------------------------------------

    def tiling_problems(self) -> list[str]:
        """One line per parameter whose saved parts do not cover it exactly once."""
        out = []
        for p in self.parameters.values():
            overlap, missing = tiling_gaps([piece.whole for s in p.slots for piece in s.pieces], p.whole_shape)
            if missing < 0:
                out.append(f"{p.name}: a saved part lies outside its shape {p.whole_shape}")
            elif overlap:
                files = ", ".join(s.file.path.name for s in p.slots)
                out.append(f"{p.name}: {overlap} element(s) saved twice ({files})")
            elif missing:
                out.append(f"{p.name}: {missing} of its {_numel(p.whole_shape)} element(s) are in no file")
        return out

    def read_weight(self, slot: Slot, box: Box) -> torch.Tensor:
        """The part of ``slot``'s local tensor inside local ``box``, read from disk (only those bytes)."""
        from safetensors import safe_open

        with safe_open(str(slot.file.path), framework="pt") as f:
            return f.get_slice("data")[tuple(slice(a, b) for a, b in box)]

    # --- optimizer ------------------------------------------------------------------------------------------

    def state(self, file: RankFile) -> dict[str, Any]:
        """The optimizer ``state_dict`` of one file, memory-mapped (tensors are read when touched)."""
        if file.path not in self._states:
            self._states[file.path] = torch.load(file.path, map_location="cpu", mmap=True, weights_only=True)
        return self._states[file.path]

    def optimizer_sources(self) -> dict[tuple[str, int | None], OptimizerSource]:
        """``(canonical name, key)`` → where its optimizer state is.

        Raises:
            CheckpointError: an optimizer file has no parameter names (it could be read only by position, under the
                plan that wrote it).
        """
        if self._optimizer is not None:
            return self._optimizer
        found: dict[tuple[str, int | None], dict[tuple[int, int], list[tuple[RankFile, int]]]] = {}
        for file in self.optimizer_files:
            names = self.state(file).get("names")
            if not isinstance(names, dict):
                raise CheckpointError(
                    f"{file.path}: the optimizer state has no parameter names, so it can be loaded only by position, "
                    f"under the plan that saved it; keep the recorded split, or resume with "
                    f"checkpoints.load_optimizer: false (Adam's moments start again)"
                )
            for index, name in names.items():
                canonical = canonical_name(name)
                saved = self.parameters.get(canonical)
                shard = vocab_shard_index(name)
                key = (
                    shard
                    if shard is not None
                    else (file.tp if saved is not None and any(s.key is not None for s in saved.slots) else None)
                )
                copy = (file.pp, file.tp)
                found.setdefault((canonical, key), {}).setdefault(copy, []).append((file, int(index)))
        self._optimizer = {
            k: OptimizerSource(k[0], k[1], tuple(copies[min(copies)]), replicas=len(copies) - 1)
            for k, copies in found.items()
        }
        return self._optimizer

    def optimizer_part(self, source: OptimizerSource, key: str, local_shape: tuple[int, ...]) -> torch.Tensor:
        """One state tensor (``exp_avg``, ``exp_avg_sq``; ``fp32`` for the master copy) of one saved part, in its
        local shape: ZeRO-1's flat dp slices are joined in dp order."""
        pieces = []
        for file, index in source.parts:
            state = self.state(file)
            if key == "fp32":
                tensor = state["gradient_accumulator"][state["names"][index]]
            else:
                tensor = state["state"][index][key]
            pieces.append(tensor.reshape(-1))
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if flat.numel() != _numel(local_shape):
            raise CheckpointError(
                f"{self.folder}: the optimizer's {key} of {source.name} has {flat.numel()} values where "
                f"its saved weight has {_numel(local_shape)}; the checkpoint's optimizer and weights "
                f"do not belong together"
            )
        return flat.view(local_shape)

    def step_of(self, source: OptimizerSource) -> Any:
        """Adam's step of a parameter (every dp slice holds the same)."""
        file, index = source.parts[0]
        return self.state(file)["state"][index].get("step")

    def state_keys(self) -> set[str]:
        """The state tensors every saved parameter has (``exp_avg``, ``exp_avg_sq`` for Adam), ``step`` aside."""
        keys: set[str] | None = None
        for file in self.optimizer_files:
            for state in self.state(file)["state"].values():
                here = set(state) - {"step"}
                keys = here if keys is None else keys & here
        return keys or set()

    def has_fp32_master(self) -> bool:
        """Whether the optimizer files carry Nanotron's fp32 master weights (``accumulate_grad_in_fp32``)."""
        return any("gradient_accumulator" in self.state(f) for f in self.optimizer_files)

    def group_of(self, source: OptimizerSource) -> dict[str, Any]:
        """The saved parameter group's hyperparameters (``lr``, ``weight_decay``, ``betas``...) of a part."""
        file, index = source.parts[0]
        for group in self.state(file)["param_groups"]:
            if index in group["params"]:
                return {k: v for k, v in group.items() if k != "params"}
        raise CheckpointError(f"{file.path}: parameter index {index} is in no parameter group; the file is damaged")

    # --- learning-rate schedule -----------------------------------------------------------------------------

    def schedule(self) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
        """``(the scheduler state every rank shares, canonical name → (base lr, last lr))``.

        Each rank's scheduler keeps one learning rate per parameter group of that rank's optimizer, in the same
        order, so a group's rates belong to the parameters the optimizer file lists in it.

        Raises:
            CheckpointError: the scheduler files disagree on the step, or an optimizer file has no scheduler beside it.
        """
        schedulers = {
            (f.pp, f.tp, f.dp): torch.load(f.path, map_location="cpu", weights_only=True) for f in self.scheduler_files
        }
        shared: dict[str, Any] | None = None
        for sd in schedulers.values():
            common = {k: v for k, v in sd.items() if k not in ("base_lrs", "_last_lr", "lr_lambdas")}
            if shared is None:
                shared = common
            elif common != shared:
                raise CheckpointError(
                    f"{self.folder}: the learning-rate schedulers of two ranks disagree ({common} against "
                    f"{shared}); the checkpoint mixes files of different steps"
                )
        per_name: dict[str, tuple[float, float]] = {}
        for file in self.optimizer_files:
            sd = schedulers.get((file.pp, file.tp, file.dp)) or schedulers.get((file.pp, file.tp, None))
            if sd is None:
                raise CheckpointError(
                    f"{file.path}: no learning-rate scheduler file of the same rank beside it; the "
                    f"checkpoint is incomplete"
                )
            state = self.state(file)
            for g, group in enumerate(state["param_groups"]):
                for index in group["params"]:
                    if index in state["names"]:
                        per_name.setdefault(
                            canonical_name(state["names"][index]), (sd["base_lrs"][g], sd["_last_lr"][g])
                        )
        return shared or {}, per_name


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _shape(text: str) -> tuple[int, ...]:
    """A header's ``unsharded_shape``: ``(48, 16)``, or ``(np.int64(48), 16)`` as Nanotron 0.2 writes a fused
    weight's under NumPy 2 (the ``64`` of ``int64`` is not a dimension)."""
    return tuple(int(x) for x in re.findall(r"\d+", re.sub(r"np\.\w+\((\d+)\)", r"\1", text)))


def _parameters(weights: list[WeightFile]) -> dict[str, SavedParameter]:
    """Group weight files into parameters, each part with the pieces of the whole it holds."""
    from safetensors import safe_open

    slots: dict[str, list[Slot]] = {}
    wholes: dict[str, tuple[int, ...]] = {}
    legacy_shards: dict[int, tuple[WeightFile, tuple[int, ...]]] = {}
    for w in weights:
        try:
            with safe_open(str(w.path), framework="pt") as f:
                meta = f.metadata() or {}
                local = tuple(f.get_slice("data").get_shape())
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise CheckpointError(
                f"{w.path}: unreadable weight file ({type(exc).__name__}: {exc}); the checkpoint was "
                f"damaged while it was being written: resume from an earlier one"
            ) from None
        shard = vocab_shard_index(w.name)
        if shard is not None:  # a chain saved before its shards were written as the lm_head's rows
            legacy_shards[shard] = (w, local)
            continue
        if "unsharded_shape" in meta:
            whole = _shape(meta["unsharded_shape"])
            pieces = parse_slices_pairs(meta["local_global_slices_pairs"], local, whole)
            key: int | None = w.tp
        else:
            whole, pieces, key = local, (Piece(full_box(local), full_box(local)),), None
        if wholes.setdefault(w.name, whole) != whole:
            raise CheckpointError(
                f"{w.path}: {w.name} is saved with whole shapes {wholes[w.name]} and {whole}; the folder "
                f"mixes checkpoints of two models"
            )
        slots.setdefault(w.name, []).append(Slot(key, w, local, pieces))
    if legacy_shards:
        rows = sum(local[0] for _, local in legacy_shards.values())
        lo = 0
        for i in sorted(legacy_shards):
            w, local = legacy_shards[i]
            whole = (rows, *local[1:])
            piece = Piece(full_box(local), ((lo, lo + local[0]), *full_box(local[1:])))
            slots.setdefault(LM_HEAD, []).append(Slot(i, w, local, (piece,)))
            wholes[LM_HEAD] = whole
            lo += local[0]
    return {name: SavedParameter(name, wholes[name], tuple(s)) for name, s in sorted(slots.items())}


def read_json(path: Path) -> Any:
    """A JSON file of the checkpoint, None when absent."""
    return json.loads(path.read_text()) if path.is_file() else None
