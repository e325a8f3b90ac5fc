"""Python imports this at start-up when this folder is on ``PYTHONPATH``. It does nothing unless a test asks,
with ``NANOTRON_EXT_CPU_TRAINER=1``, for upstream's trainer to run on CPU: then every torchrun worker (a process
with ``RANK`` set) installs the stand-ins of ``nanotron_cpu.py`` before the launcher starts."""

import os

if os.environ.get("NANOTRON_EXT_CPU_TRAINER") == "1" and "RANK" in os.environ:
    import nanotron_cpu

    nanotron_cpu.install()
