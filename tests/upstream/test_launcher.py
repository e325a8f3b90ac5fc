"""End to end: upstream Nanotron's own ``run_train.py`` and ``DistributedTrainer`` through
``torchrun -m nanotron_ext.run`` on two CPU processes over gloo, on dummy data (see ``e2e.py``); the tests of what a
run trains start the ranks directly (``e2e.TORCHRUN``). The seed model's training through torchrun is the quick run's
end-to-end test of the launcher; the others are marked slow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from upstream.e2e import TORCHRUN, launch, one_message, tiny_config, weight_digests

#: Compute alone: on the analytic H100 the tiny seed model is latency-bound and `auto` keeps one lm_head.
FLOPS_ONLY = str(Path(__file__).resolve().parents[1] / "data" / "machine_flops_only.json")

REFUSED = "cannot train; nothing was allocated."
FREEZE = {"modules": ["*"], "unfreeze": ["lm_head"], "unfreeze_last_decoder_layers": 1}
# Stage 0 = embedding + decoder.0, all frozen by FREEZE; stage 1 = decoder.1 (trained), final norm (frozen),
# lm_head (trained), cast, loss.
FROZEN_FIRST_STAGE = {"cost_strategy": "layout", "layout": "E,t|t,L", "freeze": FREEZE}
# Nanotron's usual training precision: bf16 weights, fp32 gradient accumulation (its FP32 accumulator keeps a
# master copy of each weight the optimizer is given).
BF16 = {"model__dtype": "bfloat16", "optimizer__accumulate_grad_in_fp32": True}


@pytest.mark.slow
def test_seed_model_nanotron_rule_is_refused_on_every_rank_before_any_weight(tmp_path):
    run = launch(tiny_config(tmp_path, ext={"cost_strategy": "constrained"}), "--cost-strategy", "nanotron")
    assert run.rc != 0
    one_message(run.out, f"nanotron_ext: the 'nanotron' plan for pp=2 {REFUSED}", 1)  # the table: torchrun's summary
    assert "stage  blocks" in run.out and "no parameters" in run.out.lower()
    assert "Total number of parameters" not in run.out  # the trainer never got a built model
    assert not run.losses


def test_seed_model_constrained_trains_ten_steps_and_the_loss_falls(tmp_path):
    run = launch(tiny_config(tmp_path, ext={"cost_strategy": "constrained"}))
    assert run.rc == 0, run.out[-3000:]
    assert run.out.count("nanotron_ext: 'constrained' plan for pp=2") == 1  # printed once, by rank 0
    assert sorted(run.losses) == list(range(1, 11))
    # Dummy labels are uniform over the vocabulary, so ln(50277) = 10.83 is the floor; init_method.std 0.5
    # starts above it and training must close a clear part of the gap.
    assert run.losses[10] < run.losses[1] - 0.5, run.losses


@pytest.mark.slow
def test_qwen2_trains_at_pp2(tmp_path):
    run = launch(
        tiny_config(tmp_path, "config_qwen.yaml", steps=5, ext={"cost_strategy": "constrained"}), torchrun=TORCHRUN
    )
    assert run.rc == 0, run.out[-3000:]
    assert "Qwen2" in run.out or "qwen" in run.out.lower()
    assert sorted(run.losses) == [1, 2, 3, 4, 5]
    assert run.losses[5] < run.losses[1]


@pytest.mark.slow
def test_frozen_first_stage_is_refused_without_allow_frozen_stages(tmp_path):
    run = launch(tiny_config(tmp_path, ext=FROZEN_FIRST_STAGE))
    assert run.rc != 0
    one_message(run.out, f"nanotron_ext: the 'layout' plan for pp=2 {REFUSED}", 1)
    assert "allow_frozen_stages" in run.out
    assert not run.losses


@pytest.mark.slow
def test_frozen_first_stage_trains_keeps_frozen_weights_and_resumes_from_its_checkpoint(tmp_path):
    ext = {**FROZEN_FIRST_STAGE, "allow_frozen_stages": True}
    run = launch(tiny_config(tmp_path, ext=ext, checkpoints__save_initial_state=True, **BF16), torchrun=TORCHRUN)
    assert run.rc == 0, run.out[-3000:]
    assert "PP rank(s) [0] hold nothing trainable" in run.out
    assert sorted(run.losses) == list(range(1, 11)) and run.losses[10] < run.losses[1]

    ckpt = tmp_path / "checkpoints"
    start, end = weight_digests(ckpt / "0"), weight_digests(ckpt / "10")
    assert start.keys() == end.keys() and len(start) == 15
    trained = {k for k in start if k.startswith(("model/decoder/1/", "model/lm_head/"))}
    frozen = set(start) - trained
    assert {
        k for k in frozen if "pp-rank-0" in k
    } and "model/final_layer_norm/pp_block/model_weight.safetensors" in frozen
    assert {k for k in frozen if start[k] != end[k]} == set()  # bit-identical, on rank 0 and rank 1
    assert {k for k in trained if start[k] == end[k]} == set()  # every trained matrix moved

    # Resume: the trainer loads weights, optimizer (empty on the frozen rank) and scheduler, trains step 11.
    resumed = launch(
        tiny_config(
            tmp_path,
            ext=ext,
            steps=11,
            checkpoints__resume_checkpoint_path=str(ckpt / "10"),
            checkpoints__checkpoint_interval=1,
            **BF16,
        ),
        torchrun=TORCHRUN,
    )
    assert resumed.rc == 0, resumed.out[-3000:]
    assert sorted(resumed.losses) == [11]
    after = weight_digests(ckpt / "11")
    assert {k for k in frozen if after[k] != start[k]} == set()
    assert {k for k in trained if after[k] == end[k]} == set()


@pytest.mark.slow
def test_frozen_first_stage_at_dp2_runs_without_ddp_there_and_with_ddp_on_the_trained_stage(tmp_path):
    # 4 processes: dp=2 x pp=2. Upstream would stop in check_model_has_grad ("Can't use DDP because model in
    # PP=0 has no gradient"); the frozen rank runs unwrapped, stage 1's replicas sync through DDP.
    ext = {**FROZEN_FIRST_STAGE, "allow_frozen_stages": True}
    run = launch(tiny_config(tmp_path, steps=3, ext=ext, parallelism__dp=2, **BF16), nproc=4, torchrun=TORCHRUN)
    assert run.rc == 0, run.out[-3000:]
    assert "PP rank(s) [0] hold nothing trainable" in run.out
    assert sorted(run.losses) == [1, 2, 3]


@pytest.mark.slow
def test_seed_model_with_the_vocabulary_chain_trains_through_nanotrons_trainer(tmp_path):
    # vocab_shards: auto splits the lm_head's rows over both stages of the seed model at pp=2. The launcher
    # puts the chain into upstream's LlamaForTraining, broadcasts each micro-batch's labels to the shard ranks
    # and initialises the shards as the lm_head.
    run = launch(
        tiny_config(tmp_path, ext={"cost_strategy": "constrained", "vocab_shards": "auto", "machine": FLOPS_ONLY}),
        torchrun=TORCHRUN,
    )
    assert run.rc == 0, run.out[-3000:]
    chosen = re.search(r"nanotron_ext: vocab_shards: auto -> (\d+)", run.out)
    assert chosen and int(chosen.group(1)) >= 2, run.out[:3000]
    assert re.search(r"^ +0  embedding, decoder\.0-1, final_norm, vocab\.0", run.out, re.M), run.out[:3000]
    assert re.search(r"^ +1  vocab\.\d", run.out, re.M)
    assert sorted(run.losses) == list(range(1, 11))
    assert run.losses[10] < run.losses[1] - 0.5, run.losses


@pytest.mark.slow
def test_qwen2_with_the_vocabulary_chain_trains_at_pp2(tmp_path):
    run = launch(
        tiny_config(tmp_path, "config_qwen.yaml", steps=3, ext={"cost_strategy": "constrained", "vocab_shards": 3}),
        torchrun=TORCHRUN,
    )
    assert run.rc == 0, run.out[-3000:]
    assert "vocab.0" in run.out and sorted(run.losses) == [1, 2, 3]


@pytest.mark.slow
def test_a_key_no_nanotron_reads_is_left_to_nanotrons_own_loader(tmp_path):
    # DoReMi's section: not a near miss, so the launcher only warns (once, rank 0) and runs the script, whose own
    # loader has the final word; upstream main's strict loader refuses it, and the user sees its message.
    run = launch(tiny_config(tmp_path, steps=1, doremi={"domain_names": "a, b"}))
    assert run.rc != 0
    assert set(re.findall(r"nanotron_ext\.run \[rank (\d)\]: warning: ", run.out)) == {"0"}, run.out
    assert "'doremi' is read by no Nanotron nanotron_ext knows" in run.out and "the plan goes on" in run.out
    assert 'can not match "doremi" to any data class field' in run.out, run.out  # dacite, in upstream's loader
    assert "unknown key(s)" not in run.out  # not refused by us


@pytest.mark.slow
def test_vocabulary_chain_at_dp2_takes_each_replicas_labels_from_its_own_output_rank(tmp_path):
    # 4 processes: dp=2 x pp=2, a vocabulary shard on each stage. Upstream lays ranks out pp-major, so the
    # pipeline groups are {0, 2} and {1, 3}: each replica's labels are broadcast from global rank 2 or 3 (its
    # output stage), not from rank 1, the output stage's rank within the group.
    ext = {"cost_strategy": "layout", "layout": "E,t*2,N,V|V", "vocab_shards": 2}
    run = launch(tiny_config(tmp_path, steps=3, ext=ext, parallelism__dp=2), nproc=4, torchrun=TORCHRUN)
    assert run.rc == 0, run.out[-3000:]
    assert re.search(r"^ +0  embedding, decoder\.0-1, final_norm, vocab\.0 ", run.out, re.M), run.out[:3000]
    assert re.search(r"^ +1  vocab\.1 ", run.out, re.M), run.out[:3000]
    # Dummy labels are uniform over the vocabulary: ln(50277) = 10.8 is the floor and init_method.std 0.5 starts
    # above it. (Broadcasting from group rank 1 as if it were global stops the run: rank 1 is not in {0, 2}.)
    assert sorted(run.losses) == [1, 2, 3] and all(10.8 < v < 1e3 for v in run.losses.values()), run.losses


@pytest.mark.slow
def test_lm_head_in_the_freeze_spec_trains_every_vocabulary_shard_under_auto(tmp_path):
    # `unfreeze: [lm_head]` with vocab_shards: auto: the launcher plans, builds and freezes with the chain's
    # shards standing for the lm_head; every shard's weight moves, every frozen weight is bit-identical.
    ext = {"cost_strategy": "constrained", "vocab_shards": "auto", "freeze": FREEZE, "machine": FLOPS_ONLY}
    run = launch(tiny_config(tmp_path, steps=3, ext=ext, checkpoints__save_initial_state=True), torchrun=TORCHRUN)
    assert run.rc == 0, run.out[-3000:]
    chosen = re.search(r"nanotron_ext: vocab_shards: auto -> (\d+)", run.out)
    assert chosen and int(chosen.group(1)) >= 2, run.out[:3000]
    start, end = weight_digests(tmp_path / "checkpoints" / "0"), weight_digests(tmp_path / "checkpoints" / "3")
    assert start.keys() == end.keys()
    # The chain's shards are saved as the lm_head's row shards (docs/checkpoints.md), one file each.
    trained = {k for k in start if k.startswith(("model/lm_head/", "model/decoder/1/"))}
    assert len({k for k in trained if k.startswith("model/lm_head/")}) == int(chosen.group(1)), sorted(start)
    assert {k for k in trained if start[k] == end[k]} == set()
    assert {k for k in set(start) - trained if start[k] != end[k]} == set()
