"""``python -m nanotron_ext.cli``: the ``nanotron-ext`` command (what torchrun runs, one per rank)."""

import sys

from nanotron_ext.cli import main

sys.exit(main())
