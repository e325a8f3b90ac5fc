"""Nanotron's checkpoint folder, file by file: what each file's name says (which parameter, which pp/tp/dp rank)
and what its header holds, read without loading a tensor.

Layout of a checkpoint written by Nanotron's trainer (upstream main, ``nanotron/serialize/``):

* ``model/<module path>/model_<leaf>[_pp-rank-R-of-P_tp-rank-T-of-S].safetensors``: one file per parameter (per
  tp shard when sharded, with the slices it covers in its header; tied parameters once, under their tied name);
* ``optimizer/optimizer_pp-R-of-P[_dp-D-of-Q]_tp-T-of-S_exp-E-of-X.pt``: one optimizer ``state_dict`` per rank
  (``_dp`` under ZeRO-1, whose states are flat slices of each parameter), with ``names`` (index → parameter);
* ``lr_scheduler/lr_scheduler_pp-R-of-P[_dp-D-of-Q]_tp-T-of-S_exp-E-of-X.pt``: the scheduler of each such rank;
* ``checkpoint_metadata.json`` (step, consumed samples), ``config.yaml``, ``model_config.json``, ``random/``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_METADATA",
    "MODEL_CONFIG",
    "RankFile",
    "WeightFile",
    "describe_file",
    "parse_rank_file",
    "parse_weight_file",
    "path_inside",
    "weight_name",
]

#: Written last but one by Nanotron's ``save_checkpoint``; upstream's ``parse_ckpt_path`` takes a folder that has
#: it for a checkpoint.
MODEL_CONFIG = "model_config.json"
CHECKPOINT_METADATA = "checkpoint_metadata.json"

_WEIGHT = re.compile(
    r"^model_(?P<leaf>.+?)(?:_pp-rank-(?P<pp>\d+)-of-(?P<pp_size>\d+)_tp-rank-(?P<tp>\d+)-of-(?P<tp_size>\d+)"
    r"(?:_exp-rank-(?P<exp>\d+)-of-(?P<exp_size>\d+))?)?\.safetensors$"
)
_RANK_FILE = re.compile(
    r"^(?P<kind>optimizer|lr_scheduler)_pp-(?P<pp>\d+)-of-(?P<pp_size>\d+)(?:_dp-(?P<dp>\d+)-of-(?P<dp_size>\d+))?"
    r"_tp-(?P<tp>\d+)-of-(?P<tp_size>\d+)(?:_exp-(?P<exp>\d+)-of-(?P<exp_size>\d+))?\.pt$"
)


@dataclass(frozen=True)
class WeightFile:
    """One saved weight file: the parameter it holds and, for a sharded one, the pp and tp rank in its name.

    Attributes:
        name: the parameter's name as saved (its tied name for a tied parameter), e.g.
            ``model.decoder.0.pp_block.attn.qkv_proj.weight``.
        path: the file.
        pp, tp: ranks in the file name (None for an unsharded parameter, saved without them).
        tp_size: the tp size in the file name (None likewise).
        exp_size: the expert-parallel size in the name (1 when absent).
    """

    name: str
    path: Path
    pp: int | None = None
    tp: int | None = None
    tp_size: int | None = None
    exp_size: int = 1


@dataclass(frozen=True)
class RankFile:
    """One saved optimizer or scheduler file of one (pp, dp, tp) rank (``dp`` None: written once for every dp rank,
    as ZeRO-0 does)."""

    kind: str
    path: Path
    pp: int
    pp_size: int
    tp: int
    tp_size: int
    dp: int | None = None
    dp_size: int | None = None
    exp_size: int = 1

    @property
    def rank(self) -> tuple[int, int, int]:
        """``(pp, tp, dp)``, the order sources are preferred in (dp 0 when absent)."""
        return self.pp, self.tp, self.dp or 0


def parse_weight_file(path: Path, model_root: Path) -> WeightFile | None:
    """The :class:`WeightFile` a path under ``model/`` is, or None for a file Nanotron did not write there."""
    match = _WEIGHT.match(path.name)
    if match is None:
        return None
    parts = path.relative_to(model_root).parts[:-1]
    name = ".".join([*parts, match["leaf"]])
    if match["pp"] is None:
        return WeightFile(name, path)
    return WeightFile(
        name, path, int(match["pp"]), int(match["tp"]), int(match["tp_size"]), int(match["exp_size"] or 1)
    )


def weight_name(
    name: str, pp: int | None = None, pp_size: int | None = None, tp: int | None = None, tp_size: int | None = None
) -> Path:
    """The path under ``model/`` where Nanotron saves parameter ``name`` (with the ranks when it is sharded)."""
    *parts, leaf = name.split(".")
    suffix = "" if pp is None else f"_pp-rank-{pp}-of-{pp_size}_tp-rank-{tp}-of-{tp_size}"
    return Path(*parts, f"model_{leaf}{suffix}.safetensors")


def rank_file_name(kind: str, pp: int, pp_size: int, tp: int, tp_size: int) -> str:
    """The name upstream main gives a pp/tp rank's ``optimizer`` or ``lr_scheduler`` file (ZeRO-0, no experts):
    the inverse of :func:`parse_rank_file`."""
    return f"{kind}_pp-{pp}-of-{pp_size}_tp-{tp}-of-{tp_size}_exp-0-of-1.pt"


def parse_rank_file(path: Path) -> RankFile | None:
    """The :class:`RankFile` an optimizer or scheduler file name is, or None."""
    match = _RANK_FILE.match(path.name)
    if match is None:
        return None

    def num(key: str) -> int | None:
        return None if match[key] is None else int(match[key])

    return RankFile(
        match["kind"],
        path,
        int(match["pp"]),
        int(match["pp_size"]),
        int(match["tp"]),
        int(match["tp_size"]),
        num("dp"),
        num("dp_size"),
        num("exp_size") or 1,
    )


#: What the files of a checkpoint that are not per-parameter or per-rank hold, by path inside the folder.
_NAMED_FILES = {
    "config.yaml": "the run's config as saved",
    MODEL_CONFIG: "the model's config",
    CHECKPOINT_METADATA: "the step and the samples consumed",
    "optimizer/optimizer_config.json": "the optimizer's type and sharding",
}


def describe_file(path: str) -> str:
    """What a file of a checkpoint holds, from its path inside the folder (``/``-separated), in a user's words."""
    name = path.rsplit("/", 1)[-1]
    if path.startswith("model/"):
        weight = parse_weight_file(Path(path), Path("model"))
        if weight is not None:
            shard = "" if not weight.tp_size or weight.tp_size == 1 else f", tp shard {weight.tp} of {weight.tp_size}"
            return f"the weights of {weight.name}{shard}"
    rank = parse_rank_file(Path(name))
    if rank is not None:
        what = "the optimizer state" if rank.kind == "optimizer" else "the learning-rate schedule"
        dp = "" if rank.dp is None else f", dp rank {rank.dp}"
        return f"{what} of pp rank {rank.pp}, tp rank {rank.tp}{dp}"
    if path.startswith("random/"):
        return "a rank's random states"
    return _NAMED_FILES.get(path, "a file of the checkpoint")


def path_inside(folder: Path, file: Any) -> str | None:
    """``file``'s path inside the checkpoint ``folder`` as a record lists it (``/``-separated); None for a file
    elsewhere, or for something that is not a path."""
    if not isinstance(file, (str, bytes, os.PathLike)):
        return None
    try:
        return Path(os.fsdecode(file)).resolve().relative_to(Path(folder).resolve()).as_posix()
    except ValueError:
        return None
