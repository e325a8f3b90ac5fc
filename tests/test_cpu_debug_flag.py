"""``python -m nanotron_ext.run --cpu-debug`` where it cannot run: the stand-ins are written against upstream main, so
Nanotron 0.2 is refused with the fix, before anything is put on the import path. (Where it runs, and what is importable
without it: ``tests/upstream/test_cpu_debug.py``.)"""

from __future__ import annotations

import sys

import pytest

from nanotron_ext.config import bundled_config
from nanotron_ext.integration.cpu_standins import MISSING_MODULES
from nanotron_ext.run import main


@pytest.mark.nanotron02
def test_the_flag_refuses_nanotron_02_with_the_fix_and_changes_nothing(tmp_path, capsys):
    script = tmp_path / "run_train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main(["--cpu-debug", str(script), "--config-file", str(bundled_config())]) == 2
    err = capsys.readouterr().err
    assert "--cpu-debug runs upstream Nanotron main's own trainer on CPU" in err and "nanotron-ext train" in err, err
    assert str(MISSING_MODULES) not in sys.path
