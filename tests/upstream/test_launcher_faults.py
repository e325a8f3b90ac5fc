"""The launcher's fault table: ``torchrun -m nanotron_ext.run run_train.py`` (upstream's own trainer, two CPU
ranks over gloo) is stopped mid-training in the three ways a job dies, and every process of it must be gone
within seconds. torchrun starts each rank in a session of its own, so a rank whose torchrun was SIGKILLed
would train on to its last step and save a checkpoint, unsupervised, unless it dies with its parent
(:func:`nanotron_ext.procs.exit_with_parent`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nanotron_ext.procs import kill_process_group
from upstream.e2e import tiny_config, torchrun_command

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

#: The most seconds every process of the job may take to be gone after the fault.
GONE_WITHIN_S = 5.0
#: Far more steps than the test lasts: a rank still alive after the fault would go on training.
STEPS = 100_000


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid``, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below ``root`` (torchrun's ranks, and anything they started)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[1], []).append(int(entry.name))
            starts[int(entry.name)] = st[2]
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = starts[child]
            todo.append(child)
    return out


def _alive(pid: int, start: int) -> bool:
    """Whether the process recorded as (pid, start time) still runs; a zombie has ended, a reused pid is another."""
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


class _Job:
    """One ``torchrun -m nanotron_ext.run`` of upstream's run_train.py, training for STEPS steps."""

    def __init__(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        config = tiny_config(tmp, steps=STEPS, ext={"cost_strategy": "constrained"})
        self.log = tmp / "job.log"
        cmd, env = torchrun_command(config)
        with self.log.open("w") as out:  # its own session: the cleanup's killpg reaches torchrun, never pytest
            self.torchrun = subprocess.Popen(
                cmd, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.ranks: dict[int, int] = {}

    def wait_for_training(self, timeout: float = 300) -> None:
        """Until both ranks have logged a training step; then record every process below torchrun."""
        deadline = time.monotonic() + timeout
        while "iteration: 2 / " not in self.log.read_text():
            assert self.torchrun.poll() is None, f"torchrun ended early:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no training step in {timeout} s:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        self.ranks = _descendants(self.torchrun.pid)
        rank_pids = [p for p in self.ranks if b"nanotron_ext.run" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(rank_pids) == 2, (self.ranks, rank_pids)
        self.rank_pids = sorted(rank_pids)

    def seconds_until_gone(self, kill: Callable[[], object], limit: float = 30.0) -> float:
        """Apply the fault; seconds until torchrun and every recorded process have ended (``limit`` at most)."""
        start = time.monotonic()
        kill()
        while time.monotonic() - start < limit:
            torchrun_gone = self.torchrun.poll() is not None  # our child: poll() reaps it
            if torchrun_gone and not any(_alive(p, s) for p, s in self.ranks.items()):
                return time.monotonic() - start
            time.sleep(0.01)
        return float("inf")

    def survivors(self) -> list[str]:
        """The command lines of recorded processes still running, for the failure message."""
        return [
            Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            for p, s in self.ranks.items()
            if _alive(p, s)
        ]

    def close(self) -> None:
        """SIGKILL whatever is left: torchrun's session, and each recorded process (the ranks lead their own)."""
        kill_process_group(self.torchrun)
        for pid, start in self.ranks.items():
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)


def test_every_process_of_the_job_is_gone_within_seconds_of_each_fault(tmp_path):
    faults = {
        "SIGKILL torchrun": lambda job: os.kill(job.torchrun.pid, signal.SIGKILL),
        "SIGKILL rank 1": lambda job: os.kill(job.rank_pids[1], signal.SIGKILL),
        "SIGTERM torchrun": lambda job: os.kill(job.torchrun.pid, signal.SIGTERM),
    }
    seconds: dict[str, float] = {}
    left: dict[str, list[str]] = {}
    for i, (fault, kill) in enumerate(faults.items()):
        job = _Job(tmp_path / str(i))
        try:
            job.wait_for_training()
            seconds[fault] = job.seconds_until_gone(lambda: kill(job))  # noqa: B023 (called at once)
            left[fault] = job.survivors()
        finally:
            job.close()
    print(
        "\nlauncher's fault table (seconds until every process is gone): "
        + " | ".join(f"{fault}: {s:.2f}" for fault, s in seconds.items())
    )
    slow = {fault: s for fault, s in seconds.items() if s >= GONE_WITHIN_S}
    assert not slow, f"processes outlived the fault by {GONE_WITHIN_S} s or more: {slow}; still running: {left}"
