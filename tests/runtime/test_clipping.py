"""The launcher's gradient clipping (``nanotron_ext/integration/clipping.py``) on real gloo ranks: the total norm and
every clipped gradient have the same bits whichever rank holds which parameter, and in whatever order a rank lists
them, so that a resume under another split or pp is exact. Nanotron's own rule (each rank's partial sum of squares,
then an all-reduce) rounds differently per split on these gradients: checked here too, so the case is one where the
order shows."""

from __future__ import annotations

import pytest
import torch

from .clip_workers import clip_owned
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

#: One-element gradients whose norms span four orders of magnitude: in float32 the order of their sum shows in the
#: last bit of the total (found by a search over such values for one where both Nanotron's partial sums and a
#: rank-major order give two totals over these splits).
GRADS = {f"p{i}": [value] for i, value in enumerate([2050.0, 0.428, 0.128, 3120.0, 0.675, 0.349, 85.4, 3.59])}
#: Who holds what: one rank; two ranks in name order; two ranks, each in its own order, across the names.
SPLITS = {
    "one rank": {0: sorted(GRADS)},
    "halves": {0: ["p0", "p1", "p2", "p3"], 1: ["p4", "p5", "p6", "p7"]},
    "interleaved": {0: ["p7", "p5", "p1"], 1: ["p6", "p0", "p4", "p3", "p2"]},
}


def _nanotrons_total(owned: dict[int, list[str]]) -> float:
    """Nanotron's 2-norm: each rank's sum of squared norms, the ranks' sums added in rank order."""
    partial = [
        torch.stack([torch.linalg.vector_norm(torch.tensor(GRADS[n]), dtype=torch.float) ** 2 for n in names]).sum()
        for names in owned.values()
    ]
    return torch.stack(partial).sum().sqrt().item()


def test_the_total_norm_and_every_clipped_gradient_have_the_same_bits_whoever_holds_them():
    results = {}
    for split, owned in SPLITS.items():
        ranks = run_distributed(clip_owned, len(owned), args=(owned, GRADS, 1.0))
        totals = {total for total, _ in ranks}
        assert len(totals) == 1, (split, totals)  # every rank clips by the same norm
        results[split] = (totals.pop(), {n: g for _, grads in ranks for n, g in grads.items()})
    reference = results["one rank"]
    assert reference[0] == pytest.approx(torch.linalg.vector_norm(torch.tensor(sum(GRADS.values(), []))).item())
    assert all(g != GRADS[n] for n, g in reference[1].items())  # the norm is over max_norm: every gradient scaled
    for split, result in results.items():
        assert result == reference, split
    # Nanotron's partial sums give another total on at least one of these splits: the test can tell.
    assert len({_nanotrons_total(owned) for owned in SPLITS.values()}) > 1
