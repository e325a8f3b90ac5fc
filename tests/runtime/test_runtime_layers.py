"""In-process checks of the runtime's pure-torch pieces and its user-error messages (no process group)."""

from __future__ import annotations

import pytest
import torch
from nanotron.config import LlamaConfig

from nanotron_ext.models.llama import CoreAttention, RMSNorm, RotaryEmbedding
from nanotron_ext.runtime.context import GlooParallelContext
from nanotron_ext.runtime.engine import make_engine


def _naive_attention(q, k, v, mask):
    """Reference: per-head softmax(q k^T / sqrt(d)) v with causal + key-padding mask; GQA by head grouping."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros_like(q)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for bi in range(b):
        for h in range(hq):
            scores = q[bi, :, h] @ k[bi, :, h // group].T / d**0.5
            allowed = causal & mask[bi][None, :]
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            out[bi, :, h] = probs @ v[bi, :, h // group]
    return out * mask[:, :, None, None]


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_core_attention_matches_naive(n_kv: int) -> None:
    torch.manual_seed(0)
    b, s, hq, d = 2, 7, 4, 8
    q, k, v = torch.randn(b, s, hq, d), torch.randn(b, s, n_kv, d), torch.randn(b, s, n_kv, d)
    attention = CoreAttention(
        LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=n_kv), None, 0
    )
    full = torch.ones(b, s, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, full, full), _naive_attention(q, k, v, full), atol=1e-5, rtol=1e-5)
    padded = full.clone()
    padded[0, :2] = False  # left padding
    padded[1, -3:] = False  # right padding
    got = attention(q, k, v, padded, padded)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _naive_attention(q, k, v, padded), atol=1e-5, rtol=1e-5)


def test_rotary_matches_complex_formula() -> None:
    torch.manual_seed(0)
    b, s, h, d = 2, 5, 3, 8
    x = torch.randn(b, s, h, d)
    rotary = RotaryEmbedding(dim=d, end=4, theta=10000.0)  # end < s: the table must grow
    got = rotary(x)
    # Nanotron's RotaryEmbedding: interleaved pairs viewed as complex numbers times e^{i t theta^(-2j/d)}.
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float)[: d // 2] / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    expected = torch.view_as_real(torch.view_as_complex(x.view(b, s, h, d // 2, 2)) * rot).view(b, s, h, d)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert rotary.end >= s


def test_rmsnorm() -> None:
    x = torch.randn(3, 4, 16)
    norm = RMSNorm(16, eps=1e-6)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]


def test_context_rejects_world_size_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 but tp\*pp\*dp\*ep = 1\*4\*1\*1 = 4"):
        GlooParallelContext(1, 4, 1)
    with pytest.raises(ValueError, match="positive integer"):
        GlooParallelContext(0, 2, 1)


def test_context_requires_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        GlooParallelContext(1, 1, 1)


def test_make_engine() -> None:
    assert type(make_engine("1f1b")).__name__ == "OneForwardOneBackwardPipelineEngine"
    assert type(make_engine("AFAB")).__name__ == "AllForwardAllBackwardPipelineEngine"
    with pytest.raises(ValueError, match="Unknown pipeline engine"):
        make_engine("gpipe")


def test_random_token_batches_are_seeded_shaped_and_pooled() -> None:
    from itertools import islice

    from nanotron_ext.runtime.data import random_token_batches

    first = list(islice(random_token_batches(50, 2, 8, seed=3), 4))
    again = list(islice(random_token_batches(50, 2, 8, seed=3), 4))
    other = list(islice(random_token_batches(50, 2, 8, seed=4), 4))
    assert all(t.shape == (2, 9) and t.dtype == torch.long and 0 <= t.min() and t.max() < 50 for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "same seed, same stream (every rank agrees)"
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[0], first[1])
    pooled = list(islice(random_token_batches(50, 2, 8, seed=3, pool=3), 7))
    assert [torch.equal(pooled[i], pooled[i % 3]) for i in range(7)] == [True] * 7
    assert not torch.equal(pooled[0], pooled[1])
    with pytest.raises(ValueError, match="pool=0 must be >= 1"):
        next(random_token_batches(50, 2, 8, pool=0))
