"""``nanotron_ext.procs.exit_with_parent`` on real processes: a rank dies with its launcher, and a launcher that
is process 1 (torchrun as a container's first process) is not mistaken for the init that adopts orphans."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
# A rank: set the hook, say so, then live for a minute unless the hook ends it.
RANK = (
    "import time; from nanotron_ext.procs import exit_with_parent; exit_with_parent(); "
    "print('hooked', flush=True); time.sleep(60); print('outlived', flush=True)"
)

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG"),
    pytest.mark.slow,  # tests/conftest.py: left out of the quick run
]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _line(stream, timeout: float = 30.0) -> str:
    """The next line of ``stream`` (a text pipe), or '' when none comes within ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def test_a_rank_dies_within_5_s_of_its_launchers_sigkill():
    # The launcher: a Python that starts the rank, prints its pid and sleeps.
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', {RANK!r}], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rank = int(_line(launcher.stdout))
    try:
        assert _line(launcher.stdout).strip() == "hooked"  # the rank has set its hook (it prints to the same pipe)
        assert not _gone(rank)
        launcher.kill()
        launcher.wait()
        start = time.monotonic()
        while not _gone(rank) and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert _gone(rank), "the rank outlived its SIGKILLed launcher by 5 s"
    finally:
        launcher.kill()
        if not _gone(rank):
            os.kill(rank, signal.SIGKILL)


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unprivileged user and PID namespaces (unshare)")
def test_torchrun_as_process_1_keeps_its_ranks():
    # In a fresh PID namespace torchrun is process 1, as in `docker run IMAGE torchrun ...`: its ranks see a
    # parent pid of 1, which must not read as "the launcher died before the hook was set".
    cmd = [
        "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--mount-proc",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "--no-python",
        sys.executable,
        "-c",
        RANK.replace("time.sleep(60)", "time.sleep(1)"),
    ]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "outlived" in run.stdout, run.stdout + run.stderr[-3000:]
