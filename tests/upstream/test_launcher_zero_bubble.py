"""``pp_engine: zb1p`` and ``zb2p`` in upstream Nanotron's own ``DistributedTrainer`` through ``python -m
nanotron_ext.run``: the launcher installs our engine (Nanotron has none), and training matches Nanotron's own 1F1B
engine. dp=2 × pp=2 (four processes), bf16 weights with fp32 gradient accumulation: each B's and W's gradients go
through Nanotron's ``FP32GradientAccumulator``, and DDP's reduction through Nanotron's fp32 communication hook
(the trainer asserts that hook's all-reduce happened); the weights after two optimizer steps (from the step-2
checkpoint) are what the gradients made of them, under both engines."""

from __future__ import annotations

from pathlib import Path

import torch

from upstream.e2e import launch, tiny_config

BF16 = {"model__dtype": "bfloat16", "optimizer__accumulate_grad_in_fp32": True}
# The default, schedule-aware strategy may split differently per engine; flops places the blocks alike for both.
EXT = {"cost_strategy": "flops"}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((checkpoint / "model").rglob("*.safetensors")):
        for name, tensor in load_file(f).items():
            out[f"{f.relative_to(checkpoint / 'model')}:{name}"] = tensor.float()
    return out


def test_zero_bubble_trains_upstreams_trainer_with_1f1bs_weights(tmp_path: Path) -> None:
    weights, losses, outs = {}, {}, {}
    for engine in ("zb1p", "zb2p", "1f1b"):
        run_dir = tmp_path / engine
        run_dir.mkdir()
        run = launch(tiny_config(run_dir, steps=2, ext=EXT, parallelism__pp_engine=engine, parallelism__dp=2, **BF16),
                     nproc=4)
        assert run.rc == 0, run.out[-3000:]
        assert sorted(run.losses) == [1, 2], run.out[-3000:]
        losses[engine] = run.losses
        outs[engine] = run.out
        weights[engine] = _weights(run_dir / "checkpoints" / "2")
    # The launcher's engine ran, and each stage's linears (both decoder layers' four | the lm_head, as flops
    # places them) deferred their weight gradients to W.
    for engine in ("zb1p", "zb2p"):
        for note in (f"{engine} on PP rank 0: 8 linear(s) defer", f"{engine} on PP rank 1: 1 linear(s) defer"):
            assert note in outs[engine], outs[engine][-3000:]
        assert "ZeroBubbleFallbackWarning" not in outs[engine]
        assert f"pp_engine: {engine}" in (tmp_path / engine / "checkpoints" / "2" / "config.yaml").read_text()
        assert losses[engine] == losses["1f1b"]
        assert weights[engine].keys() == weights["1f1b"].keys() and len(weights["1f1b"]) > 10
        worst = {k: float((weights[engine][k] - w).abs().max()) for k, w in weights["1f1b"].items()}
        assert max(worst.values()) == 0.0, (engine, {k: v for k, v in worst.items() if v})
