"""How the launcher ends a rank (``python -m nanotron_ext.run``), in real processes on stub scripts: the process groups
closed before the interpreter's exit, the script's exit code, and every rank's own message when one stops early."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
from launcher_scripts import ONE_RANK, script_env
from torchrun_summary import ROOT_CAUSE

from nanotron_ext.config import bundled_config
from nanotron_ext.procs import run_local_ranks

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

_CLOSE_CHILD = ONE_RANK + textwrap.dedent(
    """
    import torch.distributed as dist
    import nanotron_ext.run as launcher

    launcher.CLOSE_AFTER_ERROR_S = 1.0
    code = launcher.main(sys.argv[1:])
    print("CODE", code, "LEFT-OPEN", dist.is_initialized(), flush=True)
    sys.exit(code)
    """
)

#: What the scripts of the test below end with: a clean finish, an error exit, and an error exit whose groups do not
#: close (a peer holding a transfer open: here destroy_process_group blocks).
_ENDINGS = {
    "clean": "",
    "error": "raise SystemExit(4)\n",
    "error, closing blocks": "import time\ndist.destroy_process_group = lambda: time.sleep(60)\nraise SystemExit(4)\n",
}


@pytest.mark.parametrize(
    ("ending", "code", "printed"),
    [
        ("clean", 0, "CODE 0 LEFT-OPEN False"),
        ("error", 4, "CODE 4 LEFT-OPEN False"),
        ("error, closing blocks", 4, None),  # it exits with the code at once: nothing after main() runs
    ],
)
def test_the_launcher_closes_the_process_groups_before_the_interpreters_exit(tmp_path, ending, code, printed):
    # Left to the interpreter's exit, gloo's worker threads can abort a rank (seen in CI: "terminate called without
    # an active exception" after a clean run's last checkpoint, and after a refused resume: -6 instead of 0 or 2).
    script = tmp_path / "run_train.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n" + _ENDINGS[ending])
    env = script_env()
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _CLOSE_CHILD, str(script), "--config-file", str(bundled_config())],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == code, out.stdout + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("CODE")]
    assert lines == ([printed] if printed else []), out.stdout
    if printed is None:
        assert time.monotonic() - start < 30, "a blocked close must not hold the rank (the script's close sleeps 60 s)"


def test_the_launcher_ends_a_rank_as_the_interpreter_would_with_the_scripts_code(tmp_path):
    # `python -m nanotron_ext.run` ends before C++'s static destructors (where gloo aborted ranks), but only after
    # what the interpreter's own exit does: a running thread finishes, then the atexit handlers (wandb, logging) run.
    out = _launch_script(
        tmp_path,
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('ATEXIT', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('THREAD', flush=True)))"
        ".start()\n"
        "raise SystemExit(3)\n",
    )
    assert out.returncode == 3, out.stdout + out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line in ("THREAD", "ATEXIT")] == ["THREAD", "ATEXIT"], (
        out.stdout
    )


# Under torchrun the count on its store serves before and after the process groups exist alike; started directly,
# the ranks meet in a gloo barrier.
@pytest.mark.parametrize(
    "launch", ["torchrun, before the process groups exist", "ranks started directly, on gloo process groups"]
)
def test_every_rank_reports_why_it_stops_even_when_one_is_slow_to_say_it(tmp_path, launch):
    # Torchrun ends every rank as soon as one exits: a plan refused on both ranks was once reported by rank 1 alone,
    # and in CI a refused resume (checked before any process group exists). Here rank 0 reaches its report 1.2 s
    # after rank 1's (past the old 0.5 s grace), counted from a file rank 1 writes as it reports: the ranks' imports
    # may end seconds apart on a busy machine, and torchrun's summary orders errors by their second. Both must
    # report it. Under torchrun the first (rank 1) prints it, once a job, and each rank's error file holds its own,
    # which torchrun's summary shows; started directly (no store to share, no error file) each rank prints its own,
    # and the ranks get 0.2 s after the first one exits, as a launcher that ends the rest at once would.
    init = "" if "before" in launch else "dist.init_process_group('gloo')\n"
    reported = tmp_path / "rank-1-reports"
    source = (
        "import os, time\nimport torch.distributed as dist\nfrom nanotron_ext.errors import PlanningError\n"
        + init
        + f"rank, reported = os.environ['RANK'], {str(reported)!r}\n"
        "if rank == '0':\n"
        "    while not os.path.exists(reported):\n"
        "        time.sleep(0.02)\n"
        "    time.sleep(1.2)\n"
        "else:\n"
        "    open(reported, 'w').close()\n"
        "raise PlanningError(f'refused on rank {rank}')\n"
    )
    if launch.startswith("torchrun"):
        out = _launch_script(tmp_path, source, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
        text = out.stdout + out.stderr
        printed = re.findall(r"^nanotron_ext\.run \[rank (\d)\]: refused on rank \1$", text, re.M)
        assert out.returncode == 1 and printed == ["1"], text[-3000:]  # once, by the first rank that had it
        root = text[text.index(ROOT_CAUSE) :]
        assert "traceback : nanotron_ext.run [rank 1]: refused on rank 1" in root, text[-3000:]  # the first
        said = set(re.findall(r"traceback : nanotron_ext\.run \[rank (\d)\]: refused on rank \1$", text, re.M))
        assert said == {"0", "1"}, text[-3000:]  # the slow rank wrote its own too, before torchrun ended the job
        return
    script = tmp_path / "run_train.py"
    script.write_text(source)
    ranks = run_local_ranks(
        [sys.executable, "-m", "nanotron_ext.run", str(script), "--config-file", str(bundled_config())],
        2,
        timeout=120,
        grace=0.2,
        env=script_env(),
    ).ranks
    codes, text = [r.returncode for r in ranks], "".join(r.stdout for r in ranks)
    said = {rank for rank in ("0", "1") if f"nanotron_ext.run [rank {rank}]: refused on rank {rank}" in text}
    assert all(code not in (0, None) for code in codes) and said == {"0", "1"}, text[-3000:]


def _launch_script(tmp_path, source: str, *launcher: str) -> subprocess.CompletedProcess:
    """``python [LAUNCHER...] -m nanotron_ext.run run_train.py --config-file CONFIG`` on a script of ``source``."""
    script = tmp_path / "run_train.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, *launcher, "-m", "nanotron_ext.run", str(script), "--config-file", str(bundled_config())],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
