"""The plan a checkpoint records, the folder a resume loads (half-written ones refused, naming the last whole one),
and which plan a resume trains: the recorded split by default, a new one only where the config asks for what the
recorded split cannot be, or where the user asks to re-plan."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from nanotron_ext.checkpoint import (
    RECORD_FILE,
    PlanRecord,
    ResumeSource,
    check_same_model,
    choose_plan,
    kept_vocab_shards,
    last_complete,
    locate_checkpoint,
    read_record,
    record_for,
)
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import CheckpointError, ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.partition.layout_string import layout_ranks, layout_string
from nanotron_ext.plan import make_plan
from nanotron_ext.plan.v_plan import make_v_plan

ROLES = ["embedding", "decoder", "decoder", "final_norm", "lm_head", "cast", "loss"]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(bundled_config())  # the seed model: 2 layers, vocabulary 50277, pp=2, constrained
    blocks = inventory_from_config(cfg)
    return cfg, blocks, make_plan(blocks, cfg)


def _record(cfg, blocks, layout: str, **changes) -> PlanRecord:
    cfg_layout = cfg.with_overrides(cost_strategy="layout", layout=layout)
    plan = make_plan(blocks, cfg_layout)
    return replace(record_for(plan, cfg_layout, machine_for(cfg)), step=4, complete=True, **changes)


@pytest.mark.parametrize(
    "ranks",
    [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]],
)
def test_layout_string_is_the_inverse_of_layout_ranks(ranks):
    assert layout_ranks(layout_string(ROLES, ranks), ROLES) == ranks


def test_layout_string_compresses_runs_and_the_output_group():
    assert layout_string(ROLES, [0, 0, 1, 1, 1, 1, 1]) == "E,t|t,L"
    assert layout_string(["decoder"] * 3 + ["vocab_shard"] * 2, [0, 0, 0, 1, 1]) == "t*3|V*2"
    assert layout_string(["other"], [0]) is None


def test_a_record_round_trips_through_json_and_says_its_split(tiny, tmp_path):
    cfg, blocks, _ = tiny
    record = _record(cfg, blocks, "E,t|t,L")
    record.write(tmp_path)
    back = read_record(tmp_path)
    assert back == record and back.layout == "E,t|t,L" and back.vocab_shards == 1
    assert json.loads((tmp_path / RECORD_FILE).read_text())["stages"] == [0, 0, 1, 1, 1, 1, 1]
    assert back.model.vocab_size == 50277 and len(back.machine_digest) == 64


def test_a_v_records_its_ranks_and_chunks_and_a_contiguous_record_reads_as_before(tiny, tmp_path):
    cfg, blocks, today = tiny
    v_cfg = cfg.with_overrides(engine="zbv")
    v = make_v_plan(blocks, v_cfg)
    record = record_for(v, v_cfg, machine_for(v_cfg))
    assert (record.engine, record.stages, record.v_stages) == ("zbv", tuple(v.block_ranks), tuple(v.stages))
    assert record.layout == "E|t*2|N|H,C,X"  # the V's 2 pp chunks, as a layout string writes them
    record.write(tmp_path)
    assert read_record(tmp_path) == record
    assert "v_stages" not in record_for(today, cfg, machine_for(cfg)).to_dict()


def test_a_v_checkpoint_keeps_its_chunks_under_zbv_and_moves_off_them_under_another_engine(tiny, tmp_path):
    cfg, blocks, today = tiny
    v_cfg = cfg.with_overrides(engine="zbv")
    v = make_v_plan(blocks, v_cfg)  # E|t*2|N|H,C,X
    other = make_v_plan(blocks, v_cfg.with_overrides(cost_strategy="layout", layout="E,t|t|N|H,C,X"))
    kept = choose_plan(
        v, blocks, v_cfg, ResumeSource(tmp_path, 4, record_for(other, v_cfg, machine_for(v_cfg))), machine_for(v_cfg)
    )
    assert kept.kept and (kept.plan.bounds, kept.plan.order, kept.plan.strategy) == (
        other.bounds,
        other.order,
        "layout",
    )
    assert kept.note == (
        "resuming checkpoint 4 on its recorded split E,t|t|N|H,C,X (layout, pp=2); today 'v-search' "
        "would choose E|t*2|N|H,C,X: set nanotron_ext.resume_plan: replan (or --replan) to move to it"
    )
    source = ResumeSource(tmp_path, 4, record_for(v, v_cfg, machine_for(v_cfg)))
    moved = choose_plan(today, blocks, cfg, source, machine_for(cfg))
    assert not moved.kept and moved.plan is today
    assert moved.note.startswith("the config asks pp_engine 1f1b, the checkpoint was trained on a V (pp_engine zbv)")
    back = choose_plan(
        v, blocks, v_cfg, ResumeSource(tmp_path, 4, record_for(today, cfg, machine_for(cfg))), machine_for(v_cfg)
    )
    assert not back.kept and back.plan is v
    assert back.note.startswith(
        "the config asks pp_engine zbv, the checkpoint was trained on a contiguous split (1f1b)"
    )


def test_differences_name_each_field_as_the_user_writes_it(tiny):
    cfg, blocks, _ = tiny
    a, b = _record(cfg, blocks, "E,t|t,L"), _record(cfg, blocks, "E,t*2|L", engine="zb1p", dp=2)
    assert [str(d) for d in a.differences(b)] == ["dp: 1 -> 2", "split: E,t|t,L -> E,t*2|L", "engine: 1f1b -> zb1p"]
    assert a.differences(a) == []
    table = a.side_by_side(b)
    assert "split              E,t|t,L" in table and table.count("differs") == 3


def test_the_state_layout_is_the_same_only_where_every_file_sits_where_it_was_saved(tiny):
    cfg, blocks, _ = tiny
    a = _record(cfg, blocks, "E,t|t,L")
    assert a.same_state_layout(replace(a, engine="zb1p", strategy="constrained", dp=2))  # ZeRO-0: dp replicates
    assert not a.same_state_layout(_record(cfg, blocks, "E,t*2|L"))
    assert not a.same_state_layout(replace(a, tp=2))
    zero = replace(a, zero_stage=1)
    assert not zero.same_state_layout(replace(zero, dp=2))  # ZeRO-1 shards the state over dp
    chain = replace(a, vocab_bounds=((0, 25139), (25139, 50277)))
    assert not chain.same_state_layout(chain)  # a chain's shards are saved as lm_head rows: never by position


@pytest.mark.parametrize(
    "data, match",
    [
        ({"format": 99}, "not a nanotron_ext plan record of format 1"),
        ({"format": 1, "colour": "red"}, r"unknown plan-record field\(s\) \['colour'\]"),
        ({"format": 1, "step": 4}, "the plan record is malformed"),
    ],
)
def test_a_record_that_cannot_be_read_says_why(data, match):
    with pytest.raises(ConfigError, match=match):
        PlanRecord.from_dict(data, origin="x.json")


def _checkpoint(root: Path, step: int, *, record: PlanRecord | None, model_config: bool = True) -> Path:
    folder = root / str(step)
    (folder / "model").mkdir(parents=True)
    if model_config:
        (folder / "model_config.json").write_text("{}")
    if record is not None:
        replace(record, step=step).write(folder)
    return folder


def test_latest_txt_names_the_checkpoint(tiny, tmp_path):
    cfg, blocks, _ = tiny
    record = _record(cfg, blocks, "E,t|t,L")
    _checkpoint(tmp_path, 2, record=record)
    _checkpoint(tmp_path, 4, record=record)
    (tmp_path / "latest.txt").write_text("4")
    source = locate_checkpoint(tmp_path)
    assert (source.folder, source.step, source.record.step) == (tmp_path / "4", 4, 4)
    assert locate_checkpoint(tmp_path / "2").folder == tmp_path / "2"  # a checkpoint folder itself


@pytest.mark.parametrize("path", [None, "does/not/exist", "s3://bucket/ckpt"])
def test_nothing_to_resume_is_none_as_in_nanotron(path, tmp_path):
    assert locate_checkpoint(None if path is None else (path if "://" in path else tmp_path / path)) is None


def test_an_empty_latest_txt_is_refused_naming_the_last_whole_checkpoint(tiny, tmp_path):
    cfg, blocks, _ = tiny
    _checkpoint(tmp_path, 2, record=_record(cfg, blocks, "E,t|t,L"))
    (tmp_path / "latest.txt").write_text("")
    with pytest.raises(
        CheckpointError,
        match=rf"latest.txt holds '', not a step: a save was cut off while writing it"
        rf".*resume_checkpoint_path: {tmp_path / '2'}$",
    ):
        locate_checkpoint(tmp_path)


def test_a_checkpoint_cut_off_while_written_is_refused_naming_the_one_before(tiny, tmp_path):
    cfg, blocks, _ = tiny
    record = _record(cfg, blocks, "E,t|t,L")
    _checkpoint(tmp_path, 2, record=record)
    _checkpoint(tmp_path, 4, record=replace(record, complete=False), model_config=False)
    _checkpoint(tmp_path, 6, record=replace(record, complete=False))
    with pytest.raises(
        CheckpointError,
        match=rf"says complete: false\), so it is not loaded; resume from the last "
        rf"complete one instead: checkpoints.resume_checkpoint_path: "
        rf"{tmp_path / '2'}",
    ):
        locate_checkpoint(tmp_path / "6")
    assert last_complete(tmp_path) == tmp_path / "2"


def test_a_folder_with_weights_but_no_model_config_is_refused_where_nanotron_would_start_afresh(tmp_path):
    _checkpoint(tmp_path, 3, record=None, model_config=False)
    with pytest.raises(
        CheckpointError,
        match="has weights but no model_config.json: it was cut off while being "
        "written .* no complete checkpoint is left beside it",
    ):
        locate_checkpoint(tmp_path / "3")


def test_a_complete_record_vouches_for_a_folder_whose_model_config_was_not_written_yet(tiny, tmp_path):
    cfg, blocks, _ = tiny
    _checkpoint(tmp_path, 4, record=_record(cfg, blocks, "E,t|t,L"), model_config=False)
    assert locate_checkpoint(tmp_path / "4").step == 4


def test_by_default_a_resume_keeps_the_recorded_split_and_says_what_today_would_choose(tiny, tmp_path):
    cfg, blocks, today = tiny
    record = _record(cfg, blocks, "E,t*2|L")
    assert today.block_ranks != record.stages  # constrained would choose another split today
    choice = choose_plan(today, blocks, cfg, ResumeSource(tmp_path, 4, record), machine_for(cfg))
    assert choice.kept and choice.plan.block_ranks == record.stages and choice.plan.strategy == "layout"
    assert choice.note.startswith(
        "resuming checkpoint 4 on its recorded split E,t*2|L (layout, pp=2); today "
        f"'constrained' would choose {layout_string(ROLES, today.block_ranks)}: set "
        "nanotron_ext.resume_plan: replan (or --replan) to move to it"
    )


def test_replan_trains_todays_plan(tiny, tmp_path):
    cfg, blocks, today = tiny
    source = ResumeSource(tmp_path, 4, _record(cfg, blocks, "E,t*2|L"))
    choice = choose_plan(today, blocks, cfg, source, machine_for(cfg), mode="replan")
    assert not choice.kept and choice.plan is today and "re-planning as asked (resume_plan: replan)" in choice.note


@pytest.mark.parametrize(
    "change, why",
    [
        ({"pp": 1}, "the config asks pp=1, the checkpoint was trained at pp=2"),
        ({"layout": "E,t|t,L"}, "the config's layout 'E,t|t,L' asks for another split"),
    ],
)
def test_what_the_recorded_split_cannot_be_moves_to_a_new_plan_and_says_why(tiny, tmp_path, change, why):
    cfg, blocks, _ = tiny
    record = _record(cfg, blocks, "E,t*2|L")
    if "pp" in change:
        cfg = cfg.with_overrides(pp=1)
    else:
        cfg = cfg.with_overrides(cost_strategy="layout", layout=change["layout"])
    today = make_plan(blocks, cfg)
    choice = choose_plan(today, blocks, cfg, ResumeSource(tmp_path, 4, record), machine_for(cfg))
    assert not choice.kept and choice.plan is today
    assert choice.note.startswith(f"{why}: checkpoint 4 (E,t*2|L) moves onto the new plan")


def test_a_recorded_split_that_cannot_train_under_todays_config_is_not_kept(tiny, tmp_path):
    cfg, blocks, today = tiny
    record = _record(cfg, blocks, "E,t*2|L")
    record = replace(record, stages=(0, 0, 0, 0, 0, 1, 1))  # stage 1: cast and loss, no parameter
    choice = choose_plan(today, blocks, cfg, ResumeSource(tmp_path, 4, record), machine_for(cfg))
    assert (
        not choice.kept
        and "the recorded split cannot train under today's config (stage 1 holds no parameters" in choice.note
    )


def test_a_checkpoint_without_record_is_placed_by_name_onto_todays_plan(tiny, tmp_path):
    cfg, blocks, today = tiny
    choice = choose_plan(today, blocks, cfg, ResumeSource(tmp_path, 4, None), machine_for(cfg))
    assert choice.plan is today and "has no nanotron_ext plan record (Nanotron saved it alone)" in choice.note


def test_a_checkpoint_of_another_model_is_refused_naming_both(tiny, tmp_path):
    cfg, blocks, _ = tiny
    record = _record(cfg, blocks, "E,t|t,L")
    other = replace(record, model=replace(record.model, hidden_size=32))
    with pytest.raises(
        CheckpointError,
        match="holds another model than .*: llama: 2 layers, hidden 32, vocab 50277 "
        "against llama: 2 layers, hidden 16, vocab 50277",
    ):
        check_same_model(ResumeSource(tmp_path, 4, other), cfg)
    check_same_model(ResumeSource(tmp_path, 4, record), cfg)  # the same model passes


def test_auto_vocabulary_shards_keep_the_recorded_number_unless_replanning(tiny, tmp_path):
    cfg, blocks, _ = tiny
    record = replace(_record(cfg, blocks, "E,t|t,L"), vocab_bounds=((0, 25139), (25139, 50277)))
    source = ResumeSource(tmp_path, 4, record)
    auto = cfg.with_overrides(vocab_shards="auto")
    assert kept_vocab_shards(source, auto, "keep") == 2
    assert kept_vocab_shards(source, auto, "replan") is None
    assert kept_vocab_shards(source, cfg.with_overrides(vocab_shards=3), "keep") is None
    assert kept_vocab_shards(None, auto, "keep") is None


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_dummy_data_of_a_step_is_the_next_samples_whatever_dp(dp):
    from nanotron_ext.integration.dummy_data import sample_indices

    consumed, per_step = 32, 8  # 8 samples a step: micro-batches of 2, 8 // (2 * dp) of them on each replica
    taken = [g for d in range(dp) for mb in range(per_step // (2 * dp)) for g in sample_indices(consumed, d, dp, mb, 2)]
    assert sorted(taken) == list(range(consumed, consumed + per_step))  # the next step's samples, each once
    assert sample_indices(consumed, dp - 1, dp, 0, 2)[0] == consumed + dp - 1  # a replica starts at its own offset


def _cli(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from nanotron_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_plan_checkpoint_prints_the_recorded_plan_beside_the_resumes(tiny, tmp_path):
    cfg, blocks, today = tiny
    _checkpoint(tmp_path, 4, record=_record(cfg, blocks, "E,t*2|L"))
    (tmp_path / "latest.txt").write_text("4")
    code, out, _ = _cli("plan", str(bundled_config()), "--checkpoint", str(tmp_path))
    assert code == 0
    assert "split              E,t*2|L" in out and "resume under this config" in out
    assert "resuming checkpoint 4 on its recorded split E,t*2|L (layout, pp=2); today 'constrained' would choose" in out
    assert "what differs: nothing" in out  # the resume trains the recorded split
    code, out, _ = _cli("plan", str(bundled_config()), "--checkpoint", str(tmp_path), "--replan", "--json")
    data = json.loads(out)
    assert code == 0 and data["kept"] is False and data["resume"]["stages"] == list(today.block_ranks)
    assert {d["what"] for d in data["differences"]} == {"split", "strategy"}


def _zbv_config(tmp: Path) -> str:
    path = tmp / "zbv.yaml"
    text = bundled_config().read_text()
    assert "pp_engine: 1f1b" in text
    path.write_text(text.replace("pp_engine: 1f1b", "pp_engine: zbv"))
    return str(path)


def test_plan_checkpoint_of_a_v_under_zbv_keeps_its_chunks_or_replans_them(tiny, tmp_path):
    cfg, blocks, _ = tiny
    v_cfg = cfg.with_overrides(engine="zbv")
    today = make_v_plan(blocks, v_cfg)  # E|t*2|N|H,C,X
    other = make_v_plan(blocks, v_cfg.with_overrides(cost_strategy="layout", layout="E,t|t|N|H,C,X"))
    _checkpoint(tmp_path / "ckpt", 4, record=replace(record_for(other, v_cfg, machine_for(v_cfg)), complete=True))
    config = _zbv_config(tmp_path)
    code, out, err = _cli("plan", config, "--checkpoint", str(tmp_path / "ckpt" / "4"))
    assert code == 0 and err == "", err
    assert re.search(r"^split +E,t\|t\|N\|H,C,X +E,t\|t\|N\|H,C,X *$", out, re.M), out  # the V's chunks, kept
    assert re.search(r"^engine +zbv +zbv *$", out, re.M), out
    assert (
        "resuming checkpoint 4 on its recorded split E,t|t|N|H,C,X (layout, pp=2); today 'v-search' would choose "
        "E|t*2|N|H,C,X: set nanotron_ext.resume_plan: replan (or --replan) to move to it"
    ) in out
    assert "what differs: nothing" in out
    code, out, _ = _cli("plan", config, "--checkpoint", str(tmp_path / "ckpt" / "4"), "--replan", "--json")
    data = json.loads(out)
    assert code == 0 and data["kept"] is False
    assert data["resume"]["v_stages"] == list(today.stages) and data["resume"]["stages"] == list(today.block_ranks)
    assert {d["what"] for d in data["differences"]} == {"split", "strategy"}
    assert data["note"].startswith("re-planning as asked (resume_plan: replan): checkpoint 4 was trained on E,t|t|N")


def test_plan_checkpoint_of_a_contiguous_split_resumed_as_a_v_says_what_moves(tiny, tmp_path):
    cfg, blocks, _ = tiny
    _checkpoint(tmp_path, 4, record=_record(cfg, blocks, "E,t*2|L"))
    today = make_v_plan(blocks, cfg.with_overrides(engine="zbv"))
    code, out, err = _cli("plan", _zbv_config(tmp_path), "--checkpoint", str(tmp_path / "4"))
    assert code == 0 and err == "", err
    assert (
        "the config asks pp_engine zbv, the checkpoint was trained on a contiguous split (1f1b): checkpoint 4 "
        "(E,t*2|L) moves onto the new plan E|t*2|N|H,C,X; its weights, optimizer states and learning-rate schedule "
        "go to their new owners"
    ) in out
    assert "  split: E,t*2|L -> E|t*2|N|H,C,X\n  engine: 1f1b -> zbv\n  strategy: layout -> v-search" in out
    code, out, _ = _cli("plan", _zbv_config(tmp_path), "--checkpoint", str(tmp_path / "4"), "--json")
    data = json.loads(out)
    assert data["kept"] is False and data["resume"]["v_stages"] == list(today.stages)


def test_plan_checkpoint_without_a_plan_record_notes_how_the_launcher_resumes_it(tiny, tmp_path):
    cfg, _, today = tiny
    _checkpoint(tmp_path, 4, record=None)
    code, out, err = _cli("plan", str(bundled_config()), "--checkpoint", str(tmp_path / "4"))
    assert code == 0 and err == "", err  # the launcher resumes it: a note, not an error
    assert "checkpoint 4 could not be verified: it was saved by Nanotron alone" in out
    assert re.search(r"^split +not recorded +E,t\*2,N\|H,C,X *$", out, re.M), out
    assert "differs" not in out.split("note:")[0]
    assert (
        "note: checkpoint 4 has no nanotron_ext plan record (Nanotron saved it alone): its state is placed by name "
        "onto today's split E,t*2,N|H,C,X"
    ) in out
    code, out, _ = _cli("plan", str(bundled_config()), "--checkpoint", str(tmp_path / "4"), "--json")
    data = json.loads(out)
    assert code == 0 and data["recorded"] is None and data["differences"] is None and data["kept"] is False
    assert data["resume"]["stages"] == list(today.block_ranks)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root, record: None, "no checkpoint there"),
        (lambda root, record: _checkpoint(root, 4, record=replace(record, complete=False)), "says complete: false"),
    ],
)
def test_plan_checkpoint_refuses_what_it_cannot_compare(tiny, tmp_path, make, message):
    cfg, blocks, _ = tiny
    make(tmp_path, _record(cfg, blocks, "E,t|t,L"))
    folder = tmp_path / "4" if (tmp_path / "4").exists() else tmp_path / "nothing"
    code, out, err = _cli("plan", str(bundled_config()), "--checkpoint", str(folder))
    assert code == 2 and message in err and out == ""


def test_replan_without_checkpoint_is_a_usage_error():
    code, _, err = _cli("plan", "--replan")
    assert code == 2 and "--replan goes with --checkpoint DIR" in err
