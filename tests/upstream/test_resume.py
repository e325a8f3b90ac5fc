"""A training run outlives its plan: upstream Nanotron's own trainer (``run_train.py`` through ``torchrun -m
nanotron_ext.run``, CPU ranks over gloo) trains 6 steps under plan A, saving at steps 2, 4 and 6; then the step-4
checkpoint is resumed under plan B for steps 5 and 6. The launcher's dummy data continues from the consumed samples
(:mod:`nanotron_ext.integration.dummy_data`), so the reference for B is A's own uninterrupted run: its logged losses
at steps 5 and 6 and its step-6 weights. Resuming under A itself, through Nanotron's own loader, equals that run bit
for bit (the first test), so this reference is also "resuming the same checkpoint under plan A".

Exact where the arithmetic is the same: a split moved across pp ranks, another pp, another engine (no gradient
clipping: clipping's norm is a sum of per-rank partial sums, whose order follows the split). Within a tolerance
where it is not: the lm_head split into vocabulary shards (an online log-sum-exp), tp (partial sums across tp
ranks), dp (a reduction across replicas), clipping. The tolerance is :data:`MOVE_TOLERANCE`, defined with its
reason below.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from nanotron_cpu import PAUSE_IN_SAVE

from nanotron_ext.procs import kill_process_group
from upstream.e2e import TORCHRUN, Run, launch, one_message, tiny_config, torchrun_command, whole_weights

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

#: The shared shape: 8 samples a step as 4 micro-batches of 2 (1F1B needs pp - 1 of them at pp=4), a vocabulary
#: that tp=2 splits without padding, no gradient clipping (see the module docstring).
SHAPE = {
    "tokens__micro_batch_size": 2,
    "tokens__batch_accumulation_per_replica": 4,
    "model__model_config__vocab_size": 50276,
    "optimizer__clip_grad": None,
}
LAYOUT_A = {"cost_strategy": "layout", "layout": "E,t|t,L"}
#: Where the arithmetic differs, no element of a weight may differ from the reference by more than this fraction
#: of the largest change the two resumed steps made to that weight. The arithmetic differs only in rounding (fp32
#: ulps of each gradient); Adam divides each moment by its own root mean square, so an element whose gradient is
#: near zero, or a sum that nearly cancels, turns an ulp into a visible share of its step. Measured worst case on
#: this model: 0.205 % (the embedding, vocabulary shards 2 -> 1; 0.51 % in an earlier session's run).
MOVE_TOLERANCE = 0.01


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return whole_weights(run_dir / "checkpoints" / str(step))


def _train(tmp: Path, nproc: int = 2, *launcher_args: str, **config: Any) -> tuple[Run, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    run = launch(
        tiny_config(tmp, steps=6, checkpoints__checkpoint_interval=2, **{**SHAPE, **config}),
        *launcher_args,
        nproc=nproc,
        torchrun=TORCHRUN,
    )
    assert run.rc == 0, run.out[-4000:]
    return run, tmp


def _resume(tmp: Path, base: Path, nproc: int = 2, *launcher_args: str, **config: Any) -> tuple[Run, Path]:
    run, folder = _train(
        tmp, nproc, *launcher_args, checkpoints__resume_checkpoint_path=str(base / "checkpoints" / "4"), **config
    )
    assert sorted(run.losses) == [5, 6], run.out[-3000:]  # the step counter went on from the checkpoint
    return run, folder


def _notes(run: Run) -> list[str]:
    return re.findall(r"^nanotron_ext: (.*)$", run.out, re.M)


def _placed(run: Run, parameters: int = 15) -> str:
    """The launcher's count line, checked: every parameter and optimizer entry placed once."""
    line = next((n for n in _notes(run) if "placed, each from exactly one saved source" in n), "")
    assert (
        f"{parameters} of {parameters} parameters and {3 * parameters} of {3 * parameters} optimizer entries" in line
    ), "\n".join(_notes(run))
    return line


def _same(ref: tuple[Run, Path], new: tuple[Run, Path]) -> None:
    """Bit-identical: the losses of every step the resumed run logged, every weight at step 6."""
    (ref_run, ref_dir), (run, folder) = ref, new
    assert run.losses and {s: ref_run.losses[s] for s in run.losses} == run.losses
    a, b = _weights(ref_dir, 6), _weights(folder, 6)
    assert a.keys() == b.keys() and len(a) >= 14
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _close(ref: tuple[Run, Path], new: tuple[Run, Path], name: str) -> None:
    """Within MOVE_TOLERANCE of the two resumed steps' largest change, weight by weight; losses as logged."""
    (ref_run, ref_dir), (run, folder) = ref, new
    assert run.losses and {s: ref_run.losses[s] for s in run.losses} == run.losses
    start, a, b = _weights(ref_dir, 4), _weights(ref_dir, 6), _weights(folder, 6)
    assert a.keys() == b.keys()
    share = {
        k: float((a[k].float() - b[k].float()).abs().max() / (a[k].float() - start[k].float()).abs().max()) for k in a
    }
    print(
        f"\n{name}: largest |w - w_ref| = {100 * max(share.values()):.3g} % of that weight's largest step "
        f"({max(share, key=share.get)})"
    )
    assert max(share.values()) <= MOVE_TOLERANCE, sorted(share.items(), key=lambda kv: -kv[1])[:3]
    assert max(share.values()) > 0  # the arithmetic does differ here: a zero would belong in an exact test


# plan_a, A's six uninterrupted steps, is tests/upstream/conftest.py's (other modules resume from it too).


def test_the_plan_travels_with_every_checkpoint(plan_a):
    run, folder = plan_a
    for step in (2, 4, 6):
        record = json.loads((folder / "checkpoints" / str(step) / "nanotron_ext_plan.json").read_text())
        assert (record["step"], record["complete"], record["stages"]) == (step, True, [0, 0, 1, 1, 1, 1, 1])
        assert (record["pp"], record["tp"], record["dp"], record["engine"], record["strategy"]) == (
            2,
            1,
            1,
            "1f1b",
            "layout",
        )
        assert record["vocab_bounds"] == [] and len(record["machine_digest"]) == 64
        assert record["blocks"][0] == "model.token_position_embeddings" and record["blocks"][-1] == "loss"


def test_resuming_under_plan_a_through_nanotrons_own_loader_is_the_uninterrupted_run(plan_a, tmp_path):
    run, _ = resumed = _resume(tmp_path, plan_a[1], ext=LAYOUT_A)
    assert "resuming checkpoint 4 on its recorded split E,t|t,L (layout, pp=2), which is today's plan too" in _notes(
        run
    )
    assert not any("placed" in n for n in _notes(run))  # the layout did not change: Nanotron's own loader ran
    assert any(
        re.fullmatch(
            r"checkpoint 4: 25 files verified against the sizes and xxh3_64 checksums its save "
            r"recorded \(18\.6 MiB\)",
            n,
        )
        for n in _notes(run)
    ), _notes(run)
    _same(plan_a, resumed)


def test_by_default_the_recorded_split_is_kept_and_replan_moves_to_todays(plan_a, tmp_path):
    kept = _resume(tmp_path / "keep", plan_a[1], ext={"cost_strategy": "constrained"})
    assert (
        "resuming checkpoint 4 on its recorded split E,t|t,L (layout, pp=2); today 'constrained' would choose "
        "E,t*2,N|H,C,X: set nanotron_ext.resume_plan: replan (or --replan) to move to it"
    ) in _notes(kept[0])
    assert re.search(r"^ +1  decoder\.1, final_norm, lm_head, cast, loss ", kept[0].out, re.M)
    _same(plan_a, kept)
    moved = _resume(tmp_path / "replan", plan_a[1], 2, "--replan", ext={"cost_strategy": "constrained"})
    assert any(
        n.startswith(
            "re-planning as asked (resume_plan: replan): checkpoint 4 was trained on E,t|t,L "
            "(layout, pp=2); today: E,t*2,N|H,C,X"
        )
        for n in _notes(moved[0])
    )
    _placed(moved[0])
    _same(plan_a, moved)


@pytest.mark.parametrize("pp, nproc, layout", [(1, 1, "E,t*2,L"), (4, 4, "E|t|t|L")])
def test_another_pp_resumes_exactly(plan_a, tmp_path, pp, nproc, layout):
    run, _ = resumed = _resume(tmp_path, plan_a[1], nproc, pp=pp, ext={"cost_strategy": "layout", "layout": layout})
    assert any(
        n.startswith(
            f"the config asks pp={pp}, the checkpoint was trained at pp=2: checkpoint 4 (E,t|t,L) "
            f"moves onto the new plan {layout}"
        )
        for n in _notes(run)
    )
    assert f"checkpoint 4 -> split {layout} (pp={pp}, tp=1, dp=1)" in _placed(run)
    _same(plan_a, resumed)


def test_another_engine_resumes_exactly(plan_a, tmp_path):
    run, _ = resumed = _resume(tmp_path, plan_a[1], parallelism__pp_engine="zb1p", ext=LAYOUT_A)
    assert "zb1p on PP rank 0" in run.out
    _same(plan_a, resumed)


def test_a_zb1p_checkpoint_resumes_exactly_under_1f1b(tmp_path):
    base = _train(tmp_path / "zb1p", parallelism__pp_engine="zb1p", ext=LAYOUT_A)
    assert json.loads((base[1] / "checkpoints" / "4" / "nanotron_ext_plan.json").read_text())["engine"] == "zb1p"
    run, _ = resumed = _resume(tmp_path / "1f1b", base[1], ext=LAYOUT_A)
    assert "zb1p on PP rank 0" not in run.out
    _same(base, resumed)


def test_pp_1_to_2_resumes_exactly(tmp_path):
    base = _train(tmp_path / "pp1", 1, pp=1, ext={"cost_strategy": "layout", "layout": "E,t*2,L"})
    run, _ = resumed = _resume(tmp_path / "pp2", base[1], ext=LAYOUT_A)
    _placed(run)
    _same(base, resumed)


def test_vocabulary_shards_1_to_2_and_tp_and_zero1_dp_resume_within_the_tolerance(plan_a, tmp_path):
    chain = _resume(
        tmp_path / "k2", plan_a[1], ext={"cost_strategy": "layout", "layout": "E,t*2,N,V|V", "vocab_shards": 2}
    )
    assert "checkpoint 4 -> split E,t*2,N,V|V (pp=2, tp=1, dp=1)" in _placed(chain[0])
    _close(plan_a, chain, "vocab_shards 1 -> 2")
    tp = _resume(tmp_path / "tp2", plan_a[1], pp=1, parallelism__tp=2, ext={"cost_strategy": "constrained"})
    assert "(pp=1, tp=2, dp=1)" in _placed(tp[0])
    _close(plan_a, tp, "pp 2, tp 1 -> pp 1, tp 2")
    # ZeRO-1 over dp=2 with the same 8 samples a step (2 micro-batches of 2 on each replica): the data goes on
    # from sample 32, each replica taking every other sample.
    zero = _resume(
        tmp_path / "zero1",
        plan_a[1],
        pp=1,
        parallelism__dp=2,
        optimizer__zero_stage=1,
        tokens__batch_accumulation_per_replica=2,
        ext={"cost_strategy": "constrained"},
    )
    assert "(pp=1, tp=1, dp=2)" in _placed(zero[0])
    _close(plan_a, zero, "pp 2, dp 1 -> pp 1, dp 2, ZeRO-1")


@pytest.fixture(scope="module")
def chain_k2(tmp_path_factory):
    """A chain of two vocabulary shards, one per stage."""
    return _train(
        tmp_path_factory.mktemp("k2"), ext={"cost_strategy": "layout", "layout": "E,t*2,N,V|V", "vocab_shards": 2}
    )


@pytest.mark.parametrize(
    "ext",
    [
        {"cost_strategy": "layout", "layout": "E,t*2,N|H,C,X"},
        {"cost_strategy": "layout", "layout": "E,t*2,N,V|V*2", "vocab_shards": 3},
    ],
)
def test_vocabulary_shards_2_to_1_and_3_resume_within_the_tolerance(chain_k2, tmp_path, ext):
    resumed = _resume(tmp_path, chain_k2[1], ext=ext)
    _placed(resumed[0])
    _close(chain_k2, resumed, f"vocab_shards 2 -> {ext.get('vocab_shards', 1)}")


def test_auto_vocabulary_shards_keep_the_recorded_chain(chain_k2, tmp_path):
    # On the FLOP-only machine `auto` chooses 3 shards for this model today; the resume keeps the recorded 2 and
    # their split, and trains on exactly.
    flops_only = str(Path(__file__).resolve().parents[1] / "data" / "machine_flops_only.json")
    run, _ = resumed = _resume(
        tmp_path, chain_k2[1], ext={"cost_strategy": "constrained", "vocab_shards": "auto", "machine": flops_only}
    )
    assert "vocab_shards: auto -> 2 (kept from checkpoint 4)" in _notes(run)
    assert any(
        n.startswith("resuming checkpoint 4 on its recorded split E,t*2,N,V|V (layout, pp=2)") for n in _notes(run)
    )
    _same(chain_k2, resumed)


def test_a_chain_checkpoint_is_a_nanotron_checkpoint(chain_k2, parallel_context):
    # Upstream's own load_weights, with nothing of ours installed, reads the chain's shards as the rows of a plain
    # lm_head (one process, pp=1, tp=1): the checkpoint stays Nanotron's, and so does its HF conversion's input.
    from nanotron.config import get_config_from_file
    from nanotron.models.base import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.serialize.weights import load_weights
    from nanotron.trainer import mark_tied_parameters

    from upstream.harness import cuda_to

    folder = chain_k2[1] / "checkpoints" / "6"
    assert not (folder / "model" / "model" / "vocab_shards").exists()
    files = sorted(p.name for p in (folder / "model" / "model" / "lm_head" / "pp_block").iterdir())
    assert files == [
        "model_weight_pp-rank-0-of-2_tp-rank-0-of-2.safetensors",
        "model_weight_pp-rank-1-of-2_tp-rank-1-of-2.safetensors",
    ]
    config = get_config_from_file(str(folder / "config.yaml"))  # as Nanotron saved it, read by Nanotron
    with cuda_to("cpu"):
        model = build_model(
            model_builder=lambda: LlamaForTraining(
                config=config.model.model_config,
                parallel_context=parallel_context,
                parallel_config=config.parallelism,
                random_states=None,
            ),
            parallel_context=parallel_context,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    mark_tied_parameters(model=model, parallel_context=parallel_context, parallel_config=config.parallelism)
    load_weights(model, parallel_context, folder)
    saved = whole_weights(folder)
    head = model.model.lm_head.pp_block.weight
    assert head.shape == (50276, 16) and torch.equal(head.detach(), saved["model.lm_head.pp_block.weight"])
    assert torch.equal(
        model.model.decoder[1].pp_block.attn.qkv_proj.weight.detach(),
        saved["model.decoder.1.pp_block.attn.qkv_proj.weight"],
    )


def test_tied_embeddings_come_back_tied(tmp_path):
    # Tied across stages, the two copies' gradients are summed by an all-reduce, at pp=2 as at pp=4: exact. In one
    # stage autograd adds them micro-batch by micro-batch: the same terms in another order, hence the tolerance.
    tied = {"model__model_config__tie_word_embeddings": True}
    base = _train(tmp_path / "pp2", ext=LAYOUT_A, **tied)
    one = _resume(tmp_path / "pp1", base[1], 1, pp=1, ext={"cost_strategy": "layout", "layout": "E,t*2,L"}, **tied)
    _placed(one[0], parameters=14)  # one embedding for both ends
    _close(base, one, "tied embeddings, pp 2 -> 1")
    four = _resume(tmp_path / "pp4", base[1], 4, pp=4, ext={"cost_strategy": "layout", "layout": "E|t|t|L"}, **tied)
    _placed(four[0], parameters=14)
    _same(base, four)
    assert "model.lm_head.pp_block.weight" not in _weights(four[1], 6)  # saved once, under the embedding's name
    # The first and the last stage each hold a copy: after two steps they are still one weight, moments and all.
    states = [
        torch.load(p, weights_only=True)
        for p in sorted((four[1] / "checkpoints" / "6" / "optimizer").glob("optimizer_pp-[03]-*.pt"))
    ]
    emb = "model.token_position_embeddings.pp_block.token_embedding.weight"
    copies = [sd["state"][next(i for i, n in sd["names"].items() if n == emb)] for sd in states]
    assert len(copies) == 2 and all(torch.equal(copies[0][k], copies[1][k]) for k in ("exp_avg", "exp_avg_sq"))


def _fp32_masters(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Nanotron's fp32 master weights (``optimizer.accumulate_grad_in_fp32``), by name, from the optimizer files."""
    out = {}
    for path in sorted((run_dir / "checkpoints" / str(step) / "optimizer").glob("*.pt")):
        out.update({k: v.detach() for k, v in torch.load(path, weights_only=True)["gradient_accumulator"].items()})
    return out


def test_bf16_with_fp32_masters_and_clipping_resumes_within_the_tolerance(tmp_path):
    # bf16 weights are the fp32 masters rounded: the masters are held to the tolerance; a bf16 weight may round one
    # step the other way, and a weight that did at step 5 moves step 6's gradient: two bf16 steps at most (measured:
    # 2, on 5 of the lm_head's 804,416 elements).
    mixed = {"model__dtype": "bfloat16", "optimizer__accumulate_grad_in_fp32": True, "optimizer__clip_grad": 1.0}
    base = _train(tmp_path / "pp2", ext=LAYOUT_A, **mixed)
    run, folder = _resume(
        tmp_path / "pp4", base[1], 4, pp=4, ext={"cost_strategy": "layout", "layout": "E|t|t|L"}, **mixed
    )
    line = next((n for n in _notes(run) if "placed, each from exactly one saved source" in n), "")
    assert "15 of 15 parameters and 60 of 60 optimizer entries (exp_avg, exp_avg_sq, step, fp32 master)" in line
    assert {s: base[0].losses[s] for s in (5, 6)} == run.losses
    start, ref, new = _fp32_masters(base[1], 4), _fp32_masters(base[1], 6), _fp32_masters(folder, 6)
    assert ref.keys() == new.keys() and len(ref) == 15
    share = max(float((ref[k] - new[k]).abs().max() / (ref[k] - start[k]).abs().max()) for k in ref)
    print(f"\nbf16 + fp32 masters + clipping, pp 2 -> 4: largest |master - master_ref| = {100 * share:.3f} % of a step")
    # Clipping's norm is summed per stage, so the masters may round otherwise; in this run they come out equal.
    assert share <= MOVE_TOLERANCE
    a, b = _weights(base[1], 6), _weights(folder, 6)
    assert all(a[k].dtype == torch.bfloat16 for k in a)
    assert all(bool(((a[k].float() - b[k].float()).abs() <= a[k].float().abs() * 2**-6).all()) for k in a)


# --- refused before anything loads, on every rank -----------------------------------------------------------------


def _refused(run: Run, text: str) -> None:
    """Every rank stops with ``text`` and exit code 2 (usage or config; torchrun reports the first rank's), printed
    once and named as torchrun's root cause, with no traceback of ours and no training step."""
    assert run.rc != 0
    one_message(run.out, f"error: {text}", 2)
    assert not run.losses


def test_a_checkpoint_of_another_model_stops_every_rank_before_anything_is_built(plan_a, tmp_path):
    run = launch(
        tiny_config(
            tmp_path,
            steps=6,
            **{**SHAPE, "model__model_config__hidden_size": 32},
            checkpoints__resume_checkpoint_path=str(plan_a[1] / "checkpoints" / "4"),
            ext=LAYOUT_A,
        )
    )
    _refused(run, "checkpoint 4 (")
    assert (
        "holds another model than" in run.out and "hidden 16, vocab 50276 against llama: 2 layers, hidden 32" in run.out
    )
    assert "Total number of parameters" not in run.out


def test_a_plan_with_no_place_for_saved_layers_is_refused_not_silently_dropped(plan_a, tmp_path):
    # Megatron-Bridge #4992: a saved layout collapsed to pp=1 silently dropped decoder layers. Here the checkpoint
    # has no plan record (as one Nanotron saved alone), so only the placement can tell that decoder.1 has no owner.
    plain = tmp_path / "plain" / "4"
    shutil.copytree(plan_a[1] / "checkpoints" / "4", plain)
    (plain / "nanotron_ext_plan.json").unlink()
    run = launch(
        tiny_config(
            tmp_path,
            steps=6,
            **{**SHAPE, "model__model_config__num_hidden_layers": 1},
            checkpoints__resume_checkpoint_path=str(plain),
            ext={"cost_strategy": "layout", "layout": "E|t,L"},
        )
    )
    _refused(
        run,
        "cannot resume checkpoint 4 (saved without a plan record) under the new plan (E|t,L, pp=2, tp=1, "
        "dp=1); nothing was loaded.",
    )
    assert "the new plan has no place for 6 saved parameter(s): model.decoder.1.pp_block.attn.o_proj.weight" in run.out
    assert "has no nanotron_ext plan record (Nanotron saved it alone)" in run.out


def _gone(marker: str, timeout: float = 30) -> None:
    """Wait until no process's command line holds ``marker`` (the killed job's config path)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).find(marker) >= 0]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of the killed job outlived it by {timeout} s")


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_inside_save(config: Path, step: int, *launcher_args: str) -> str:
    """Launch ``config`` through torchrun and SIGKILL it while every rank is inside step ``step``'s save (weights
    written, optimizer not: the CPU stand-ins' fault injection holds them there); its output."""
    cmd, env = torchrun_command(config, *launcher_args, extra_env={PAUSE_IN_SAVE: str(step)})
    folder, log_path = config.parent / "checkpoints" / str(step), config.parent / "killed.log"
    with log_path.open("w") as log:
        torchrun = subprocess.Popen(
            cmd, env=env, cwd=config.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while not all((folder / f"PAUSED-{r}").exists() for r in (0, 1)):
            assert torchrun.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(torchrun.pid, signal.SIGKILL)
        _gone(str(config))
    finally:
        kill_process_group(torchrun)
    return log_path.read_text()


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_resumable_and_the_cut_one_refused(plan_a, tmp_path):
    # torchrun is SIGKILLed while every rank is inside step 4's save.
    config = tiny_config(tmp_path, steps=6, checkpoints__checkpoint_interval=2, **SHAPE, ext=LAYOUT_A)
    kill_inside_save(config, 4)
    folder = tmp_path / "checkpoints"
    assert (folder / "latest.txt").read_text() == "2"
    assert json.loads((folder / "4" / "nanotron_ext_plan.json").read_text())["complete"] is False
    assert not (folder / "4" / "optimizer").exists() and (folder / "4" / "model").is_dir()
    # Resumed from the checkpoints folder: latest.txt names step 2, which trains on to the uninterrupted run's step 6.
    for sub in ("resumed", "refused"):
        (tmp_path / sub).mkdir()
    resumed = launch(
        tiny_config(
            tmp_path / "resumed",
            steps=6,
            checkpoints__checkpoint_interval=2,
            **SHAPE,
            checkpoints__resume_checkpoint_path=str(folder),
            ext=LAYOUT_A,
        ),
        torchrun=TORCHRUN,
    )
    assert resumed.rc == 0 and sorted(resumed.losses) == [3, 4, 5, 6], resumed.out[-3000:]
    _same(plan_a, (Run(resumed.rc, resumed.out), tmp_path / "resumed"))
    # Pointed at the cut-off folder itself: refused, naming the one to use.
    refused = launch(
        tiny_config(
            tmp_path / "refused", steps=6, **SHAPE, checkpoints__resume_checkpoint_path=str(folder / "4"), ext=LAYOUT_A
        )
    )
    _refused(
        refused,
        f"{folder / '4'} was being written when its run stopped (its nanotron_ext_plan.json says "
        f"complete: false), so it is not loaded; resume from the last complete one instead: "
        f"checkpoints.resume_checkpoint_path: {folder / '2'}",
    )
