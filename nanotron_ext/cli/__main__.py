"""``python -m nanotron_ext.cli``: the ``nanotron-ext`` command (what torchrun runs, one per rank).

A rank of a distributed run (``train``, ``calibrate --in-run``) ends before C++'s static destructors, where gloo's
threads have aborted a rank whose work was done ("terminate called without an active exception": seen in CI once,
after ``calibrate --in-run`` had written its profile); a command run alone exits as any Python program.
"""

import os
import sys

from nanotron_ext.cli import main
from nanotron_ext.procs import RENDEZVOUS_VARIABLES, exit_without_teardown

code = main()
if any(name in os.environ for name in RENDEZVOUS_VARIABLES):
    exit_without_teardown(code)
sys.exit(code)
