"""Checkpoints written file by file in Nanotron's format (as ``nanotron/serialize/`` writes them), from whole tensors
and a layout, and the live parameters another layout needs: the reference the checkpoint tests load against.

Written independently of ``nanotron_ext.checkpoint``: slices are spelled by hand in Nanotron's string format, and
ZeRO-1's partition follows ``ZeroDistributedOptimizer._partition_parameters`` (upstream main, ``optim/zero.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanotron_ext.checkpoint import LM_HEAD, Need
from nanotron_ext.checkpoint.boxes import Piece

KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Layout:
    """Where each parameter lives.

    Attributes:
        stage: parameter → pp rank (a vocabulary shard ``i``'s rank is ``stage[f"shard{i}"]``).
        pp, tp, dp: sizes; ``zero``: ZeRO-1 (optimizer state in flat dp slices).
        split: parameter → the dim it is split along across tp (absent: replicated on every tp rank).
        fused: parameter → how many matrices are stacked in it along dim 0 (Nanotron's fused qkv and gate/up
            projections): each tp rank holds its chunk of every one, so its local tensor is several pieces.
        shards: vocabulary shards of the lm_head (1: a plain lm_head).
        frozen: parameters without optimizer state.
    """

    stage: dict[str, int]
    pp: int = 1
    tp: int = 1
    dp: int = 1
    zero: bool = False
    split: dict[str, int] = field(default_factory=dict)
    fused: dict[str, int] = field(default_factory=dict)
    shards: int = 1
    frozen: frozenset[str] = frozenset()


def rows_of(rows: int, shards: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, shards)
    out, lo = [], 0
    for i in range(shards):
        out.append((lo, lo + base + (i < extra)))
        lo = out[-1][1]
    return out


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def _slices(box: list[tuple[int, int]]) -> str:
    return "|".join(f"{a},{b},None" for a, b in box)


Part = tuple[int, int, str, list[tuple[list[tuple[int, int]], list[tuple[int, int]]]], tuple[int, ...]]


def _parts(name: str, shape: tuple[int, ...], layout: Layout) -> list[Part]:
    """(pp rank, slot, optimizer name, [(local box, whole box)], local shape) of every saved part of a parameter."""
    full = [(0, n) for n in shape]

    def one(box: list[tuple[int, int]]) -> tuple[list, tuple[int, ...]]:
        local = tuple(b - a for a, b in box)
        return [([(0, n) for n in local], box)], local

    if name == LM_HEAD and layout.shards > 1:
        return [
            (layout.stage[f"shard{i}"], i, f"model.vocab_shards.{i}.pp_block.weight", *one([(lo, hi), *full[1:]]))
            for i, (lo, hi) in enumerate(rows_of(shape[0], layout.shards))
        ]
    if name in layout.split:
        d, stacked = layout.split[name], layout.fused.get(name, 1)
        out = []
        for t in range(layout.tp):
            if stacked == 1:
                a, b = _chunks(shape[d], layout.tp)[t]
                out.append(
                    (layout.stage[name], t, name, *one([(a, b) if k == d else (0, n) for k, n in enumerate(shape)]))
                )
                continue
            size = shape[0] // stacked  # dim 0: chunk t of each stacked matrix, one after the other locally
            a, b = _chunks(size, layout.tp)[t]
            pieces = [
                ([(j * (b - a), (j + 1) * (b - a)), *full[1:]], [(j * size + a, j * size + b), *full[1:]])
                for j in range(stacked)
            ]
            out.append((layout.stage[name], t, name, pieces, (stacked * (b - a), *shape[1:])))
        return out
    return [(layout.stage[name], -1, name, *one(full))]


def _take(whole: torch.Tensor, pieces: list, local_shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(local_shape, dtype=whole.dtype)
    for local, box in pieces:
        out[tuple(slice(a, b) for a, b in local)] = whole[tuple(slice(a, b) for a, b in box)]
    return out


def _zero_offsets(numel: int, dp: int) -> list[tuple[int, int]]:
    per = (numel - 1) // dp + 1
    sizes = [per] * dp
    remainder = per * dp - numel
    for i in range(dp - remainder, dp):
        sizes[i] -= 1
    ends = [sum(sizes[: i + 1]) for i in range(dp)]
    return list(zip([0, *ends[:-1]], ends))


def write_checkpoint(
    folder: Path,
    weights: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    layout: Layout,
    *,
    step: float = 4.0,
    lr: float = 0.01,
) -> None:
    """Save ``weights`` and their optimizer ``states`` under ``layout`` as Nanotron's trainer would."""
    model = folder / "model"
    files: dict[tuple[int, int, int | None], dict] = {}
    for name, whole in weights.items():
        for pp_rank, slot, opt_name, pieces, local_shape in _parts(name, tuple(whole.shape), layout):
            local = _take(whole, pieces, local_shape)
            *dirs, leaf = name.split(".")
            sharded = slot >= 0 or name in layout.split
            if sharded:
                size = layout.shards if name == LM_HEAD and layout.shards > 1 else layout.tp
                path = model.joinpath(
                    *dirs, f"model_{leaf}_pp-rank-{pp_rank}-of-{layout.pp}_tp-rank-{slot}-of-{size}.safetensors"
                )
                meta = {
                    "version": "1.5",
                    "unsharded_shape": str(tuple(whole.shape)),
                    "local_global_slices_pairs": ";".join(f"{_slices(a)}#{_slices(b)}" for a, b in pieces),
                }
            else:
                path, meta = model.joinpath(*dirs, f"model_{leaf}.safetensors"), {}
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"data": local}, str(path), metadata=meta)
            if name in layout.frozen:
                continue
            tps = [slot] if slot >= 0 and name in layout.split else list(range(layout.tp))
            for tp in tps:
                state = {k: _take(states[name][k], pieces, local_shape) for k in KEYS}
                dps = range(layout.dp) if layout.zero else [None]
                offsets = _zero_offsets(local.numel(), layout.dp) if layout.zero else None
                for dp in dps:
                    part = state
                    if offsets is not None:
                        a, b = offsets[dp]
                        if a == b:
                            continue
                        part = {k: v.reshape(-1)[a:b].clone() for k, v in state.items()}
                    f = files.setdefault((pp_rank, tp, dp), {"state": {}, "param_groups": [], "names": {}})
                    index = len(f["names"])
                    f["names"][index] = opt_name
                    f["state"][index] = {"step": torch.tensor(step), **part}
                    f["param_groups"].append({"lr": lr, "weight_decay": 0.01, "initial_lr": lr, "params": [index]})
    (folder / "optimizer").mkdir(parents=True, exist_ok=True)
    (folder / "lr_scheduler").mkdir(parents=True, exist_ok=True)
    for (pp, tp, dp), sd in files.items():
        dp_part = "" if dp is None else f"_dp-{dp}-of-{layout.dp}"
        ranks = f"pp-{pp}-of-{layout.pp}{dp_part}_tp-{tp}-of-{layout.tp}_exp-0-of-1"
        torch.save(sd, folder / "optimizer" / f"optimizer_{ranks}.pt")
        n = len(sd["param_groups"])
        torch.save(
            {
                "base_lrs": [lr] * n,
                "last_epoch": int(step),
                "_step_count": int(step) + 1,
                "_last_lr": [lr / 2] * n,
                "lr_lambdas": [{}] * n,
            },
            folder / "lr_scheduler" / f"lr_scheduler_{ranks}.pt",
        )
    (folder / "model_config.json").write_text(json.dumps({"hidden_size": 4}))


def needs_of(weights: dict[str, torch.Tensor], layout: Layout) -> list[Need]:
    """Every rank's live parameters under ``layout`` (ranks numbered pp-major, then dp, then tp)."""
    out = []
    for name, whole in weights.items():
        shape = tuple(whole.shape)
        for pp_rank, slot, local_name, pieces, local in _parts(name, shape, layout):
            tps = [slot] if name in layout.split else list(range(layout.tp))
            for dp in range(layout.dp):
                for tp in tps:
                    rank = (pp_rank * layout.dp + dp) * layout.tp + tp
                    tied = name not in layout.split and layout.tp > 1 and not (name == LM_HEAD and layout.shards > 1)
                    out.append(
                        Need(
                            name,
                            local_name,
                            rank,
                            dp,
                            local,
                            shape,
                            tuple(Piece(tuple(a), tuple(b)) for a, b in pieces),
                            name not in layout.frozen,
                            tied,
                        )
                    )
    return out


def model_tensors(seed: int = 0, *, vocab: int = 11, hidden: int = 4, layers: int = 2) -> dict[str, torch.Tensor]:
    """A tiny model's weights (two same-shaped decoder layers, so a misplaced one would go unnoticed by shape)."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.token_position_embeddings.pp_block.token_embedding.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        out[f"model.decoder.{i}.pp_block.attn.qkv_proj.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        out[f"model.decoder.{i}.pp_block.input_layernorm.weight"] = torch.randn(hidden, generator=g)
    out["model.final_layer_norm.pp_block.weight"] = torch.randn(hidden, generator=g)
    out[LM_HEAD] = torch.randn(vocab, hidden, generator=g)
    return out


def states_of(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: {k: torch.randn(w.shape, generator=g) for k in KEYS} for n, w in weights.items()}
