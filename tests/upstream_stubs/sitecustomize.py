"""Python imports this at start-up when this folder is on ``PYTHONPATH`` (the upstream test pass, as CI runs it).

A thin shim: the stand-ins themselves live once, in the package (``nanotron_ext/integration/cpu_standins``, the
launcher's ``--cpu-debug``). This puts the package's stand-in packages for flash_attn, triton and grouped_gemm on the
import path, so that tests import upstream Nanotron in-process, as the flag does for a run; and, in a rank asked for a
test fault (``nanotron_cpu.PAUSE_IN_SAVE``), it installs that fault. Nothing here imports nanotron_ext's modules:
the folder is found from the package's location alone (importing it would load torch into every process).
"""

import importlib.util
import os
import sys

_spec = importlib.util.find_spec("nanotron_ext")
if _spec is not None and _spec.submodule_search_locations:
    _folder = os.path.join(list(_spec.submodule_search_locations)[0], "integration", "cpu_standins", "missing_modules")
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

if os.environ.get("NANOTRON_EXT_TEST_PAUSE_IN_SAVE") and "RANK" in os.environ:
    import nanotron_cpu

    nanotron_cpu.install_pause_in_save()
