"""Mutation check: do the tests catch small, plausible bugs? Not part of CI; re-run it after changing the
validator, freezing, the collective check, profiling, the partitioner or the simulator.

Each mutation is (file, exact old text, new text, the tests to run). The script copies the repository to a
temporary folder (``git archive HEAD`` by default, so that what is checked is the committed code and never
someone's half-done edit; ``--worktree`` copies the working tree instead), checks that the selected tests pass
there unmutated, then applies one mutation at a time to the copy, runs ``python -m pytest -x -q SELECTION`` in
it with this interpreter, and restores the file. The repository itself is never written.

The copy's package must be the one imported: the virtual environment has an editable install pointing at the
original checkout, so ``PYTHONPATH`` is set to the copy (setuptools' editable finder comes after ``PYTHONPATH``
on ``sys.meta_path``; the script checks it), and the spawned test ranks put the copy first as well.

Some tests run against only one Nanotron (``tests/conftest.py``): each mutation names the pass its tests run in
(``nanotron``: ``any``, ``0.2`` or ``upstream``). The script runs the mutations of the Nanotron installed in the
interpreter that runs it and lists the others as left for the other pass, so run it once per environment (the
upstream one with ``tests/upstream_stubs`` on ``PYTHONPATH``, as CI does; ``--only`` to run a few). The copy
sits beside a link to the project's ``../shared`` so that the upstream tests find upstream's checkout.

Usage: ``python tools/mutate.py [--only SUBSTRING] [--worktree] [--keep]``; exit 1 if a mutation survives, cannot
be applied, or its tests collect nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from mutations import MUTATIONS  # noqa: E402  (tools/ is the script's folder on sys.path)

#: A mutation that runs longer than this is stopped and reported as TIMEOUT (the spawn helper's own deadlines are
#: well below it, so a hang there fails the test first).
MUTATION_TIMEOUT_S = 300


def _copy_repo(dest: Path, worktree: bool) -> None:
    if worktree:
        ignore = shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "*.egg-info"
        )
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
        return
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(
    copy: Path, tests: tuple[str, ...], timeout: float, *, stop_first: bool = True, deselect: tuple[str, ...] = ()
) -> tuple[int | None, str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *(["-x"] if stop_first else []),
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        *tests,
        *(f"--deselect={t}" for t in deselect),
    ]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def _failures(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)  # ids may hold spaces: [tp: 4 ...]


def _nothing_ran(code: int | None, output: str) -> bool:
    """pytest collected nothing (exit 4 or 5), or passed without one passing test (every one skipped, as a test
    of the other Nanotron's pass is): a "pass" that tests nothing. The project's ``-q`` plus ours leave no summary
    line, so the passes are counted in the progress lines (``..s.   [100%]``)."""
    progress = re.findall(r"^([.sxXFE]+)\s+\[\s*\d+%\]\s*$", output, re.M)
    return code in (4, 5) or (code == 0 and not any("." in line for line in progress))


def _nanotron_under_test(copy: Path) -> str:
    """``upstream`` or ``0.2``, decided as ``tests/upstream/harness.py`` decides (upstream main has Qwen2)."""
    probe = "import importlib.util; print('upstream' if importlib.util.find_spec('nanotron.models.qwen') else '0.2')"
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=copy, env=_env(copy), capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only mutations whose name contains this (repeatable)")
    parser.add_argument("--worktree", action="store_true", help="copy the working tree instead of HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    tmp = Path(tempfile.mkdtemp(prefix="nanotron_ext_mutate_"))
    copy = tmp / "repo"
    rows = []
    try:
        _copy_repo(copy, args.worktree)
        if (ROOT.parent / "shared").is_dir():  # tests/upstream/harness.py finds upstream's checkout at ../shared
            (tmp / "shared").symlink_to(ROOT.parent / "shared")
        nanotron = _nanotron_under_test(copy)
        mutations = [m for m in selected if m.nanotron in ("any", nanotron)]
        for m in selected:
            if m not in mutations:
                rows.append((m.name, m.file, f"LEFT FOR THE {m.nanotron} PASS", 0.0))
        where = subprocess.run(
            [sys.executable, "-c", "import nanotron_ext; print(nanotron_ext.__file__)"],
            cwd=copy,
            env=_env(copy),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(where).resolve().is_relative_to(copy.resolve()):
            print(f"the copy's package is not the one imported ({where}); stopping", file=sys.stderr)
            return 2
        print(
            f"copy: {copy} ({'working tree' if args.worktree else 'HEAD'}); nanotron_ext from {where}; "
            f"Nanotron under test: {nanotron} ({len(rows)} mutation(s) left for the other pass)"
        )
        selection = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        if not selection:  # pytest without paths would run the whole suite
            print("no mutation for this Nanotron was selected")
            mutations = []
        start = time.monotonic()
        code, output = _pytest(copy, selection, MUTATION_TIMEOUT_S * 2, stop_first=False) if selection else (0, "")
        broken = tuple(_failures(output))
        if code != 0 and not broken:
            print(f"baseline: the selected tests do not run:\n{output[-4000:]}", file=sys.stderr)
            return 2
        print(
            f"baseline: {len(selection)} test selections unmutated ({time.monotonic() - start:.0f} s); "
            + (f"{len(broken)} fail already and are left out: {', '.join(broken)}" if broken else "all pass")
        )
        print()
        for m in mutations:
            path = copy / m.file
            original = path.read_text()
            count = original.count(m.old)
            if count != 1:
                rows.append((m.name, m.file, f"NOT APPLIED (old text found {count} times)", 0.0))
                print(f"{rows[-1][0]}: {rows[-1][2]}", flush=True)
                continue
            path.write_text(original.replace(m.old, m.new))
            start = time.monotonic()
            try:
                code, output = _pytest(copy, m.tests, MUTATION_TIMEOUT_S, deselect=broken)
            finally:
                path.write_text(original)
            seconds = time.monotonic() - start
            if code is None:
                verdict = "TIMEOUT"
            elif _nothing_ran(code, output):
                verdict = f"NOT RUN (pytest exit code {code}, no test passed or failed)"
            elif code == 0:
                verdict = "SURVIVED"
            else:
                verdict = (_failures(output) or [f"? (pytest exit code {code})"])[0]
            rows.append((m.name, m.file, verdict, seconds))
            print(f"{m.name}: {verdict} ({seconds:.0f} s)", flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(MUTATIONS)}
    rows.sort(key=lambda r: order[r[0]])
    headers = ("mutation", "file", "caught by", "s")
    cells = [(n, f.removeprefix("nanotron_ext/"), v, f"{s:.0f}") for n, f, v, s in rows]
    widths = [max(len(str(r[i])) for r in [headers, *cells]) for i in range(4)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(str(c).rjust(w) if i == 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    bad = [r for r in rows if r[2] in ("SURVIVED", "TIMEOUT") or r[2].startswith(("NOT APPLIED", "NOT RUN"))]
    left = [r for r in rows if r[2].startswith("LEFT FOR")]
    ran = len(rows) - len(left)
    print(
        f"\n{ran - len(bad)} of {ran} mutations caught; {sum(r[2] == 'SURVIVED' for r in rows)} survived"
        + (f"; {len(left)} left for the other Nanotron's pass" if left else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
