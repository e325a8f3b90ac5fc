"""``tests/runtime/forkserver.py``: a rank forked from the server sees what ``python ARGV`` would give it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from nanotron_ext.procs import local_env, run_local_ranks

from .forkserver import ForkedRank, start
from .test_procs import _alive

PY = sys.executable
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks (Linux)")

_SHOW = (
    "import json, os, sys, tempfile; print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(), "
    "'x': os.environ.get('X'), 'rank': os.environ['RANK'], 'hash': hash('a'), 'torch': 'torch' in sys.modules, "
    "'main': __name__, 'sid': os.getsid(0) == os.getpid(), 'tmp': tempfile.gettempdir(), "
    "'ours': sorted({m.split('.')[0] for m in sys.modules} & {'nanotron', 'nanotron_ext', 'flash_attn', 'triton'})}))"
)


def _forked(argv, env, cwd, out, err):  # noqa: ANN001, ANN202
    """``start``, failing where the rank was not forked."""
    proc = start(argv, env, cwd, out, err)
    assert isinstance(proc, ForkedRank), "the rank was not forked from the server"
    return proc


def test_a_forked_rank_sees_its_argv_environment_folder_and_session(tmp_path: Path) -> None:
    run = run_local_ranks(
        [PY, "-c", _SHOW, "one", "two"],
        2,
        timeout=60,
        env=local_env(X="x", TMPDIR=str(tmp_path)),
        cwd=tmp_path,
        start=_forked,
    )
    assert run.ok, run.describe()
    seen = [json.loads(r.stdout.strip().splitlines()[-1]) for r in run.ranks]
    for rank, s in enumerate(seen):
        assert s["argv"] == ["-c", "one", "two"] and s["path0"] == "" and s["cwd"] == str(tmp_path)
        assert s["x"] == "x" and s["rank"] == str(rank) and s["main"] == "__main__" and s["sid"]
        assert s["tmp"] == str(tmp_path)  # its own TMPDIR: tests look there for what a run leaves behind
        assert s["torch"], "the server did not preload torch"
        # Nanotron and this package import in the rank, after the launcher's stand-ins are on the path
        assert s["ours"] == [], s["ours"]
    assert seen[0]["hash"] != seen[1]["hash"], "two ranks of a launch share a hash seed"


def test_a_module_and_a_script_run_as_main_with_their_own_path(tmp_path: Path) -> None:
    (tmp_path / "shown.py").write_text(_SHOW)
    for argv, path0 in (
        ([PY, "-m", "shown", "a"], str(tmp_path)),
        ([PY, str(tmp_path / "shown.py"), "a"], str(tmp_path)),
    ):
        run = run_local_ranks(argv, 1, timeout=60, env=local_env(PYTHONPATH=str(tmp_path)), cwd=tmp_path, start=start)
        assert run.ok, run.describe()
        s = json.loads(run.ranks[0].stdout.strip().splitlines()[-1])
        assert s["path0"] == path0 and s["argv"][1:] == ["a"] and s["main"] == "__main__"


@pytest.mark.parametrize(
    ("code", "expected", "printed"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import sys; sys.exit('bye')", 1, "bye"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15, ""),
        ("import atexit; atexit.register(print, 'at exit')", 0, "at exit"),
        (
            "import threading, time; threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()",
            0,
            "joined",
        ),
    ],
)
def test_a_forked_rank_ends_as_the_interpreter_would(code: str, expected: int, printed: str) -> None:
    run = run_local_ranks([PY, "-c", code], 1, timeout=60, rendezvous=False, env=local_env(), start=_forked)
    assert run.ranks[0].returncode == expected and printed in run.ranks[0].stdout, run.describe()


def test_the_deadline_kills_a_forked_rank_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w')"
        ".write(str(p.pid)); time.sleep(60)"
    )
    run = run_local_ranks([PY, "-c", code], 1, timeout=5, rendezvous=False, env=local_env(), start=_forked)
    assert run.deadline_hit and run.ranks[0].killed
    child = int(pid_file.read_text())
    gone_by = time.monotonic() + 2.0  # the kernel may take a moment to finish a process that is not our child
    while _alive(child) and time.monotonic() < gone_by:
        time.sleep(0.01)
    assert not _alive(child), "the rank's own child outlived the launch"


def test_another_interpreter_or_its_flags_start_a_plain_process() -> None:
    import subprocess

    assert isinstance(
        start([PY, "-u", "-c", "pass"], local_env(), None, open(os.devnull, "wb"), None), subprocess.Popen
    )
    assert isinstance(start(["/bin/true"], local_env(), None, open(os.devnull, "wb"), None), subprocess.Popen)
