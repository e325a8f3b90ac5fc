"""The splits ``predict_vs_measure.py`` trains, planned inside its ranks: each named split's config, blocks and plan,
the key that makes two splits one model, and what ``vocab_shards: auto`` picks under a profile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.partition.layout_string import SYMBOLS
from nanotron_ext.plan import make_plan, resolve_vocab_shards


class PlannedSplit(NamedTuple):
    """A named split: the config it is planned under, its blocks and its plan."""

    cfg: Any
    blocks: Any
    plan: Any


def layout_of(ranks: Sequence[int], roles: Sequence[str]) -> str:
    """The layout string of a split, e.g. ``E,t*5|t*3,N,H,C,X``."""
    symbol = {roles_[0]: s for s, roles_ in SYMBOLS.items() if len(roles_) == 1}
    stages = []
    for k in range(max(ranks) + 1):
        items: list[list[Any]] = []
        for r, role in zip(ranks, roles):
            if r == k:
                if items and items[-1][0] == symbol[role]:
                    items[-1][1] += 1
                else:
                    items.append([symbol[role], 1])
        stages.append(",".join(s if n == 1 else f"{s}*{n}" for s, n in items))
    return "|".join(stages)


def _shifted(plan: Any, blocks: Sequence[Any], shift: int) -> str:
    """pp=2: the layout whose first stage holds ``shift`` more decoder layers than ``plan``'s (fewer when
    negative), the cut inside the decoder stack (each stage keeps at least one layer)."""
    roles = [b.role for b in blocks]
    decoders = [i for i, role in enumerate(roles) if role == "decoder"]
    first = sum(plan.block_ranks[i] == 0 for i in decoders)
    cut = decoders[min(max(1, first + shift), len(decoders) - 1)]
    return layout_of([0 if i < cut else 1 for i in range(len(roles))], roles)


def plan_splits(
    names: Sequence[str], cfg: Any, machine_path: str, layouts: dict[str, str] | None = None
) -> dict[str, PlannedSplit]:
    """Each named split, planned. ``default``, the chain and the shifts are planned under the machine profile at
    ``machine_path``; Nanotron's rule, uniform and FLOP-optimal need no times."""
    under = cfg.with_overrides(machine=machine_path)
    out: dict[str, PlannedSplit] = {}
    for name in names:
        if name in ("nanotron", "uniform"):
            c, strategy = cfg, name
        elif name == "flop-optimal":
            c, strategy = cfg.with_overrides(objective="slowest_stage"), "constrained"
        elif name == "default":
            c, strategy = under, "constrained"
        elif name.startswith("chain K="):
            c, strategy = under.with_overrides(vocab_shards=int(name.removeprefix("chain K="))), "constrained"
        elif name in (layouts or {}):
            c, strategy = cfg.with_overrides(layout=(layouts or {})[name]), "layout"
        elif name.startswith("shift "):
            _, blocks, plan = out["default"]
            c, strategy = under.with_overrides(layout=_shifted(plan, blocks, int(name.split()[1]))), "layout"
        else:
            raise ValueError(f"unknown split {name!r}")
        blocks = inventory_from_config(c)
        out[name] = PlannedSplit(c, blocks, make_plan(blocks, c, strategy))
    return out


def split_key(cfg: Any, plan: Any) -> str:
    """What makes two splits one model: the vocabulary-shard count and the stage of every block."""
    return f"K{cfg.vocab_shards}:" + ",".join(map(str, plan.block_ranks))


def auto_pick(cfg: Any, machine_path: str, plans: dict[str, PlannedSplit]) -> dict[str, Any]:
    """What ``vocab_shards: auto`` picks under the profile, and which trained split that is."""
    resolved, choice = resolve_vocab_shards(cfg.with_overrides(vocab_shards="auto", machine=machine_path))
    assert choice is not None
    blocks = inventory_from_config(resolved)
    plan = make_plan(blocks, resolved)
    key = split_key(resolved, plan)
    same = [n for n, (c, _, p) in plans.items() if split_key(c, p) == key]
    same.sort(key=lambda n: not (n == "default" or n.startswith("chain")))  # name it as the default or a chain
    return {
        "shards": choice.shards,
        "step_times": {str(k): v for k, v in choice.step_times.items()},
        "ranks": list(plan.block_ranks),
        "same_as": same[0] if same else None,
    }
