"""Compare the weights of two Nanotron checkpoints saved under different pipeline splits (tp=1, no vocabulary shards):
``python compare_weights.py REFERENCE OTHER...``, e.g. ``checkpoints/resume_pp2/6 checkpoints/resume_pp1/6``.

A weight's file name carries the pipeline rank that saved it (``model_weight_pp-rank-0-of-2_tp-rank-0-of-1``), so each
weight is matched by its path with that part left out. Prints, per checkpoint, whether every weight is bit-identical
to the reference's, or the largest difference; exits 1 if one differs or a weight is missing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every weight of ``checkpoint`` (a step's folder), by its path under ``model/`` without the pipeline rank."""
    files = sorted((checkpoint / "model").rglob("*.safetensors"))
    if not files:
        raise SystemExit(
            f"{checkpoint}: no model/**/*.safetensors here; give a step's folder, e.g. checkpoints/train/4"
        )
    out = {}
    for f in files:
        name = re.sub(r"_pp-rank-\d+-of-\d+", "", str(f.relative_to(checkpoint / "model")))
        if re.search(r"_tp-rank-\d+-of-(?!1\.)\d+", name):
            raise SystemExit(f"{f}: a tensor-parallel shard; this script compares tp=1 checkpoints only")
        out[name] = load_file(f)["data"]
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    reference = weights(Path(argv[0]))
    worst = 0
    for other in argv[1:]:
        theirs = weights(Path(other))
        if theirs.keys() != reference.keys():
            print(f"{other}: other weights than {argv[0]}: {sorted(theirs.keys() ^ reference.keys())}")
            worst = 1
            continue
        diff = max(float((reference[k].float() - theirs[k].float()).abs().max()) for k in reference)
        same = all(torch.equal(reference[k], theirs[k]) for k in reference)
        print(
            f"{other}: {len(reference)} weights, "
            + ("bit-identical to " if same else f"max |w - w_ref| = {diff:.3g} against ")
            + argv[0]
        )
        worst = max(worst, 0 if same else 1)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
