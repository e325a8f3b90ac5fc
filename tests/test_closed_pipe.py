"""A reader that closes the output early: the same exit code on every run, never a traceback (real processes).

The command writes its whole output once, at the end (``nanotron_ext.cli.output``), so the outcome depends only on
what the reader did: gone before the write, 141; took the output and left, the command's own code; left while an
output larger than the pipe was still being written, 141.
"""

from __future__ import annotations

import fcntl
import io
import os
import subprocess
import sys

import pytest

from nanotron_ext.config import bundled_config

#: Each command's code when the reader takes the output (the exit code of the verdict).
COMMANDS = {
    "plan": (["plan"], 0),
    "plan --compare": (["plan", "--compare"], 0),
    "plan --json": (["plan", "--json"], 0),
    "plan --compare-engines": (["plan", "--compare-engines"], 0),
    "plan, INVALID": (["plan", "--cost-strategy", "nanotron"], 1),
    "simulate": (["simulate", "--out", "{tmp}/t.png"], 0),
    "simulate --compare": (["simulate", "--compare", "--out", "{tmp}/t.png", "--loads-out", "{tmp}/l.png"], 0),
    "--help": (["--help"], 0),
    "plan --help": (["plan", "--help"], 0),
    "--version": (["--version"], 0),
}
#: The pipe's size in these tests (the smallest Linux allows): an output over twice it outlasts any reader that
#: stops after a few lines.
PIPE_BYTES = 4096
#: About 23 KiB of stage and memory tables (pp = 64), in under a second.
LARGE = ["plan", str(bundled_config("llama_3_70b.yaml")), "--pp", "64"]
LARGE_CODE = 1  # the verdict: some stage of this plan cannot train
RUNS = 3


def _run(argv: list[str], lines: int | None, *, unbuffered: bool, dev: bool = False) -> tuple[int, str, bytes]:
    """Run the command with stdout into a :data:`PIPE_BYTES` pipe whose reader reads ``lines`` lines (None: all,
    0: it closed before the command started) and closes it; returns the exit code, stderr and what was read.
    ``dev``: Python's development mode, which prints what a stream that fails again when it is collected would
    otherwise keep silent."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    if lines == 0:
        os.close(read)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "PYTHONDEVMODE")}
    env.update({"PYTHONUNBUFFERED": "1"} if unbuffered else {}, **({"PYTHONDEVMODE": "1"} if dev else {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanotron_ext.cli", *argv], stdout=write, stderr=subprocess.PIPE, env=env
    )
    os.close(write)
    got = b""
    if lines != 0:
        while lines is None or got.count(b"\n") < lines:
            chunk = os.read(read, PIPE_BYTES)
            if not chunk:
                break
            got += chunk
        os.close(read)
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err, got


pytestmark = pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="sets a pipe's size (Linux)")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_ends_141_when_the_reader_is_gone_and_its_own_code_when_it_read(tmp_path, name):
    argv, done = COMMANDS[name]
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, err, _ = _run(argv, 0, unbuffered=True, dev=True)
    assert (code, err) == (141, "")  # --help and --version too: one rule for every output
    code, err, got = _run(argv, 1, unbuffered=True)
    assert (code, err) == (done, "") and got


@pytest.mark.parametrize("lines", [0, 1, 2, 12])
def test_a_report_the_pipe_holds_ends_with_its_verdict_whenever_the_reader_leaves(lines):
    # Written line by line, `plan | head -2` raced head's exit: "0 141 141 141 0" over five runs. Both buffering
    # modes, every run: 141 only when the reader was gone before the write.
    for run in range(RUNS):
        code, err, got = _run(["plan"], lines, unbuffered=run % 2 == 0)
        assert (code, err) == (141 if lines == 0 else 0, ""), (run, err, got[:200])


@pytest.mark.parametrize("lines", [0, 1, 2, 40])
def test_a_report_larger_than_the_pipe_ends_141_whenever_the_reader_leaves_early(lines):
    for run in range(RUNS):
        code, err, got = _run(LARGE, lines, unbuffered=run % 2 == 0)
        assert (code, err) == (141, ""), (run, err)
        assert got.count(b"\n") >= lines
    code, err, got = _run(LARGE, None, unbuffered=True)  # a reader that reads it all gets the verdict
    assert (code, err) == (LARGE_CODE, "") and len(got) > 2 * PIPE_BYTES + 8192


def test_the_output_is_written_once_at_the_end(monkeypatch):
    # Python's unbuffered stdout (PYTHONUNBUFFERED=1) writes every print at once; inside the command nothing may
    # reach the pipe before the end, or a reader's exit races the next write.
    read, write = os.pipe()
    unbuffered = io.TextIOWrapper(io.FileIO(write, "wb", closefd=False), write_through=True)
    monkeypatch.setattr(sys, "stdout", unbuffered)
    from nanotron_ext.cli.output import whole_output

    with whole_output():
        print("first line")
        assert fcntl.ioctl(read, 0x541B, b"\0\0\0\0") == b"\0\0\0\0"  # FIONREAD: nothing in the pipe yet
        print("second line")
    assert os.read(read, 100) == b"first line\nsecond line\n"
    os.close(read)
    os.close(write)


@pytest.mark.parametrize("command, held", [("plan", True), ("simulate", True), ("train", False), ("calibrate", False)])
def test_reports_are_held_and_progress_streams(monkeypatch, command, held):
    # plan and simulate print a report at the end: held, then written once. train and calibrate print a line per
    # step (or per measurement): each goes out as it is printed, or a watcher sees nothing until the end.
    import nanotron_ext.cli as cli

    read, write = os.pipe()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write, "wb", closefd=False), write_through=True))
    seen: list[bytes] = []

    def command_that_prints(args: object) -> int:
        print("step 1")
        seen.append(fcntl.ioctl(read, 0x541B, b"\0\0\0\0"))  # FIONREAD: bytes already in the pipe
        return 0

    module = getattr(cli, command)
    monkeypatch.setattr(module, f"cmd_{command}", command_that_prints)
    argv = [command, "--out", "m.json"] if command == "calibrate" else [command]
    assert cli.main(argv) == 0
    assert (int.from_bytes(seen[0], sys.byteorder) == 0) == held
    assert os.read(read, 100) == b"step 1\n"
    os.close(read)
    os.close(write)


BROKEN = """
import os, sys
from nanotron_ext.cli.common import report_error
read, write = os.pipe()
if sys.argv[1] == "stdout":
    os.close(read)
    os.dup2(write, 1)
sys.exit(report_error(BrokenPipeError(32, "Broken pipe")))
"""


@pytest.mark.parametrize("where, code", [("stdout", 141), ("elsewhere", 3)])
def test_a_broken_pipe_is_a_closed_output_only_when_the_reader_of_stdout_left(where, code):
    # train's and calibrate's catch-alls pass every error to report_error: a BrokenPipeError of their output is a
    # reader that left (141, quietly), one of a socket to a peer is a failure (3, one line).
    proc = subprocess.run([sys.executable, "-c", BROKEN, where], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code
    assert (proc.stderr == "") == (code == 141), proc.stderr


def test_an_output_that_cannot_be_written_is_one_line_and_exit_3():
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "nanotron_ext.cli", "plan"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 3
    assert proc.stderr == (
        "nanotron-ext: error: cannot write the output: No space left on device; free space or write elsewhere\n"
    )
