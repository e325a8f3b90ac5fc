"""A checkpoint proves its files before anything loads: upstream Nanotron's own trainer (``run_train.py`` through
``torchrun -m nanotron_ext.run``, two CPU ranks over gloo) saves steps 2 and 4; each case copies them, damages
files of step 4 (cut short, deleted, one byte flipped; weights and optimizer states) and resumes it, under the
recorded plan and under another split. Every rank stops with the same message before a weight is loaded, naming
each file, what it holds and what is wrong with it, and the step-2 checkpoint, which verifies. A record written
before records listed their files resumes with a line saying it could not be verified; a file that then fails to
load stops every rank with a load failure (exit code 3) naming it.

One training run is shared by every case, the resume tests' plan A; a refused resume stops before the model is built
(about as long as starting the two processes).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from nanotron_ext.checkpoint import RECORD_FILE
from upstream.e2e import Run, launch, one_message, tiny_config
from upstream.test_resume import LAYOUT_A, SHAPE

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

KEPT = LAYOUT_A  # plan A's own split (SHAPE and plan A: test_resume.py's)
OTHER_SPLIT = {"cost_strategy": "layout", "layout": "E,t*2|L"}  # pp=2 too: the launcher's loader places the state

LM_HEAD = "model/model/lm_head/pp_block/model_weight_pp-rank-1-of-2_tp-rank-0-of-1.safetensors"
EMBEDDING = (
    "model/model/token_position_embeddings/pp_block/token_embedding/"
    "model_weight_pp-rank-0-of-2_tp-rank-0-of-1.safetensors"
)
QKV_0 = "model/model/decoder/0/pp_block/attn/qkv_proj/model_weight_pp-rank-0-of-2_tp-rank-0-of-1.safetensors"
OPTIMIZER = "optimizer/optimizer_pp-{}-of-2_tp-0-of-1_exp-0-of-1.pt"


@pytest.fixture(scope="module")
def saved(plan_a, tmp_path_factory) -> Path:
    """Checkpoints 2 and 4 under E,t|t,L: those of plan A (tests/upstream/conftest.py; this module's shape, saving
    every 2 steps), copied as they were written (files and times) into a folder whose latest is 4."""
    run, base = plan_a
    # Nanotron's trainer saves step 6 twice (its interval, then save_final_state): written and logged once.
    once = [str(base / "checkpoints" / step) for step in ("2", "4", "6")]
    assert re.findall(r"Saving checkpoint at (\S+)", run.out) == once
    folder = tmp_path_factory.mktemp("saved") / "checkpoints"
    for step in (2, 4):
        shutil.copytree(base / "checkpoints" / str(step), folder / str(step))
    (folder / "latest.txt").write_text("4")
    return folder


def _copy(saved: Path, tmp: Path) -> Path:
    shutil.copytree(saved, tmp / "checkpoints")
    return tmp / "checkpoints"


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {"cut": _cut, "delete": Path.unlink, "flip": _flip}


def _resume(tmp: Path, folder: Path, ext: dict, steps: int = 6) -> Run:
    return launch(
        tiny_config(
            tmp,
            steps=steps,
            checkpoints__checkpoint_interval=2,
            **SHAPE,
            checkpoints__resume_checkpoint_path=str(folder),
            ext=ext,
        )
    )


def _notes(run: Run) -> list[str]:
    return re.findall(r"^nanotron_ext: (.*)$", run.out, re.M)


def _stopped_on_every_rank(run: Run, code: int, first_line: str, lines: list[str]) -> None:
    """Both ranks stop with exit code ``code`` (torchrun reports the first): ``first_line`` printed once (one job, one
    message), each of ``lines`` (the message's next lines) in both ranks' error files, which torchrun's summary shows;
    no step trains and no traceback of ours is printed."""
    one_message(run.out, f"error: {first_line}", code)
    for line in lines:
        assert run.out.count(line) == 2, (line, run.out[-3000:])  # the summary's two failures, never printed
    assert not run.losses
    assert "lost rank" not in run.out  # a peer is never blamed


def test_every_file_the_save_wrote_is_listed_with_its_size_and_checksum_and_the_record_is_written_last(saved):
    folder = saved / "4"
    record = json.loads((folder / RECORD_FILE).read_text())
    on_disk = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file() and p.name != RECORD_FILE}
    assert {f["path"] for f in record["files"]} == set(on_disk) and len(on_disk) == 25
    for f in record["files"]:
        data = on_disk[f["path"]].read_bytes()
        assert (f["size"], f["checksum"]) == (len(data), f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"), f["path"]
    assert "model_config.json" in on_disk  # written by Nanotron after latest.txt moved: listed all the same
    last = max(p.stat().st_mtime_ns for p in on_disk.values())
    assert (folder / RECORD_FILE).stat().st_mtime_ns >= last


@pytest.mark.parametrize("plan", ["kept", "another split"])
@pytest.mark.parametrize(
    "damage",
    [
        # Each case damages three files at once (every rank reports every file): between them, each of the three
        # damages hits a weight file and an optimizer file.
        {LM_HEAD: "cut", QKV_0: "flip", OPTIMIZER.format(1): "delete"},
        {EMBEDDING: "delete", OPTIMIZER.format(0): "cut", OPTIMIZER.format(1): "flip"},
    ],
    ids=["weights-cut-and-flipped-optimizer-deleted", "weight-deleted-optimizers-cut-and-flipped"],
)
def test_damaged_files_stop_every_rank_before_anything_loads_naming_each(saved, tmp_path, plan, damage):
    root = _copy(saved, tmp_path)
    sizes = {path: (root / "4" / path).stat().st_size for path in damage}
    for path, how in damage.items():
        DAMAGE[how](root / "4" / path)
    run = _resume(tmp_path, root / "4", KEPT if plan == "kept" else OTHER_SPLIT)
    expected = {
        "cut": lambda p: f"{sizes[p] // 2} bytes where the save wrote {sizes[p]} (cut short)",
        "delete": lambda p: "missing",
        "flip": lambda p: "its bytes differ from those the save wrote, at the same size (xxh3_64:",
    }
    holds = {
        LM_HEAD: "the weights of model.lm_head.pp_block.weight",
        EMBEDDING: "the weights of model.token_position_embeddings.pp_block.token_embedding.weight",
        QKV_0: "the weights of model.decoder.0.pp_block.attn.qkv_proj.weight",
        OPTIMIZER.format(0): "the optimizer state of pp rank 0, tp rank 0",
        OPTIMIZER.format(1): "the optimizer state of pp rank 1, tp rank 0",
    }
    _stopped_on_every_rank(
        run,
        2,
        f"checkpoint 4 ({root / '4'}) does not hold the files its save wrote, so nothing was loaded:",
        [f"  {path} ({holds[path]}): {expected[how](path)}" for path, how in sorted(damage.items())]
        + [
            f"cannot be trusted; resume from the last checkpoint that verifies instead: "
            f"checkpoints.resume_checkpoint_path: {root / '2'}"
        ],
    )
    assert "Total number of parameters" not in run.out  # stopped before the model was built


def _unlisted(root: Path) -> None:
    """The records as nanotron_ext wrote them before they listed their files."""
    for step in (2, 4):
        path = root / str(step) / RECORD_FILE
        record = json.loads(path.read_text())
        del record["files"]
        path.write_text(json.dumps(record))


def test_a_record_without_files_still_resumes_and_says_it_could_not_be_verified(saved, tmp_path):
    root = _copy(saved, tmp_path)
    _unlisted(root)
    run = _resume(tmp_path, root / "4", KEPT, steps=5)
    assert run.rc == 0 and sorted(run.losses) == [5], run.out[-3000:]
    assert (
        "checkpoint 4 could not be verified: it was saved before nanotron_ext recorded its files' checksums, so "
        "a damaged file would show only when it is read"
    ) in _notes(run)


@pytest.mark.parametrize(
    "path, how, error",
    [
        (LM_HEAD, "cut", "its weights: {path}: SafetensorError: "),
        (OPTIMIZER.format(1), "delete", "its optimizer states: {path}: FileNotFoundError: "),
    ],
)
def test_a_file_that_fails_to_load_stops_every_rank_with_a_load_failure_naming_it(saved, tmp_path, path, how, error):
    # Without checksums in its record nothing proves the files first: the damage shows while rank 1 loads.
    root = _copy(saved, tmp_path)
    _unlisted(root)
    (root / "2" / RECORD_FILE).write_text((saved / "2" / RECORD_FILE).read_text())  # step 2 lists its files
    DAMAGE[how](root / "4" / path)
    run = _resume(tmp_path, root / "4", KEPT)
    _stopped_on_every_rank(
        run,
        3,
        f"loading checkpoint 4 ({root / '4'}) failed, so every rank stops before training on a partly loaded state:",
        [
            f"  rank 1, reading {error.format(path=path)}",
            f"the file is most likely damaged; resume from the last checkpoint that verifies instead: "
            f"checkpoints.resume_checkpoint_path: {root / '2'}",
        ],
    )
