"""A checkpoint's files, proved: each file hashed as a save writes it (never read back), listed in the plan record
with its size and checksum, and checked before a resume loads anything (here in one process, and shared out over
simulated ranks); ``nanotron-ext plan --checkpoint`` runs the same check. The process tests on upstream's trainer
are ``tests/upstream/test_resume_files.py``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xxhash

from nanotron_ext.checkpoint import (
    RECORD_FILE,
    PlanRecord,
    ResumeSource,
    read_record,
    record_for,
    verify_checkpoint,
)
from nanotron_ext.checkpoint.digest import SavedFile
from nanotron_ext.checkpoint.files import describe_file
from nanotron_ext.checkpoint.verify import check_files, hash_owners
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import CheckpointError
from nanotron_ext.integration.checkpoint_io import SaveRecorder
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import machine_for
from nanotron_ext.plan import make_plan

WEIGHT = "model/model/lm_head/pp_block/model_weight_pp-rank-1-of-2_tp-rank-0-of-1.safetensors"
OPTIMIZER = "optimizer/optimizer_pp-0-of-2_tp-0-of-1_exp-0-of-1.pt"


def _checksum(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"


@pytest.fixture(scope="module")
def record() -> PlanRecord:
    cfg = load_config(bundled_config())
    cfg = cfg.with_overrides(cost_strategy="layout", layout="E,t|t,L")
    return replace(record_for(make_plan(inventory_from_config(cfg), cfg), cfg, machine_for(cfg)), complete=True)


def _save(folder: Path, record: PlanRecord, step: int, *, listed: bool = True) -> Path:
    """A checkpoint folder as a save writes it: a weight, an optimizer state, a JSON file, all through the
    recorder; then the complete record, listing them."""
    folder = folder / str(step)
    (folder / "model/model/lm_head/pp_block").mkdir(parents=True)
    (folder / "optimizer").mkdir()
    recorder = SaveRecorder(folder)
    recorder.save_safetensors({"data": torch.arange(600.0).reshape(30, 20)}, folder / WEIGHT, {"version": "1.4"})
    recorder._torch_save(torch.save)(
        {"state": {0: {"exp_avg": torch.ones(300)}}, "names": {0: "w"}}, folder / OPTIMIZER
    )
    with recorder._open(folder / "model_config.json", "w") as f:
        json.dump({"hidden_size": 16}, f)
    files = tuple(recorder.files[k] for k in sorted(recorder.files)) if listed else None
    replace(record, step=step, files=files).write(folder)
    return folder


def test_a_recorder_hashes_each_file_as_it_is_written_never_by_reading_it_back(tmp_path):
    recorder = SaveRecorder(tmp_path)
    with recorder._open(tmp_path / "config.yaml", "w") as f:
        f.write("a: 1\nb: é\n")
    with recorder._open(tmp_path / "raw.bin", "wb", buffering=0) as f:
        f.write(b"\x00" * 10)
    recorder._torch_save(torch.save)({"x": torch.arange(5)}, tmp_path / "state.pt")
    recorder.save_safetensors({"data": torch.ones(3, 4)}, tmp_path / "w.safetensors", None)
    with recorder._open(tmp_path.parent / f"{tmp_path.name}-elsewhere.txt", "w") as f:  # outside the folder
        f.write("not recorded")
    # A named pipe: what reaches the reader is what was written; reading the "file" back afterwards gives nothing,
    # so a checksum taken that way would be the empty one.
    os.mkfifo(tmp_path / "pipe.bin")
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend((tmp_path / "pipe.bin").read_bytes()))
    reader.start()
    with recorder._open(tmp_path / "pipe.bin", "wb") as f:
        f.write(b"through the pipe " * 1000)
    reader.join(timeout=30)
    assert recorder.files["pipe.bin"] == SavedFile("pipe.bin", len(received), _checksum(bytes(received)))
    assert sorted(recorder.files) == ["config.yaml", "pipe.bin", "raw.bin", "state.pt", "w.safetensors"]
    for name in ("config.yaml", "raw.bin", "state.pt", "w.safetensors"):
        data = (tmp_path / name).read_bytes()
        assert recorder.files[name] == SavedFile(name, len(data), _checksum(data))
    assert (tmp_path / "config.yaml").read_text() == "a: 1\nb: é\n"
    assert torch.equal(torch.load(tmp_path / "state.pt")["x"], torch.arange(5))
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w.safetensors")["data"], torch.ones(3, 4))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
@pytest.mark.parametrize("shape", [(37, 5), (7,), (3, 0)])
def test_the_streamed_safetensors_file_is_safetensors_own_byte_for_byte(tmp_path, dtype, shape):
    from safetensors.torch import load_file, save_file

    tensors = {"data": (torch.randn(shape) * 10).to(dtype)}
    metadata = {"version": "1.4"}
    save_file(tensors, tmp_path / "theirs.safetensors", metadata=metadata)
    SaveRecorder(tmp_path).save_safetensors(tensors, tmp_path / "ours.safetensors", metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert torch.equal(load_file(tmp_path / "ours.safetensors")["data"], tensors["data"])


def test_a_streamed_file_with_several_tensors_and_metadata_entries_reads_back_as_written(tmp_path):
    from safetensors import safe_open

    tensors = {
        "b": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "a": torch.randn(4, dtype=torch.float64),
        "c": torch.ones(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5),
    }
    metadata = {"version": "1.4", "local_global_slices_pairs": "x", "unsharded_shape": "(4,)"}
    SaveRecorder(tmp_path).save_safetensors(tensors, tmp_path / "ours.safetensors", metadata)
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert f.metadata() == metadata and sorted(f.keys()) == sorted(tensors)
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_files_no_writer_recorded_are_listed_by_size_alone(tmp_path):
    recorder = SaveRecorder(tmp_path)
    with recorder._open(tmp_path / "a.json", "w") as f:
        f.write("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.txt").write_text("12345")  # pathlib's own open: not a writer the recorder swaps
    (tmp_path / RECORD_FILE).write_text("{}")
    (tmp_path / f".{RECORD_FILE}.x1.tmp").write_text("")  # an atomic write's temporary file
    assert recorder.unrecorded(recorder.files) == [SavedFile("sub/extra.txt", 5, None)]


def test_the_record_lists_the_files_and_reads_back_a_record_without_them(tmp_path, record):
    folder = _save(tmp_path, record, 4)
    back = read_record(folder)
    assert [f.path for f in back.files] == [
        "model/model/lm_head/pp_block/model_weight_pp-rank-1-of-2_tp-rank-0-of-1.safetensors",
        "model_config.json",
        OPTIMIZER,
    ]
    assert (
        json.loads((folder / RECORD_FILE).read_text())["files"][1]["size"]
        == (folder / "model_config.json").stat().st_size
    )
    data = json.loads((folder / RECORD_FILE).read_text())
    del data["files"]  # as records were written before they listed files
    assert PlanRecord.from_dict(data).files is None


def test_an_intact_checkpoint_verifies_and_says_what_it_proved(tmp_path, record):
    folder = _save(tmp_path, record, 4)
    verdict = verify_checkpoint(ResumeSource(folder, 4, read_record(folder)))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != RECORD_FILE)
    assert (verdict.verified, verdict.files, verdict.size) == (True, 3, size)
    assert verdict.line().startswith(
        "checkpoint 4: 3 files verified against the sizes and xxh3_64 checksums its save recorded"
    )


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _grow(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "file, holds",
    [
        (WEIGHT, "the weights of model.lm_head.pp_block.weight"),
        (OPTIMIZER, "the optimizer state of pp rank 0, tp rank 0"),
    ],
)
@pytest.mark.parametrize(
    "damage, says",
    [
        (Path.unlink, "missing"),
        (_cut, r"(\d+) bytes where the save wrote (\d+) \(cut short\)"),
        (_grow, r"(\d+) bytes where the save wrote (\d+) \(longer than written\)"),
        (
            _flip,
            r"its bytes differ from those the save wrote, at the same size \(xxh3_64:[0-9a-f]{16} where the save "
            r"recorded xxh3_64:[0-9a-f]{16}\)",
        ),
    ],
)
def test_a_damaged_file_is_named_with_what_it_holds_and_what_is_wrong(tmp_path, record, file, holds, damage, says):
    _save(tmp_path, record, 2)
    folder = _save(tmp_path, record, 4)
    written = (folder / file).stat().st_size
    damage(folder / file)
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(ResumeSource(folder, 4, read_record(folder)))
    lines = str(caught.value).split("\n")
    assert lines[0] == f"checkpoint 4 ({folder}) does not hold the files its save wrote, so nothing was loaded:"
    match = re.fullmatch(rf"  {re.escape(file)} \({holds}\): {says}", lines[1])
    assert match, lines[1]
    if match.groups():
        assert (int(match[1]), int(match[2])) == ((folder / file).stat().st_size, written)
    assert lines[2].endswith(
        f"cannot be trusted; resume from the last checkpoint that verifies instead: "
        f"checkpoints.resume_checkpoint_path: {tmp_path / '2'}"
    )


def test_the_checkpoint_named_instead_is_the_newest_older_one_that_verifies(tmp_path, record):
    _save(tmp_path, record, 2)
    _flip(_save(tmp_path, record, 3) / WEIGHT)  # complete, but damaged too
    folder = _save(tmp_path, record, 4)
    _save(tmp_path, record, 6)  # newer: never the one to go back to
    (folder / OPTIMIZER).unlink()
    source = ResumeSource(folder, 4, read_record(folder))
    with pytest.raises(
        CheckpointError,
        match=rf"verifies instead: checkpoints.resume_checkpoint_path: "
        rf"{tmp_path / '2'}$",
    ):
        verify_checkpoint(source)
    (tmp_path / "2" / WEIGHT).unlink()
    with pytest.raises(
        CheckpointError,
        match="no checkpoint beside it verifies: restore these files from a copy, or "
        "start again without checkpoints.resume_checkpoint_path$",
    ):
        verify_checkpoint(source)
    _save(tmp_path, record, 1, listed=False)
    with pytest.raises(
        CheckpointError,
        match=rf"resume from the last complete checkpoint instead \(saved without "
        rf"checksums, so it cannot be verified\): checkpoints.resume_checkpoint_"
        rf"path: {tmp_path / '1'}$",
    ):
        verify_checkpoint(source)


def test_a_record_without_files_cannot_be_verified_and_says_so(tmp_path, record):
    folder = _save(tmp_path, record, 4, listed=False)
    _flip(folder / WEIGHT)  # nothing to tell it by
    verdict = verify_checkpoint(ResumeSource(folder, 4, read_record(folder)))
    assert not verdict.verified and verdict.line() == (
        "checkpoint 4 could not be verified: it was saved before nanotron_ext recorded its files' checksums, so a "
        "damaged file would show only when it is read"
    )
    assert "was saved by Nanotron alone" in verify_checkpoint(ResumeSource(folder, 4, None)).line()


def test_a_checksum_of_an_unknown_kind_is_refused_on_every_rank_before_any_reads(tmp_path, record):
    folder = _save(tmp_path, record, 4)
    files = tuple(replace(f, checksum="blake9:00") if f.path == WEIGHT else f for f in read_record(folder).files)
    with pytest.raises(
        CheckpointError,
        match="its recorded checksum is 'blake9', which this nanotron_ext does not know .* upgrade to verify it",
    ):
        verify_checkpoint(
            ResumeSource(folder, 4, replace(read_record(folder), files=files)),
            rank=1,
            world=2,
            gather=lambda x: pytest.fail("a rank read before every rank knew the checksum"),
        )


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_the_reading_is_shared_out_each_file_once_and_every_rank_gets_every_finding(tmp_path, record, world):
    folder = _save(tmp_path, record, 4)
    files = read_record(folder).files
    owners = hash_owners(files, world)
    assert len(owners) == len(files) and set(owners) <= set(range(world))
    load = [sum(f.size for f, o in zip(files, owners) if o == r) for r in range(world)]
    assert max(load) - min(load) <= max(f.size for f in files)  # largest first, to the least loaded
    _cut(folder / WEIGHT)
    (folder / "model_config.json").unlink()
    per_rank = [check_files(folder, files, rank=r, world=world) for r in range(world)]
    found = sorted(str(p) for problems in per_rank for p in problems)
    assert found == sorted(map(str, check_files(folder, files))) and len(found) == 2
    messages = set()
    for rank in range(world):
        with pytest.raises(CheckpointError) as caught:
            verify_checkpoint(
                ResumeSource(folder, 4, read_record(folder)),
                rank=rank,
                world=world,
                gather=lambda _: [check_files(folder, files, rank=r, world=world) for r in range(world)],
            )
        messages.add(str(caught.value))
    assert len(messages) == 1 and WEIGHT in messages.pop()


@pytest.mark.parametrize(
    "path, holds",
    [
        (
            "model/model/decoder/0/pp_block/attn/qkv_proj/model_weight_pp-rank-0-of-2_tp-rank-1-of-2.safetensors",
            "the weights of model.decoder.0.pp_block.attn.qkv_proj.weight, tp shard 1 of 2",
        ),
        (
            "model/model/final_layer_norm/pp_block/model_weight.safetensors",
            "the weights of model.final_layer_norm.pp_block.weight",
        ),
        (
            "optimizer/optimizer_pp-1-of-2_dp-3-of-4_tp-0-of-1_exp-0-of-1.pt",
            "the optimizer state of pp rank 1, tp rank 0, dp rank 3",
        ),
        (
            "lr_scheduler/lr_scheduler_pp-0-of-2_tp-0-of-1_exp-0-of-1.pt",
            "the learning-rate schedule of pp rank 0, tp rank 0",
        ),
        ("random/tp-0-of-1_dp-0-of-1_pp-1-of-2.pt", "a rank's random states"),
        ("checkpoint_metadata.json", "the step and the samples consumed"),
        ("optimizer/optimizer_config.json", "the optimizer's type and sharding"),
        ("notes.txt", "a file of the checkpoint"),
    ],
)
def test_each_file_is_described_by_what_it_holds(path, holds):
    assert describe_file(path) == holds


def _cli(*argv: str) -> tuple[int, str, str]:
    from nanotron_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_plan_checkpoint_runs_the_resumes_check_and_exits_non_zero_on_a_damaged_file(tmp_path, record):
    folder = _save(tmp_path, record, 4)
    code, out, _ = _cli("plan", str(bundled_config()), "--checkpoint", str(folder))
    assert code == 0 and "  checkpoint 4: 3 files verified against the sizes and xxh3_64 checksums" in out
    _flip(folder / OPTIMIZER)
    code, out, err = _cli("plan", str(bundled_config()), "--checkpoint", str(folder))
    assert (
        code == 2
        and out == ""
        and f"  {OPTIMIZER} (the optimizer state of pp rank 0, tp rank 0): its bytes differ from those the save wrote"
        in err
    )
    unlisted = _save(tmp_path / "old", record, 4, listed=False)
    code, out, _ = _cli("plan", str(bundled_config()), "--checkpoint", str(unlisted), "--json")
    assert code == 0 and json.loads(out)["files_verified"] is None
